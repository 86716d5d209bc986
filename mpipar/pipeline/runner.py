"""Run a pipeline schedule on real tensors: stage-filtered forwards, boundaries as transfers.

The model is ordinary mpipar code whose layers live on several meshes, handed from one to the
next by ``dist.reshard`` (seed 000 §4.3). A *stage* is a run of ops on one mesh between two
cross-mesh reshards, in program order, so meshes may repeat (interleaved virtual stages).

``F(s, m)`` runs the whole forward of micro-batch ``m`` inside a ``StageRun``: ops of stage
``s`` execute for real; every other op only runs its rule (shape-only: no compute, no
communication); the cross-mesh reshard into stage ``s`` yields the activation received by
``RECV_F`` (a leaf, so the stage's tape stops there) and the one out of ``s`` is kept for
``SEND_F``. The random stream is positioned where eager mode would be for micro-batch ``m``,
so dropout masks are the same as without a pipeline.

``B(s, m)`` backpropagates the stage's outputs with the gradients ``RECV_B`` received (the
loss on the last stage, scaled by 1/M); the gradients of its received inputs go out by
``SEND_B``. Under a zero-bubble schedule ``B`` computes input gradients only and ``W`` the
weight gradients (``autograd.run_backward(defer=...)``).

The simulator hosts every rank: it runs all actions in one dependency-respecting order and a
transfer completes at its ``SEND``. Under MPI each process runs its own pipeline rank's list;
sender and receiver each call the same reshard at their ``SEND``/``RECV``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpipar import autograd, hooks
from mpipar import random as mrandom
from mpipar.backend import current_backend
from mpipar.distribute import _reshard, reshard_to
from mpipar.mesh import ProcessMesh
from mpipar.ops.math import ones_like_global, scale
from mpipar.pipeline.actions import Action
from mpipar.pipeline.schedule import Schedule
from mpipar.spec import DistSpec
from mpipar.tensor import Parameter, Tensor

Key = tuple[int, int]  # (stage the tensor enters, index among that stage's incoming transfers)


@dataclass
class Transfer:
    key: Key
    src: DistSpec
    dst: DistSpec
    dtype: Any


class StageRun:
    """The state of one forward pass run for stage ``target`` (``-1``: no stage is real)."""

    def __init__(self, target: int, microbatch: int, inbox: dict[tuple[Key, int], Tensor]) -> None:
        self.target = target
        self.microbatch = microbatch
        self.inbox = inbox
        self.stage = 0
        self.mesh: ProcessMesh | None = None
        self.meshes: list[ProcessMesh] = []
        self.next_in = 0
        self.transfers: dict[Key, Transfer] = {}
        self.outgoing: list[tuple[Key, Tensor, DistSpec]] = []
        self.incoming: list[tuple[Key, Tensor]] = []
        self.dense_params: dict[int, tuple[Tensor, ProcessMesh]] = {}
        """Dense parameters and the mesh of the first op that used them (to place them there)."""

    # ------------------------------------------------------------------ called by dispatch
    def note_inputs(self, inputs: Sequence[Tensor], mesh: ProcessMesh) -> None:
        for t in inputs:
            if isinstance(t, Parameter) and not t.is_dist and id(t) not in self.dense_params:
                self.dense_params[id(t)] = (t, mesh)

    def op_is_real(self, mesh: ProcessMesh, op: str) -> bool:
        if self.mesh is None:
            self.mesh = mesh
            self.meshes.append(mesh)
        elif not mesh.same_layout(self.mesh):
            raise ValueError(
                f"pipeline: {op} runs on {mesh} while stage {self.stage} (on {self.mesh}) is running; "
                "hand tensors to the next stage's mesh with dist.reshard before using them there"
            )
        return self.stage == self.target

    # ------------------------------------------------------------------ called by reshard
    def boundary(self, src: Tensor, dst: DistSpec) -> Tensor:
        if self.mesh is None:
            self.mesh = src.spec.mesh
            self.meshes.append(self.mesh)
        if not src.spec.mesh.same_layout(self.mesh):
            raise ValueError(
                f"pipeline: a tensor on {src.spec.mesh} moves to {dst.mesh} while stage {self.stage} runs on "
                f"{self.mesh}; schedules move activations only from one stage to the next"
            )
        if not dst.mesh.same_layout(self.mesh):
            self.stage += 1
            self.mesh = dst.mesh
            self.meshes.append(dst.mesh)
            self.next_in = 0
        key = (self.stage, self.next_in)
        self.next_in += 1
        self.transfers[key] = Transfer(key, src.spec, dst, src.dtype)
        if self.stage - 1 == self.target:  # leaving the real stage: keep it for SEND_F
            self.outgoing.append((key, src, dst))
        elif self.stage == self.target:  # entering it: what RECV_F delivered, as a leaf
            received = self.inbox.pop((key, self.microbatch))
            leaf = received.detach()
            leaf.stop_gradient = src.stop_gradient
            self.incoming.append((key, leaf))
            return leaf
        if self.target < 0:  # the probe: a planned reshard, on the tape (the plan's backward crosses it)
            shadow = src if src.is_abstract else Tensor.abstract(src.shape, src.dtype, src.spec)
            if shadow is not src:
                shadow.stop_gradient = src.stop_gradient
                shadow._set_history(src._grad_fn, src._out_index)
            return _reshard(shadow, dst, current_backend())
        out = Tensor.abstract(src.shape, src.dtype, dst)
        out.stop_gradient = src.stop_gradient
        return out


@dataclass
class Probe:
    """What one all-shape-only forward revealed: stages, their meshes, the transfers, draws."""

    num_stages: int
    meshes: list[ProcessMesh]
    transfers: dict[Key, Transfer]
    draws: int
    dense_params: list[tuple[Tensor, ProcessMesh]] = field(default_factory=list)


def probe(forward: Callable[[], Any], with_grad: bool = False) -> tuple[Probe, Any]:
    """Run ``forward`` with no stage real (rules only) to find the stages; returns its result too
    (a shape-only loss to backpropagate when ``with_grad``)."""
    run = StageRun(-1, 0, {})
    state = mrandom.get_rng_state()
    start = mrandom.draws()
    hooks.stage_runs.append(run)
    try:
        with autograd.set_grad_enabled(with_grad):
            result = forward()
    finally:
        hooks.stage_runs.pop()
        used = mrandom.draws() - start
        mrandom.set_rng_state(state)
    if run.mesh is None:
        raise ValueError("pipeline: the forward ran no distributed op, so it has no stages")
    return Probe(run.stage + 1, run.meshes, run.transfers, used, list(run.dense_params.values())), result


@dataclass
class MicroState:
    outgoing: list[tuple[Key, Tensor, DistSpec]] = field(default_factory=list)
    incoming: list[tuple[Key, Tensor]] = field(default_factory=list)
    loss: Tensor | None = None
    deferred: autograd.DeferredWeights | None = None


class PipelineRunner:
    """Executes one training step of ``forward(m) -> loss`` under ``schedule`` (see module doc)."""

    def __init__(
        self, schedule: Schedule, info: Probe, forward: Callable[[int], Tensor], grad_params: Sequence[Tensor] = ()
    ) -> None:
        if schedule.num_stages != info.num_stages:
            raise ValueError(
                f"the schedule has {schedule.num_stages} stages but the model has {info.num_stages} "
                f"(meshes {[m.process_ids for m in info.meshes]}); build the schedule with num_stages={info.num_stages}"
            )
        self.schedule, self.info, self.forward = schedule, info, forward
        self.grad_params = list(grad_params)
        """Parameters the step gives a gradient (from the probe's backward)."""
        self.m = schedule.num_microbatches

    def step(self) -> list[Tensor]:
        """Run every action this process takes part in; return the micro-batch losses it holds."""
        self.inbox_f: dict[tuple[Key, int], Tensor] = {}
        self.inbox_b: dict[tuple[Key, int], Tensor] = {}
        self.states: dict[tuple[int, int], MicroState] = {}
        self.base_draw = mrandom.draws()
        backend = current_backend()
        if backend.name in ("mpi", "nccl"):
            prank = self._my_pipeline_rank()
            for action in self.schedule.actions[prank] if prank >= 0 else ():
                self._run(action, hosting_all=False)
            # Another stage's parameters got their gradients elsewhere: hold empty ones of the same
            # layout, so the optimizer (clipping norms, ZeRO gathers) stays one SPMD program.
            for p in self.grad_params:
                if p.grad is None and p.is_dist:
                    spec = p.grad_spec()
                    p.grad = Tensor._from_shards(spec, {}, p.dtype)
        else:
            for rank, index in self.schedule.validate().order:
                self._run(self.schedule.actions[rank][index], hosting_all=True)
        mrandom.set_rng_state({**mrandom.get_rng_state(), "draws": self.base_draw + self.m * self.info.draws})
        last = self.info.num_stages - 1
        return [st.loss for (s, _), st in sorted(self.states.items()) if s == last and st.loss is not None]

    def _my_pipeline_rank(self) -> int:
        rank = current_backend().rank
        for s, mesh in enumerate(self.info.meshes):
            if rank in mesh:
                return self.schedule.rank_of(s)
        return -1

    # ------------------------------------------------------------------ actions
    def _run(self, a: Action, hosting_all: bool) -> None:
        kind, s, m = a.kind, a.stage, a.microbatch
        if kind == "F":
            self._forward(s, m)
        elif kind == "B":
            self._backward(s, m, split=self.schedule.split_backward)
        elif kind == "W":
            st = self.states[(s, m)]
            if st.deferred is not None:
                st.deferred.run()
        elif kind == "SEND_F":
            for key, src, dst in self.states[(s, m)].outgoing:
                out = reshard_to(src, dst)
                if hosting_all or out.hosted_ranks:
                    self.inbox_f[(key, m)] = out
        elif kind == "RECV_F":
            for key, t in self.info.transfers.items():
                if key[0] == s and (key, m) not in self.inbox_f:
                    placeholder = Tensor._from_shards(t.src, {}, t.dtype)
                    self.inbox_f[(key, m)] = reshard_to(placeholder, t.dst)
        elif kind == "SEND_B":
            for key, leaf in self.states[(s, m)].incoming:
                if leaf.grad is None:
                    continue
                back = self._grad_layout(self.info.transfers[key].src)
                out = reshard_to(leaf.grad, back)
                if hosting_all or out.hosted_ranks:
                    self.inbox_b[(key, m)] = out
        elif kind == "RECV_B":
            for key, t in self.info.transfers.items():
                if key[0] == s + 1 and (key, m) not in self.inbox_b:
                    grad_spec = self._grad_layout(t.dst)
                    back = self._grad_layout(t.src)
                    placeholder = Tensor._from_shards(grad_spec, {}, t.dtype)
                    self.inbox_b[(key, m)] = reshard_to(placeholder, back)

    @staticmethod
    def _grad_layout(spec: DistSpec) -> DistSpec:
        return spec.without_partial()

    def _forward(self, s: int, m: int) -> None:
        run = StageRun(s, m, self.inbox_f)
        state = mrandom.get_rng_state()
        mrandom.set_rng_state({**state, "draws": self.base_draw + m * self.info.draws})
        hooks.stage_runs.append(run)
        try:
            with hooks.scope(f"stage{s}"):
                loss = self.forward(m)
        finally:
            hooks.stage_runs.pop()
            mrandom.set_rng_state(state)
        st = MicroState(run.outgoing, run.incoming)
        if s == self.info.num_stages - 1:
            st.loss = loss
        self.states[(s, m)] = st

    def _backward(self, s: int, m: int, split: bool) -> None:
        st = self.states[(s, m)]
        roots: list[Tensor] = []
        grads: list[Any] = []
        for key, src, _dst in st.outgoing:
            g = self.inbox_b.pop((key, m), None)
            if g is not None and not src.stop_gradient:
                roots.append(src)
                grads.append(g)
        if st.loss is not None and not st.loss.stop_gradient:
            roots.append(st.loss)
            grads.append(scale(ones_like_global(st.loss), 1.0 / self.m))
        defer = (lambda t: isinstance(t, Parameter)) if split else None
        with hooks.phase("backward"):
            st.deferred = autograd.run_backward(roots, grads, defer=defer)


def split_microbatches(t: Tensor, m: int, what: str = "batch") -> list[Tensor]:
    """Cut a batch into ``m`` equal micro-batches along dim 0 without communication.

    Each data-parallel shard is cut locally: micro-batch ``i`` is the ``i``-th piece of every
    shard, so its rows are, in order, the ``i``-th piece of each distinct dim-0 chunk. The loss
    (a mean over rows) does not depend on that order; the one-big-device reference cuts the
    same rows.
    """
    import numpy as np

    if m == 1:
        return [t]
    if not t.shape:
        raise ValueError(f"cannot cut a 0-d {what} into micro-batches")
    n = t.shape[0]
    spec = t._spec
    chunks = sorted({b[0] for b in spec.boxes.values()}) if spec is not None else [(0, n)]
    sizes = {e - s for s, e in chunks}
    if n % m or any(size % m for size in sizes) or len(sizes) > 1:
        k = len(chunks)
        raise ValueError(
            f"{what} of {n} rows cannot be cut into {m} equal micro-batches over {k} data-parallel shard(s): "
            f"{n} must be divisible by {k} * {m} = {k * m}"
        )
    piece = sizes.pop() // m
    out = []
    for i in range(m):
        rows = np.concatenate([np.arange(s + i * piece, s + (i + 1) * piece) for s, _e in chunks])
        shape = (n // m, *t.shape[1:])
        if t.is_abstract:
            out.append(
                Tensor.abstract(
                    shape, t.dtype, DistSpec(shape, spec.mesh, list(spec.placements)) if spec is not None else None
                )
            )
            continue
        if spec is None or t._value is not None:  # dense, or one big device (--reference)
            value = t._value[rows]
            if spec is None:
                out.append(Tensor(value))
            else:
                sub = DistSpec(shape, spec.mesh, list(spec.placements))
                out.append(Tensor._from_reference(sub, value))
            continue
        sub = DistSpec(shape, spec.mesh, list(spec.placements))
        shards = {}
        for r, local in t._shards.items():
            shards[r] = local[i * piece : (i + 1) * piece]
        out.append(Tensor._from_shards(sub, shards, t.dtype))
    return out


def batch_parts(batch: Sequence[Any], m: int) -> list[list[Any]]:
    """``split_microbatches`` on each tensor of a batch; returns one list per micro-batch.

    A ``None`` in the batch (no labels) is ``None`` in every micro-batch; a NumPy array or a
    nested list is a dense tensor, as the model's call would take it."""
    import numpy as np

    split: list[list[Any]] = []
    for i, t in enumerate(batch):
        if t is None:
            split.append([None] * m)
            continue
        if not isinstance(t, Tensor):
            try:
                t = Tensor(np.asarray(t))
            except (TypeError, ValueError) as exc:
                raise TypeError(
                    f"batch input {i} is a {type(t).__name__}; a pipeline cuts tensors, arrays or None into "
                    f"micro-batches ({exc})"
                ) from None
        split.append(split_microbatches(t, m, f"batch input {i}"))
    return [[parts[i] for parts in split] for i in range(m)]
