"""The dry-run validator: hand-broken schedules are refused, naming the rank and the action.

.venv/bin/python -m pytest tests/unit/test_pipeline_validate.py -q
"""

from __future__ import annotations

import pytest

from mpipar.pipeline import Action, Schedule, ScheduleDeadlock, ScheduleError, build_schedule, validate

# 2 stages, 2 micro-batches, written out by hand: each rank's sends follow its computes.
GOOD = [
    ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
    ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"],
]


def test_hand_written_schedule_passes_every_semantics() -> None:
    schedule = Schedule(GOOD, num_stages=2, num_microbatches=2)
    for semantics in ("rendezvous", "eager", "nonblocking"):
        run = schedule.validate(semantics)
        assert sorted(run.order) == sorted((r, i) for r in range(2) for i in range(8))
    assert schedule.actions == build_schedule("1F1B", 2, 2).actions  # the builder writes the same lists


def test_send_send_cycle_deadlocks_only_with_rendezvous() -> None:
    """Both ranks send before they receive: fine with buffered sends, a deadlock with blocking ones."""
    lists = [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
    ]
    schedule = Schedule(lists, num_stages=2, num_microbatches=2)
    schedule.validate("eager")
    schedule.validate("nonblocking")
    with pytest.raises(ScheduleDeadlock) as info:
        validate(schedule)  # rendezvous is the default
    exc = info.value
    assert (exc.rank, exc.index, str(exc.action)) == (0, 3, "0SEND_F1")
    assert "rank 0 action #3 0SEND_F1 can never run: it waits for rank 1 to reach 1RECV_F1 (#4)" in str(exc)
    assert "rank 1 is blocked at #3 1SEND_B0" in str(exc)
    assert [(b.rank, str(b.action)) for b in exc.blocked] == [(0, "0SEND_F1"), (1, "1SEND_B0")]


def test_receive_posted_too_early_deadlocks_blocking_but_not_nonblocking() -> None:
    lists = [["0RECV_B0", "0F0", "0SEND_F0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    schedule = Schedule(lists, num_stages=2, num_microbatches=1)
    schedule.validate("nonblocking")  # irecv posted early is harmless
    for semantics in ("rendezvous", "eager"):
        with pytest.raises(ScheduleDeadlock) as info:
            schedule.validate(semantics)
        assert (info.value.rank, str(info.value.action)) == (0, "0RECV_B0")
        assert "rank 1 is blocked at #0 1RECV_F0" in str(info.value)


def test_local_order_error_is_named_first() -> None:
    """Rank 1 runs its backward before its forward; rank 0 is stuck only because of that."""
    lists = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1B0", "1F0", "1SEND_B0"]]
    schedule = Schedule(lists, num_stages=2, num_microbatches=1)
    for semantics in ("rendezvous", "eager", "nonblocking"):
        with pytest.raises(ScheduleDeadlock) as info:
            schedule.validate(semantics)
        assert (info.value.rank, info.value.index, str(info.value.action)) == (1, 1, "1B0")
        assert "it needs 1F0, which comes later in rank 1's own list (#2)" in str(info.value)


def test_send_before_its_producer() -> None:
    lists = [["0SEND_F0", "0F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    with pytest.raises(
        ScheduleDeadlock, match=r"sends the result of 0F0, which comes later in rank 0's own list \(#1\)"
    ):
        Schedule(lists, 2, 1).validate("nonblocking")


def test_deadlock_in_built_schedule_after_hand_edit() -> None:
    """Take a real 1F1B schedule and move one receive after its consumer."""
    rows = build_schedule("1F1B", 4, 4).to_strings()
    row = rows[2]
    i = row.index("2RECV_F1")
    j = row.index("2F1")
    row.insert(j, row.pop(i))  # now 2F1 comes before 2RECV_F1
    with pytest.raises(ScheduleDeadlock) as info:
        Schedule(rows, 4, 4).validate()
    assert (info.value.rank, str(info.value.action)) == (2, "2F1")
    assert "it needs 2RECV_F1, which comes later in rank 2's own list" in str(info.value)


# ---------------------------------------------------------------------- structural errors
@pytest.mark.parametrize(
    ("lists", "stages", "mbs", "where", "message"),
    [
        ([["0F0", "0B0"], ["0F0"]], 2, 1, (1, 0, "0F0"), "stage 0 runs on rank 0 mod 2 = 0, not rank 1"),
        ([["0F0", "0B0", "0F0"], ["1F0", "1B0"]], 2, 1, (0, 2, "0F0"), "repeats action #0"),
        ([["0F0", "0B0"], ["1F0", "1B7"]], 2, 1, (1, 1, "1B7"), "micro-batch 7 is out of range"),
        ([["0F0", "2B0"], ["1F0"]], 2, 1, (0, 1, "2B0"), "stage 2 is out of range"),
        ([["0F0", "0B0", "0W0"], ["1F0", "1B0"]], 2, 1, (0, 2, "0W0"), "does not split backward"),
        ([["0F0", "0SEND_B0", "0B0"], ["1F0", "1B0"]], 2, 1, (0, 1, "0SEND_B0"), "it has no stage -1 to send to"),
        ([["0F0", "0SEND_F0", "1F0", "1B0", "0B0"]], 2, 1, (0, 1, "0SEND_F0"), "both run on rank 0"),
        ([["0F0", "0B0", "0xB0"]], 1, 1, (0, 2, None), "cannot parse pipeline action '0xB0'"),
    ],
)
def test_structure_errors_name_rank_and_action(
    lists: list[list[str]], stages: int, mbs: int, where: tuple[int, int, str | None], message: str
) -> None:
    with pytest.raises(ScheduleError) as info:
        Schedule(lists, stages, mbs, split_backward=False)
    exc = info.value
    rank, index, token = where
    assert exc.rank == rank and exc.index == index
    assert (str(exc.action) if exc.action else None) == token
    assert f"rank {rank} action #{index}" in str(exc)
    assert message in str(exc)


def test_missing_receive_names_the_rank_and_consumer() -> None:
    lists = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1F0", "1B0", "1SEND_B0"]]
    with pytest.raises(ScheduleError) as info:
        Schedule(lists, 2, 1)
    assert (info.value.rank, str(info.value.action)) == (1, "1F0")
    assert "rank 1 has no 1RECV_F0: its 1F0 (action #0) needs stage 0's output from rank 0" in str(info.value)


def test_missing_send_and_missing_compute() -> None:
    with pytest.raises(ScheduleError, match=r"rank 0 has no 0SEND_F0: its 0F0 .* must feed rank 1's receive 1RECV_F0"):
        Schedule([["0F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]], 2, 1)
    with pytest.raises(ScheduleError, match="stage 1 micro-batch 1 has no B action; add '1B1' to rank 1's list"):
        Schedule.from_compute_orders([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1B0", "1F1"]], 2, 2)


def test_wrong_peer_is_refused() -> None:
    lists = [[Action("F", 0, 0), Action("SEND_F", 0, 0, peer=2), "0RECV_B0", "0B0"], [*GOOD[1][:2], "1B0", "1SEND_B0"]]
    with pytest.raises(ScheduleError, match="its peer is rank 2, but stage 0's SEND_F partner stage runs on rank 1"):
        Schedule(lists, 2, 1)


def test_weight_actions_require_split_backward() -> None:
    with pytest.raises(ScheduleError, match="weight-gradient action in a schedule that does not split backward"):
        Schedule([["0F0", "0B0", "0W0"]], 1, 1, split_backward=False)
    with pytest.raises(ScheduleError, match="stage 0 micro-batch 0 has no W action"):
        Schedule([["0F0", "0B0"]], 1, 1, split_backward=True)


def test_compute_order_deadlock_from_compute_orders() -> None:
    with pytest.raises(ScheduleDeadlock) as info:
        Schedule.from_compute_orders([["0F0", "0B0"], ["1B0", "1F0"]], 2, 1)
    assert (info.value.rank, str(info.value.action)) == (1, "1B0")
    assert "it needs 1F0, which comes later in its own list (#1)" in str(info.value)
    with pytest.raises(ScheduleError, match="compute orders hold only F, B and W actions"):
        Schedule.from_compute_orders([["0F0", "0SEND_F0", "0B0"], ["1F0", "1B0"]], 2, 1)


def test_bad_containers_and_counts() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        Schedule([], 1, 1)
    with pytest.raises(TypeError, match="one action list per rank"):
        Schedule("0F0", 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_stages must be a multiple of the number of ranks"):
        Schedule([["0F0", "0B0", "2F0", "2B0"], ["1F0", "1B0"]], 3, 1)
    with pytest.raises(ValueError, match="dry-run semantics 'lazy' is unknown"):
        build_schedule("1F1B", 2, 2).validate("lazy")


def test_from_dict_and_csv_refuse_bad_fields() -> None:
    data = build_schedule("1F1B", 2, 2).to_dict()
    with pytest.raises(ValueError, match="schedule field 'num_ranks' is 3 but the action lists give 2"):
        Schedule.from_dict({**data, "num_ranks": 3})
    with pytest.raises(ValueError, match="schedule field 'actions' is missing"):
        Schedule.from_dict({k: v for k, v in data.items() if k != "actions"})
    with pytest.raises(ValueError, match="schedule CSV line 3: cannot parse pipeline action '0Q1'"):
        Schedule.from_csv("rank,index,action\n0,0,0F0\n0,1,0Q1\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['index'\]"):
        Schedule.from_csv("rank,action\n0,0F0\n")


def test_nonblocking_deadlock_names_the_missing_send() -> None:
    """Rank 0 posts its activation send only after a backward that needs rank 1 to have run."""
    lists = [["0F0", "0RECV_B0", "0B0", "0SEND_F0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    with pytest.raises(ScheduleDeadlock) as info:
        Schedule(lists, 2, 1).validate("nonblocking")
    assert (info.value.rank, info.value.index, str(info.value.action)) == (0, 2, "0B0")
    assert (
        "rank 1 is blocked at action #1 1F0: its input arrives by 1RECV_F0, but rank 0 never posts 0SEND_F0 (#3)"
        in str(info.value)
    )
