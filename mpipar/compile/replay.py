"""A replayed training step: the first call records every op's decisions, later calls replay them.

    @dist.compile_step
    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        return loss

    for x, y in loader():
        loss = train_step(x, y)        # step 1 records; steps 2.. replay

An eager step asks, for every op, the op's SPMD rule which layouts to run on, builds the
target specs, the output specs and dtypes and each hosted rank's boxes. These depend only on
the layouts, shapes, dtypes and attributes the step sees, which in a training loop are the
same every step. ``compile_step`` records the decision (``mpipar.ops.dispatch.Decision``) of
each op in order on the first call and hands them back by position on later calls, after a
cheap check per op (the same op, input specs, dtypes, attributes and reuse of reshards): no
rule lookup, no spec or box building, no key hashing. The kernels and the collectives still run
every step on the step's data, so a replayed step computes bit-for-bit what the eager step
computes.

Which recording a call replays is chosen by a cheap key: the layout (shape, dtype, spec) of
every tensor argument, the backend, and the layout of every parameter the recording used. A
new input shape or layout, or a parameter moved to another placement, records a new program
(``retraces`` counts them); an op whose check fails mid-step (control flow that depends on the
data) ends the replay there: the rest of the step runs eagerly and records, and that new
recording replaces the old one for the key.

``dist.to_static`` replays its training steps the same way.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from mpipar import _capture_hooks, _tape, comm
from mpipar.backend import current_backend
from mpipar.compile import capture
from mpipar.ops import dispatch
from mpipar.tensor import Parameter, Tensor, reuse_enabled

R = TypeVar("R")


@dataclass(eq=False)
class _Entry:
    """One recorded op call: what the check compares, and the decision to hand back."""

    op: Any
    specs: tuple[Any, ...]
    """Per flat input its spec (dense: its shape)."""
    dtypes: tuple[Any, ...]
    attrs: tuple[Any, ...]
    """The attributes that decide, frozen with their types (``1`` and ``1.0`` differ)."""
    reuse: Any
    decision: dispatch.Decision


class StepPlayer:
    """Replays a program of decisions by position; records where it has none (or diverged)."""

    def __init__(self, program: list[_Entry] | None, backend: Any = None) -> None:
        self.backend = backend
        """Decisions hold the hosted ranks of the backend they were made on: replay only there."""
        self.program: list[_Entry] = program if program is not None else []
        self.position = 0
        self.recording = program is None
        self.diverged = False
        self.replayed = 0
        self.params: dict[int, tuple[weakref.ref[Tensor], Any]] = {}

    def next(
        self, op: Any, flat: list[Tensor], attrs: dict[str, Any], reuse: Any, backend: Any
    ) -> dispatch.Decision | None:
        """The recorded decision of this op call, or None (then dispatch decides and ``record``s)."""
        if self.recording:
            return None
        if backend is not self.backend:  # another backend inside the step: decide afresh
            return None
        program, i = self.program, self.position
        if i < len(program):
            entry = program[i]
            if entry.op is op and _same_call(entry, flat, attrs, reuse):
                self.position = i + 1
                self.replayed += 1
                return entry.decision
        # The step took another path here: keep what matched, record the rest afresh.
        self.diverged = True
        self.recording = True
        del program[i:]
        return None

    def record(
        self, op: Any, flat: list[Tensor], attrs: dict[str, Any], reuse: Any, decision: dispatch.Decision, backend: Any
    ) -> None:
        if not self.recording or backend is not self.backend:
            return
        specs = tuple(t._spec if t._spec is not None else t._shape for t in flat)
        frozen = dispatch.freeze_attrs(dispatch.decision_attrs(op, attrs))
        self.program.append(_Entry(op, specs, tuple(t._dtype for t in flat), frozen, reuse, decision))
        self.position = len(self.program)
        for t in flat:
            if isinstance(t, Parameter) and t._spec is not None and id(t) not in self.params:
                self.params[id(t)] = (weakref.ref(t), t._spec)

    def __enter__(self) -> StepPlayer:
        dispatch._replaying.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        dispatch._replaying.remove(self)


def _same_call(entry: _Entry, flat: list[Tensor], attrs: dict[str, Any], reuse: Any) -> bool:
    specs = entry.specs
    if len(specs) != len(flat):
        return False
    for t, s, dt in zip(flat, specs, entry.dtypes, strict=True):
        have = t._spec if t._spec is not None else t._shape
        if have is not s and have != s:
            return False
        if t._dtype != dt:
            return False
    if reuse != entry.reuse:
        return False
    if not entry.attrs:
        return not dispatch.decision_attrs(entry.op, attrs)
    try:
        return bool(dispatch.freeze_attrs(dispatch.decision_attrs(entry.op, attrs)) == entry.attrs)
    except (TypeError, ValueError):  # an attribute that cannot be compared (an array): decide afresh
        return False


def _is_array(value: Any) -> bool:
    """A NumPy (or CuPy) array among a step's arguments: a tuple shape and a dtype."""
    return isinstance(getattr(value, "shape", None), tuple) and getattr(value, "dtype", None) is not None


def _layout_key(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("tensor", value._spec if value._spec is not None else None, tuple(value._shape), value._dtype)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_layout_key(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _layout_key(v)) for k, v in value.items()))
    if _is_array(value):  # its shape and dtype
        return (type(value), value.shape, value.dtype)
    return ("other", type(value))


@dataclass(eq=False)
class _Program:
    entries: list[_Entry]
    params: list[tuple[weakref.ref[Tensor], Any]]
    backend: Any
    """The backend it was recorded on (held, so that its id in the key is never reused)."""

    def params_unchanged(self) -> bool:
        """Is every parameter the recording used still alive and laid out as it was?"""
        for ref, spec in self.params:
            p = ref()
            if p is None or (p._spec is not spec and p._spec != spec):
                return False
        return True


@dataclass(eq=False)
class _Capture:
    """The capture of one layout key: traces so far, the last one, the program, or why not."""

    traces: int = 0
    last: capture.Tracer | None = None
    program: capture.Program | None = None
    refused: str | None = None
    keep: list[Any] = field(default_factory=list)
    """The objects among the arguments its key names by identity (kept alive: ids stay unique)."""


def _static_key(value: Any, keep: list[Any]) -> Any:
    """The arguments that are neither tensors nor arrays, as a captured program's key: Python
    values are constants of the program (``jax.jit``'s static arguments), so another value is
    another program. Numbers and strings by value, other objects by identity (kept alive)."""
    if isinstance(value, Tensor) or _is_array(value):
        return None
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_static_key(v, keep) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _static_key(v, keep)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return (type(value), value)
    keep.append(value)
    return ("object", id(value))


def _flat_args(value: Any, out: list[Any]) -> list[Any]:
    """The tensors and arrays among a call's arguments, in ``_layout_key``'s order."""
    if isinstance(value, Tensor) or _is_array(value):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _flat_args(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _flat_args(v, out)
    return out


class CompiledStep(Generic[R]):
    """What ``compile_step`` returns: call it like the function (see the module docstring)."""

    def __init__(self, fn: Callable[..., R], capture: bool = False) -> None:
        self.fn = fn
        self.capture = capture
        """Run a captured program of the step's array work after two identical traces (``mpipar.capture``)."""
        self._captures: dict[Any, _Capture] = {}
        self.captured = False
        """Whether the last call ran the captured program (or set it up from its trace)."""
        self.capture_refused: str | None = None
        """Why the last call's step is not captured (None when it is, or while it is still being traced)."""
        self.captured_calls = 0
        """Calls that ran a captured program instead of ``fn``."""
        self._programs: dict[Any, _Program] = {}
        self.retraces = 0
        """How many calls recorded a program (the first call, and each change of layout)."""
        self.replayed_ops = 0
        """Ops whose decision came from a recording, over all calls."""
        self.enabled = True
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if not self.enabled:
            return self.fn(*args, **kwargs)
        backend = current_backend()
        key = (id(backend), _layout_key(args), _layout_key(kwargs))
        if self.capture and not _capture_hooks.capture_tracers:
            return self._captured_call(key, backend, args, kwargs)
        return self._decided(key, backend, args, kwargs)

    def _captured_call(self, key: Any, backend: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """Run the captured program of ``key``, or trace towards one (``mpipar.capture``)."""
        keep: list[Any] = []
        static = _static_key((args, kwargs), keep) if args or kwargs else None
        ckey = (key, static, _tape.is_grad_enabled(), reuse_enabled())
        st = self._captures.get(ckey)
        flat = _flat_args(kwargs, _flat_args(args, []))
        busy = capture.observed()
        if st is not None and st.program is not None and busy is None:
            try:
                out = st.program.run(flat)
            except capture.Stale:  # checked before any work: trace this layout afresh
                st = self._captures[ckey] = _Capture(keep=keep)
            else:
                self.captured, self.capture_refused = True, None
                self.captured_calls += 1
                return out  # type: ignore[no-any-return]
        self.captured = False
        if busy is not None:
            self.capture_refused = busy
            return self._decided(key, backend, args, kwargs)
        if st is None:
            if len(self._captures) >= 64:  # layouts that never repeat: keep the memory bounded
                self._captures.clear()
            st = self._captures[ckey] = _Capture(keep=keep)
        if st.refused is not None:
            self.capture_refused = st.refused
            return self._decided(key, backend, args, kwargs)
        prev = st.last
        try:
            snap = prev.snapshot(flat) if prev is not None and prev.refused is None else None
        except Exception as exc:  # the capture never fails a step: it refuses instead
            st.refused = self.capture_refused = (
                f"the capture could not copy the step's state ({type(exc).__name__}: {exc})"
            )
            return self._decided(key, backend, args, kwargs)
        tr = capture.StepTracer(flat, backend, prev if snap is not None else None)
        tripwire = capture.Tripwire(tr)
        comm._recorders.append(tripwire)
        _capture_hooks.capture_tracers.append(tr)
        try:
            out = self._decided(key, backend, args, kwargs)
        finally:
            _capture_hooks.capture_tracers.remove(tr)
            comm._recorders.remove(tripwire)
        tr.finish(out)
        st.traces += 1
        same = snap is not None and tr.refused is None and tr.sig == prev.sig  # type: ignore[union-attr]
        fine, same = capture.agree([tr.refused is None, same], backend)
        if fine and same:
            assert snap is not None
            program = None
            try:
                program = capture.Program(tr)
            except Exception as exc:  # the capture never fails a step: it refuses instead
                why: str | None = f"the capture could not build its program ({type(exc).__name__}: {exc})"
            else:  # the program as it will run (constants folded, updates moved up), from the step's start
                why = tr.validate(snap, program)
            (valid,) = capture.agree([why is None], backend)
            if valid:
                st.program, st.last = program, None
                self.captured, self.capture_refused = True, None
                return out
            st.refused = why or "the validation run differs on another rank"
        elif not fine:
            st.refused = tr.refused or "a trace was refused on another rank"
        elif st.traces >= capture.MAX_TRACES:
            st.refused = (
                f"{st.traces} traced calls never gave the same program twice in a row (an array made per call by code "
                "the capture does not see, or a value baked in that changes per call: a random key, a step count)"
            )
        else:
            st.last = tr
        self.capture_refused = st.refused
        return out

    def _decided(self, key: Any, backend: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        program = self._programs.get(key)
        if program is not None and (program.backend is not backend or not program.params_unchanged()):
            program = None
        player = StepPlayer(program.entries if program is not None else None, backend)
        with player:
            out = self.fn(*args, **kwargs)
        self.replayed_ops += player.replayed
        if player.recording:  # a first call, a new layout, or a step that left its recording
            self.retraces += 1
            if len(self._programs) >= 64:  # layouts that never repeat: keep the memory bounded
                self._programs.clear()
            params = dict(player.params)
            if program is not None:
                params.update({id(ref()): (ref, spec) for ref, spec in program.params if ref() is not None})
            self._programs[key] = _Program(player.program, list(params.values()), backend)
        return out

    def reset(self) -> None:
        """Forget every recording and capture (the next call records again)."""
        self._programs.clear()
        self._captures.clear()


@overload
def compile_step(fn: Callable[..., R], *, capture: bool = False) -> CompiledStep[R]: ...


@overload
def compile_step(fn: None = None, *, capture: bool = False) -> Callable[[Callable[..., R]], CompiledStep[R]]: ...


def compile_step(fn: Callable[..., R] | None = None, *, capture: bool = False) -> Any:
    """Replay ``fn``'s per-op decisions after its first call (see the module docstring).

    Use it as a decorator on a training step (``@compile_step`` or ``@compile_step(capture=True)``),
    or wrap a step function. Results are bit-for-bit those of calling ``fn`` directly;
    ``.retraces`` counts the calls that had to record. ``capture=True`` runs, once two traced
    calls agree and a validation run matched, a captured program of the step's array work
    instead of ``fn`` (``mpipar.capture``: semantics, and when it refuses: ``.capture_refused``).
    """
    if fn is None:
        return lambda f: compile_step(f, capture=capture)
    if not callable(fn):
        raise TypeError(f"compile_step needs a function (the training step), got {type(fn).__name__}")
    return CompiledStep(fn, capture=bool(capture))
