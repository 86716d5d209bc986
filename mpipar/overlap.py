"""Overlapped gradient reduction: data-parallel all-reduces start while backward still runs.

    with dist.overlap_grad_reduction(bucket_mib=4.0):
        loss.backward()          # buckets of gradients are reduced while later layers' backward runs
    opt.step()                   # every .grad is complete when backward() returns

It is on by default, with buckets of 25 MiB (``DEFAULT_ON_BUCKET_MIB``, the default of Paddle's
``DataParallel`` ``comm_buffer_size`` and of PyTorch's DDP); ``$MPIPAR_GRAD_BUCKET_MIB`` sets the
size, ``MPIPAR_GRAD_BUCKET_MIB=off`` or ``overlap_grad_reduction(None)`` turns it off. Off, a
leaf's Partial gradient is resharded to the leaf's layout as soon as backward produces it: one
blocking all-reduce per gradient, and the next layer's backward waits for it. On (PyTorch DDP's
scheme), each gradient whose reshard is exactly one all-reduce joins the
open *bucket* of its kind (mesh, axes, reduce op, dtype) in the order backward produces them
(reverse layer order: the last layer's gradients come first); once a bucket holds
``bucket_mib`` MiB of gradients it is packed into one buffer per rank and its all-reduce is
*started* (``Communicator.all_reduce_start``: non-blocking MPI calls under ``mpiexec``). Every
later op of the backward pass moves the started reductions on (an op hook calls ``test``), and
when backward ends the last, partly filled buckets start and everything is waited for, in start
order. Each gradient then takes the rest of its usual path (cast, the leaf's hooks,
accumulation into ``.grad``) in the order backward produced them.

Results do not depend on it, nor on timing: the ordered reductions sum element by element in
group order, so reducing a packed bucket gives each gradient the bits its own all-reduce gives,
and a leaf's contributions are accumulated in the same order. The bytes moved are the same; the
number of all-reduces is the number of buckets (``bucket_mib=0``: one per gradient, as without
overlap). Where bucketing would change what others observe, gradients take the usual path:
layouts whose reshard is not one all-reduce (ZeRO's reduce-scatter), dense leaves, abstract and
shape-only runs, the one-device reference, plan tracing (``reshard_hooks``) and measured
timelines (span recorders). Started collectives are ordered per group like blocking ones: every
rank starts its buckets in the same order, because every rank runs the same backward.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mpipar import _capture_hooks, hooks
from mpipar._modes import Mode, execution_mode
from mpipar.backend import current_backend
from mpipar.comm import Pending, _span_recorders, comm_context
from mpipar.env import env_number, env_text
from mpipar.reshard.executor import freeze
from mpipar.reshard.planner import plan_reshard
from mpipar.tensor import Tensor

if TYPE_CHECKING:
    from mpipar.spec import DistSpec

DEFAULT_BUCKET_MIB = 4.0


@dataclass(eq=False)
class _Entry:
    """One gradient contribution to a leaf, in the order backward produced it."""

    leaf: Tensor
    target: DistSpec | None = None
    grad: Tensor | None = None
    """The Partial gradient until its bucket starts; then the reduced one once it is done (or,
    for a contribution that took the usual path, its resharded gradient from the start)."""


@dataclass(eq=False)
class _Bucket:
    index: int
    key: tuple[Any, ...]
    step: Any
    entries: list[_Entry] = field(default_factory=list)
    nbytes: int = 0
    started: list[tuple[tuple[int, ...], Pending, dict[int, list[tuple[int, tuple[int, ...]]]]]] = field(
        default_factory=list
    )


class GradReduceOverlap:
    """The setting ``overlap_grad_reduction`` installs (a context manager).

    ``bucket_mib``: how many MiB of gradients (whole tensors, so every rank draws the same
    bucket boundaries) a bucket collects before its all-reduce starts; 0 starts one per
    gradient. ``record``: keep ``events``, the order of bucket starts (``("start", index,
    bytes)``), backward ops (``("op", name)``) and the final wait (``("wait", buckets)``) of
    every backward pass, to check that reductions really start while backward runs.
    """

    def __init__(self, bucket_mib: float | None = DEFAULT_BUCKET_MIB, record: bool = False) -> None:
        self.off = bucket_mib is None
        """``bucket_mib=None``: no buckets inside (each gradient reduced alone, blocking, as soon as
        backward produces it): the opt-out of the default buckets."""
        if bucket_mib is None:
            bucket_mib = 0.0
        if (
            not isinstance(bucket_mib, (int, float))
            or isinstance(bucket_mib, bool)
            or not math.isfinite(bucket_mib)
            or bucket_mib < 0
        ):
            raise ValueError(
                f"overlap_grad_reduction: bucket_mib must be a finite number >= 0 (MiB of gradients per bucket), got {bucket_mib!r}"
            )
        self.bucket_bytes = int(bucket_mib * 2**20)
        self.record = record
        self.events: list[tuple[Any, ...]] = []
        self.buckets_started = 0

    def __enter__(self) -> GradReduceOverlap:
        _settings.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _settings.remove(self)


def overlap_grad_reduction(bucket_mib: float | None = DEFAULT_BUCKET_MIB, record: bool = False) -> GradReduceOverlap:
    """Inside ``with``, backward starts data-parallel gradient reductions in buckets while it
    runs (module docstring). Same results, bit for bit. ``bucket_mib=None`` turns buckets off
    inside (outside any ``with``, backward uses the default buckets: ``default_setting``)."""
    return GradReduceOverlap(bucket_mib, record)


_settings: list[GradReduceOverlap] = []
_session: list[_Session] = []


def current_session() -> _Session | None:
    return _session[-1] if _session else None


DEFAULT_ON_BUCKET_MIB = 25.0
"""The bucket size every backward pass uses when no ``overlap_grad_reduction`` is active: Paddle's
``DataParallel`` (``comm_buffer_size``) and PyTorch's DDP default to 25 MB buckets."""
BUCKETS_ENV = "MPIPAR_GRAD_BUCKET_MIB"
"""Environment variable: MiB per default bucket; ``off`` (or ``none``) turns the default off, so
each gradient is reduced on its own as soon as backward produces it."""


def default_setting() -> GradReduceOverlap | None:
    """The setting of a backward pass outside any ``overlap_grad_reduction``: buckets of
    ``DEFAULT_ON_BUCKET_MIB`` unless ``$MPIPAR_GRAD_BUCKET_MIB`` says otherwise."""
    given = os.environ.get(BUCKETS_ENV)
    if _default_cache.get("given", _UNSEEN) == given:  # every backward pass asks: parse a new value only
        return _default_cache["setting"]  # type: ignore[no-any-return]
    setting = _parse_default_setting()
    _default_cache["given"], _default_cache["setting"] = given, setting
    return setting


_UNSEEN = object()


def _parse_default_setting() -> GradReduceOverlap | None:
    raw = (env_text(BUCKETS_ENV) or "").lower()
    if raw in ("off", "none", "no", "false"):
        return None
    mib = env_number(
        BUCKETS_ENV, DEFAULT_ON_BUCKET_MIB, minimum=0.0, strict=False, unit="MiB per gradient bucket (or off)"
    )
    return GradReduceOverlap(mib)


_default_cache: dict[str, Any] = {}

_DEFAULT_LATER = GradReduceOverlap(DEFAULT_ON_BUCKET_MIB)
"""A session's setting until its first reduction reads the default one (``begin_backward``)."""
_NO_BUCKETS = GradReduceOverlap(None)
"""The setting read when the default buckets are off."""


def begin_backward() -> _Session | None:
    """A session for the backward pass starting now (no pass running: a nested pass, as recompute
    runs, joins the outer one's buckets), with the innermost ``overlap_grad_reduction``'s setting,
    else the default buckets (``default_setting``)."""
    if _session:
        return None
    if _settings:
        setting: GradReduceOverlap | None = _settings[-1]
    elif _capture_hooks.capture_tracers and _capture_hooks.capture_tracer() is not None:
        # A step being captured (mpipar.capture) records each gradient's own reshard, which its
        # program replays; the default buckets stay out of it (an explicit setting refuses the capture).
        setting = None
    else:
        # The default buckets, their setting read when a gradient first needs a reduction
        # (``_Session.offer``): a pass with none (tensor parallelism alone) never reads the
        # environment, whose lookup of an unset variable raises and catches a ``KeyError``.
        setting = _DEFAULT_LATER
    if setting is None or setting.off:
        return None
    session = _Session(setting)
    _session.append(session)
    if setting.record:  # it records every op; else it joins the op hooks when a reduction starts
        hooks.op_hooks.append(session)
    return session


def end_backward(session: _Session | None, finish_leaf: Callable[[Tensor, Tensor], None], failed: bool = False) -> None:
    """Close ``session``: start what is left, wait for everything, finish the leaves (unless
    the pass failed: then its buckets are dropped, and the error goes on)."""
    if session is None:
        return
    try:
        if not failed:
            session.finish(finish_leaf)
    finally:
        _session.remove(session)
        if session in hooks.op_hooks:
            hooks.op_hooks.remove(session)


class _Session:
    """The buckets of one backward pass."""

    def __init__(self, setting: GradReduceOverlap) -> None:
        self.setting = setting
        self.backend = current_backend()
        self.entries: list[_Entry] = []
        self.waiting: set[int] = set()  # ids of leaves with a contribution in a bucket
        self.open: dict[tuple[Any, ...], _Bucket] = {}
        self.started: list[_Bucket] = []
        self.done = 0  # buckets at the front of ``started`` that have completed
        self.count = 0

    # ------------------------------------------------------------------ gradients arrive
    def offer(self, leaf: Tensor, g: Tensor, to_layout: Callable[[Tensor, Tensor], Tensor]) -> bool:
        """Take ``g`` (a contribution to ``leaf``'s gradient) into a bucket, or take it in order
        behind the leaf's bucketed ones; False: the caller handles it as usual. ``to_layout``
        is the engine's reshard of a gradient to its leaf's layout (handed in by autograd)."""
        if self.setting is _DEFAULT_LATER:  # the default buckets' first offer: their setting now
            self.setting = default_setting() or _NO_BUCKETS
        if self.setting.off:  # (``MPIPAR_GRAD_BUCKET_MIB=off``: each gradient is reduced on its own)
            return False
        step = self._bucketable(leaf, g)
        if step is None:
            if id(leaf) not in self.waiting:
                return False
            # The leaf has a contribution in flight: this one must be added after it.
            self.entries.append(_Entry(leaf, grad=to_layout(leaf, g)))
            return True
        entry = _Entry(leaf, leaf.grad_spec(), g)
        self.entries.append(entry)
        self.waiting.add(id(leaf))
        op = step.reduce_type or "sum"
        key = (
            tuple(step.src.mesh.process_ids),
            tuple(step.src.mesh.shape),
            tuple(step.axes),
            op,
            np.dtype(g.dtype).str,
        )
        bucket = self.open.get(key)
        if bucket is None:
            bucket = self.open[key] = _Bucket(self.count, key, step)
            self.count += 1
        bucket.entries.append(entry)
        bucket.nbytes += math.prod(g.shape) * np.dtype(g.dtype).itemsize
        if bucket.nbytes >= self.setting.bucket_bytes:
            self._start(bucket)
        self.progress()
        return True

    def _bucketable(self, leaf: Tensor, g: Tensor) -> Any | None:
        """The reshard's one all-reduce step when ``g`` may be bucketed, else None."""
        gs = g._spec
        if gs is None or leaf._spec is None or leaf._grad_any_layout:
            return None
        target = leaf.grad_spec()
        if gs is target or gs == target:  # already in its layout (the usual tensor-parallel case): nothing to reduce
            return None
        backend = self.backend
        if execution_mode([g], backend) is not Mode.DISTRIBUTED or hooks.reshard_hooks or _span_recorders:
            return None
        if not g._shards:
            return None
        plan = plan_reshard(g.spec, target)
        if len(plan.steps) != 1 or plan.steps[0].kind != "all_reduce":
            return None
        return plan.steps[0]

    # ------------------------------------------------------------------ buckets
    def _start(self, bucket: _Bucket) -> None:
        """Pack the bucket (one flat buffer per hosted rank) and start its all-reduce."""
        del self.open[bucket.key]
        step, op = bucket.step, bucket.key[3]
        dtype = np.dtype(bucket.key[4])
        first = bucket.entries[0].grad
        assert first is not None
        hosted = first._shards.keys()
        groups: list[tuple[int, ...]] = []
        for r in hosted:
            for group in step.groups_with(r):
                if group not in groups:
                    groups.append(group)
        names = ", ".join(e.leaf._label() for e in bucket.entries[:4]) + (" ..." if len(bucket.entries) > 4 else "")
        comm = self.backend.comm
        with comm_context(
            f"overlapped gradient reduction, bucket {bucket.index} ({len(bucket.entries)} gradients: {names})"
        ):
            for group in groups:
                members = [r for r in group if r in hosted]
                flats: dict[int, Any] = {}
                layout: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
                for r in members:
                    pieces = [e.grad._shards[r] for e in bucket.entries]  # type: ignore[union-attr]
                    flats[r] = _packed(pieces, dtype, self.backend.xp)
                    at, where = 0, []
                    for p in pieces:
                        where.append((at, tuple(p.shape)))
                        at += math.prod(p.shape)
                    layout[r] = where
                bucket.started.append((group, comm.all_reduce_start(group, flats, op), layout))
        for e in bucket.entries:
            e.grad = None  # the packed copy is what travels; the Partial shards may go
        self.started.append(bucket)
        if self not in hooks.op_hooks:  # from now on every op gives the reductions a push
            hooks.op_hooks.append(self)
        self.setting.buckets_started += 1
        if self.setting.record:
            self.setting.events.append(("start", bucket.index, bucket.nbytes))

    def progress(self) -> None:
        """Move started reductions on, in start order (so each member posts the next phase of
        its buckets in the same order), stopping at the first that is still in flight."""
        while self.done < len(self.started):
            if not all(p.test() for _, p, _ in self.started[self.done].started):
                return
            self.done += 1

    def on_op(self, op: Any, inputs: Any, used: Any, outputs: Any, result: Any, attrs: dict[str, Any]) -> None:
        """The op hook: every op backward runs gives the started reductions a push."""
        if self.setting.record:
            self.setting.events.append(("op", op.name))
        if self.done < len(self.started):
            self.progress()

    def finish(self, finish_leaf: Callable[[Tensor, Tensor], None]) -> None:
        """Start the partly filled buckets, wait for all, finish every leaf in arrival order
        (``finish_leaf``: the engine's cast, hooks and accumulation, handed in by autograd)."""
        for bucket in list(self.open.values()):  # in the order they were opened: the same everywhere
            self._start(bucket)
        if self.setting.record:
            self.setting.events.append(("wait", len(self.started)))
        for bucket in self.started:
            shards: list[dict[int, Any]] = [{} for _ in bucket.entries]
            # Members handed the same reduced buffer (a process hosting several ranks: the
            # simulator) get the same view of each gradient, as a per-gradient all-reduce gives
            # them one array: replicas keep sharing their gradients and what is computed from them.
            views: dict[tuple[int, int, tuple[int, ...]], Any] = {}
            for _group, pending, layout in bucket.started:
                for r, reduced in pending.wait().items():
                    flat = reduced.reshape(-1)
                    for k, (at, shape) in enumerate(layout[r]):
                        key = (id(reduced), at, tuple(shape))
                        view = views.get(key)
                        if view is None:
                            view = views[key] = freeze(flat[at : at + math.prod(shape)].reshape(shape))
                        shards[k][r] = view
            dtype = np.dtype(bucket.key[4])
            for e, mine in zip(bucket.entries, shards, strict=True):
                assert e.target is not None
                e.grad = Tensor._from_shards(e.target, mine, dtype)
        self.done = len(self.started)
        if self in hooks.op_hooks:  # the adds below are accumulation, not backward
            hooks.op_hooks.remove(self)
        for e in self.entries:
            assert e.grad is not None
            finish_leaf(e.leaf, e.grad)
        self.entries = []


def _packed(pieces: list[Any], dtype: np.dtype, xp: Any) -> Any:
    """The pieces back to back in one new flat buffer (the bucket a started reduction sends)."""
    out = xp.empty(sum(math.prod(p.shape) for p in pieces), dtype=dtype)
    at = 0
    for p in pieces:
        size = math.prod(p.shape)
        out[at : at + size].reshape(p.shape)[...] = p
        at += size
    return out
