"""Paddle's static graph (``paddle.static``) on mpipar's ops: a program is a recorded graph.

    paddle.enable_static()
    with paddle.static.program_guard(paddle.static.default_main_program()):
        img = paddle.static.data(name="img", shape=[None, 256], dtype="float32")
        label = paddle.static.data(name="label", shape=[None, 1], dtype="int64")
        loss = paddle.nn.functional.cross_entropy(model(img), label)
        optimizer.minimize(loss)                      # optimizer built with parameters=None
    exe = paddle.static.Executor()
    exe.run(paddle.static.default_startup_program())
    loss_v, = exe.run(feed={"img": x, "label": y}, fetch_list=[loss.name])

One semantics with eager. ``static.data`` is a placeholder: a shape-only tensor (a ``None``
dimension traced as ``DYNAMIC_DIM_TRACE_SIZE``). The model's code runs on it once, in
shape-only mode (``mpipar._modes``): every op call on a placeholder, or on what was computed
from one, is recorded -- op name, inputs, attributes -- with every in-place ``shard_tensor`` and
every ``reshard`` made outside an op, so a program may carry placements and the communication
they imply. Parameters are the layers' own tensors (their values exist from the moment the
layer is built: the startup program has nothing left to initialize). ``optimizer.minimize``
adds an update to the program. ``Executor.run`` feeds arrays to the placeholders and runs the
recorded calls as the eager ops they are, then, for each ``minimize``, the eager backward and
update; so a static program computes bit for bit what the same eager code computes. Runs after
the first replay the first one's per-op decisions (``mpipar.compile.replay``).

While it is built, a program also keeps a ``Plan`` (``mpipar.compile.trace``) of its forward,
backward and update, with placements and inserted communication: ``print(program)`` lists it,
and ``program.desc`` is what ``mpipar.base.core.Graph`` draws.

Refused, by name: a program run before anything was recorded into it, a feed of another
shape or dtype than its ``data``, a fetch of a name the program does not have, and calls of
Paddle's static API mpipar does not have (``mpipar.static`` lists them).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar import autograd, hooks
from mpipar import random as mrandom
from mpipar._modes import in_static_mode, set_static_mode
from mpipar.backend import current_backend
from mpipar.compile.plan import Plan
from mpipar.compile.program_view import listing
from mpipar.compile.replay import CompiledStep
from mpipar.compile.trace import PlanRecorder
from mpipar.distribute import reshard, shard_tensor
from mpipar.mesh import ProcessMesh
from mpipar.nn.layer import get_default_dtype
from mpipar.ops import dispatch
from mpipar.ops.math import ones_like_global
from mpipar.spec import DistSpec
from mpipar.tensor import Parameter, Tensor

DYNAMIC_DIM_TRACE_SIZE = 2
"""The size a ``None`` (or -1) dimension of ``static.data`` is traced with. Not 1, so that no
op broadcasts it; the program's listing shows it as -1 on the placeholder."""


# --------------------------------------------------------------------------- specs and places
class InputSpec:
    """Paddle's ``paddle.static.InputSpec(shape, dtype, name)``: the shape (``None`` or -1 for a
    size known only when fed), dtype and name of an input."""

    def __init__(
        self,
        shape: Sequence[int | None] | None = None,
        dtype: Any = "float32",
        name: str | None = None,
        stop_gradient: bool = False,
    ) -> None:
        self.shape = tuple(_dim(d, name or "InputSpec") for d in (shape or ()))
        self.dtype = np.dtype(dtype)
        self.name = name
        self.stop_gradient = bool(stop_gradient)

    def __repr__(self) -> str:
        return f"InputSpec(shape={list(self.shape)}, dtype={self.dtype}, name={self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InputSpec) and (self.shape, self.dtype, self.name) == (
            other.shape,
            other.dtype,
            other.name,
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype, self.name))

    def traced_shape(self, fill: int = DYNAMIC_DIM_TRACE_SIZE) -> tuple[int, ...]:
        return tuple(fill if d is None else d for d in self.shape)


def _dim(d: Any, who: str) -> int | None:
    if d is None or (isinstance(d, (int, np.integer)) and int(d) == -1):
        return None
    if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or int(d) < 0:
        raise ValueError(f"{who}: a shape dimension must be a non-negative int, None or -1, got {d!r}")
    return int(d)


class Place:
    """Paddle's places. mpipar runs where its backend runs (NumPy, or CuPy with NCCL under
    ``mpiexec`` on GPUs): a place is accepted and recorded, and chooses nothing."""

    kind = "cpu"

    def __init__(self, device_id: int = 0) -> None:
        if not isinstance(device_id, (int, np.integer)) or device_id < 0:
            raise ValueError(f"{type(self).__name__}: device id must be a non-negative int, got {device_id!r}")
        self.device_id = int(device_id)

    def __repr__(self) -> str:
        return f"Place({self.kind})" if self.kind == "cpu" else f"Place({self.kind}:{self.device_id})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.device_id == self.device_id  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.kind, self.device_id))


class CPUPlace(Place):
    def __init__(self) -> None:
        super().__init__(0)


class CUDAPlace(Place):
    kind = "gpu"


# --------------------------------------------------------------------------- the recorded graph
@dataclass(frozen=True)
class _Var:
    """A reference to a program variable (by index) inside a recorded call's inputs."""

    index: int


@dataclass
class _Call:
    """One recorded call: an op (``dispatch.apply``), an in-place ``shard_tensor`` or a ``reshard``."""

    kind: str
    name: str
    inputs: list[Any]
    """Per input: a ``_Var``, a captured tensor (a parameter, a constant), or a list of them."""
    attrs: dict[str, Any]
    outputs: list[int]


@dataclass
class _Minimize:
    optimizer: Any
    loss: int
    parameters: list[Tensor]


class _StaticRecorder(PlanRecorder):
    """The program's plan: a ``PlanRecorder`` that keeps only the program's own (shape-only)
    work, not eager work done meanwhile (a data loader, a parameter's initialisation)."""

    def on_op(
        self,
        op: Any,
        inputs: list[Tensor],
        used: list[Tensor],
        outputs: list[Tensor],
        result: Any,
        attrs: dict[str, Any],
    ) -> None:
        if any(t.is_abstract for t in itertools.chain(inputs, outputs)):
            super().on_op(op, inputs, used, outputs, result, attrs)

    def on_reshard(self, src: Tensor, out: Tensor, plan: Any, reason: str) -> None:
        if src.is_abstract or out.is_abstract:
            super().on_reshard(src, out, plan, reason)

    def on_manual_collective(self, *args: Any, **kwargs: Any) -> None:
        return None  # a static program records no manual collectives (they need values)

    def on_backward(self, roots: Sequence[Tensor]) -> None:
        if any(t.is_abstract for t in roots):
            super().on_backward(roots)


class ProgramDesc:
    """What ``program.desc`` is: a program's plan and how to draw it (``mpipar.base.core.Graph``)."""

    def __init__(
        self, plan: Callable[[], Plan], title: str, serial: bool = False, rank: int = 0, dynamic: set[int] | None = None
    ) -> None:
        self._plan, self.title, self.serial, self.rank = plan, title, serial, rank
        self.dynamic = dynamic or set()

    def plan(self) -> Plan:
        return self._plan()

    def listing(self) -> str:
        return listing(self.plan(), title=self.title, serial=self.serial, rank=self.rank, dynamic=self.dynamic)


class PlanProgram:
    """A compiled step's plan seen as a Paddle program (``Engine.main_program`` and friends):
    ``print`` lists it, ``.desc`` draws it."""

    def __init__(self, plan: Callable[[], Plan], title: str, serial: bool = False, rank: int = 0) -> None:
        self.desc = ProgramDesc(plan, title, serial, rank)

    def plan(self) -> Plan:
        return self.desc.plan()

    def __str__(self) -> str:
        return self.desc.listing()

    def __repr__(self) -> str:
        return f"<program {self.desc.title!r}>"


def viewing_rank() -> int:
    """Whose local view a printed program shows: this program's rank (a process under MPI, a
    thread in per-rank simulation), else rank 0."""
    backend = current_backend()
    if backend.program_rank is not None:
        return int(backend.program_rank)
    return int(getattr(backend, "rank", 0)) if backend.name in ("mpi", "nccl") else 0


class StepPrograms:
    """A compiled step's programs as Paddle's auto-parallel ``Engine`` shows them:
    ``serial_main_program`` (the step on one device, placements as annotations), ``main_program``
    (this rank's ops, local shapes and inserted communication) and the two startup programs (the
    parameters as initialised). Each prints, and draws through ``mpipar.base``."""

    def __init__(self, plan: Callable[[], Plan]) -> None:
        self._step_plan = plan

    @property
    def main_program(self) -> PlanProgram:
        return PlanProgram(self._step_plan, "main program", serial=False, rank=viewing_rank())

    @property
    def serial_main_program(self) -> PlanProgram:
        return PlanProgram(self._step_plan, "serial main program", serial=True)

    @property
    def startup_program(self) -> PlanProgram:
        return PlanProgram(self._startup_plan, "startup program", serial=False, rank=viewing_rank())

    @property
    def serial_startup_program(self) -> PlanProgram:
        return PlanProgram(self._startup_plan, "serial startup program", serial=True)

    def _startup_plan(self) -> Plan:
        """The parameters as initialised (no ops: they hold their values from construction)."""
        full = self._step_plan()
        return Plan(
            meshes=list(full.meshes),
            tensors=[t for t in full.tensors if t.kind == "parameter"],
            meta={"kind": "startup"},
        )


class Program:
    """Paddle's ``paddle.static.Program`` (see the module docstring)."""

    _counter = itertools.count()

    def __init__(self, startup: bool = False, title: str | None = None) -> None:
        self.is_startup = startup
        self.title = title or ("startup program" if startup else "main program")
        self.random_seed = 0
        self._id = next(Program._counter)
        self._tensors: list[Tensor] = []
        """The program's variables, by index (placeholders and recorded outputs, shape-only)."""
        self._index: dict[int, int] = {}
        self._names: dict[str, int] = {}
        self._feeds: dict[str, tuple[int, tuple[int | None, ...]]] = {}
        self._calls: list[_Call] = []
        self._minimize: list[_Minimize] = []
        self._param_names: dict[int, str] = {}
        self._params: dict[int, Tensor] = {}
        """The parameters (trainable leaves) the recorded calls read, in order of first use."""
        self._recorder = _StaticRecorder({"kind": "static_program", "program": self.title})
        self._plan: Plan | None = None
        self._op_counts: dict[str, int] = {}
        self._step: CompiledStep[dict[int, Tensor]] = CompiledStep(self._execute)
        self._for_test = False
        self._active = 0
        self._owner: int | None = None
        self._running = False

    # ------------------------------------------------------------------ Paddle's surface
    @property
    def desc(self) -> ProgramDesc:
        return ProgramDesc(self.plan, self.title, dynamic=self.dynamic_tensor_ids())

    @property
    def num_blocks(self) -> int:
        return 1

    def global_block(self) -> Block:
        return Block(self)

    def block(self, index: int) -> Block:
        if index != 0:
            raise ValueError(f"Program.block({index}): mpipar programs have one block (0)")
        return Block(self)

    def list_vars(self) -> list[Tensor]:
        return list(self._tensors) + list(self._params.values())

    def clone(self, for_test: bool = False) -> Program:
        """A copy that shares the recorded calls; ``for_test=True`` drops the updates (an
        evaluation program) and runs without gradients."""
        out = Program(self.is_startup, self.title + (" (for test)" if for_test else " (clone)"))
        out._tensors, out._index, out._names = list(self._tensors), dict(self._index), dict(self._names)
        out._feeds, out._calls, out._params = dict(self._feeds), list(self._calls), dict(self._params)
        out._param_names = dict(self._param_names)
        out._minimize = [] if for_test else list(self._minimize)
        out._recorder = self._recorder
        out._for_test = for_test
        return out

    def plan(self) -> Plan:
        """The program's plan: its ops with placements, its communication, forward to update."""
        return self._plan if self._plan is not None else self._recorder.plan()

    def __str__(self) -> str:
        if self.is_startup:
            return f"{{ // {self.title}: parameters are initialised when their layers are built; nothing to run }}"
        return self.desc.listing()

    def __repr__(self) -> str:
        return f"<Program {self.title!r}: {len(self._calls)} recorded calls, feeds {sorted(self._feeds)}>"

    def dynamic_tensor_ids(self) -> set[int]:
        """Plan ids of the placeholders (whose ``None`` dimensions a listing shows as -1)."""
        out = set()
        for index, _shape in self._feeds.values():
            tid = self._recorder._ids.get(self._tensors[index])
            if tid is not None:
                out.add(tid)
        return out

    # ------------------------------------------------------------------ building
    def _var(self, t: Tensor) -> int | None:
        index = self._index.get(id(t))
        if index is not None and self._tensors[index] is t:
            return index
        return None

    def _add_var(self, t: Tensor) -> int:
        index = len(self._tensors)
        self._tensors.append(t)
        self._index[id(t)] = index
        if t.name:
            self._names.setdefault(t.name, index)
        return index

    def add_data(self, name: str, shape: Sequence[Any], dtype: Any, stop_gradient: bool = True) -> Tensor:
        if not isinstance(name, str) or not name:
            raise ValueError(f"static.data: name must be a non-empty string, got {name!r}")
        if name in self._names:
            raise ValueError(f"static.data: the program already has a variable named {name!r}")
        declared = tuple(_dim(d, f"static.data {name!r}") for d in shape)
        t = Tensor.abstract([DYNAMIC_DIM_TRACE_SIZE if d is None else d for d in declared], np.dtype(dtype))
        t.name = name
        t.stop_gradient = bool(stop_gradient)
        index = self._add_var(t)
        self._feeds[name] = (index, declared)
        self._recorder.mark(t, "input", name)
        self._plan = None
        return t

    def _ref(self, x: Any, op: str, i: int) -> Any:
        if isinstance(x, (list, tuple)):
            return [self._ref(v, op, i) for v in x]
        if not isinstance(x, Tensor):
            return x
        index = self._var(x)
        if index is not None:
            return _Var(index)
        if x.is_abstract:
            raise ValueError(
                f"static program {self.title!r}: input {i} of {op} ({x._label()}) has no values and was not made by "
                "an op mpipar records (static.data, an op, shard_tensor or reshard); build it from static.data"
            )
        if isinstance(x, Parameter) and not x.stop_gradient and id(x) not in self._params:
            self._params[id(x)] = x
            scope = hooks.current_scope()
            shown = x.name or f"param_{len(self._params) - 1}"
            if scope and "." not in shown:  # a layer's "weight": name it by the layer that reads it
                shown = f"{scope}.{shown}"
            self._param_names[id(x)] = shown
            self._recorder.mark(x, "parameter", shown)
        return x

    def _involves(self, inputs: Sequence[Any]) -> bool:
        for x in inputs:
            if isinstance(x, (list, tuple)):
                if self._involves(x):
                    return True
            elif isinstance(x, Tensor) and self._var(x) is not None:
                return True
        return False

    def _name_outputs(self, op: str, outs: Sequence[Tensor]) -> list[int]:
        n = self._op_counts.get(op, 0)
        self._op_counts[op] = n + 1
        indices = []
        for j, t in enumerate(outs):
            if not t.name:
                t.name = f"{op}_{n}.tmp_{j}"
            self._recorder.mark(t, "activation", t.name)
            indices.append(self._add_var(t))
        return indices

    def on_apply(self, name: str, inputs: Sequence[Any], attrs: dict[str, Any], result: Any) -> None:
        if self._ignores() or hooks.current_phase() != "forward" or not self._involves(inputs):
            return
        refs = [self._ref(x, name, i) for i, x in enumerate(inputs)]
        outs = list(result) if isinstance(result, tuple) else [result]
        self._calls.append(_Call("op", name, refs, dict(attrs), self._name_outputs(name, outs)))
        self._plan = None

    def on_shard_tensor(self, tensor: Tensor, mesh: ProcessMesh, placements: Sequence[Any]) -> None:
        index = self._var(tensor)
        if index is None or hooks.current_phase() != "forward":
            return
        self._calls.append(
            _Call(
                "shard_tensor", "shard_tensor", [_Var(index)], {"mesh": mesh, "placements": list(placements)}, [index]
            )
        )
        self._plan = None

    def on_reshard_call(self, tensor: Tensor, spec: DistSpec, out: Tensor) -> None:
        index = self._var(tensor)
        if index is None or hooks.current_phase() != "forward":
            return
        self._calls.append(
            _Call(
                "reshard",
                "reshard",
                [_Var(index)],
                {"mesh": spec.mesh, "placements": list(spec.placements)},
                self._name_outputs("reshard", [out]),
            )
        )
        self._plan = None

    def on_minimize(self, optimizer: Any, loss: Tensor, parameters: Any, no_grad_set: Any) -> bool:
        """Add the update if ``loss`` is this program's; return whether it was."""
        index = self._var(loss)
        if index is None or self._ignores():
            return False
        if loss.stop_gradient:
            raise ValueError(f"minimize: {loss._label()} depends on no trainable parameter")
        params = list(parameters) if parameters is not None else list(self._params.values())
        skip = {id(p) for p in (no_grad_set or ())} | {n for n in (no_grad_set or ()) if isinstance(n, str)}
        params = [p for p in params if id(p) not in skip and (p.name or "") not in skip]
        if not optimizer._parameter_list:
            optimizer._parameter_list = list(params)
        else:
            known = {id(p) for p in optimizer._parameter_list}
            optimizer._parameter_list.extend(p for p in params if id(p) not in known)
        self._minimize.append(_Minimize(optimizer, index, params))
        self._trace_update(loss, optimizer, params)
        self._plan = None
        return True

    def _trace_update(self, loss: Tensor, optimizer: Any, params: list[Tensor]) -> None:
        """Add the backward (shape-only, on the recorded graph) and the update to the plan.
        The parameters' own gradients are put back: building changes no value."""
        saved = [(p, p.grad) for p in params]
        rec = self._recorder
        names = [self._param_names.get(id(p)) or p.name or f"param_{i}" for i, p in enumerate(params)]
        for p, name in zip(params, names, strict=True):
            rec.mark(p, "parameter", name)
        with hooks.phase("backward"):
            autograd.run_backward([loss], [ones_like_global(loss)])
        for p, name in zip(params, names, strict=True):
            if p.grad is not None:
                rec.mark(p.grad, "gradient", f"{name}@GRAD")
        rec.meta.setdefault("updates", []).append({"optimizer": type(optimizer).__name__, "parameters": names})
        for p, g in saved:
            p.grad = g

    # ------------------------------------------------------------------ activation
    def _ignores(self) -> bool:
        """Is this call another program rank's (per-rank simulation), or inside this program's own run?"""
        return self._running or current_backend().program_rank != self._owner

    def activate(self) -> None:
        if self._active == 0:
            self._owner = current_backend().program_rank
            hooks.program_hooks.append(self)
            self._recorder.__enter__()
        self._active += 1

    def deactivate(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._recorder.__exit__(None, None, None)
            hooks.program_hooks.remove(self)

    # ------------------------------------------------------------------ running
    def run(
        self, feed: dict[str, Any] | None, fetch_list: Sequence[Any] | None, return_numpy: bool = True
    ) -> list[Any]:
        if self.is_startup:
            return []  # parameters hold their values from the moment their layer is built
        if not self._calls and not self._feeds:
            raise ValueError(f"Executor.run: {self.title!r} is empty; build it under paddle.static.program_guard first")
        fetch = [self._fetch_index(f) for f in (fetch_list or [])]
        feeds = self._feed_tensors(feed or {})
        self._running = True  # a run computes values: nothing in it belongs to the program
        try:
            env = self._step(feeds)
        finally:
            self._running = False
        out = []
        for kind, value in fetch:
            t = env[value] if kind == "var" else value
            out.append(t.numpy() if return_numpy else t)
        return out

    def _fetch_index(self, f: Any) -> tuple[str, Any]:
        if isinstance(f, Tensor):
            index = self._var(f)
            if index is not None:
                return ("var", index)
            if id(f) in self._params:
                return ("param", f)
            raise ValueError(f"Executor.run: fetch {f._label()} is not a variable of {self.title!r}")
        if isinstance(f, str):
            if f in self._names:
                return ("var", self._names[f])
            for p in self._params.values():
                if p.name == f:
                    return ("param", p)
            raise ValueError(
                f"Executor.run: {self.title!r} has no variable named {f!r} to fetch "
                f"(data: {sorted(self._feeds)}; e.g. fetch loss.name)"
            )
        raise TypeError(f"Executor.run: fetch_list items are variables or their names, got {type(f).__name__}")

    def _feed_tensors(self, feed: dict[str, Any]) -> dict[str, Tensor]:
        if not isinstance(feed, dict):
            raise TypeError(f"Executor.run: feed must be a dict of data name -> array, got {type(feed).__name__}")
        unknown = sorted(set(feed) - set(self._feeds))
        if unknown:
            raise ValueError(
                f"Executor.run: {self.title!r} has no data named {unknown} (its data: {sorted(self._feeds)})"
            )
        needed = self._needed_feeds()
        missing = sorted(n for n in needed if n not in feed)
        if missing:
            raise ValueError(f"Executor.run: feed is missing {missing}, which {self.title!r} reads")
        out: dict[str, Tensor] = {}
        for name in sorted(feed):
            index, declared = self._feeds[name]
            value = feed[name]
            placeholder = self._tensors[index]
            if isinstance(value, Tensor):
                if value.is_abstract:
                    raise ValueError(f"Executor.run: feed {name!r} is a placeholder, not a value")
                t = value
            else:
                arr = np.asarray(value)
                if arr.dtype == object:
                    raise TypeError(f"Executor.run: feed {name!r} is not a numeric array")
                t = Tensor(arr, dtype=arr.dtype)
            if t.dtype != placeholder.dtype:
                raise TypeError(
                    f"Executor.run: feed {name!r} has dtype {t.dtype}, but static.data declared {placeholder.dtype}"
                )
            shape = tuple(t.shape)
            if len(shape) != len(declared) or any(
                d is not None and d != s for d, s in zip(declared, shape, strict=False)
            ):
                shown = [-1 if d is None else d for d in declared]
                raise ValueError(
                    f"Executor.run: feed {name!r} has shape {list(shape)}, but static.data declared {shown}"
                )
            if not t.stop_gradient:
                t = t.detach()
            t.stop_gradient = placeholder.stop_gradient
            out[name] = t
        return out

    def _needed_feeds(self) -> set[str]:
        used: set[int] = set()
        for call in self._calls:
            _collect(call.inputs, used)
        return {name for name, (index, _) in self._feeds.items() if index in used}

    def _execute(self, feeds: dict[str, Tensor]) -> dict[int, Tensor]:
        """One run: the recorded calls on the fed values, then each update (eager semantics)."""
        env: dict[int, Tensor] = {self._feeds[name][0]: t for name, t in feeds.items()}
        train = bool(self._minimize)
        with autograd.set_grad_enabled(train):
            for call in self._calls:
                _run_call(call, env)
        for m in self._minimize:
            loss = env[m.loss]
            loss.backward()
            m.optimizer.step()
            m.optimizer.clear_grad()
        return env


def _collect(inputs: Sequence[Any], into: set[int]) -> None:
    for x in inputs:
        if isinstance(x, _Var):
            into.add(x.index)
        elif isinstance(x, list):
            _collect(x, into)


def _resolve(x: Any, env: dict[int, Tensor], call: _Call) -> Any:
    if isinstance(x, _Var):
        t = env.get(x.index)
        if t is None:
            raise ValueError(f"static program: {call.name} reads a variable that was not fed or computed")
        return t
    if isinstance(x, list):
        return [_resolve(v, env, call) for v in x]
    return x


def _run_call(call: _Call, env: dict[int, Tensor]) -> None:
    inputs = [_resolve(x, env, call) for x in call.inputs]
    if call.kind == "op":
        attrs = call.attrs
        op = dispatch.get_op(call.name)
        if "key" in op.volatile_attrs:  # a random key per call, drawn where eager draws it
            attrs = {**attrs, "key": mrandom.next_key()}
        result = dispatch.apply(call.name, inputs, attrs)
        outs = list(result) if isinstance(result, tuple) else [result]
    elif call.kind == "shard_tensor":
        outs = [shard_tensor(inputs[0], call.attrs["mesh"], call.attrs["placements"])]
    else:
        # The layout, not the traced spec: a fed batch's size may differ from the traced one.
        outs = [reshard(inputs[0], call.attrs["mesh"], call.attrs["placements"])]
    for index, t in zip(call.outputs, outs, strict=True):
        env[index] = t


class Block:
    """Paddle's ``program.global_block()``: the program's variables by name and its ops."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.idx = 0

    @property
    def vars(self) -> dict[str, Tensor]:
        out = {t.name: t for t in self.program._tensors if t.name}
        out.update({p.name: p for p in self.program._params.values() if p.name})
        return out

    def var(self, name: str) -> Tensor:
        found = self.vars.get(name)
        if found is None:
            raise ValueError(f"{self.program.title!r} has no variable named {name!r}")
        return found

    def has_var(self, name: str) -> bool:
        return name in self.vars

    def all_parameters(self) -> list[Tensor]:
        return list(self.program._params.values())

    @property
    def ops(self) -> list[Any]:
        return list(self.program.plan().ops)


# --------------------------------------------------------------------------- module state
@dataclass
class _ProgramState:
    """One program's default programs and guards (per program rank: the simulator may run one
    program per rank in threads of one process, each with its own, as processes under MPI)."""

    main: Program
    startup: Program
    guards: list[tuple[Program, Program]]


_states: dict[int | None, _ProgramState] = {}


def _state() -> _ProgramState:
    rank = current_backend().program_rank
    st = _states.get(rank)
    if st is None:
        st = _states[rank] = _ProgramState(Program(title="main program"), Program(startup=True), [])
    return st


def default_main_program() -> Program:
    st = _state()
    return st.guards[-1][0] if st.guards else st.main


def default_startup_program() -> Program:
    st = _state()
    return st.guards[-1][1] if st.guards else st.startup


def _recording() -> Program | None:
    return default_main_program() if in_static_mode() else None


def enable_static() -> None:
    """Paddle's ``paddle.enable_static()``: ops on ``static.data`` build the current program."""
    if in_static_mode():
        return
    set_static_mode(True)
    default_main_program().activate()


def disable_static(place: Any = None) -> None:
    """Back to eager (dynamic) mode, Paddle's default."""
    if not in_static_mode():
        return
    default_main_program().deactivate()
    set_static_mode(False)


def in_dynamic_mode() -> bool:
    return not in_static_mode()


@contextlib.contextmanager
def program_guard(main_program: Program, startup_program: Program | None = None) -> Iterator[None]:
    """Build into ``main_program`` inside the block (Paddle's ``static.program_guard``)."""
    if not isinstance(main_program, Program):
        raise TypeError(f"program_guard: main_program must be a static.Program, got {type(main_program).__name__}")
    if startup_program is not None and not isinstance(startup_program, Program):
        raise TypeError(
            f"program_guard: startup_program must be a static.Program, got {type(startup_program).__name__}"
        )
    before = _recording()
    guards = _state().guards
    guards.append((main_program, startup_program or default_startup_program()))
    if in_static_mode():
        if before is not None:
            before.deactivate()
        main_program.activate()
    try:
        yield
    finally:
        now = _recording()
        guards.pop()
        if in_static_mode() and now is not None:
            now.deactivate()
            after = _recording()
            if after is not None:
                after.activate()


def data(name: str, shape: Sequence[Any], dtype: Any = None, lod_level: int = 0) -> Tensor:
    """Paddle's ``static.data``: a placeholder of the current program, fed by ``Executor.run``."""
    program = _recording()
    if program is None:
        raise ValueError("static.data needs static mode: call mpipar.enable_static() first (Paddle's habit)")
    if lod_level:
        raise ValueError(f"static.data {name!r}: lod_level={lod_level} (LoD tensors) is not supported")
    return program.add_data(name, shape, dtype if dtype is not None else get_default_dtype())


class Executor:
    """Paddle's ``static.Executor(place=None)``: runs a program on fed arrays (module docstring)."""

    def __init__(self, place: Place | None = None) -> None:
        if place is not None and not isinstance(place, Place):
            raise TypeError(
                f"Executor: place must be mpipar.CPUPlace() or mpipar.CUDAPlace(i), got {type(place).__name__}"
            )
        self.place = place

    def run(
        self,
        program: Program | None = None,
        feed: dict[str, Any] | None = None,
        fetch_list: Sequence[Any] | Any = None,
        feed_var_name: str = "feed",
        fetch_var_name: str = "fetch",
        scope: Any = None,
        return_numpy: bool = True,
        use_program_cache: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        if kwargs:
            raise TypeError(f"Executor.run: unsupported arguments {sorted(kwargs)}")
        if scope is not None:
            raise ValueError(
                "Executor.run: scope= is not supported (mpipar programs keep their values in their tensors)"
            )
        if program is None:
            program = default_main_program()
        if not isinstance(program, Program):
            raise TypeError(
                f"Executor.run: program must be a static.Program, got {type(program).__name__} "
                "(CompiledProgram and others are not supported)"
            )
        if fetch_list is not None and not isinstance(fetch_list, (list, tuple)):
            fetch_list = [fetch_list]
        return program.run(feed, fetch_list, return_numpy)

    def close(self) -> None:
        return None
