"""Checking pipeline schedules: structure, then a dry run that finds deadlocks.

``check_structure`` refuses a schedule whose actions are on the wrong rank, out of range,
duplicated or missing (every (stage, micro-batch) needs F and B, and W when backward is split;
every stage boundary that crosses ranks needs its SEND/RECV pairs with the right peers).

``dry_run`` then executes every rank's list in lockstep rounds without computing anything:

* in round ``k`` each rank first runs the sends/receives at the head of its list that can
  complete, then at most one compute action whose inputs were ready before round ``k``;
* ``semantics="rendezvous"`` (default): a send completes only together with its receive, as
  with blocking ``MPI_Ssend``/``MPI_Recv`` -- the strictest reading, so a schedule that passes
  runs with plain blocking point-to-point calls in list order;
* ``semantics="eager"``: a send completes at once (buffered), a receive blocks until its send
  has run;
* ``semantics="nonblocking"``: sends and receives are posted in list order and never block
  (``isend``/``irecv``); a compute action waits until the transfers it consumes have both
  halves posted. This is how the simulator times a schedule, and what the grid shows.

A round with no progress is a deadlock: ``ScheduleDeadlock`` names the rank and the action that
can never run, and why, for every stuck rank. The rounds of a non-blocking run are the steps
of the ``step x rank`` grid (one step per compute action, communication takes none).

Run the tests: ``.venv/bin/python -m pytest tests/unit/test_pipeline_validate.py -q``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mpipar.pipeline.actions import (
    COMPUTE_KINDS,
    Action,
    Blocked,
    ScheduleDeadlock,
    ScheduleError,
    matching,
    parse_action,
    producer,
)

SEMANTICS = ("rendezvous", "eager", "nonblocking")


def stage_rank(stage: int, num_ranks: int) -> int:
    """The rank that runs ``stage``: stages are dealt round-robin, stage ``s`` on rank ``s mod ranks``."""
    return stage % num_ranks


def expected_peer(kind: str, stage: int, num_ranks: int) -> int:
    """The peer rank of a send/receive of ``stage``."""
    other = stage + 1 if kind in ("SEND_F", "RECV_B") else stage - 1
    return stage_rank(other, num_ranks)


def normalize(
    actions: Sequence[Sequence[Action | str]], num_stages: int, num_microbatches: int
) -> tuple[tuple[Action, ...], ...]:
    """Parse tokens and fill in the peer of every send/receive; refuse a wrong explicit peer."""
    if isinstance(actions, str | bytes) or not isinstance(actions, Sequence):
        raise TypeError(f"schedule actions must be a list with one action list per rank, got {type(actions).__name__}")
    num_ranks = len(actions)
    if num_ranks == 0:
        raise ValueError("a schedule needs at least one rank; got an empty list of action lists")
    out: list[tuple[Action, ...]] = []
    for rank, row in enumerate(actions):
        if isinstance(row, str | bytes) or not isinstance(row, Sequence):
            raise TypeError(f"rank {rank}'s actions must be a list of actions or tokens, got {row!r}")
        fixed: list[Action] = []
        for index, item in enumerate(row):
            try:
                action = parse_action(item)
            except (TypeError, ValueError) as exc:
                raise ScheduleError(f"rank {rank} action #{index}: {exc}", rank=rank, index=index) from None
            _check_ranges(action, rank, index, num_ranks, num_stages, num_microbatches)
            if action.is_comm:
                peer = expected_peer(action.kind, action.stage, num_ranks)
                if action.peer is not None and action.peer != peer:
                    raise ScheduleError(
                        f"rank {rank} action #{index} {action}: its peer is rank {action.peer}, but stage "
                        f"{action.stage}'s {action.kind} partner stage runs on rank {peer}; drop the peer or set it to {peer}",
                        rank=rank,
                        index=index,
                        action=action,
                    )
                action = action.with_peer(peer)
            fixed.append(action)
        out.append(tuple(fixed))
    return tuple(out)


def _check_ranges(
    action: Action, rank: int, index: int, num_ranks: int, num_stages: int, num_microbatches: int
) -> None:
    where = f"rank {rank} action #{index} {action}"
    if action.stage >= num_stages:
        raise ScheduleError(
            f"{where}: stage {action.stage} is out of range, the schedule has stages 0..{num_stages - 1}",
            rank=rank,
            index=index,
            action=action,
        )
    if action.microbatch >= num_microbatches:
        raise ScheduleError(
            f"{where}: micro-batch {action.microbatch} is out of range, the schedule has micro-batches "
            f"0..{num_microbatches - 1}",
            rank=rank,
            index=index,
            action=action,
        )
    owner = stage_rank(action.stage, num_ranks)
    if owner != rank:
        raise ScheduleError(
            f"{where}: stage {action.stage} runs on rank {action.stage} mod {num_ranks} = {owner}, not rank {rank}; "
            f"move the action to rank {owner}'s list",
            rank=rank,
            index=index,
            action=action,
        )
    if action.is_comm:
        other = action.stage + 1 if action.kind in ("SEND_F", "RECV_B") else action.stage - 1
        if not 0 <= other < num_stages:
            side = "last" if other >= num_stages else "first"
            raise ScheduleError(
                f"{where}: stage {action.stage} is the {side} stage, it has no stage {other} to "
                f"{'send to' if action.is_send else 'receive from'}; remove the action",
                rank=rank,
                index=index,
                action=action,
            )
        if stage_rank(other, num_ranks) == rank:
            raise ScheduleError(
                f"{where}: stages {action.stage} and {other} both run on rank {rank}, so nothing crosses ranks; "
                "remove the action",
                rank=rank,
                index=index,
                action=action,
            )


def check_structure(
    actions: tuple[tuple[Action, ...], ...],
    num_stages: int,
    num_microbatches: int,
    split_backward: bool,
    *,
    with_comm: bool = True,
) -> None:
    """Refuse duplicated or missing actions (``with_comm=False``: compute-only lists)."""
    num_ranks = len(actions)
    where_is: list[dict[tuple[str, int, int], int]] = []
    for rank, row in enumerate(actions):
        seen: dict[tuple[str, int, int], int] = {}
        for index, action in enumerate(row):
            if action.kind == "W" and not split_backward:
                raise ScheduleError(
                    f"rank {rank} action #{index} {action}: a weight-gradient action in a schedule that does not "
                    "split backward; use a zero-bubble kind (ZBH1) or drop the W actions",
                    rank=rank,
                    index=index,
                    action=action,
                )
            if action.is_comm and not with_comm:
                raise ScheduleError(
                    f"rank {rank} action #{index} {action}: compute orders hold only F, B and W actions; "
                    "communication is inserted for you",
                    rank=rank,
                    index=index,
                    action=action,
                )
            if action.key in seen:
                raise ScheduleError(
                    f"rank {rank} action #{index} {action} repeats action #{seen[action.key]}; each action runs once",
                    rank=rank,
                    index=index,
                    action=action,
                )
            seen[action.key] = index
        where_is.append(seen)

    kinds = COMPUTE_KINDS if split_backward else ("F", "B")
    for stage in range(num_stages):
        rank = stage_rank(stage, num_ranks)
        for mb in range(num_microbatches):
            for kind in kinds:
                if (kind, stage, mb) not in where_is[rank]:
                    raise ScheduleError(
                        f"stage {stage} micro-batch {mb} has no {kind} action; add '{stage}{kind}{mb}' to "
                        f"rank {rank}'s list",
                        rank=rank,
                        action=Action(kind, stage, mb),
                    )
    if not with_comm:
        return
    for stage in range(num_stages - 1):
        src, dst = stage_rank(stage, num_ranks), stage_rank(stage + 1, num_ranks)
        if src == dst:
            continue
        for mb in range(num_microbatches):
            # (rank that must hold it, the action, the action that needs it on that rank)
            needs = (
                (
                    dst,
                    Action("RECV_F", stage + 1, mb),
                    Action("F", stage + 1, mb),
                    f"stage {stage}'s output from rank {src}",
                ),
                (
                    src,
                    Action("SEND_F", stage, mb),
                    Action("F", stage, mb),
                    f"rank {dst}'s receive {stage + 1}RECV_F{mb}",
                ),
                (
                    src,
                    Action("RECV_B", stage, mb),
                    Action("B", stage, mb),
                    f"stage {stage + 1}'s gradient from rank {dst}",
                ),
                (
                    dst,
                    Action("SEND_B", stage + 1, mb),
                    Action("B", stage + 1, mb),
                    f"rank {src}'s receive {stage}RECV_B{mb}",
                ),
            )
            for rank, action, user, why in needs:
                if action.key not in where_is[rank]:
                    verb = "receive" if action.is_recv else "send"
                    raise ScheduleError(
                        f"rank {rank} has no {action}: its {user} (action #{where_is[rank][user.key]}) "
                        f"{'needs' if action.is_recv else 'must feed'} {why}; add the {verb} "
                        f"{'before' if action.is_recv else 'after'} {user}",
                        rank=rank,
                        index=where_is[rank][user.key],
                        action=user,
                    )


@dataclass(frozen=True)
class DryRun:
    """The lockstep execution a dry run found: the step of every action, and the global order."""

    steps: tuple[tuple[int, ...], ...]
    """``steps[rank][index]``: the round in which that action ran."""
    order: tuple[tuple[int, int], ...]
    """Every action as (rank, index), in one valid sequential execution order."""
    num_steps: int
    semantics: str


def dry_run(
    actions: tuple[tuple[Action, ...], ...],
    num_stages: int,
    split_backward: bool,
    semantics: str = "rendezvous",
) -> DryRun:
    """Execute all lists without computing; raise ``ScheduleDeadlock`` if some action can never run."""
    if semantics not in SEMANTICS:
        raise ValueError(f"dry-run semantics {semantics!r} is unknown; use one of {', '.join(SEMANTICS)}")
    num_ranks = len(actions)
    pos = [0] * num_ranks
    steps = [[-1] * len(row) for row in actions]
    compute_round: dict[tuple[str, int, int], int] = {}
    comm_done: set[tuple[str, int, int]] = set()
    order: list[tuple[int, int]] = []
    remaining = sum(len(row) for row in actions)

    def head(rank: int) -> Action | None:
        return actions[rank][pos[rank]] if pos[rank] < len(actions[rank]) else None

    def run(rank: int, step: int) -> None:
        nonlocal remaining
        action = actions[rank][pos[rank]]
        steps[rank][pos[rank]] = step
        order.append((rank, pos[rank]))
        if action.is_comm:
            comm_done.add(action.key)
        else:
            compute_round[action.key] = step
        pos[rank] += 1
        remaining -= 1

    def inputs_ready(rank: int, action: Action, step: int) -> bool:
        for dep in local_inputs(action, num_stages, num_ranks, split_backward):
            if dep.is_comm:  # a receive: both halves of the transfer must have run
                if dep.key not in comm_done or matching(dep).key not in comm_done:
                    return False
            elif compute_round.get(dep.key, step) >= step:
                return False
        return True

    step = 0
    while remaining:
        before = remaining
        changed = True
        while changed:  # communication phase: zero time, repeat until nothing more completes
            changed = False
            for rank in range(num_ranks):
                while (action := head(rank)) is not None and action.is_comm:
                    partner = matching(action)
                    peer = action.peer
                    assert peer is not None
                    send = action if action.is_send else partner
                    if action.is_send and producer(send).key not in compute_round:
                        break
                    if semantics == "nonblocking" or (semantics == "eager" and action.is_send):
                        run(rank, step)
                    elif semantics == "eager":
                        if partner.key not in comm_done:
                            break
                        run(rank, step)
                    else:
                        other = head(peer)
                        if other is None or other.key != partner.key or producer(send).key not in compute_round:
                            break
                        sender, receiver = (rank, peer) if action.is_send else (peer, rank)
                        run(sender, step)
                        run(receiver, step)
                    changed = True
        for rank in range(num_ranks):  # compute phase: at most one action per rank
            action = head(rank)
            if action is not None and action.is_compute and inputs_ready(rank, action, step):
                run(rank, step)
        if remaining == before:
            _raise_deadlock(actions, pos, compute_round, comm_done, num_stages, split_backward, semantics)
        step += 1
    return DryRun(steps=tuple(tuple(row) for row in steps), order=tuple(order), num_steps=step, semantics=semantics)


def local_inputs(action: Action, num_stages: int, num_ranks: int, split_backward: bool) -> list[Action]:
    """What a compute action waits for on its own rank: local compute results or receives."""
    s, m, rank = action.stage, action.microbatch, stage_rank(action.stage, num_ranks)
    out: list[Action] = []
    if action.kind == "F" and s > 0:
        out.append(Action("F", s - 1, m) if stage_rank(s - 1, num_ranks) == rank else Action("RECV_F", s, m))
    elif action.kind == "B":
        out.append(Action("F", s, m))
        if s < num_stages - 1:
            out.append(Action("B", s + 1, m) if stage_rank(s + 1, num_ranks) == rank else Action("RECV_B", s, m))
    elif action.kind == "W":
        out.append(Action("B", s, m))
    return out


def _raise_deadlock(
    actions: tuple[tuple[Action, ...], ...],
    pos: list[int],
    compute_round: dict[tuple[str, int, int], int],
    comm_done: set[tuple[str, int, int]],
    num_stages: int,
    split_backward: bool,
    semantics: str,
) -> None:
    num_ranks = len(actions)
    index_of = [{a.key: i for i, a in enumerate(row)} for row in actions]

    def where(rank: int) -> str:
        if pos[rank] >= len(actions[rank]):
            return f"rank {rank} has finished its list"
        return f"rank {rank} is blocked at #{pos[rank]} {actions[rank][pos[rank]]}"

    blocked: list[tuple[bool, Blocked]] = []
    for rank in range(num_ranks):
        if pos[rank] >= len(actions[rank]):
            continue
        action = actions[rank][pos[rank]]
        local_cause = False
        if action.is_compute:
            reason = "its inputs never arrive"
            for dep in local_inputs(action, num_stages, num_ranks, split_backward):
                done = dep.key in comm_done if dep.is_comm else dep.key in compute_round
                if not done:
                    reason = f"it needs {dep}, which comes later in rank {rank}'s own list (#{index_of[rank][dep.key]})"
                    local_cause = True
                    break
                if dep.is_comm and matching(dep).key not in comm_done:
                    peer = expected_peer(dep.kind, dep.stage, num_ranks)
                    send = matching(dep)
                    reason = (
                        f"its input arrives by {dep}, but rank {peer} never posts {send} "
                        f"(#{index_of[peer][send.key]}): {where(peer)}"
                    )
                    break
        else:
            partner = matching(action)
            peer = action.peer
            assert peer is not None
            send = action if action.is_send else partner
            if action.is_send and producer(send).key not in compute_round:
                reason = (
                    f"it sends the result of {producer(send)}, which comes later in rank {rank}'s own list "
                    f"(#{index_of[rank][producer(send).key]})"
                )
                local_cause = True
            elif action.is_send:
                reason = (
                    f"it waits for rank {peer} to reach {partner} (#{index_of[peer][partner.key]}), but {where(peer)}"
                )
            else:
                reason = (
                    f"it waits for rank {peer} to {'reach' if semantics == 'rendezvous' else 'run'} {partner} "
                    f"(#{index_of[peer][partner.key]}), but {where(peer)}"
                )
        blocked.append((local_cause, Blocked(rank, pos[rank], action, reason)))
    # A rank whose own list is out of order is the root cause; name it first.
    ordered = [b for _, b in sorted(blocked, key=lambda item: (not item[0], item[1].rank))]
    first = ordered[0]
    lines = "\n".join(f"  {b}" for b in ordered)
    raise ScheduleDeadlock(
        f"schedule deadlocks ({semantics} send/recv): rank {first.rank} action #{first.index} {first.action} "
        f"can never run: {first.reason}\n{lines}\n"
        "fix: reorder the lists so every send meets its receive and every input is produced first, or build "
        "the lists with mpipar.pipeline.build_schedule / Schedule.from_compute_orders, which place "
        "communication in a deadlock-free order",
        ordered,
    )
