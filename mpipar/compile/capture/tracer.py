"""Recording one eager call of a step into instructions over slots, describing where it leaves
its results, and checking a program against it bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpipar import comm
from mpipar._xp import to_numpy
from mpipar.compile.capture.instructions import Array, Instruction, Kind, Planned, Refused, Stale
from mpipar.compile.capture.results import GradLayout, GradResult, Result, StateResult, TensorOut, TensorResult
from mpipar.compile.capture.sources import (
    ArgSource,
    GradSource,
    Source,
    StateSource,
    TensorSource,
    arrays_of,
    describe,
    getter,
    grad_state,
    layout_of,
    source_key,
    tensor_key,
)
from mpipar.optimizer.optimizer import Optimizer
from mpipar.tensor import Tensor

meta_override: dict[tuple[int, int], dict[str, Any]] = {}
"""During a validation run: the optimizer step counts as they were before the traced call (the
eager call already advanced the live ones)."""


MAX_TRACES = 3
"""Traced calls per layout key before giving up on two consecutive identical ones."""


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


class Tripwire:
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
        self.roots: list[tuple[int, Source]] = []
        """(slot, source) of every array read from outside the step (``getter`` reads it live)."""
        self.root_slot: dict[tuple[Any, ...], int] = {}
        self.consts: list[tuple[int, Array]] = []
        self.instrs: list[Instruction] = []
        self.sig: list[Any] = []
        self.keep: list[Any] = []
        self.refused: str | None = None
        self.depth = 0
        self.leaves: dict[int, Tensor] = {}
        self.optimizers: dict[int, Optimizer] = {}
        self.updated: dict[tuple[int, int], tuple[Optimizer, Tensor]] = {}
        self.out_template: Any = None
        self.rebind: list[Result] = []
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
                self.start_grads.append((leaf, grad_state(leaf)))
            seen: set[int] = set()
            for _, src in prev.roots:
                if isinstance(src, TensorSource) and id(src.tensor) not in seen:
                    seen.add(id(src.tensor))
                    self.start_tensors.append((src.tensor, src.tensor._spec, src.tensor._dtype))
                with contextlib.suppress(Stale):
                    self.start_ids[source_key(src)] = id(getter(src)(flat_args))

    # ------------------------------------------------------------------ recording
    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    def _new_slot(self, array: Array) -> int:
        s = len(self.arrays)
        self.arrays.append(array)
        self.where[id(array)] = s
        return s

    def _source(self, t: Any, r: int | None) -> Source:
        i = self.arg_index.get(id(t))
        if i is not None:
            if not t.stop_gradient:  # its .grad would be set on this call's object: not a result the program puts back
                raise Refused(f"the step's argument {i} ({t._label()}) requires a gradient; pass parameters by closure")
            return ArgSource(i, r)
        if t._grad_fn is not None:
            raise Refused(f"the step reads {t._label()}, which has autograd history from outside the step")
        self.keep.append(t)
        if t._grad_fn is None and not t.stop_gradient:
            self.leaves[id(t)] = t
        return TensorSource(t, r)

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
        src = (
            source
            if isinstance(source, (ArgSource, TensorSource, GradSource, StateSource))
            else self._source(source, rank)
        )
        key = source_key(src)
        if key in self.root_slot:  # the same tensor's shard again, under another array: replaced mid-step
            raise Refused(
                f"the storage of {describe(src)} was replaced inside the step by code the capture does not see"
            )
        was = self.start_ids.get(key)
        if was is not None and was != id(array):
            raise Refused(
                f"the storage of {describe(src)} was replaced inside the step by code the capture does not see"
            )
        s = self._new_slot(array)
        self.root_slot[key] = s
        self.roots.append((s, src))
        self.sig.append(("root", s, key, layout_of(array)))
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
        self.instrs.append(Instruction(fn, ins, outs, Kind.SEVERAL if multi else Kind.ONE))
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
        self.instrs.append(Instruction(fn, (), None, Kind.EFFECT))
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
            for r, a in arrays_of(g):
                if id(a) not in self.where:
                    try:
                        self.slot_of(a, GradSource(leaf, r))
                    except Refused as exc:
                        self.refuse(str(exc))

    def escape(self, what: str) -> None:
        if threading.get_ident() == self.thread:
            self.refuse(f"the step reads a tensor's value in Python ({what}): its control flow may depend on the data")

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
                if isinstance(src, TensorSource) and id(src.tensor) not in ended:
                    ended.add(id(src.tensor))
                    self._end_tensor(src.tensor)
                elif isinstance(src, ArgSource):
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
            if id(out) in self.arg_index or any(
                isinstance(src, TensorSource) and src.tensor is out for _, src in self.roots
            ):
                raise Refused(f"the step returns {out._label()}, a tensor from outside the step; return a computed one")
            return TensorOut(out._spec, out._dtype, tuple(out._shape), self._slots_of(out, out))
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
        return tuple((r, self.slot_of(a, source if not isinstance(source, str) else None, r)) for r, a in arrays_of(t))

    def _end_tensor(self, t: Any) -> None:
        slots = tuple((r, self.slot_of(a, t, r)) for r, a in arrays_of(t))
        start = tuple((r, self.root_slot.get(tensor_key(t, r))) for r, _ in arrays_of(t))
        self.sig.append(("end-tensor", id(t), id(t._spec), slots))
        if slots != start:
            self.rebind.append(TensorResult(t, t._spec, t._dtype, slots))

    def _end_arg(self, src: ArgSource) -> None:
        """An argument must still hold what the step read (the program does not rebind arguments)."""
        s = self.root_slot[source_key(src)]
        try:
            now = getter(src)(self.flat)
        except Stale:
            now = None
        if now is not self.arrays[s]:
            raise Refused(f"the step replaces the storage of its argument {src.position}")

    def _end_grad(self, leaf: Any) -> None:
        g = leaf.grad
        if g is None:
            self.sig.append(("end-grad", id(leaf), None))
            self.rebind.append(GradResult(leaf, None))
            return
        slots = tuple((r, self.slot_of(a, GradSource(leaf, r))) for r, a in arrays_of(g))
        self.sig.append(("end-grad", id(leaf), id(g._spec), g._dtype, slots))
        self.rebind.append(GradResult(leaf, GradLayout(g._spec, g._dtype, g.stop_gradient, slots)))

    def _end_states(self, opt: Any, p: Any) -> None:
        state = opt._states.get(id(p))
        if state is None:
            raise Refused(f"the optimizer has no state for {p._label()} after its step")
        for n in opt.state_names:
            t = state[n]
            slots = tuple((r, self.slot_of(a, StateSource(opt, id(p), n, r))) for r, a in arrays_of(t))
            self.sig.append(("end-state", id(opt), id(p), n, id(t._spec), slots))
            self.rebind.append(StateResult(opt, id(p), n, t._spec, t._dtype, slots))

    # ------------------------------------------------------------------ validation
    def snapshot(self, flat_args: Sequence[Any]) -> dict[str, Any]:
        """Copies of every array this trace read from outside, and the step counts, as they are now."""
        roots: dict[int, Array] = {}
        for s, src in self.roots:
            with contextlib.suppress(Stale):
                copy = getter(src)(flat_args).copy()
                copy.flags.writeable = False  # read-only as the live shards: no update writes into it in place
                roots[s] = copy
        steps = {(id(opt), pid): dict(opt._states.get(pid, {})) for opt, p in self.updated.values() for pid in (id(p),)}
        return {"roots": roots, "steps": steps}

    def validate(self, snap: dict[str, Any], program: Planned | None = None) -> str | None:
        """Run the program (``program``'s instructions as it will run them: folded, reordered;
        else the trace's) from ``snap`` (the state before this eager call) and compare every
        array it produces with the eager call's, bit for bit; None when all agree."""

        n = len(self.arrays)
        slots: list[Any] = [None] * n
        for s, src in self.roots:
            if s not in snap["roots"]:
                return f"{describe(src)} could not be read back before the traced call"
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
        meta_override.update(snap["steps"])
        try:
            for fn, ins, outs, kind in instrs:
                if kind is Kind.EFFECT:
                    continue  # Python effects already happened in the eager call
                res = fn(*[slots[i] for i in ins])
                if kind is Kind.ONE:
                    slots[outs] = res
                else:
                    for o, a in zip(outs, res, strict=True):
                        slots[o] = a
        except Exception as exc:  # any failure of the check refuses the capture
            return f"the validation run failed: {type(exc).__name__}: {exc}"
        finally:
            meta_override.clear()
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
