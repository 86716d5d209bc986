"""Memory accounting: bytes each rank holds, by category, read off the layouts.

    report = dist.memory_report(model, optimizer, loss)   # after forward, before backward
    report.per_rank[3]["activations"]                     # bytes rank 3 keeps for backward
    print(report.table())

Categories: ``parameters``, ``gradients``, ``optimizer_state``, ``activations`` (the tensors
the autograd tape keeps for backward, each storage counted once; a ZeRO-3 weight gathered
again in backward counts zero). Bytes come from every tensor's layout (local shape x dtype
size of each rank), so the report is the same in the simulator, in shape-only mode and on
every MPI process. A dense tensor counts on every rank (each process holds it).
Optimizer states an ``offload_optimizer`` keeps in host memory count in ``host`` (per rank and
category, ``host_total(rank)``), not in ``per_rank`` (the device).

What a tape node keeps is read by ``kept_tensors(node)``: a re-gather note keeps the shard it
gathers from (sequence parallel's gathered activation is held as its sequence shard, a ZeRO-3
weight as the parameter itself), and a tensor made by a reshard with no step (a placement
change on a mesh axis of one rank) is the same arrays as its source, so it counts as the source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpipar.autograd import Node, Packed, _topo_order
from mpipar.reshard.planner import plan_reshard
from mpipar.tensor import Tensor

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")


@dataclass
class MemoryReport:
    per_rank: dict[int, dict[str, int]] = field(default_factory=dict)
    """Device bytes per rank and category."""
    host: dict[int, dict[str, int]] = field(default_factory=dict)
    """Host bytes per rank and category: what ``offload_optimizer`` keeps off the device."""

    def add(self, t: Tensor, category: str, ranks: Iterable[int], on_host: bool = False) -> None:
        itemsize = np.dtype(t.dtype).itemsize
        where = self.host if on_host else self.per_rank
        if t.is_dist:
            spec = t.spec
            for r in spec.mesh.process_ids:
                n = int(np.prod(spec.local_shape(r), dtype=np.int64)) * itemsize
                where.setdefault(r, dict.fromkeys(CATEGORIES, 0))[category] += n
        else:
            n = int(np.prod(t.shape, dtype=np.int64)) * itemsize
            for r in ranks:
                where.setdefault(r, dict.fromkeys(CATEGORIES, 0))[category] += n

    def host_total(self, rank: int) -> int:
        """Bytes ``rank`` keeps in host memory (offloaded optimizer states and master weights)."""
        return sum(self.host.get(rank, {}).values())

    def total(self, rank: int) -> int:
        """Bytes on ``rank``'s device (host bytes are in ``host_total``)."""
        return sum(self.per_rank.get(rank, {}).values())

    def peak(self) -> tuple[int, int]:
        """(rank, bytes) of the rank holding the most."""
        rank = max(self.per_rank, key=self.total)
        return rank, self.total(rank)

    def table(self) -> str:
        head = f"{'rank':>5} " + " ".join(f"{c:>16}" for c in CATEGORIES) + f" {'total':>16}"
        rows = [head]
        for r in sorted(self.per_rank):
            cells = " ".join(f"{self.per_rank[r][c] / 2**20:13.3f} MiB" for c in CATEGORIES)
            host = f" {self.host_total(r) / 2**20:13.3f} MiB" if self.host else ""
            rows.append(f"{r:>5} {cells} {self.total(r) / 2**20:13.3f} MiB{host}")
        if self.host:
            rows[0] += f" {'host (offload)':>16}"
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        """Per rank: device bytes by category, and under ``host`` what is offloaded (only when something is)."""

        def row(r: int) -> dict[str, Any]:
            return {"rank": r, **self.per_rank[r], **({"host": dict(self.host[r])} if r in self.host else {})}

        return {"ranks": [row(r) for r in sorted(self.per_rank)]}


def storage_of(t: Tensor) -> Tensor:
    """The tensor whose storage ``t`` is: its source, through reshards that had no step."""
    while t.is_dist and t._grad_fn is not None and t._grad_fn.op == "reshard":
        source = t._grad_fn.parents[0]
        if source is None or not source.is_dist or plan_reshard(source.spec, t.spec).steps:
            break
        t = source
    return t


def kept_tensors(node: Node) -> list[Tensor]:
    """The tensors ``node`` keeps alive for its backward, each as the storage holding it."""
    return [t for _, t in kept_items(node)]


def kept_items(node: Node) -> list[tuple[str, Tensor]]:
    """``kept_tensors`` with what each is to the node: ``input 0``, ``output 1``, ``input 0 (note)``."""
    kept: list[tuple[str, Tensor]] = []
    for role, values in (("input", node.ctx.inputs), ("output", node.ctx.outputs)):
        for i, saved in enumerate(values):
            if saved is None:
                continue
            if isinstance(saved, Packed):
                kept.extend((f"{role} {i} (note)", t) for t in _noted(saved))
                continue
            live = node.parents[i] if role == "input" and i < len(node.parents) else None
            # The saved value is detached; its live twin (the op's input) knows where it came from.
            kept.append((f"{role} {i}", storage_of(live) if live is not None and live._sid == saved._sid else saved))
    return kept


def tape_storages(roots: Sequence[Tensor], is_parameter: Callable[[Tensor], bool]) -> list[tuple[Node, Tensor]]:
    """What the tape behind ``roots`` keeps for backward: each storage once (the first node
    keeping it, in forward order, claims it), parameters (``is_parameter``) left out.

    The one rule for activations: ``memory_report`` sums these, and the plan recorder
    (``mpipar.trace``) writes them into a plan, so the dashboard's memory view counts the same.
    """
    seen: set[int] = set()
    nodes: dict[int, Node] = {}
    for root in roots:
        for node in _topo_order(root):
            nodes.setdefault(id(node), node)
    out: list[tuple[Node, Tensor]] = []
    for node in nodes.values():
        for t in kept_tensors(node):
            if t._sid in seen or is_parameter(t):
                continue
            seen.add(t._sid)
            out.append((node, t))
    return out


def _noted(packed: Packed) -> list[Tensor]:
    """Tensors a pack hook's note holds (a re-gather note: the shard or parameter it gathers from)."""
    payload = packed.payload
    items = payload if isinstance(payload, tuple | list) else (payload,)
    return [x for x in items if isinstance(x, Tensor)]


def memory_report(
    model: Any = None, optimizer: Any = None, loss: Tensor | None = None, parameters: Iterable[Tensor] | None = None
) -> MemoryReport:
    params = list(parameters) if parameters is not None else (list(model.parameters()) if model is not None else [])
    if optimizer is not None and not params:
        params = list(optimizer._parameter_list)
    ranks: set[int] = set()
    for p in params:
        if p.is_dist:
            ranks.update(p.spec.mesh.process_ids)
    report = MemoryReport()
    for p in params:
        report.add(p, "parameters", ranks)
        if p.grad is not None:
            report.add(p.grad, "gradients", ranks)
    if optimizer is not None:
        offload = getattr(optimizer, "offload", None)
        for name, t in optimizer.state_tensors().items():
            on_host = offload is not None and offload.offloads(name.rsplit(".", 1)[-1])
            report.add(t, "optimizer_state", ranks, on_host=on_host)
    if loss is not None and loss._grad_fn is not None:
        param_sids = {p._sid for p in params}
        for _, t in tape_storages([loss], lambda t: t._sid in param_sids):
            report.add(t, "activations", ranks)
    for r in ranks | set(report.host):
        report.per_rank.setdefault(r, dict.fromkeys(CATEGORIES, 0))
    return report
