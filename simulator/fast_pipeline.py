"""``simulate_schedule``'s numbers for many costs of one schedule: the search's pipeline simulator.

The event simulation of ``simulator.schedule_sim`` decides *when* each action runs from the
costs, but *which* values it combines does not depend on them: every rank walks its action
list in a fixed order, a compute action starts at ``max(rank free, its inputs' ends)`` and ends
a cost later, a transfer starts at ``max(send posted, receive posted)``. So the schedule is
compiled once (``compile_schedule``, per kind, stages, micro-batches and chunks) into a list of
nodes ``end = max(inputs) + cost[slot]``, in the order ``_Run`` evaluates them, and each
candidate's costs only replay that list (``Program.run``): the same floating-point operations
in the same order, so the same bits, without building actions, spans or a ``Timeline``.
The search prices hundreds of pipelines of thousands of actions; the event simulation spent
most of its time on that bookkeeping.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from mpipar.pipeline import Action, Schedule, build_schedule, matching, resolve_kind
from mpipar.pipeline.actions import final_backward_kind
from mpipar.pipeline.schedule import one_f_one_b
from mpipar.pipeline.validate import local_inputs
from simulator.cost import PipelineCost

ZERO = 0
"""Node 0: the time every rank starts at."""


@dataclass(frozen=True)
class PipelineTimes:
    """What the search reads off a simulated step."""

    ends: tuple[float, ...]
    """Per lane (pipeline rank): the end of its last compute action."""
    makespan: float
    busy: float
    """Compute time summed over lanes."""
    in_flight: tuple[int, ...]
    """Activation bytes held at once on each lane."""


@dataclass(frozen=True)
class Program:
    """A schedule's simulation as straight-line code (module docstring)."""

    schedule: Schedule
    inputs: tuple[tuple[int, ...], ...]
    """Per node (node 0 excluded): the nodes whose latest end it waits for."""
    slots: tuple[int, ...]
    """Per node: the index of its cost in ``costs(cost)``'s vector."""
    probes: tuple[tuple[str, Action], ...]
    """Per cost slot: ``("compute" | "transfer" | "hold", a representative action)`` (a hold costs
    nothing: a blocked rank's free time, the later of its own and its transfer's end)."""
    lanes: tuple[tuple[int, ...], ...]
    """Per lane: its compute nodes in execution order."""
    transfers: tuple[int, ...]
    flight: tuple[tuple[tuple[int, int], ...], ...]
    """Per lane: ``(stage, +1 | -1)`` as its actions take or free a micro-batch's activations."""

    def costs(self, cost: PipelineCost) -> list[float]:
        split = self.schedule.split_backward
        return [
            cost.compute_time(a, split) if kind == "compute" else cost.transfer_time(a) if kind == "transfer" else 0.0
            for kind, a in self.probes
        ]

    def run(self, cost: PipelineCost, activations: tuple[int, ...]) -> PipelineTimes:
        """The step under ``cost``, equal bit for bit to ``_Run(schedule, cost).timeline()``'s."""
        if cost.num_stages != self.schedule.num_stages:
            raise ValueError(f"the cost describes {cost.num_stages} stages, the schedule {self.schedule.num_stages}")
        c = self.costs(cost)
        start = [0.0] * (len(self.inputs) + 1)
        end = [0.0] * (len(self.inputs) + 1)
        for i, (ins, slot) in enumerate(zip(self.inputs, self.slots, strict=True), 1):
            # Left to right like _Run's running max: equal values keep the earlier one.
            ready = end[ins[0]]
            for j in ins[1:]:
                ready = max(ready, end[j])
            start[i] = ready
            end[i] = ready + c[slot]
        spans = [i for lane in self.lanes for i in lane] + list(self.transfers)
        makespan = max((end[i] for i in spans), default=0.0) - min((start[i] for i in spans), default=0.0)
        ends = tuple(max((end[i] for i in lane), default=0.0) for lane in self.lanes)
        busy = 0.0
        for lane in self.lanes:  # Timeline.busy per rank, then summed over ranks, in that order
            total = 0.0
            for i in lane:  # execution order is start order: a rank runs one action at a time
                total += end[i] - start[i]
            busy += total
        return PipelineTimes(ends, makespan, busy, peak_in_flight(self.flight, activations))


@functools.lru_cache(maxsize=64)  # bounded: a long interleaved schedule compiles to tens of thousands of nodes
def compile_schedule(kind: str, stages: int, micro: int, chunks: int, blocking: bool = False) -> Program:
    """``build_schedule(kind, stages, micro, chunks)`` compiled by one symbolic run of ``_Run``'s
    loop; ``blocking``: its transfers hold both ranks until done (``PipelineCost.blocking_transfers``)."""
    schedule = build_schedule(kind, stages, micro, chunks)
    ranks = schedule.num_ranks
    split = schedule.split_backward
    inputs: list[tuple[int, ...]] = []
    slots: list[int] = []
    slot_of: dict[tuple[str, str, int], int] = {}
    probes: list[tuple[str, Action]] = []

    def slot(what: str, action: Action) -> int:
        key = (what, action.kind, action.stage)
        if key not in slot_of:
            slot_of[key] = len(probes)
            probes.append((what, action))
        return slot_of[key]

    def node(ins: tuple[int, ...], s: int) -> int:
        inputs.append(ins)
        slots.append(s)
        return len(inputs)

    free = [ZERO] * ranks
    pos = [0] * ranks
    posted: dict[tuple[str, int, int], int] = {}
    arrival: dict[tuple[str, int, int], int] = {}
    compute_end: dict[tuple[str, int, int], int] = {}
    lanes: list[list[int]] = [[] for _ in range(ranks)]
    transfers: list[int] = []
    remaining = sum(len(row) for row in schedule.actions)
    while remaining:  # _Run.timeline's sweep, action for action
        progressed = 0
        for rank in range(ranks):
            row = schedule.actions[rank]
            while pos[rank] < len(row):
                action = row[pos[rank]]
                if action.is_comm:
                    if action.key not in posted:
                        posted[action.key] = free[rank]
                    other = matching(action)
                    send, recv = (action, other) if action.is_send else (other, action)
                    if other.key in posted and recv.key not in arrival:
                        t = node((posted[send.key], posted[recv.key]), slot("transfer", send))
                        arrival[recv.key] = t
                        transfers.append(t)
                    if blocking:
                        if recv.key not in arrival:
                            break  # held until the other side posts its half
                        # _Run: free = max(free, arrival); a node of zero cost keeps the same max.
                        free[rank] = node((free[rank], arrival[recv.key]), slot("hold", action))
                else:
                    ins = [free[rank]]
                    waiting = False
                    for dep in local_inputs(action, schedule.num_stages, ranks, split):
                        if dep.is_comm:
                            if dep.key not in arrival:
                                waiting = True
                                break
                            ins.append(arrival[dep.key])
                        else:
                            ins.append(compute_end[dep.key])
                    if waiting:
                        break
                    n = node(tuple(ins), slot("compute", action))
                    compute_end[action.key] = n
                    free[rank] = n
                    lanes[rank].append(n)
                pos[rank] += 1
                progressed += 1
        if not progressed:
            raise RuntimeError(f"the pipeline compiler stalled at positions {pos} of {schedule!r}")
        remaining -= progressed
    done = final_backward_kind(split)
    flight = tuple(
        tuple((a.stage, 1 if a.kind == "F" else -1) for a in schedule.actions[k] if a.kind in ("F", done))
        for k in range(ranks)
    )
    return Program(
        schedule, tuple(inputs), tuple(slots), tuple(probes), tuple(tuple(x) for x in lanes), tuple(transfers), flight
    )


LONGEST_WALK = 50_000
"""Compute actions ``lane_flight_events`` lists at most (a 32-stage, 1536-micro-batch step has
150,000: the bound that needs it is skipped rather than paid for)."""


@functools.lru_cache(maxsize=256)
def lane_flight_events(
    kind: str, stages: int, micro: int, chunks: int
) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """``Program.flight`` of the schedule ``build_schedule`` would make, from its compute orders
    alone (no send/receive insertion, no validation: they do not move a compute action), or
    ``None`` beyond ``LONGEST_WALK`` actions."""
    spec = resolve_kind(kind)
    if micro * stages * (3 if spec.split_backward else 2) > LONGEST_WALK:
        return None
    ranks = stages // chunks
    if spec.name == "Interleaved1F1B" and chunks == 1:  # build_schedule's own special case
        orders = one_f_one_b.compute_order(ranks, 1, micro)
    else:
        orders = spec.compute_order(ranks, chunks, micro)
    done = final_backward_kind(spec.split_backward)
    return tuple(tuple((a.stage, 1 if a.kind == "F" else -1) for a in row if a.kind in ("F", done)) for row in orders)


def peak_in_flight(events: tuple[tuple[tuple[int, int], ...], ...], activations: tuple[int, ...]) -> tuple[int, ...]:
    """Per lane, the most activation bytes held at once (``estimate._peak_in_flight_bytes``): the
    running sum of the events' bytes, at its highest right after a forward (0 if none)."""
    act = np.asarray(activations, dtype=np.int64)
    out = []
    for stages, signs, forward in _event_arrays(events):
        if not forward.any():
            out.append(0)
            continue
        live = np.cumsum(signs * act[stages])  # integer bytes: exact, as the walk's sums
        out.append(max(0, int(live[forward].max())))
    return tuple(out)


_EventArrays = tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
_arrays: dict[int, tuple[object, _EventArrays]] = {}


def _event_arrays(events: tuple[tuple[tuple[int, int], ...], ...]) -> _EventArrays:
    """Per lane (stages, signs, is-forward) arrays, kept by the events' identity: they come from
    the compiled-program and walk caches, and hashing thousands of pairs per call would cost
    what the arrays save. The entry holds the events, so their id is not reused meanwhile."""
    hit = _arrays.get(id(events))
    if hit is not None and hit[0] is events:
        return hit[1]
    if len(_arrays) >= 1024:
        _arrays.clear()
    out = []
    for lane in events:
        pairs = np.asarray(lane, dtype=np.int64).reshape(-1, 2)
        out.append((pairs[:, 0], pairs[:, 1], pairs[:, 1] > 0))
    _arrays[id(events)] = (events, tuple(out))
    return tuple(out)
