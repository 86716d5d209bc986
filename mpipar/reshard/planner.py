"""The reshard planner: a pure function from (source spec, destination spec) to a list of steps.

Same mesh
---------
The planner searches (Dijkstra) over placement states of the mesh axes that must change,
where one edge is one collective over a *group* of mesh axes taken together (the flattened
group of their ranks), or one local step. The cost of a path is the bytes a rank receives,
summed over steps (the most loaded rank of each step), then the number of collectives,
then the number of steps. Grouping axes is what beats going axis by axis:

    transition (one axis, n ranks, T = tensor bytes)   step             bytes received per rank
    S(i) -> R                                          all_gather       (n-1)/n * T
    P    -> R                                          all_reduce       2 (n-1)/n * T   (ring)
    P    -> S(i)                                       reduce_scatter   (n-1)/n * T
    S(i) -> S(j)                                       all_to_all       (n-1)/n * T/n
    R    -> S(i)                                       slice            0
    R    -> P, S(i) -> P                               partial          0

    2x2 mesh            axis by axis                     grouped (this planner)
    [P, P] -> [R, R]    all_reduce x2: 2 T               all_reduce over 4 ranks: 1.5 T
    [S0,S1] -> [S1,S0]  all_to_all x2: 0.5 T..0.75 T     one exchange over 4 ranks: 0.25 T

Moves (G = the group's axes, s = the current placements):

* ``all_reduce``:     s[G] all Partial(op)              -> Replicate on G
* ``reduce_scatter``: s[G] all Partial(op)              -> the destination's Shard on G
* ``all_gather``:     s[G] all Shard                    -> Replicate on G
* ``all_to_all``:     s[G] all Shard                    -> the destination's (other) Shard on G
* ``slice``:          s[G] all Replicate                -> the destination's Shard on G (local)
* ``partial``:        s[a] Replicate or Shard           -> the destination's Partial (local)

A move on G is legal only when the data each rank needs is inside its group: for every
tensor dim d that G shards (before or after), no axis outside G may shard d *inside* G's
split (at a higher axis index, see the nesting rule in ``spec.py``). The search only moves
axes that change, closed under that rule, so a path always exists: reduce, gather innermost
first, slice outermost first, then make partials.

Different meshes
----------------
Size-reducing steps run on the sender, size-increasing ones on the receiver: the source is
resharded on its mesh to a form with no Partial and as little replication as possible
(reduce_scatter instead of all_reduce; local slices of replicas), then each destination rank
receives exactly the boxes it lacks by point-to-point ``transfer`` (each element crosses the
link once), then the destination's replication and Partial are restored on its mesh
(all_gather, local partial).

Zigzag (load-balanced) splits
-----------------------------
``ZigzagShard`` boxes are in the dim's storage order (``spec.py``). A step that turns a zigzag
dim whole (``all_gather``) reorders the gathered dim to the natural order; one that makes a
whole dim zigzag (``slice``, ``reduce_scatter``) reorders it to storage order first. So
``Z -> R`` is one all_gather, ``R -> Z`` a local slice, ``P -> Z`` one reduce_scatter, and
``Z <-> S`` goes through ``R`` (all_gather, then a slice). No ``all_to_all`` or ``partial``
step starts or ends on a zigzag axis, and a cross-mesh move between specs of different
storage orders goes through their plain-``Shard`` forms.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

from mpipar.placement import Partial, Placement, Replicate, Shard, ZigzagShard
from mpipar.spec import Box, DistSpec, box_intersect, box_numel, box_relative, box_shape, slabs_in_order

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
LOCAL_KINDS = ("slice", "partial")


@dataclass(frozen=True)
class Piece:
    """One point-to-point piece of a cross-mesh transfer: ``box`` goes from ``src`` to ``dst``."""

    src: int
    dst: int
    box: Box


@dataclass(frozen=True)
class ReshardStep:
    """One step of a plan. ``src``/``dst`` are the specs before and after it."""

    kind: str
    src: DistSpec
    dst: DistSpec
    axes: tuple[int, ...] = ()
    reduce_type: str | None = None
    recv_elems: float = 0.0
    """Elements received by the most loaded rank (ring formulas for reductions)."""
    pieces: tuple[Piece, ...] = field(default=(), repr=False)

    @property
    def is_comm(self) -> bool:
        return self.kind in COLLECTIVES or self.kind == "transfer"

    def bytes_per_rank(self, itemsize: int) -> float:
        return self.recv_elems * itemsize

    def axes_str(self) -> str:
        names = self.src.mesh.dim_names
        return ",".join(names[a] for a in self.axes)

    def describe(self) -> str:
        """``all_gather on x: S(0)R -> RR``."""
        rt = f"({self.reduce_type})" if self.reduce_type else ""
        if self.kind == "transfer":
            n_msgs = sum(1 for p in self.pieces if p.src != p.dst)
            return (
                f"transfer {self.src.mesh.process_ids} -> {self.dst.mesh.process_ids}: "
                f"{self.src.placements_str} -> {self.dst.placements_str} ({n_msgs} messages)"
            )
        return f"{self.kind}{rt} on {self.axes_str()}: {self.src.placements_str} -> {self.dst.placements_str}"

    def __str__(self) -> str:
        return self.describe()

    # The executor asks the questions below for every collective it runs (under MPI, for one
    # rank); their answers depend only on the step, so each is computed once per step.
    def member_shapes(self, group: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The source shard shape of each member of ``group``, in member order."""
        return self._memo("shapes", group, lambda: tuple(box_shape(self.src.boxes[m]) for m in group))

    def chunk_cuts(self, rank: int, group: tuple[int, ...]) -> tuple[list[tuple[Any, ...]], bool]:
        """How a reduce_scatter cuts ``rank``'s shard into the chunks of ``group``.

        The index of each member's chunk in the rank's source shard, in member order, and
        whether those chunks are consecutive slabs of the first dim covering the whole shard
        (then a C-contiguous shard is already the packed send buffer).
        """

        def cuts() -> tuple[list[tuple[Any, ...]], bool]:
            src_box = self.src.boxes[rank]
            boxes = [self.dst.boxes[m] for m in group]
            return [box_relative(b, src_box) for b in boxes], slabs_in_order(src_box, boxes)

        return self._memo("cuts", (rank, group), cuts)

    def groups_with(self, rank: int) -> list[tuple[int, ...]]:
        """The rank groups of this step's collective that ``rank`` belongs to."""
        return self._memo("groups", rank, lambda: [g for g in self.src.mesh.groups(self.axes) if rank in g])

    def gathers_slabs(self, rank: int, group: tuple[int, ...]) -> bool:
        """Do the source shards of ``group``, in member order, tile ``rank``'s destination box
        as consecutive slabs of the first dim (then an all_gather's receive buffer is the new
        shard as it lies)?"""
        return self._memo(
            "slabs", (rank, group), lambda: slabs_in_order(self.dst.boxes[rank], [self.src.boxes[m] for m in group])
        )

    def dst_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s destination shard."""
        return self._memo("dst_shape", rank, lambda: box_shape(self.dst.boxes[rank]))

    def _memo(self, question: str, key: Any, answer: Callable[[], Any]) -> Any:
        memo = self._answers
        found = memo.get((question, key), _UNASKED)
        if found is _UNASKED:
            found = memo[(question, key)] = answer()
        return found

    @cached_property
    def _answers(self) -> dict[tuple[str, Any], Any]:
        return {}


_UNASKED = object()


@dataclass(frozen=True)
class ReshardPlan:
    src: DistSpec
    dst: DistSpec
    steps: tuple[ReshardStep, ...]

    @property
    def comm_steps(self) -> tuple[ReshardStep, ...]:
        return tuple(s for s in self.steps if s.is_comm)

    def recv_elems_per_rank(self) -> float:
        return sum(s.recv_elems for s in self.steps)

    def bytes_per_rank(self, itemsize: int) -> float:
        return self.recv_elems_per_rank() * itemsize

    def format(self, itemsize: int | None = None) -> str:
        """The plan as text, one line per step (golden-tested)."""
        head = f"{self.src.placements_str} -> {self.dst.placements_str}"
        if not self.src.mesh.same_layout(self.dst.mesh):
            head = f"{self.src.mesh.process_ids}:{self.src.placements_str} -> {self.dst.mesh.process_ids}:{self.dst.placements_str}"
        lines = [f"reshard {list(self.src.shape)} {head}"]
        if not self.steps:
            lines.append("  (no step)")
        for i, s in enumerate(self.steps, 1):
            cost = ""
            if s.is_comm:
                amount = s.bytes_per_rank(itemsize) if itemsize else s.recv_elems
                unit = "B" if itemsize else "elems"
                cost = f"  [{_num(amount)} {unit}/rank]"
            lines.append(f"  {i}. {s.describe()}{cost}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    @cached_property
    def step_contexts(self) -> tuple[str, ...]:
        """Each step's communication label (``reshard S(0) -> R: all_gather on x: ...``).

        Built once per cached plan: formatting it on every execution was a measurable part
        of a small reshard's cost under MPI.
        """
        head = f"reshard {self.src.placements_str} -> {self.dst.placements_str}"
        return tuple(f"{head}: {s.describe()}" for s in self.steps)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


# =============================================================================== public entry
def plan_reshard(src: DistSpec, dst: DistSpec) -> ReshardPlan:
    """Plan the conversion of a tensor laid out as ``src`` into ``dst`` (cached, pure)."""
    # An eager step reshards the same spec objects every step (interned, and its decisions'):
    # found by their identity first, without hashing both specs or comparing equal ones field
    # by field, as the cache below does.
    entry = _BY_IDENTITY.get((id(src), id(dst)))
    if entry is not None and entry[0] is src and entry[1] is dst:
        return entry[2]
    if src.shape != dst.shape:
        raise ValueError(f"reshard cannot change the shape: source {src} vs destination {dst}")
    plan = _plan_cached(src, dst)
    if len(_BY_IDENTITY) >= 4096:
        _BY_IDENTITY.clear()
    _BY_IDENTITY[(id(src), id(dst))] = (src, dst, plan)
    return plan


_BY_IDENTITY: dict[tuple[int, int], tuple[DistSpec, DistSpec, ReshardPlan]] = {}
"""``plan_reshard``'s answers per (source, destination) spec by identity (an entry holds both
specs, so neither id is reused while it lasts)."""


@lru_cache(maxsize=8192)
def _plan_cached(src: DistSpec, dst: DistSpec) -> ReshardPlan:
    if src.mesh.same_layout(dst.mesh):
        return ReshardPlan(src, dst, _plan_same_mesh(src, dst.with_mesh(src.mesh)))
    return ReshardPlan(src, dst, _plan_cross_mesh(src, dst))


# ========================================================================= same-mesh search
State = tuple[Placement, ...]


def _legal(
    shape: tuple[int, ...], before: State, after: State, group: Sequence[int], trivial: frozenset[int] = frozenset()
) -> bool:
    """The nesting rule: no outside axis shards a dim G touches at a higher axis index.

    ``trivial`` axes have one rank: their split is the whole chunk, so they never break nesting.
    """
    gset = set(group) | set(trivial)
    for d in range(len(shape)):
        touching = [a for a in group if any(isinstance(p, Shard) and p.dim == d for p in (before[a], after[a]))]
        if not touching:
            continue
        first = min(touching)
        for a, p in enumerate(before):
            if a > first and a not in gset and isinstance(p, Shard) and p.dim == d:
                return False
    return True


def _partials_commute(state: State) -> bool:
    """Intermediate states obey the spec rule: only sum and avg partials may mix."""
    ops = {p.reduce_type for p in state if isinstance(p, Partial)}
    return len(ops) <= 1 or ops <= {"sum", "avg"}


def _active_axes(shape: tuple[int, ...], src: State, dst: State) -> tuple[int, ...]:
    active = {a for a in range(len(src)) if src[a] != dst[a]}
    changed = True
    while changed:
        changed = False
        for d in range(len(shape)):
            touching = [a for a in active if any(isinstance(p, Shard) and p.dim == d for p in (src[a], dst[a]))]
            if not touching:
                continue
            first = min(touching)
            for a in range(len(src)):
                if a > first and a not in active and any(isinstance(p, Shard) and p.dim == d for p in (src[a], dst[a])):
                    active.add(a)
                    changed = True
    return tuple(sorted(active))


def _subsets(axes: Sequence[int]) -> Iterator[tuple[int, ...]]:
    for k in range(1, len(axes) + 1):
        yield from itertools.combinations(axes, k)


def _moves(
    shape: tuple[int, ...], state: State, dst: State, active: Sequence[int]
) -> Iterator[tuple[str, tuple[int, ...], State, str | None]]:
    """Candidate (kind, axes, next_state, reduce_type) from ``state``."""
    for group in _subsets(active):
        ps = [state[a] for a in group]
        if all(isinstance(p, Partial) for p in ps):
            ops = {p.reduce_type for p in ps if isinstance(p, Partial)}
            if len(ops) == 1:
                op = ops.pop()
                nxt = list(state)
                for a in group:
                    nxt[a] = Replicate()
                yield "all_reduce", group, tuple(nxt), op
                if all(isinstance(dst[a], Shard) for a in group):
                    nxt = list(state)
                    for a in group:
                        nxt[a] = dst[a]
                    yield "reduce_scatter", group, tuple(nxt), op
        elif all(isinstance(p, Shard) for p in ps):
            nxt = list(state)
            for a in group:
                nxt[a] = Replicate()
            yield "all_gather", group, tuple(nxt), None
            zigzag = any(isinstance(p, ZigzagShard) for p in (*ps, *(dst[a] for a in group)))
            if not zigzag and all(isinstance(dst[a], Shard) and dst[a] != state[a] for a in group):
                nxt = list(state)
                for a in group:
                    nxt[a] = dst[a]
                yield "all_to_all", group, tuple(nxt), None
        elif all(isinstance(p, Replicate) for p in ps) and all(isinstance(dst[a], Shard) for a in group):
            nxt = list(state)
            for a in group:
                nxt[a] = dst[a]
            yield "slice", group, tuple(nxt), None
    for a in active:
        target = dst[a]
        if (
            isinstance(target, Partial)
            and isinstance(state[a], (Replicate, Shard))
            and not isinstance(state[a], ZigzagShard)
        ):
            nxt = list(state)
            nxt[a] = target
            yield "partial", (a,), tuple(nxt), target.reduce_type


def _recv_elems(kind: str, before: DistSpec, after: DistSpec, group: Sequence[int]) -> float:
    """Elements received by the most loaded rank in one step."""
    if kind in LOCAL_KINDS:
        return 0.0
    n = 1
    for a in group:
        n *= before.mesh.shape[a]
    worst = 0.0
    for r, b_before in before.boxes.items():
        b_after = after.boxes[r]
        if kind == "all_reduce":
            v = 2.0 * (n - 1) / n * box_numel(b_before)
        elif kind == "reduce_scatter":
            v = float((n - 1) * box_numel(b_after))
        elif kind == "all_gather":
            v = float(box_numel(b_after) - box_numel(b_before))
        else:  # all_to_all
            overlap = box_intersect(b_before, b_after)
            v = float(box_numel(b_after) - (box_numel(overlap) if overlap else 0))
        worst = max(worst, v)
    return worst


def _plan_same_mesh(src: DistSpec, dst: DistSpec) -> tuple[ReshardStep, ...]:
    shape, mesh = src.shape, src.mesh
    # On a one-rank axis every placement holds the same data (the whole chunk; a partial of one
    # value is the value), so such axes never need a step.
    # The search labels them Replicate on both ends (never a Partial-type conflict); the result
    # takes the destination's labels from the plan.
    trivial = frozenset(a for a in range(mesh.ndim) if mesh.shape[a] == 1)
    start = tuple(Replicate() if a in trivial else p for a, p in enumerate(src.placements))
    goal = tuple(Replicate() if a in trivial else p for a, p in enumerate(dst.placements))
    if start == goal:
        return ()
    src = DistSpec(shape, mesh, start)
    active = tuple(a for a in _active_axes(shape, start, goal) if a not in trivial)
    counter = itertools.count()
    # cost = (received elements, collectives, steps)
    frontier: list[tuple[tuple[float, int, int], int, State]] = [((0.0, 0, 0), next(counter), start)]
    best: dict[State, tuple[float, int, int]] = {start: (0.0, 0, 0)}
    parent: dict[State, tuple[State, ReshardStep]] = {}
    while frontier:
        cost, _, state = heapq.heappop(frontier)
        if state == goal:
            break
        if cost > best.get(state, cost):
            continue
        before = DistSpec(shape, mesh, state)
        for kind, group, nxt, op in _moves(shape, state, goal, active):
            if not _legal(shape, state, nxt, group, trivial) or not _partials_commute(nxt):
                continue
            try:
                after = DistSpec(shape, mesh, nxt)
            except ValueError:  # e.g. a zigzag split no longer outermost: not a layout
                continue
            recv = _recv_elems(kind, before, after, group)
            is_comm = kind in COLLECTIVES
            new_cost = (cost[0] + recv, cost[1] + int(is_comm), cost[2] + 1)
            if new_cost < best.get(nxt, (float("inf"), 0, 0)):
                best[nxt] = new_cost
                parent[nxt] = (state, ReshardStep(kind, before, after, tuple(group), op, recv))
                heapq.heappush(frontier, (new_cost, next(counter), nxt))
    if goal not in parent:
        raise AssertionError(f"reshard planner found no path from {src} to {dst}")  # a path always exists
    steps: list[ReshardStep] = []
    state = goal
    while state != start:
        prev, step = parent[state]
        steps.append(step)
        state = prev
    return tuple(reversed(steps))


# ======================================================================== cross-mesh plans
def _spread(spec: DistSpec, prefer: Sequence[Placement] | None) -> DistSpec:
    """The least replicated, partial-free layout of ``spec`` on its own mesh.

    Every Replicate or Partial axis becomes a Shard of a tensor dim that still has at least as
    many elements as the axis has ranks, preferring the dim ``prefer`` shards on that axis (so
    sender and receiver chunks line up), else the longest one. Partial axes that cannot be
    split become Replicate (they must be reduced before leaving the mesh).
    """
    mesh = spec.mesh
    pls = list(spec.placements)
    for a, p in enumerate(pls):
        if isinstance(p, Shard):
            continue
        k = mesh.shape[a]
        cur = DistSpec(spec.shape, mesh, [q if not isinstance(q, Partial) else Replicate() for q in pls])
        extents = [e - s for s, e in cur.box_at([0] * mesh.ndim)]
        candidates: list[int] = []
        preferred = prefer[a] if prefer is not None and a < len(prefer) else None
        if isinstance(preferred, Shard):
            candidates.append(preferred.dim)
        candidates += sorted(range(len(spec.shape)), key=lambda d: (-extents[d], d))
        chosen: Placement = Replicate()
        for d in candidates:
            if extents[d] < k:
                continue
            trial = list(pls)
            trial[a] = Shard(d)
            if _legal(spec.shape, tuple(pls), tuple(trial), (a,)):
                chosen = Shard(d)
                break
        pls[a] = chosen
    return DistSpec(spec.shape, mesh, pls)


def _transfer_step(src: DistSpec, dst: DistSpec) -> ReshardStep:
    """Point-to-point pieces taking every destination box from the source cells."""
    cells = src.cells
    pieces: list[Piece] = []
    demand: dict[Box, int] = {}
    recv_by_rank: dict[int, int] = {}
    for r in dst.mesh.process_ids:
        need = dst.boxes[r]
        got = 0
        for cell, holders in cells.items():
            part = box_intersect(cell, need)
            if part is None:
                continue
            if r in holders:
                sender = r
            else:
                i = demand.get(cell, 0)
                demand[cell] = i + 1
                sender = holders[i % len(holders)]
            pieces.append(Piece(sender, r, part))
            if sender != r:
                got += box_numel(part)
        recv_by_rank[r] = got
    recv = float(max(recv_by_rank.values(), default=0))
    return ReshardStep("transfer", src, dst, (), None, recv, tuple(pieces))


def _plan_cross_mesh(src: DistSpec, dst: DistSpec) -> tuple[ReshardStep, ...]:
    if src.zigzag != dst.zigzag:  # different storage orders: the boxes do not compare; go plain
        plain_src, plain_dst = src.natural(), dst.natural()
        return (
            _plan_same_mesh(src, plain_src) + _plan_cross_mesh(plain_src, plain_dst) + _plan_same_mesh(plain_dst, dst)
        )
    same_ndim = src.mesh.ndim == dst.mesh.ndim
    send_form = _spread(src, dst.placements if same_ndim else None)
    recv_form = _spread(
        DistSpec(dst.shape, dst.mesh, [p if not isinstance(p, Partial) else Replicate() for p in dst.placements]),
        send_form.placements if same_ndim else None,
    )
    steps = list(_plan_same_mesh(src, send_form))
    steps.append(_transfer_step(send_form, recv_form))
    steps.extend(_plan_same_mesh(recv_form, dst))
    return tuple(steps)
