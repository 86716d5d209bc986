"""A captured step: the training step as a flat program of local array work, run without ``fn``.

    train_step = dist.compile_step(step, capture=True)
    for x in loader():
        loss = train_step(x)          # the first two or three calls trace eagerly; later ones run the program

``compile_step(fn, capture=True)`` traces ``fn`` at the level of local arrays: every kernel call
on local shards (``ops.dispatch``), every reshard's execution on the communicator
(``distribute._reshard_now``), the seed of backward (``ops.creation.ones_like_global``), the
optimizer's per-shard update (``Optimizer._step_param``) and its step counters. Each call
becomes one pre-bound instruction over numbered slots. Once two consecutive traced calls of
the same layout key give the same program instruction by instruction (same functions, the
same non-array arguments, the same tensors read by identity) and a validation run of that
program from a copy of the step's starting state reproduces the eager call bit for bit, later
calls run the program instead of ``fn``: no per-op Python (rules, tape, autograd engine,
optimizer loop), only the kernels and collectives on the step's data, so results stay
bit-identical to eager. The program then puts its results back where eager leaves them: the
parameters' storage, ``.grad`` (None after ``clear_grad``), the optimizer's states and step
counts, and returns Tensors built from its outputs.

Semantics, as ``jax.jit``'s: Python side effects inside ``fn`` (prints, appends, counters)
run only on traced calls; ``fn`` must return Tensors (in tuples, lists, dicts) or None; the
returned Tensors of a captured call carry no autograd history; Python values among the
arguments are part of the program's key (static arguments). Values that legitimately
change between steps are read live by the instruction on every run: the learning rate
(``get_lr()``, an ``LRScheduler`` included), each parameter's ``optimize_attr`` multiplier and
the optimizer's step counts (Adam's bias correction).

Fail closed: a step the program cannot reproduce is never captured. ``.capture_refused``
says why, and such a step keeps running eagerly (with the per-op decisions replayed). Refused:
a step that reads a tensor's value in Python (``float(loss)``, ``.numpy()``, ``.item()``,
``full_tensor()``, ``local_tensor()``: control flow on data), returns anything but Tensors,
draws a new random key per call (dropout: its attribute differs between the two traces), uses
an array made by code the capture does not see (it shows up as a different array each call),
communicates outside a reshard (a tripwire on the communicator), runs under observers (plan
tracing, timelines, pipeline stage runs), or whose validation run differs in any bit. A
captured program is checked on every call (the layout key, every tensor it reads still alive
and laid out as traced, every gradient and optimizer state present as traced, no observer) and
falls back to tracing when a check fails. Under MPI every traced call ends with the ranks
agreeing (a small all-reduce) on whether to validate and capture, so all take the same path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from mpipar import comm, hooks
from mpipar.backend import current_backend
from mpipar.distribute import _shards_from_global
from mpipar.optimizer.optimizer import _ALONE_REFS, Optimizer, _param_lr, _shard_refs
from mpipar.optimizer.sgd_momentum_adam import SGD
from mpipar.placement import Replicate
from mpipar.reshard.executor import _RUNNERS, execute_plan, freeze
from mpipar.spmd.rules.common import norm_axes
from mpipar.tensor import Tensor, _as_array, _storage_ids
from mpipar.xp import to_numpy

Array = Any

_meta_override: dict[tuple[int, int], dict[str, Any]] = {}
"""During a validation run: the optimizer step counts as they were before the traced call (the
eager call already advanced the live ones)."""

MAX_TRACES = 3
"""Traced calls per layout key before giving up on two consecutive identical ones."""


class Refused(Exception):
    """Raised inside the tracer to abandon a capture (never reaches the user)."""


class _Stale(Exception):
    """A captured program's check failed on this call: run it eagerly and trace again."""


# ============================================================================ slot sources
def _freeze(value: Any, keep: list[Any]) -> Any:
    """A comparable stand-in for a non-array argument: scalars by type and value, containers and
    dataclasses (kernel contexts) element by element, hashable objects (specs, plans, functions)
    by their own equality, anything else (arrays) by identity; all kept alive in ``keep`` so
    that an identity cannot be reused while the trace lives."""
    if value is None or isinstance(value, (bool, int, float, str, complex, np.generic, np.dtype)):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_freeze(v, keep) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _freeze(v, keep)) for k, v in value.items()))
    keep.append(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a kernel context: its fields
        return ("fields", type(value), tuple(_freeze(getattr(value, f.name), keep) for f in dataclasses.fields(value)))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return ("value", type(value), value)  # compared with ==: identity unless the type defines equality


def _same_bits(a: Array, b: Array) -> bool:
    a, b = to_numpy(a), to_numpy(b)  # device arrays copied to the host (CuPy refuses np.asarray)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.ascontiguousarray(a).view(np.uint8).tobytes() == np.ascontiguousarray(b).view(np.uint8).tobytes())


class _Tripwire:
    """A communication recorder while tracing: any collective outside an instrumented call
    (a hand-written collective, a bucketed gradient reduction) makes the capture refuse."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def record(self, event: Any) -> None:
        tr = self.tracer
        if tr.depth == 0 and threading.get_ident() == tr.thread:
            tr.refuse(f"a {event.op} on ranks {list(event.ranks)} runs outside the reshards the capture records")


class Tracer:
    """One eager call being recorded into a program of instructions over slots."""

    def __init__(self, flat_args: Sequence[Any], backend: Any, prev: Tracer | None) -> None:
        self.backend = backend
        self.thread = threading.get_ident()
        self.arg_index = {id(a): i for i, a in enumerate(flat_args)}
        self.flat = list(flat_args)
        self.where: dict[int, int] = {}
        """id(array) -> the slot holding it now (the latest producer wins: in-place updates)."""
        self.arrays: list[Array] = []
        """Per slot, the array the eager call had there (kept alive: ids stay unique)."""
        self.roots: list[tuple[int, tuple[Any, ...]]] = []
        """(slot, source) of every array read from outside the step (``_getter`` reads it live)."""
        self.root_slot: dict[tuple[Any, ...], int] = {}
        self.consts: list[tuple[int, Array]] = []
        self.instrs: list[tuple[Callable[..., Any], tuple[int, ...], Any, int]] = []
        """(fn, input slots, output slot(s), kind): kind 0 one output, 1 several, 2 an effect."""
        self.sig: list[Any] = []
        self.keep: list[Any] = []
        self.refused: str | None = None
        self.depth = 0
        self.leaves: dict[int, Tensor] = {}
        self.optimizers: dict[int, Optimizer] = {}
        self.updated: dict[tuple[int, int], tuple[Optimizer, Tensor]] = {}
        self.out_template: Any = None
        self.rebind: list[tuple[Any, ...]] = []
        self.start_grads: list[tuple[Tensor, Any]] = []
        self.start_ids: dict[tuple[Any, ...], int] = {}
        self.updates: dict[int, tuple[int, int]] = {}
        """Optimizer updates: instruction -> (id of the optimizer, id of the parameter)."""
        self.bumps: dict[int, tuple[int, int]] = {}
        """Step counts (effects): instruction -> (id of the optimizer, id of the parameter)."""
        self.pure: set[int] = set()
        """Instructions that compute the same arrays from the same inputs on every run (mpipar's
        own kernels, fills): on constant inputs only, ``Program`` folds them into constants."""
        self.in_place: list[tuple[int, Any, int]] = []
        """(instruction, parameter, rank) of updates that may write the parameter's shard in place."""
        self.start_tensors: list[tuple[Any, Any, Any]] = []
        """(tensor, spec, dtype) of every tensor the previous trace read, as this call began."""
        if prev is not None:  # what the previous trace read: its starting state now, for checks
            for leaf in prev.leaves.values():
                self.start_grads.append((leaf, _grad_state(leaf)))
            seen: set[int] = set()
            for _, src in prev.roots:
                if src[0] == "tensor" and id(src[1]) not in seen:
                    seen.add(id(src[1]))
                    self.start_tensors.append((src[1], src[1]._spec, src[1]._dtype))
                with contextlib.suppress(_Stale):
                    self.start_ids[_source_key(src)] = id(_getter(src)(flat_args))

    # ------------------------------------------------------------------ recording
    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    def _new_slot(self, array: Array) -> int:
        s = len(self.arrays)
        self.arrays.append(array)
        self.where[id(array)] = s
        return s

    def _source(self, t: Any, r: int | None) -> tuple[Any, ...]:
        i = self.arg_index.get(id(t))
        if i is not None:
            if not t.stop_gradient:  # its .grad would be set on this call's object: not a result the program puts back
                raise Refused(f"the step's argument {i} ({t._label()}) requires a gradient; pass parameters by closure")
            return ("arg", i, r)
        if t._grad_fn is not None:
            raise Refused(f"the step reads {t._label()}, which has autograd history from outside the step")
        self.keep.append(t)
        if t._grad_fn is None and not t.stop_gradient:
            self.leaves[id(t)] = t
        return ("tensor", t, r)

    def slot_of(self, array: Array, source: Any, rank: int | None = None) -> int:
        """The slot of an input array: produced earlier in the step, or read from ``source`` (a
        tensor and its rank, or a source tuple), or a constant (``source`` None)."""
        s = self.where.get(id(array))
        if s is not None:
            return s
        if source is None:
            s = self._new_slot(array)
            self.consts.append((s, array))
            self.sig.append(("const", s, id(array)))
            return s
        src = source if isinstance(source, tuple) else self._source(source, rank)
        key = _source_key(src)
        if key in self.root_slot:  # the same tensor's shard again, under another array: replaced mid-step
            raise Refused(
                f"the storage of {_describe(src)} was replaced inside the step by code the capture does not see"
            )
        was = self.start_ids.get(key)
        if was is not None and was != id(array):
            raise Refused(
                f"the storage of {_describe(src)} was replaced inside the step by code the capture does not see"
            )
        s = self._new_slot(array)
        self.root_slot[key] = s
        self.roots.append((s, src))
        self.sig.append(("root", s, key, _layout_of(array)))
        return s

    def _produce(self, array: Array) -> int:
        if not hasattr(array, "shape"):
            raise Refused(f"an instrumented call returned a {type(array).__name__}, not an array")
        return self._new_slot(array)

    def record(
        self,
        fn: Callable[..., Any],
        key: tuple[Any, ...],
        inputs: Sequence[tuple[Array, Any, int | None]],
        result: Any,
        multi: bool,
    ) -> None:
        """Record a call already made (``result`` from the eager code) as ``fn`` over slots."""
        try:
            ins = tuple(self.slot_of(a, src, r) for a, src, r in inputs)
            outs: Any = tuple(self._produce(a) for a in result) if multi else self._produce(result)
            key_frozen = _freeze(key, self.keep)
        except Refused as exc:
            self.refuse(str(exc))
            return
        except Exception as exc:  # the capture never fails a step: it refuses instead
            self.refuse(f"the capture could not record a call ({type(exc).__name__}: {exc})")
            return
        self.instrs.append((fn, ins, outs, 1 if multi else 0))
        self.sig.append((key_frozen, ins, outs))

    def call(
        self, fn: Callable[..., Any], key: tuple[Any, ...], inputs: Sequence[tuple[Array, Any, int | None]], multi: bool
    ) -> Any:
        """Run ``fn`` on the inputs now (collectives inside are expected) and record it."""
        self.depth += 1
        try:
            result = fn(*[a for a, _, _ in inputs])
        finally:
            self.depth -= 1
        self.record(fn, key, inputs, result, multi)
        return result

    def effect(self, fn: Callable[[], None], key: tuple[Any, ...]) -> None:
        """Record a Python effect the eager code just made (a step count), replayed every run."""
        self.instrs.append((fn, (), None, 2))
        self.sig.append((_freeze(key, self.keep), "effect"))

    def note_optimizer(self, opt: Optimizer) -> None:
        self.optimizers[id(opt)] = opt
        self.keep.append(opt)
        for p in opt._parameter_list:
            self.leaves[id(p)] = p

    def note_leaf(self, leaf: Tensor) -> None:
        """The engine accumulates into ``leaf.grad``: a gradient held from before the step is a root."""
        if leaf._grad_hooks:
            self.refuse(f"{leaf._label()} has gradient hooks (Python run on every backward)")
        self.leaves[id(leaf)] = leaf
        g = leaf.grad
        if g is not None:
            for r, a in _arrays_of(g):
                if id(a) not in self.where:
                    try:
                        self.slot_of(a, ("grad", leaf, r))
                    except Refused as exc:
                        self.refuse(str(exc))

    def escape(self, what: str) -> None:
        if threading.get_ident() == self.thread:
            self.refuse(f"the step reads a tensor's value in Python ({what}): its control flow may depend on the data")

    # ------------------------------------------------------------------ the call sites' entry points
    # (``hooks.CaptureTracer``: dispatch, distribute, creation, the optimizer live below this module)
    def record_kernel(
        self,
        op: Any,
        ctx: Any,
        attrs: dict[str, Any],
        dtypes: Sequence[Any],
        used: Sequence[Any],
        r: int | None,
        arrays: Sequence[Array],
        got: Any,
        dense: bool = False,
        raw: Any = None,
    ) -> None:
        record_kernel(self, op, ctx, attrs, dtypes, used, r, arrays, got, dense=dense, raw=raw)

    def reshard(self, plan: Any, tensor: Any, backend: Any) -> dict[int, Array]:
        return reshard(self, plan, tensor, backend)

    def from_global(self, dst: Any, tensor: Any) -> dict[int, Array]:
        return from_global(self, dst, tensor)

    def shard_array(self, spec: Any, data: Any, dtype: Any) -> dict[int, Array]:
        return shard_array(self, spec, data, dtype)

    def create(self, make: Callable[..., Array], shapes: Sequence[tuple[int, ...]], dtype: Any) -> tuple[Array, ...]:
        return create(self, make, shapes, dtype)

    def update(
        self, opt: Any, p: Any, lr: float, src: Any, gv: Any, state: dict[str, Any], r: int, cdt: Any
    ) -> tuple[Array, dict[str, Array]]:
        return update(self, opt, p, lr, src, gv, state, r, cdt)

    def bump_step(self, opt: Any, p: Any) -> None:
        bump_step(self, opt, p)

    # ------------------------------------------------------------------ end of the traced call
    def finish(self, out: Any) -> None:
        """Describe the outputs and where the step leaves its results (parameters, grads, states)."""
        if self.refused is not None:
            return
        try:
            self.out_template = self._template(out)
            self.sig.append(("out", self.out_template))
            ended: set[int] = set()
            for _, src in list(self.roots):
                if src[0] == "tensor" and id(src[1]) not in ended:
                    ended.add(id(src[1]))
                    self._end_tensor(src[1])
                elif src[0] == "arg":
                    self._end_arg(src)
            for leaf in self.leaves.values():
                self._end_grad(leaf)
            for opt, p in self.updated.values():
                self._end_states(opt, p)
        except Refused as exc:
            self.refuse(str(exc))
        except Exception as exc:  # the capture never fails a step: it refuses instead
            self.refuse(f"the capture could not describe the step's results ({type(exc).__name__}: {exc})")

    def _template(self, out: Any) -> Any:
        if out is None:
            return None
        if isinstance(out, Tensor):
            if id(out) in self.arg_index or any(src[0] == "tensor" and src[1] is out for _, src in self.roots):
                raise Refused(f"the step returns {out._label()}, a tensor from outside the step; return a computed one")
            return ("tensor", out._spec, out._dtype, tuple(out._shape), self._slots_of(out, out))
        if isinstance(out, (list, tuple)) and type(out) in (list, tuple):
            return (type(out), tuple(self._template(v) for v in out))
        if isinstance(out, dict) and type(out) is dict:
            return (dict, tuple((k, self._template(v)) for k, v in out.items()))
        raise Refused(
            f"the step returns a {type(out).__name__}; a captured step returns Tensors (in tuples, lists, dicts) or None"
        )

    def _slots_of(self, t: Any, source: Any) -> tuple[tuple[int | None, int], ...]:
        if t._abstract or t._init is not None:
            raise Refused(f"{t._label()} holds no values (shape-only or lazy)")
        return tuple((r, self.slot_of(a, source if not isinstance(source, str) else None, r)) for r, a in _arrays_of(t))

    def _end_tensor(self, t: Any) -> None:
        slots = tuple((r, self.slot_of(a, t, r)) for r, a in _arrays_of(t))
        start = tuple((r, self.root_slot.get(("tensor", id(t), r))) for r, _ in _arrays_of(t))
        self.sig.append(("end-tensor", id(t), id(t._spec), slots))
        if slots != start:
            self.rebind.append(("tensor", t, t._spec, t._dtype, slots))

    def _end_arg(self, src: tuple[Any, ...]) -> None:
        """An argument must still hold what the step read (the program does not rebind arguments)."""
        s = self.root_slot[_source_key(src)]
        try:
            now = _getter(src)(self.flat)
        except _Stale:
            now = None
        if now is not self.arrays[s]:
            raise Refused(f"the step replaces the storage of its argument {src[1]}")

    def _end_grad(self, leaf: Any) -> None:
        g = leaf.grad
        if g is None:
            self.sig.append(("end-grad", id(leaf), None))
            self.rebind.append(("grad", leaf, None))
            return
        slots = tuple((r, self.slot_of(a, ("grad", leaf, r))) for r, a in _arrays_of(g))
        self.sig.append(("end-grad", id(leaf), id(g._spec), g._dtype, slots))
        self.rebind.append(("grad", leaf, (g._spec, g._dtype, g.stop_gradient, slots)))

    def _end_states(self, opt: Any, p: Any) -> None:
        state = opt._states.get(id(p))
        if state is None:
            raise Refused(f"the optimizer has no state for {p._label()} after its step")
        for n in opt.state_names:
            t = state[n]
            slots = tuple((r, self.slot_of(a, ("state", opt, id(p), n, r))) for r, a in _arrays_of(t))
            self.sig.append(("end-state", id(opt), id(p), n, id(t._spec), slots))
            self.rebind.append(("state", opt, id(p), n, t._spec, t._dtype, slots))

    # ------------------------------------------------------------------ validation
    def snapshot(self, flat_args: Sequence[Any]) -> dict[str, Any]:
        """Copies of every array this trace read from outside, and the step counts, as they are now."""
        roots: dict[int, Array] = {}
        for s, src in self.roots:
            with contextlib.suppress(_Stale):
                copy = _getter(src)(flat_args).copy()
                copy.flags.writeable = False  # read-only as the live shards: no update writes into it in place
                roots[s] = copy
        steps = {(id(opt), pid): dict(opt._states.get(pid, {})) for opt, p in self.updated.values() for pid in (id(p),)}
        return {"roots": roots, "steps": steps}

    def validate(self, snap: dict[str, Any], program: Program | None = None) -> str | None:
        """Run the program (``program``'s instructions as it will run them: folded, reordered;
        else the trace's) from ``snap`` (the state before this eager call) and compare every
        array it produces with the eager call's, bit for bit; None when all agree."""

        n = len(self.arrays)
        slots: list[Any] = [None] * n
        for s, src in self.roots:
            if s not in snap["roots"]:
                return f"{_describe(src)} could not be read back before the traced call"
            slots[s] = snap["roots"][s]
        for s, a in self.consts:
            slots[s] = a
        instrs = self.instrs
        alias: dict[int, int] = {}
        if program is not None:
            instrs, alias = program.instrs, program.alias
            for s, a in enumerate(program.template):
                if a is not None:
                    slots[s] = a
        saved = list(comm._recorders), list(comm._span_recorders)
        comm._recorders.clear()  # the check's collectives are internal: observers do not hear them
        comm._span_recorders.clear()
        _meta_override.update(snap["steps"])
        try:
            for fn, ins, outs, kind in instrs:
                if kind == 2:
                    continue  # Python effects already happened in the eager call
                res = fn(*[slots[i] for i in ins])
                if kind == 0:
                    slots[outs] = res
                else:
                    for o, a in zip(outs, res, strict=True):
                        slots[o] = a
        except Exception as exc:  # any failure of the check refuses the capture
            return f"the validation run failed: {type(exc).__name__}: {exc}"
        finally:
            _meta_override.clear()
            comm._recorders[:] = saved[0]
            comm._span_recorders[:] = saved[1]
        for s, same_as in alias.items():  # an instruction left out: its eager array must equal the one it reads
            slots[s] = slots[same_as]
        root_slots = {s for s, _ in self.roots} | {s for s, _ in self.consts}
        for s in range(n):
            if s in root_slots:
                continue
            try:
                same = _same_bits(slots[s], self.arrays[s])
            except Exception as exc:  # an array the check cannot read back: refuse
                return f"the validation run's slot {s} cannot be compared ({type(exc).__name__}: {exc})"
            if not same:
                return f"the validation run differs from the eager call at slot {s} (an in-place write or a hidden input the capture does not see)"
        return None


# ============================================================================ sources
def _source_key(src: tuple[Any, ...]) -> tuple[Any, ...]:
    """A source as a comparable key (objects by identity, kept alive by the trace)."""
    kind = src[0]
    if kind == "arg":
        return src
    if kind in ("tensor", "grad"):
        return (kind, id(src[1]), src[2])
    return ("state", id(src[1]), src[2], src[3], src[4])


def _describe(src: tuple[Any, ...]) -> str:
    """A source in words, for a refusal's reason."""
    kind = src[0]
    if kind == "arg":
        return f"argument {src[1]}"
    if kind == "tensor":
        return src[1]._label()
    if kind == "grad":
        return f"the gradient of {src[1]._label()}"
    return f"optimizer state {src[3]} of parameter {src[2]}"


def _layout_of(array: Array) -> tuple[Any, ...]:
    """What the signature keeps of a root array: its shape and dtype (its values are the call's)."""
    return (tuple(getattr(array, "shape", ())), str(getattr(array, "dtype", "")))


def _arrays_of(t: Any) -> list[tuple[int | None, Array]]:
    """A tensor's arrays by hosted rank (None: the whole value of a dense tensor); a distributed
    tensor this process hosts no rank of has none."""
    if t._spec is not None:
        return list(t._shards.items())
    return [(None, t._value)]


def _grad_state(leaf: Any) -> Any:
    """What a program checks of a parameter before it runs: trainable or not, gradient layout."""
    g = leaf.grad
    return (leaf.stop_gradient, None if g is None else (g._spec, g._dtype))


def _read(t: Any, r: int | None) -> Array:
    """``t``'s shard of rank ``r`` (None: its dense value) now; ``_Stale`` when it has none."""
    if r is None:
        v = t._dense
        if v is None or t._init is not None:
            raise _Stale
        return v
    a = t._shards.get(r)
    if a is None:
        raise _Stale
    return a


def _getter(src: tuple[Any, ...]) -> Callable[[Sequence[Any]], Array]:
    """A function of the call's flat arguments reading the source's array live."""
    kind = src[0]
    if kind == "arg":
        i, r = src[1], src[2]

        def arg(flat: Sequence[Any]) -> Array:
            a = flat[i]
            return a if r == "array" else _read(a, r)

        return arg
    if kind == "tensor":
        ref = weakref.ref(src[1])
        r = src[2]

        def tensor(flat: Sequence[Any]) -> Array:
            t = ref()
            if t is None:
                raise _Stale
            return _read(t, r)

        return tensor
    if kind == "grad":
        ref = weakref.ref(src[1])
        r = src[2]

        def grad(flat: Sequence[Any]) -> Array:
            t = ref()
            if t is None or t.grad is None:
                raise _Stale
            return _read(t.grad, r)

        return grad
    opt_ref, pid, name, r = weakref.ref(src[1]), src[2], src[3], src[4]

    def state(flat: Sequence[Any]) -> Array:
        opt = opt_ref()
        st = opt._states.get(pid) if opt is not None else None
        if st is None or name not in st:
            raise _Stale
        return _read(st[name], r)

    return state


# ============================================================================ the program
class Program:
    """A captured step: instructions over slots, how to fill its roots, where its results go."""

    def __init__(self, tr: Tracer) -> None:
        self.n = len(tr.arrays)
        self.binders = [(s, _getter(src)) for s, src in tr.roots]
        self.template: list[Any] = [None] * self.n
        for s, a in tr.consts:
            self.template[s] = a
        self.out = tr.out_template
        self.leaf_guards = [(weakref.ref(leaf), state) for leaf, state in tr.start_grads]
        self.tensor_guards = [(weakref.ref(t), spec, dtype) for t, spec, dtype in tr.start_tensors]
        self.optimizer_guards = [(weakref.ref(opt), _optimizer_setup(opt)) for opt in tr.optimizers.values()]
        self.alone: list[tuple[weakref.ref[Any], list[bool], int]] = []
        self.alone_flags: list[bool] = []
        instrs = list(tr.instrs)
        for k, (i, p, _) in enumerate(_in_place_updates(tr)):
            fn, ins, outs, kind = instrs[i]
            self.alone_flags.append(False)
            self.alone.append((weakref.ref(p), self.alone_flags, k))
            instrs[i] = (partial(_write_in_place, fn, self.alone_flags, k), ins, outs, kind)
        self._alone_test = (_ALONE_REFS, _shard_refs)
        kept = set(_template_slots(tr.out_template)) | {s for e in tr.rebind for s in _rebind_slots(e)}
        self.alias: dict[int, int] = {}
        """Slots never made because an earlier instruction makes the same array (``_same_once``)."""
        indexed = _fold_constants(tr, list(enumerate(instrs)), self.template, kept)
        indexed = _updates_early(tr, _same_once(tr, indexed, kept, self.alias))
        self.instrs = [ins for _, ins in indexed]
        """The instructions as they run (folded, reordered): what the validation run checks."""
        self.program = _with_drops(self.instrs, kept)
        self.rebind = _weak_rebind(tr.rebind)

    def run(self, flat: Sequence[Any]) -> Any:
        """The step on this call's arguments; raises ``_Stale`` (before any work) if a check fails."""
        for ref, (stop, grad) in self.leaf_guards:
            leaf = ref()
            if leaf is None or leaf.stop_gradient != stop:
                raise _Stale
            g = leaf.grad
            if (g is None) != (grad is None) or (g is not None and (g._spec != grad[0] or g._dtype != grad[1])):
                raise _Stale
        for ref, spec, dtype in self.tensor_guards:
            t = ref()
            if t is None or (t._spec is not spec and t._spec != spec) or t._dtype != dtype or t._grad_fn is not None:
                raise _Stale
        for ref, setup in self.optimizer_guards:
            opt = ref()
            if opt is None or _optimizer_setup(opt) != setup:
                raise _Stale
        if self.alone:
            alone_refs, shard_refs = self._alone_test
            for ref, flags, k in self.alone:
                # As eager's ``_unfreeze_if_alone``: nothing but the parameter may hold its shard.
                p = ref()
                flags[k] = p is not None and len(p._shards) == 1 and _owns(p) and shard_refs(p)[:2] == alone_refs
        slots = list(self.template)
        for s, get in self.binders:
            slots[s] = get(flat)
        for fn, ins, outs, kind, drop in self.program:
            if kind == 4:  # one output of two inputs (most kernels): no argument list to build
                slots[outs] = fn(slots[ins[0]], slots[ins[1]])
            elif kind == 3:  # one output of one input
                slots[outs] = fn(slots[ins[0]])
            elif kind == 0:
                slots[outs] = fn(*[slots[i] for i in ins])
            elif kind == 1:
                for o, a in zip(outs, fn(*[slots[i] for i in ins]), strict=True):
                    slots[o] = a
            else:  # 5: an effect
                fn()
            for s in drop:  # last use: let the allocator hand the memory to the next array while it is hot
                slots[s] = None
        _apply_rebind(self.rebind, slots)
        return _build(self.out, slots)


Indexed = list[tuple[int, tuple[Any, ...]]]
"""Instructions with their index in the trace (``Tracer.pure``, ``.updates`` and ``.bumps`` name them by it)."""


def _fold_constants(tr: Tracer, instrs: Indexed, template: list[Any], kept: set[int]) -> Indexed:
    """The instructions less those that make the same arrays on every run: a pure one
    (``Tracer.pure``) whose inputs are all constants (the seed of backward, its scaling,
    reshape and broadcast). Their outputs become constants holding the traced values (which
    the validation run reproduced bit for bit), read-only so nothing writes into them; one
    whose output the step returns or leaves behind keeps running (a result is an array of its own)."""
    const = {s for s, _ in tr.consts}
    out = []
    for i, ins_ in instrs:
        _, ins, outs, kind = ins_
        made = (outs,) if kind == 0 else outs if kind == 1 else None
        if i in tr.pure and made is not None and all(s in const for s in ins) and not kept.intersection(made):
            for s in made:
                a = tr.arrays[s]
                if isinstance(a, np.ndarray) and a.flags.writeable:
                    a = a.copy()
                    a.flags.writeable = False
                template[s] = a
                const.add(s)
            continue
        out.append((i, ins_))
    return out


def _same_once(tr: Tracer, instrs: Indexed, kept: set[int], alias: dict[int, int]) -> Indexed:
    """The instructions less repeats: a pure one-output instruction calling the same function
    object on the same slots as an earlier one (the backward of ``z * z`` multiplies the same
    two arrays twice) reads that one's output instead (``alias``: slot -> the slot it reads).
    Forgotten at every update or effect, which may overwrite a slot in place."""
    seen: dict[tuple[Any, tuple[int, ...]], int] = {}
    out: Indexed = []
    for i, (fn, ins, outs, kind) in instrs:
        if alias:
            ins = tuple(alias.get(s, s) for s in ins)
        if i in tr.updates or kind == 2:
            seen.clear()
        elif i in tr.pure and kind == 0 and outs not in kept:
            try:
                key = (fn, ins)
                hash(key)
            except TypeError:
                key = None
            if key is not None:
                if key in seen:
                    alias[outs] = seen[key]
                    continue
                seen[key] = outs
        out.append((i, (fn, ins, outs, kind)))
    return out


def _updates_early(tr: Tracer, instrs: Indexed) -> Indexed:
    """Each optimizer update moved up to right after the last instruction it must follow, as a
    hand-written step updates each weight as soon as its gradient is made: the gradient is
    still in cache, and its memory goes back to the allocator for the rest of backward. The
    arithmetic is the same (each update reads the same arrays), so are the bits. An update
    follows: the makers of its inputs; every instruction reading or making an array that
    shares memory with the shard it may overwrite (SGD in place); every update that may
    overwrite memory its inputs share; and every effect but the step counts of other
    parameters (its own count stays after it: Adam's bias correction reads the count as it
    was). Only on NumPy, where memory sharing can be asked (elsewhere the order stays)."""
    if not tr.updates or not _numpy_only(tr):
        return instrs
    out: Indexed = []
    for i, ins_ in instrs:
        if i not in tr.updates:
            out.append((i, ins_))
            continue
        who = tr.updates[i]
        ins = ins_[1]
        target = tr.arrays[ins[0]]
        shared = {s for s, a in enumerate(tr.arrays) if hasattr(a, "shape") and np.may_share_memory(a, target)}
        reads = [tr.arrays[s] for s in ins]
        pos = 0
        for k, (j, (_, ins_j, outs_j, kind_j)) in enumerate(out):
            made = () if kind_j == 2 else (outs_j,) if kind_j == 0 else tuple(outs_j)
            if kind_j == 2:
                after = tr.bumps.get(j) in (None, who)
            elif j in tr.updates:
                after = any(np.may_share_memory(tr.arrays[ins_j[0]], a) for a in reads if hasattr(a, "shape")) or bool(
                    shared.intersection(ins_j)
                )
            else:
                after = False
            if after or set(ins).intersection(made) or shared.intersection(ins_j) or shared.intersection(made):
                pos = k + 1
        out.insert(pos, (i, ins_))
    return out


def _with_drops(instrs: list[tuple[Any, ...]], kept: set[int]) -> list[tuple[Any, ...]]:
    """Each instruction with the slots it reads or makes for the last time (none that the
    outputs or the results put back need): the run drops them right after it."""
    last: dict[int, int] = {}
    for i, (_, ins, outs, kind) in enumerate(instrs):
        made = () if kind == 2 else ((outs,) if kind == 0 else outs)
        for s in (*ins, *made):
            last[s] = i
    drops: list[list[int]] = [[] for _ in instrs]
    for s, i in last.items():
        if s not in kept:
            drops[i].append(s)
    out = []
    for (fn, ins, outs, kind), d in zip(instrs, drops, strict=True):
        if kind == 0 and len(ins) in (1, 2):
            kind = 2 + len(ins)  # 3: one input, 4: two inputs (``Program.run`` calls them directly)
        elif kind == 2:
            kind = 5  # an effect
        out.append((fn, ins, outs, kind, tuple(d)))
    return out


def _optimizer_setup(opt: Any) -> tuple[Any, ...]:
    """What an optimizer's step does besides the updates the program replays: its clip, its
    update layouts (ZeRO), offloading, master weights and parameter list, by identity."""
    return (
        id(opt._grad_clip),
        id(opt._update_layout),
        id(opt.offload),
        opt._multi_precision,
        tuple(map(id, opt._parameter_list)),
        type(opt._learning_rate),
    )


def _owns(p: Any) -> bool:
    a = next(iter(p._shards.values()))
    return type(a) is np.ndarray and a.base is None and a.flags.c_contiguous and a.flags.owndata


def _write_in_place(fn: Callable[..., Any], flags: list[bool], k: int, *arrays: Array) -> Any:
    """An update allowed to overwrite the parameter's shard (``SGD``'s ``w -= lr * g``) when the
    run began with nothing but the parameter holding it; read-only otherwise (a new array)."""
    if flags[k]:
        arrays[0].flags.writeable = True
    return fn(*arrays)


def _numpy_only(tr: Tracer) -> bool:
    """Are all the trace's arrays NumPy's own (exactly ``np.ndarray``, or NumPy scalars)? Only
    there can ``np.may_share_memory`` and the memory flags be asked; a device array (CuPy's, or
    the CI stand-in's NumPy subclass standing for it) is not NumPy memory, so the program keeps
    the trace's order and writes nothing in place there."""
    return all(type(a) is np.ndarray or isinstance(a, np.generic) for a in tr.arrays if hasattr(a, "shape"))


def _in_place_updates(tr: Tracer) -> list[tuple[int, Any, int]]:
    """The updates that may overwrite the parameter's shard: no later instruction, output or
    result reads that shard or anything sharing its memory (a view, a no-op reshard's output).
    None on device arrays (``_numpy_only``): ``_owns`` would refuse them on every run anyway."""
    if not tr.in_place or not _numpy_only(tr):
        return []
    out = []
    for i, p, r in tr.in_place:
        ins = tr.instrs[i][1]
        src = ins[0]
        if not any(s == src and key[0] == "tensor" and key[1] == id(p) for key, s in tr.root_slot.items()):
            continue
        base = tr.arrays[src]
        new = tr.instrs[i][2][0]
        shared = {
            s for s, a in enumerate(tr.arrays) if s != new and hasattr(a, "shape") and np.may_share_memory(a, base)
        }
        later = {j for _, ins_j, _, _ in tr.instrs[i + 1 :] for j in ins_j}
        kept = set(_template_slots(tr.out_template)) | {s for e in tr.rebind for s in _rebind_slots(e)}
        if not (shared & (later | kept)):
            out.append((i, p, r))
    return out


def _template_slots(t: Any) -> list[int]:
    if t is None:
        return []
    if t[0] == "tensor":
        return [s for _, s in t[4]]
    return [s for v in t[1] for s in _template_slots(v[1] if t[0] is dict else v)]


def _rebind_slots(e: tuple[Any, ...]) -> list[int]:
    if e[0] == "tensor":
        return [s for _, s in e[4]]
    if e[0] == "grad":
        return [] if e[2] is None else [s for _, s in e[2][3]]
    return [s for _, s in e[6]]


def _weak_rebind(entries: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    out = []
    for e in entries:
        out.append((e[0], weakref.ref(e[1]), *e[2:]))
    return out


def _apply_rebind(entries: list[tuple[Any, ...]], slots: list[Any]) -> None:
    for e in entries:
        kind, obj = e[0], e[1]()
        if obj is None:
            continue
        if kind == "tensor":
            _, _, spec, dtype, where = e
            if spec is None:
                obj._sid = next(_storage_ids)
                obj._dense = slots[where[0][1]]
            elif obj._spec is spec and obj._dense is None and obj._dtype == dtype and _holds(obj._shards, where, slots):
                # Updated in place (SGD): the same arrays, a new value. A new storage id, as
                # ``_set_dist`` gives (reshards of the old value are not reused), and read-only again.
                obj._sid = next(_storage_ids)
                for _, s in where:
                    slots[s].flags.writeable = False
            else:
                obj._set_dist(spec, {r: slots[s] for r, s in where}, dtype)
        elif kind == "grad":
            desc = e[2]
            if desc is None:
                if obj.grad is not None:
                    obj.grad = None
            else:
                spec, dtype, stop, where = desc
                obj.grad = _tensor(spec, dtype, tuple(spec.shape) if spec is not None else None, where, slots)
                obj.grad.stop_gradient = stop
        else:
            _, _, pid, name, spec, dtype, where = e
            obj._states[pid][name] = _tensor(spec, dtype, None, where, slots, computed=False)


def _holds(shards: dict[int, Array], where: Sequence[tuple[Any, int]], slots: list[Any]) -> bool:
    """Does ``shards`` hold exactly the slots' arrays (by identity), NumPy ones, rank for rank?"""
    if len(shards) != len(where):
        return False
    for r, s in where:
        a = slots[s]
        if shards.get(r) is not a or type(a) is not np.ndarray:
            return False
    return True


def _tensor(
    spec: Any, dtype: Any, shape: Any, where: Sequence[tuple[int | None, int]], slots: list[Any], computed: bool = True
) -> Tensor:
    if spec is None:
        t = Tensor.__new__(Tensor)
        Tensor.__init__(t, None, dtype=dtype)
        v = slots[where[0][1]]
        t._dense = v
        t._shape = type(t._shape)(v.shape)
        t._dtype = v.dtype
        return t
    t = Tensor._from_shards(spec, {r: slots[s] for r, s in where}, dtype)
    if computed:
        t._reshards = {}  # a computed value, as the eager one (reshard it once)
    return t


def _build(template: Any, slots: list[Any]) -> Any:
    if template is None:
        return None
    kind = template[0]
    if kind == "tensor":
        _, spec, dtype, shape, where = template
        return _tensor(spec, dtype, shape, where, slots)
    items = [_build(v, slots) for v in template[1]] if kind is not dict else None
    if kind is list:
        return items
    if kind is tuple:
        return tuple(items or ())
    return {k: _build(v, slots) for k, v in template[1]}


# ============================================================================ call sites
def _kernel1_fn(kernel: Callable[..., Any], ctx: Any, attrs: dict[str, Any], dt: Any, *arrays: Array) -> Array:
    """``_kernel_fn`` of a one-output op on NumPy arrays: the same normalisation, fewer steps."""
    arr = kernel(ctx, *arrays, **attrs)
    if type(arr) is not np.ndarray:
        if not isinstance(arr, np.generic):
            return freeze(arr if arr.dtype == dt else arr.astype(dt))
        arr = np.asarray(arr)
    if arr.dtype != dt:
        arr = arr.astype(dt)
    arr.flags.writeable = False
    return arr


def _kernel_fn(op: Any, ctx: Any, attrs: dict[str, Any], dtypes: Sequence[Any], multi: bool, *arrays: Array) -> Any:
    """An op's kernel on local arrays, normalised as ``dispatch._run_dist`` does (0-d, dtype, read-only)."""

    result = op.kernel(ctx, *arrays, **attrs)
    got = list(result) if multi else [result]
    for j, (arr, dt) in enumerate(zip(got, dtypes, strict=True)):
        if isinstance(arr, np.generic):
            arr = np.asarray(arr)
        if arr.dtype != dt:
            arr = arr.astype(dt)
        got[j] = freeze(arr)
    return tuple(got) if multi else got[0]


def _dense_kernel_fn(
    op: Any, ctx: Any, attrs: dict[str, Any], dtypes: Sequence[Any], multi: bool, *arrays: Array
) -> Any:
    """An op's kernel on whole arrays, normalised as ``dispatch._run_dense`` does."""

    result = op.kernel(ctx, *arrays, **attrs)
    got = list(result) if multi else [result]
    for j, (arr, dt) in enumerate(zip(got, dtypes, strict=True)):
        arr = (
            np.asarray(arr, dtype=dt)
            if isinstance(arr, (np.ndarray, np.generic, int, float, bool))
            else arr.astype(dt, copy=False)
        )
        got[j] = freeze(arr)
    return tuple(got) if multi else got[0]


def record_kernel(
    tr: Tracer,
    op: Any,
    ctx: Any,
    attrs: dict[str, Any],
    dtypes: Sequence[Any],
    used: Sequence[Any],
    r: int | None,
    arrays: Sequence[Array],
    got: Sequence[Array],
    dense: bool = False,
    raw: Any = None,
) -> None:
    """Record one kernel call of ``_run_dist`` (``dense``: ``_run_dense``) that produced ``got``
    (``raw``: what the kernel itself returned)."""
    multi = bool(op.multi_output)
    # A kernel that gave a NumPy array of the output dtype needs no normalising: the same input
    # layouts and dtypes (checked on every run) give it again. The program's intermediates need
    # not be read-only (nothing but the program sees them); what it hands out is frozen.
    bare = not dense and not multi and type(raw) is np.ndarray and got[0] is raw
    if bare:
        fn = partial(op.kernel, ctx, **attrs)
    elif dense:
        fn = partial(_dense_kernel_fn, op, ctx, attrs, tuple(dtypes), multi)
    elif not multi:
        fn = partial(_kernel1_fn, op.kernel, ctx, attrs, dtypes[0])
    else:
        fn = partial(_kernel_fn, op, ctx, attrs, tuple(dtypes), multi)
    if not dense and not multi:
        fn = _specialized(op, ctx, attrs, arrays, got[0], dtypes[0], bare) or fn
    key = ("kernel", dense, bare, op.kernel, ctx, attrs, tuple(dtypes))
    n = len(tr.instrs)
    tr.record(fn, key, [(a, u, r) for a, u in zip(arrays, used, strict=True)], tuple(got) if multi else got[0], multi)
    if len(tr.instrs) > n and _builtin(op):
        tr.pure.add(n)


def _builtin(op: Any) -> bool:
    """An op whose kernel is mpipar's own: a function of its inputs, attributes and context only
    (a user's kernel may read state the capture cannot see, so it is never folded)."""
    return getattr(op.kernel, "__module__", "").startswith("mpipar.ops.")


_BINARY = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul, "divide": operator.truediv}
"""mpipar's elementwise kernels that are ``x + y`` (etc.) on NumPy arrays: called as the operator."""


def _specialized(
    op: Any, ctx: Any, attrs: dict[str, Any], arrays: Sequence[Array], out: Array, dt: Any, bare: bool
) -> Callable[..., Array] | None:
    """A cheaper call giving the same array as ``op``'s kernel on these NumPy inputs (shapes and
    dtypes fixed by the trace): what the kernel works out from its context on every call (the
    local output shape, the reduced axes, the global count of a mean) worked out once, and the
    same NumPy call made. Only mpipar's own kernels, on NumPy; None for anything else. The
    validation run checks the result bit for bit like any other instruction."""
    if ctx.xp is not np or not _builtin(op) or any(type(a) is not np.ndarray for a in arrays):
        return None
    name = getattr(op.kernel, "__name__", "")
    if bare and op.name in _BINARY and name == "<lambda>" and len(arrays) == 2:
        return _BINARY[op.name]
    if bare and name == "_to_local_shape" and len(arrays) == 1:
        return operator.methodcaller("reshape", tuple(out.shape))
    if bare and name == "_expand_kernel" and len(arrays) == 1:
        return partial(np.broadcast_to, shape=tuple(out.shape))
    if bare and name == "_matmul_kernel" and len(arrays) == 2:
        tx, ty = bool(attrs.get("trans_x", False)), bool(attrs.get("trans_y", False))
        return np.matmul if not (tx or ty) else partial(_matmul_fn, tx, ty)
    if name in ("_sum_kernel", "_mean_kernel") and len(arrays) == 1:
        axes = norm_axes(attrs.get("axis"), len(ctx.in_shape(0)), "reduction")  # as the kernels' ``_red_axes``
        keep = attrs.get("keepdim", False)
        if name == "_sum_kernel":
            return partial(np.add.reduce, axis=axes, dtype=None, out=None, keepdims=keep) if bare else None
        x = arrays[0]
        if not np.issubdtype(x.dtype, np.floating):
            return None
        count = x.dtype.type(math.prod(ctx.in_shape(0)[a] for a in axes))  # the kernel's global count
        return partial(_mean_fn, axes, keep, count, np.dtype(dt))
    return None


def _matmul_fn(tx: bool, ty: bool, x: Array, y: Array) -> Array:
    return np.matmul(x.swapaxes(-1, -2) if tx else x, y.swapaxes(-1, -2) if ty else y)


def _mean_fn(axes: tuple[int, ...], keep: bool, count: Any, dt: Any, x: Array) -> Array:
    """``_mean_kernel`` of a floating array with its count worked out, normalised as ``_kernel1_fn``."""
    arr = np.add.reduce(x, axis=axes, dtype=None, out=None, keepdims=keep) / count
    if type(arr) is not np.ndarray:
        arr = np.asarray(arr)
    if arr.dtype != dt:
        arr = arr.astype(dt)
    arr.flags.writeable = False
    return arr


def _plan_fn(
    plan: Any, ranks: tuple[int, ...], out_ranks: tuple[int, ...], dtype: Any, backend: Any, label: str, *arrays: Array
) -> tuple[Array, ...]:

    if comm.recording():  # observers hear the collectives with their reason
        with comm.comm_context(label):
            res = execute_plan(plan, dict(zip(ranks, arrays, strict=True)), dtype, backend)
    else:
        res = execute_plan(plan, dict(zip(ranks, arrays, strict=True)), dtype, backend)
    return tuple(res[r] for r in out_ranks)


def reshard(tr: Tracer, plan: Any, tensor: Any, backend: Any) -> dict[int, Array]:
    """``execute_plan`` of ``tensor``'s shards, run now and recorded."""

    if not plan.steps:  # nothing moves: the shards come back as they are, nothing to record ...
        try:  # ... but they are named after the tensor they come from (a root, or made earlier)
            for r, a in tensor._shards.items():
                tr.slot_of(a, tensor, r)
        except Refused as exc:
            tr.refuse(str(exc))
        return execute_plan(plan, tensor._shards, tensor._dtype, backend)
    ranks = tuple(tensor._shards)
    tr.depth += 1
    try:
        res = execute_plan(plan, tensor._shards, tensor._dtype, backend)
    finally:
        tr.depth -= 1
    out_ranks = tuple(res)
    label = comm.current_context()
    key = ("reshard", plan, ranks, out_ranks, tensor._dtype, backend)
    one = _one_step_fn(plan, ranks, out_ranks, tensor, backend, label)
    if one is not None:  # one rank in, the same one out: a one-output instruction
        tr.record(one, key, [(tensor._shards[ranks[0]], tensor, ranks[0])], res[ranks[0]], False)
        return res
    fn = partial(_plan_fn, plan, ranks, out_ranks, tensor._dtype, backend, label)
    tr.record(fn, key, [(tensor._shards[r], tensor, r) for r in ranks], tuple(res[r] for r in out_ranks), True)
    return res


def _one_step_fn(
    plan: Any, ranks: tuple[int, ...], out_ranks: tuple[int, ...], tensor: Any, backend: Any, label: str
) -> Callable[[Array], Array] | None:
    """A one-step plan on the one rank this process hosts (MPI), bound for the program: the
    step's runner called straight (``execute_plan``'s loop, dict and context are for many
    steps and observers), and an all-reduce bound to the communicator's lowest layer
    (``bound_all_reduce``: the whole-buffer gather and the group-order fold) where it has one.
    Observers make either take ``execute_plan`` as eager does, so they hear the call and its reason."""
    if len(plan.steps) != 1 or len(ranks) != 1 or out_ranks != ranks:
        return None
    (step,) = plan.steps
    rank, a = ranks[0], tensor._shards[ranks[0]]
    general = partial(_plan_fn, plan, ranks, out_ranks, tensor._dtype, backend, label)
    if step.kind == "all_reduce" and type(a) is np.ndarray:
        # The bound all-reduce gathers into a host buffer kept from step to step: NumPy shards
        # only. Device shards (NCCL) keep the general path, whose data moves through NCCL.
        bind = getattr(backend.comm, "bound_all_reduce", None)
        groups = step.groups_with(rank)
        bound = (
            bind(groups[0], tuple(a.shape), a.dtype, step.reduce_type or "sum")
            if bind is not None and len(groups) == 1
            else None
        )
        if bound is not None:
            return partial(_bound_fn, bound, general)
    if (
        step.kind == "partial"
        and type(a) is np.ndarray
        and isinstance(step.src.placements[step.axes[0]], Replicate)
        and (step.reduce_type or "sum") == "sum"
    ):
        # Replicate -> Partial(sum): one rank of the axis keeps its value, the others hold zeros,
        # the same zeros on every step (read-only on NumPy, so one array serves them all).
        if step.src.mesh.coordinate(rank)[step.axes[0]] == 0:
            return partial(_kept_fn, general)
        return partial(_zeros_fn, freeze(backend.xp.zeros_like(a)), general)
    return partial(_step_fn, _RUNNERS[step.kind], step, rank, np.dtype(tensor._dtype), backend, general)


def _kept_fn(general: Callable[..., tuple[Array, ...]], a: Array) -> Array:
    if comm.recording():
        return general(a)[0]
    return freeze(a)


def _zeros_fn(zeros: Array, general: Callable[..., tuple[Array, ...]], a: Array) -> Array:
    if comm.recording():
        return general(a)[0]
    return zeros


def _bound_fn(bound: Callable[[Array], Array], general: Callable[..., tuple[Array, ...]], a: Array) -> Array:
    if comm.recording():
        return general(a)[0]
    return freeze(bound(a))


def _step_fn(
    run: Callable[..., dict[int, Array]],
    step: Any,
    rank: int,
    dtype: Any,
    backend: Any,
    general: Callable[..., tuple[Array, ...]],
    a: Array,
) -> Array:
    if comm.recording():
        return general(a)[0]
    return freeze(run(step, {rank: a}, dtype, backend)[rank])


def _from_global_fn(dst: Any, out_ranks: tuple[int, ...], value: Array) -> tuple[Array, ...]:
    res = _shards_from_global(dst, np.asarray(value))
    return tuple(res[r] for r in out_ranks)


def from_global(tr: Tracer, dst: Any, tensor: Any) -> dict[int, Array]:
    """A dense tensor cut into ``dst``'s hosted shards, run now and recorded."""
    value = np.asarray(tensor._value)
    res = _shards_from_global(dst, value)
    out_ranks = tuple(res)
    fn = partial(_from_global_fn, dst, out_ranks)
    tr.record(fn, ("from_global", dst, out_ranks), [(value, tensor, None)], tuple(res[r] for r in out_ranks), True)
    return res


def _fill_fn(make: Callable[..., Array], shapes: tuple[tuple[int, ...], ...], dtype: Any) -> tuple[Array, ...]:
    return tuple(make(s, dtype=dtype) for s in shapes)


def create(tr: Tracer, make: Callable[..., Array], shapes: Sequence[tuple[int, ...]], dtype: Any) -> tuple[Array, ...]:
    """Fresh arrays (ones, zeros) made now and on every run."""
    fn = partial(_fill_fn, make, tuple(map(tuple, shapes)), dtype)
    res = fn()
    n = len(tr.instrs)
    tr.record(fn, ("create", make, tuple(map(tuple, shapes)), np.dtype(dtype)), [], res, True)
    if len(tr.instrs) > n:
        tr.pure.add(n)
    return res


def _update_fn(
    opt_ref: weakref.ref[Any],
    p_ref: weakref.ref[Any],
    pid: int,
    names: tuple[str, ...],
    cdt: Any,
    decay: Any,
    *arrays: Array,
) -> tuple[Array, ...]:
    """The optimizer's update of one shard, its learning rate and step count read live."""
    opt, p = opt_ref(), p_ref()
    if opt is None or p is None:
        raise _Stale
    meta = _meta_override.get((id(opt), pid)) if _meta_override else None
    if meta is None:
        meta = opt._states[pid]
    lr = _param_lr(p, opt.get_lr())
    if decay is not None:
        opt._decay_this = decay
    src, g = arrays[0], arrays[1]
    new_p, new_states = opt._update(src, g.astype(cdt, copy=False), dict(zip(names, arrays[2:], strict=True)), lr, meta)
    return (new_p, *[new_states[n] for n in names])


def _sgd_fn(opt_ref: weakref.ref[Any], p_ref: weakref.ref[Any], cdt: Any, src: Array, g: Array) -> tuple[Array]:
    """``_update_fn`` of plain SGD: no states, no decay flag, no step count read (fewer lookups)."""
    opt, p = opt_ref(), p_ref()
    if opt is None or p is None:
        raise _Stale
    lr = _param_lr(p, opt.get_lr())
    return (opt._update(src, g.astype(cdt, copy=False), {}, lr, None)[0],)


def update(
    tr: Tracer, opt: Any, p: Any, lr: float, src: Any, gv: Any, state: dict[str, Any], r: int, cdt: Any
) -> tuple[Array, dict[str, Array]]:
    """``opt._update`` of ``p``'s shard on rank ``r``, run now and recorded."""
    names = tuple(opt.state_names)
    live = _param_lr(p, opt.get_lr())
    if live != lr:
        tr.refuse(f"{type(opt).__name__} updates {p._label()} with a learning rate its get_lr() does not give")
    decay = getattr(opt, "_decay_this", None)
    tr.updated[(id(opt), id(p))] = (opt, p)
    if type(opt)._update is SGD._update and not names and decay is None:
        fn = partial(_sgd_fn, weakref.ref(opt), weakref.ref(p), cdt)
    else:
        fn = partial(_update_fn, weakref.ref(opt), weakref.ref(p), id(p), names, cdt, decay)
    grad_src = ("grad", p, r) if gv is p.grad else gv
    inputs = [(src._shards[r], src, r), (gv._shards[r], grad_src, r)]
    inputs += [(state[n]._shards[r], ("state", opt, id(p), n, r), r) for n in names]
    key = ("update", type(opt)._update, opt, id(p), names, np.dtype(cdt), decay, type(opt).get_lr)
    res = tr.call(fn, key, inputs, True)
    if tr.instrs and tr.instrs[-1][0] is fn:
        tr.updates[len(tr.instrs) - 1] = (id(opt), id(p))
        if opt.updates_in_place and len(src._shards) == 1 and src is p:
            tr.in_place.append((len(tr.instrs) - 1, p, r))
    return res[0], dict(zip(names, res[1:], strict=True))


def _bump_fn(opt_ref: weakref.ref[Any], pid: int) -> None:
    opt = opt_ref()
    if opt is None:
        raise _Stale
    state = opt._states[pid]
    state["step"] = state.get("step", 0) + 1


def bump_step(tr: Tracer, opt: Any, p: Any) -> None:
    """The optimizer just counted a step of ``p``: count it on every run too."""
    tr.effect(partial(_bump_fn, weakref.ref(opt), id(p)), ("step", opt, id(p)))
    tr.bumps[len(tr.instrs) - 1] = (id(opt), id(p))


def observed() -> str | None:
    """Why a captured program may not run now (observers that must see every op), or None."""

    if hooks.op_start_hooks or hooks.op_hooks or hooks.reshard_hooks or hooks.backward_hooks:
        return "observers (plan tracing, memory accounting, timelines) must see every op"
    if hooks.stage_runs:
        return "a pipeline stage run is in progress"
    if comm._span_recorders:
        return "a measured timeline records the step"
    return None


def agree(ok: Sequence[bool], backend: Any) -> list[bool]:
    """Under MPI (a process hosting part of the world) every flag is the minimum over all ranks,
    so that all processes take the same path (validation runs collectives)."""

    world = backend.world_group()
    mine = [r for r in world if backend.hosts(r)]
    if len(mine) == len(world) or not mine:
        return list(ok)
    saved = list(comm._recorders), list(comm._span_recorders)
    comm._recorders.clear()
    comm._span_recorders.clear()
    try:
        buf = np.array([1 if f else 0 for f in ok], dtype=np.int64)
        got = backend.comm.all_reduce(world, {mine[0]: buf}, "min")
    finally:
        comm._recorders[:] = saved[0]
        comm._span_recorders[:] = saved[1]
    return [bool(v) for v in next(iter(got.values()))]


def _shard_array_fn(spec: Any, dtype: Any, out_ranks: tuple[int, ...], data: Array) -> tuple[Array, ...]:
    res = _shards_from_global(spec, _as_array(data, dtype, copy=True))
    return tuple(res[r] for r in out_ranks)


def shard_array(tr: Tracer, spec: Any, data: Any, dtype: Any) -> dict[int, Array]:
    """``shard_tensor`` of an array (a step argument, read live on every run; another array is
    a constant by identity), run now and recorded."""
    i = tr.arg_index.get(id(data))
    ranks = tuple(current_hosted(spec))
    fn = partial(_shard_array_fn, spec, dtype, ranks)
    source = ("arg", i, "array") if i is not None else None
    res = tr.call(
        fn, ("shard_array", spec, None if dtype is None else np.dtype(dtype), ranks), [(data, source, None)], True
    )
    return dict(zip(ranks, res, strict=True))


def current_hosted(spec: Any) -> tuple[int, ...]:
    return tuple(current_backend().hosted_ranks(spec.mesh))
