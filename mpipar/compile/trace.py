"""Record what a program does -- ops, the rule decisions, every reshard -- into a ``Plan``.

    with dist.trace() as rec:
        loss = model(x); loss.backward(); opt.step()
    plan = rec.plan()               # mpipar.compile.plan.Plan, saveable as JSON

Recording is observation only: it never changes what runs. Under the shape-only backend the
same program records a plan without computing anything.

When the first backward pass starts (and each one following it before any forward op: a
pipeline's stages), the recorder writes what its tape keeps for backward
into ``meta["kept_for_backward"]``: ``[tensor id, op index]`` pairs, each storage once, the op
being the forward op whose tape node keeps it (null for a node no op made: a recompute region's,
which keeps the region's inputs). The tensors are ``mpipar.debug.memory.tape_storages``' -- the rule
``memory_report`` sums -- so a plan's memory view and the runtime's report count the same bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from mpipar import hooks
from mpipar.autograd import Node
from mpipar.backend import current_backend
from mpipar.compile.plan import HOST_TENSORS_KEY, KEPT_KEY, Plan, PlanMesh, PlanOp, PlanReshard, PlanStep, PlanTensor
from mpipar.debug.memory import tape_storages
from mpipar.mesh import ProcessMesh
from mpipar.reshard.planner import ReshardPlan
from mpipar.tensor import Parameter, Tensor


class PlanRecorder:
    def __init__(self, meta: dict[str, Any] | None = None) -> None:
        self.meta = dict(meta or {})
        self._ids: weakref.WeakKeyDictionary[Tensor, int] = weakref.WeakKeyDictionary()
        self._tensors: dict[int, PlanTensor] = {}
        self._meshes: dict[tuple[Any, ...], PlanMesh] = {}
        self._ops: list[PlanOp] = []
        self._reshards: list[PlanReshard] = []
        self._pending: list[int] = []
        self._kinds: dict[int, str] = {}
        self.pipeline: dict[str, Any] | None = None
        self.memory: dict[str, Any] | None = None
        self._owner: int | None = None
        self._node_ops: weakref.WeakKeyDictionary[Node, int] = weakref.WeakKeyDictionary()
        self._by_storage: dict[int, int] = {}
        self._kept_storages: set[int] = set()
        self._kept_done = False
        """Storage id -> the first plan tensor holding it (a node keeps a detached twin of an op's
        output: the same storage, which the plan already names)."""

    # ------------------------------------------------------------------ context
    def _foreign(self) -> bool:
        """Is this call from another rank's program? Per-rank programs in the simulator
        (``simulator.per_rank``) share the hooks; a recorder keeps the program that opened it,
        as each process's recorder does under MPI."""
        return self._owner is not None and current_backend().program_rank != self._owner

    def __enter__(self) -> PlanRecorder:
        self._owner = current_backend().program_rank
        hooks.op_hooks.append(self)
        hooks.reshard_hooks.append(self)
        hooks.backward_hooks.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        hooks.op_hooks.remove(self)
        hooks.reshard_hooks.remove(self)
        hooks.backward_hooks.remove(self)

    # ------------------------------------------------------------------ ids
    def _mesh_id(self, mesh: ProcessMesh) -> int:
        key = (tuple(mesh.shape), tuple(mesh.process_ids), tuple(mesh.dim_names))
        if key not in self._meshes:
            self._meshes[key] = PlanMesh(
                len(self._meshes), tuple(mesh.shape), tuple(mesh.process_ids), tuple(mesh.dim_names)
            )
        return self._meshes[key].id

    def mark(self, tensor: Tensor, kind: str, name: str | None = None) -> int:
        """Label a tensor (a parameter, an input, an optimizer state) in the plan."""
        tid = self.tensor_id(tensor)
        self._kinds[tid] = kind
        old = self._tensors[tid]
        self._tensors[tid] = PlanTensor(
            tid, name or old.name, kind, old.shape, old.dtype, old.mesh, old.placements, old.local_shapes
        )
        return tid

    def mark_optimizer(self, optimizer: Any) -> None:
        """Label what an optimizer holds after its step: each parameter, its gradient, its states
        (``meta["host_tensors"]``: the states an ``offload_optimizer`` keeps in host memory, so
        memory views put them on the host, not the device; tensor records stay device-agnostic)."""
        for i, p in enumerate(optimizer._parameter_list):
            name = p.name or f"param_{i}"
            self.mark(p, "parameter", name)
            if p.grad is not None:
                self.mark(p.grad, "gradient", f"{name}@GRAD")
        offload = getattr(optimizer, "offload", None)
        host: list[int] = []
        for name, t in optimizer.state_tensors().items():
            tid = self.mark(t, "optimizer_state", name)
            if offload is not None and offload.offloads(name.rsplit(".", 1)[-1]):
                host.append(tid)
        if host:
            self.meta[HOST_TENSORS_KEY] = host

    def tensor_id(self, t: Tensor) -> int:
        tid = self._ids.get(t)
        if tid is not None and self._tensors[tid].placements == (t.spec.placements_str if t.is_dist else ""):
            return tid
        # New tensor, or one re-marked in place since: a new plan entry.
        tid = len(self._tensors)
        self._ids[t] = tid
        kind = self._kinds.get(tid) or ("parameter" if isinstance(t, Parameter) else "activation")
        if t.is_dist:
            spec = t.spec
            mesh = self._mesh_id(spec.mesh)
            locals_ = spec.local_shapes
            pls = spec.placements_str
        else:
            mesh, locals_, pls = None, (), ""
        self._tensors[tid] = PlanTensor(tid, t.name or "", kind, tuple(t.shape), str(t.dtype), mesh, pls, locals_)
        self._by_storage.setdefault(t._sid, tid)
        return tid

    def _storage_id(self, t: Tensor) -> int:
        """The plan tensor already naming ``t``'s storage in ``t``'s layout, else ``t``'s own entry."""
        tid = self._by_storage.get(t._sid)
        if tid is not None:
            known = self._tensors[tid]
            if known.shape == tuple(t.shape) and known.placements == (t.spec.placements_str if t.is_dist else ""):
                return tid
        return self.tensor_id(t)

    # ------------------------------------------------------------------ hooks
    def on_reshard(self, src: Tensor, out: Tensor, plan: ReshardPlan, reason: str) -> None:
        if self._foreign():
            return
        itemsize = src.dtype.itemsize
        steps = []
        for s in plan.steps:
            pieces: tuple[tuple[int, int, int], ...] = ()
            if s.kind == "transfer":
                elems = [(p.src, p.dst, int(_numel(p.box)) * itemsize) for p in s.pieces if p.src != p.dst]
                pieces = tuple(elems)
            axes = tuple(s.src.mesh.dim_names[a] for a in s.axes)
            steps.append(
                PlanStep(
                    s.kind,
                    axes,
                    s.reduce_type,
                    s.src.placements_str,
                    s.dst.placements_str,
                    s.bytes_per_rank(itemsize),
                    pieces,
                )
            )
        index = len(self._reshards)
        self._reshards.append(
            PlanReshard(
                index,
                None,
                self.tensor_id(src),
                self.tensor_id(out),
                reason,
                hooks.current_phase(),
                tuple(src.shape),
                str(src.dtype),
                self._mesh_id(plan.src.mesh),
                plan.src.placements_str,
                self._mesh_id(plan.dst.mesh),
                plan.dst.placements_str,
                plan.bytes_per_rank(itemsize),
                tuple(steps),
            )
        )
        if hooks.resharding_for() is not None:
            self._pending.append(index)

    def on_op(
        self,
        op: Any,
        inputs: list[Tensor],
        used: list[Tensor],
        outputs: list[Tensor],
        result: Any,
        attrs: dict[str, Any],
    ) -> None:
        if self._foreign():
            return
        index = len(self._ops)
        if hooks.current_phase() == "forward":
            node = outputs[0]._grad_fn if outputs else None
            if node is not None:
                self._node_ops[node] = index
            self._kept_done = KEPT_KEY in self.meta  # a forward after a backward: the record is whole
        for r in self._pending:
            old = self._reshards[r]
            self._reshards[r] = PlanReshard(**{**old.__dict__, "op": index})
        rule = result.rule if result is not None else ("replicate-only" if op.replicate_only else "")
        self._ops.append(
            PlanOp(
                index,
                op.name,
                hooks.current_phase(),
                hooks.current_scope(),
                tuple(self.tensor_id(t) for t in inputs),
                tuple(self.tensor_id(t) for t in outputs),
                rule,
                result.reason if result is not None else "",
                tuple(_pls(t) for t in inputs),
                tuple(_pls(t) for t in used),
                tuple(_pls(t) for t in outputs),
                tuple(self._pending),
                tuple((k, attrs[k]) for k in op.cost_attrs if k in attrs),
            )
        )
        self._pending = []

    def on_manual_collective(
        self,
        call: str,
        group: tuple[int, ...],
        kind: str,
        reduce_type: str | None,
        src: str,
        dst: str,
        tensor: Tensor,
        bytes_per_rank: float,
        pieces: tuple[tuple[int, int, int], ...] = (),
    ) -> None:
        """A manual collective (``mpipar.collective``) as a one-step reshard on its group's
        1-D mesh (axis ``group``), so plan views count it with the reshards' communication."""
        if self._foreign():
            return
        key = ((len(group),), tuple(group), ("group",))
        if key not in self._meshes:
            self._meshes[key] = PlanMesh(len(self._meshes), *key)
        mesh = self._meshes[key].id
        tid = self.tensor_id(tensor)
        step = PlanStep(kind, ("group",), reduce_type, src, dst, float(bytes_per_rank), pieces)
        self._reshards.append(
            PlanReshard(
                len(self._reshards),
                None,
                tid,
                tid,
                f"manual {call} on group {list(group)}",
                hooks.current_phase(),
                tuple(tensor.shape),
                str(tensor.dtype),
                mesh,
                src,
                mesh,
                dst,
                float(bytes_per_rank),
                (step,),
            )
        )

    def on_backward(self, roots: Sequence[Tensor]) -> None:
        """A backward pass starts: record what its tape keeps. Passes one after another with no
        forward op between (a pipeline's stages, each its own graph) add to the record; once a
        forward op follows (the next micro-batch or step), the record is complete."""
        if self._foreign() or self._kept_done:
            return
        record = self.meta.setdefault(KEPT_KEY, [])
        for node, t in tape_storages(roots, lambda t: isinstance(t, Parameter)):
            if t._sid not in self._kept_storages:
                self._kept_storages.add(t._sid)
                record.append([self._storage_id(t), self._node_ops.get(node)])

    # ------------------------------------------------------------------ result
    def plan(self) -> Plan:
        return Plan(
            meshes=sorted(self._meshes.values(), key=lambda m: m.id),
            tensors=[self._tensors[i] for i in sorted(self._tensors)],
            ops=list(self._ops),
            reshards=list(self._reshards),
            meta=dict(self.meta),
            pipeline=self.pipeline,
            memory=self.memory,
        )


def _pls(t: Tensor) -> str:
    return t.spec.placements_str if t.is_dist else "dense"


def _numel(box: Any) -> int:
    out = 1
    for s, e in box:
        out *= e - s
    return out


def trace(meta: dict[str, Any] | None = None) -> PlanRecorder:
    """A recorder to use as a context manager (see the module docstring)."""
    return PlanRecorder(meta)
