"""Lowering compute orders to full action lists: where each send and receive goes.

A schedule kind decides only the order of F/B/W on each rank. This pass adds the transfers
between ranks so that the lists cannot deadlock even with blocking (rendezvous) send/recv:

1. time the compute orders with the kind's unit costs (F=1, B=2; B=1, W=1 when backward is
   split), each action starting when its rank is free and its inputs are done;
2. put every event on one global sequence: a compute action at its start time, the transfer of
   its result (a SEND on the producer's rank paired with a RECV on the consumer's) at its end
   time, transfers first on ties;
3. read each rank's list off that sequence.

The global sequence is itself a valid execution in which each transfer is one rendezvous, so
the lists are deadlock-free by construction, and a receive sits just where its data becomes
available: a rank never waits on a receive earlier than its compute order forces it to.
"""

from __future__ import annotations

from fractions import Fraction

from mpipar.pipeline.actions import Action, Blocked, ScheduleDeadlock, dependencies
from mpipar.pipeline.validate import stage_rank

UNIT_COSTS = {"F": Fraction(1), "B": Fraction(2), "W": Fraction(1)}
UNIT_COSTS_SPLIT = {"F": Fraction(1), "B": Fraction(1), "W": Fraction(1)}


def time_compute_orders(
    orders: tuple[tuple[Action, ...], ...],
    num_stages: int,
    split_backward: bool,
    costs: dict[str, Fraction] | None = None,
) -> list[list[tuple[Fraction, Fraction]]]:
    """(start, end) of every compute action, each as early as its rank and inputs allow."""
    if costs is None:
        costs = UNIT_COSTS_SPLIT if split_backward else UNIT_COSTS
    num_ranks = len(orders)
    end: dict[tuple[str, int, int], Fraction] = {}
    free = [Fraction(0)] * num_ranks
    pos = [0] * num_ranks
    times: list[list[tuple[Fraction, Fraction]]] = [[] for _ in range(num_ranks)]
    remaining = sum(len(row) for row in orders)
    while remaining:
        progressed = False
        for rank in range(num_ranks):
            while pos[rank] < len(orders[rank]):
                action = orders[rank][pos[rank]]
                deps = dependencies(action, num_stages, split_backward)
                if any(dep.key not in end for dep in deps):
                    break
                start = max([free[rank], *(end[dep.key] for dep in deps)])
                finish = start + costs[action.kind]
                end[action.key] = finish
                free[rank] = finish
                times[rank].append((start, finish))
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            _raise_order_deadlock(orders, pos, end, num_stages, split_backward)
    return times


def insert_communication(
    orders: tuple[tuple[Action, ...], ...], num_stages: int, split_backward: bool
) -> tuple[tuple[Action, ...], ...]:
    """Full per-rank action lists (compute plus SEND/RECV) for per-rank compute orders."""
    num_ranks = len(orders)
    times = time_compute_orders(orders, num_stages, split_backward)
    # (time, 0 = transfer / 1 = compute, tie-breakers..., rank-local actions to append)
    events: list[tuple[Fraction, int, int, int, list[tuple[int, Action]]]] = []
    for rank, row in enumerate(orders):
        for index, action in enumerate(row):
            start, finish = times[rank][index]
            events.append((start, 1, rank, index, [(rank, action)]))
            target = _transfer_target(action, num_stages)
            if target is None or stage_rank(target, num_ranks) == rank:
                continue
            peer = stage_rank(target, num_ranks)
            direction = action.kind  # F ships an activation, B an input gradient
            send = Action(f"SEND_{direction}", action.stage, action.microbatch, peer)
            recv = Action(f"RECV_{direction}", target, action.microbatch, rank)
            events.append((finish, 0, rank, index, [(rank, send), (peer, recv)]))
    events.sort(key=lambda e: (e[0], e[1], e[2], e[3]))
    lists: list[list[Action]] = [[] for _ in range(num_ranks)]
    for *_, placed in events:
        for rank, action in placed:
            lists[rank].append(action)
    return tuple(tuple(row) for row in lists)


def _transfer_target(action: Action, num_stages: int) -> int | None:
    """The stage that consumes this compute action's result, if any."""
    if action.kind == "F" and action.stage < num_stages - 1:
        return action.stage + 1
    if action.kind == "B" and action.stage > 0:
        return action.stage - 1
    return None


def _raise_order_deadlock(
    orders: tuple[tuple[Action, ...], ...],
    pos: list[int],
    end: dict[tuple[str, int, int], Fraction],
    num_stages: int,
    split_backward: bool,
) -> None:
    num_ranks = len(orders)
    index_of = {a.key: (r, i) for r, row in enumerate(orders) for i, a in enumerate(row)}
    found: list[tuple[bool, Blocked]] = []
    for rank in range(num_ranks):
        if pos[rank] >= len(orders[rank]):
            continue
        action = orders[rank][pos[rank]]
        missing = next(d for d in dependencies(action, num_stages, split_backward) if d.key not in end)
        owner, where = index_of[missing.key]
        place = "its own list" if owner == rank else f"rank {owner}'s list"
        reason = f"it needs {missing}, which comes later in {place} (#{where})"
        found.append((owner == rank, Blocked(rank, pos[rank], action, reason)))
    # A rank whose own list is out of order is the root cause; name it first.
    blocked = [b for _, b in sorted(found, key=lambda item: (not item[0], item[1].rank))]
    first = blocked[0]
    lines = "\n".join(f"  {b}" for b in blocked)
    raise ScheduleDeadlock(
        f"compute order deadlocks: rank {first.rank} action #{first.index} {first.action} can never run: "
        f"{first.reason}\n{lines}\nfix: order each rank's list so every action's inputs can be produced before it",
        blocked,
    )
