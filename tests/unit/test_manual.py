"""Manual mode in the simulator: Paddle's collectives on per-rank tensors, one thread per rank.

Every collective against NumPy (``tests/mpi_scripts/manual_cases.py``, the same script the
MPI tests run), generated cases with uneven sizes, the mismatch and deadlock reports (each
within 15 s, never a hang), visibility in ``CommDebugMode``, distributed tensors mixed in,
the differentiable pair, and each rank's own NumPy and Python generators (the fleet examples, seed
003's programs as written, are in test_seed_examples.py).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

import numpy as np
import pytest
from conftest import REPO
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_scripts.manual_cases import run_cases
from processes import environ, run_python

import mpipar as dist
from mpipar.compat.collective import ManualCallError, c_identity, mp_allreduce
from simulator.launch import uses_manual_api
from simulator.per_rank import ManualModeError, PerRankBackend


def per_rank(n: int, program: Callable[[int], object]) -> dict[int, object]:
    """Run ``program(rank)`` as the program of each of ``n`` virtual ranks; their results."""
    backend = PerRankBackend(n)
    results: dict[int, object] = {}
    with dist.use_backend(backend):
        backend.world.run(lambda: results.__setitem__(dist.get_rank(), program(dist.get_rank())))
    return results


def launch(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    env = environ(drop_prefix="MPIPAR_")
    start = time.monotonic()
    out = run_python(*args, env=env, timeout=timeout)
    return out, time.monotonic() - start


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_every_collective_against_numpy(n: int) -> None:
    results = per_rank(n, lambda rank: run_cases())
    assert results == {r: 171 for r in range(n)}


@settings(max_examples=25)
@given(
    n=st.integers(2, 5),
    dtype=st.sampled_from(["float16", "float32", "float64", "int32", "int64"]),
    op=st.sampled_from(["sum", "max", "min", "prod"]),
    lengths=st.lists(st.integers(0, 6), min_size=5, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_generated_reductions_and_exchanges(n: int, dtype: str, op: str, lengths: list[int], seed: int) -> None:
    """all_reduce, reduce_scatter with uneven pieces and alltoall with uneven pieces, vs NumPy."""

    def value(rank: int, salt: int, size: int) -> np.ndarray:
        return np.random.default_rng([seed, rank, salt]).integers(-3, 4, size).astype(dtype)

    f = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]

    def fold(arrays: list[np.ndarray]) -> np.ndarray:
        out = arrays[0]
        for a in arrays[1:]:
            out = f(out, a)
        return out

    def program(me: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        t = dist.to_tensor(value(me, 0, lengths[0]))
        dist.all_reduce(t, op=op)
        out = dist.to_tensor(np.zeros(lengths[me], dtype))
        dist.reduce_scatter(out, [dist.to_tensor(value(me, 1 + i, lengths[i])) for i in range(n)], op=op)
        received = [np.zeros(lengths[(r + me) % 5], dtype) for r in range(n)]
        dist.alltoall([value(me, 10 + j, lengths[(me + j) % 5]) for j in range(n)], received)
        return t.numpy(), out.numpy(), received

    results = per_rank(n, program)
    for me in range(n):
        reduced, scattered, received = results[me]  # type: ignore[misc]
        np.testing.assert_array_equal(reduced, fold([value(r, 0, lengths[0]) for r in range(n)]))
        np.testing.assert_array_equal(scattered, fold([value(r, 1 + me, lengths[me]) for r in range(n)]))
        for r in range(n):
            np.testing.assert_array_equal(received[r], value(r, 10 + me, lengths[(r + me) % 5]))
        assert scattered.dtype == np.dtype(dtype)


def test_mismatched_collectives_name_ranks_calls_and_group() -> None:
    def program(me: int) -> None:
        t = dist.to_tensor(np.ones(4, "float32"))
        dist.all_reduce(t)  # call 1 matches
        if me == 2:
            dist.all_gather([], t)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)

    with pytest.raises(ManualModeError) as err:
        per_rank(3, program)
    msg = str(err.value)
    assert "collective mismatch on group [0, 1, 2] (call #2 on that group)" in msg
    # rank 2 completed call 1 and runs on (turns pass only when a rank blocks), so it arrives first
    assert "rank 2 calls all_gather float32[4], rank 0 calls all_reduce(max) float32[4]" in msg


def test_different_shapes_in_one_collective_are_a_mismatch() -> None:
    def program(me: int) -> None:
        dist.broadcast(dist.to_tensor(np.ones(3 + me)), src=0)

    with pytest.raises(
        ManualModeError, match=r"rank 0 calls broadcast float64\[3\] from rank 0, rank 1 calls broadcast float64\[4\]"
    ):
        per_rank(2, program)


def test_a_recv_never_matched_is_a_deadlock_report() -> None:
    def program(me: int) -> None:
        t = dist.to_tensor(np.ones(4, "float32"))
        if me == 0:
            dist.recv(t, src=1)
        group = dist.new_group([0, 1, 2])
        dist.all_reduce(t, group=group)

    with pytest.raises(ManualModeError) as err:
        per_rank(4, program)
    msg = str(err.value)
    assert msg.startswith("deadlock in the per-rank programs")
    assert "rank 0: recv float32[4] from rank 1: rank 1 never sends it" in msg
    assert (
        "rank 1: all_reduce(sum) float32[4] on group [0, 1, 2] (call #1 on that group), waiting for rank(s) [0]" in msg
    )
    assert "rank 3: finished" in msg


def test_collectives_on_different_groups_deadlock_with_both_groups_named() -> None:
    def program(me: int) -> None:
        t = dist.to_tensor(np.ones(2))
        first, second = dist.new_group([0, 1]), dist.new_group([1, 0, 2])
        dist.all_reduce(t, group=first if me == 0 else second)

    with pytest.raises(ManualModeError) as err:
        per_rank(3, program)
    msg = str(err.value)
    assert "rank 0: all_reduce(sum) float64[2] on group [0, 1] (call #1 on that group), waiting for rank(s) [1]" in msg
    assert (
        "rank 1: all_reduce(sum) float64[2] on group [1, 0, 2] (call #1 on that group), waiting for rank(s) [0]" in msg
    )


def test_a_message_never_received_and_a_wrong_recv_buffer_are_errors() -> None:
    with pytest.raises(ManualModeError, match="messages sent but never received: rank 0 -> rank 1"):
        per_rank(2, lambda me: dist.send(dist.to_tensor(np.ones(2)), dst=1) if me == 0 else None)

    def wrong(me: int) -> None:
        if me == 0:
            dist.send(dist.to_tensor(np.ones(2)), dst=1)
        else:
            dist.recv(dist.to_tensor(np.ones(3)), src=0)

    with pytest.raises(
        ManualModeError, match=r"rank 1 expects float64\[3\] from rank 0 \(tag 0\) but got float64\[2\]"
    ):
        per_rank(2, wrong)


def test_a_failing_rank_ends_the_run_with_its_error() -> None:
    def program(me: int) -> None:
        if me == 1:
            raise KeyError("boom on rank 1")
        dist.barrier()

    with pytest.raises(KeyError, match="boom on rank 1") as err:
        per_rank(3, program)
    assert "(raised in the program of rank 1)" in err.value.__notes__


def test_bad_arguments_are_clear_errors() -> None:
    def program(me: int) -> None:
        t = dist.to_tensor(np.ones(2))
        with pytest.raises(ManualCallError, match="op='mean' is not a reduce op"):
            dist.all_reduce(t, op="mean")
        with pytest.raises(ManualCallError, match=r"broadcast: src=5 is not a member of the group \[0, 1\]"):
            dist.broadcast(t, src=5)
        with pytest.raises(ManualCallError, match=r"new_group.*rank 7 is outside the world of 2 ranks"):
            dist.new_group([0, 7])
        with pytest.raises(ManualCallError, match="names itself as dst"):
            dist.send(t, dst=me)
        with pytest.raises(ManualCallError, match="the list has 3 tensors but the group has 2 members"):
            dist.reduce_scatter(t, [t, t, t])
        with pytest.raises(TypeError, match=r"must be a dist\.Tensor or a NumPy array, got list"):
            dist.all_reduce([1.0, 2.0])
        mesh = dist.ProcessMesh([0, 1])
        d = dist.shard_tensor(np.ones((2, 2)), mesh, [dist.Shard(0)])
        with pytest.raises(TypeError, match=r"pass dist_tensor.local_tensor\(\)"):
            dist.all_reduce(d)

    per_rank(2, program)


def test_one_program_hosting_every_rank_refuses_manual_collectives() -> None:
    # The plain simulator's world grows to 4 ranks where the mesh is first used (a mesh is a pure value).
    dist.shard_tensor(np.zeros(4), dist.ProcessMesh([0, 1, 2, 3]), [dist.Shard(0)])
    with pytest.raises(ManualCallError, match=r"run the script with `python -m simulator -n 4 script.py`"):
        dist.all_reduce(dist.to_tensor(np.ones(2)))


def test_a_world_of_one_is_one_device() -> None:
    t = dist.to_tensor(np.arange(3.0))
    dist.all_reduce(t, op=dist.ReduceOp.PROD)
    got: list[dist.Tensor] = []
    dist.all_gather(got, t)
    np.testing.assert_array_equal(t.numpy(), np.arange(3.0))
    assert len(got) == 1 and np.array_equal(got[0].numpy(), np.arange(3.0))


def test_non_members_are_untouched_and_groups_have_paddle_fields() -> None:
    def program(me: int) -> tuple[float, int, int]:
        group = dist.new_group([2, 0])
        t = dist.to_tensor(np.array([float(me + 1)]))
        dist.all_reduce(t, group=group)
        return float(t.numpy()[0]), group.rank, group.nranks

    assert per_rank(3, program) == {0: (4.0, 1, 2), 1: (2.0, -1, 2), 2: (4.0, 0, 2)}
    ids = per_rank(3, lambda me: (dist.new_group([0, 1]).id, dist.new_group([1, 2]).id, dist.new_group([0, 1]).id))
    assert len(set(ids.values())) == 1  # the same ids on every rank
    first, second, again = ids[0]  # type: ignore[misc]
    assert first == again != second


def test_comm_debug_mode_sees_each_manual_collective_once() -> None:
    def program(me: int) -> dict[str, int]:
        with dist.CommDebugMode() as comm:
            t = dist.to_tensor(np.ones(5, "float32"))
            dist.all_reduce(t)
            dist.all_gather([], t)
            if me == 0:
                dist.send(t, dst=1)
            elif me == 1:
                dist.recv(t, src=0)
            dist.barrier()
        return comm.counts()

    counts = per_rank(2, program)
    # each rank's CommDebugMode sees the whole world's calls once (one event per collective; a
    # message is one "send" event, as for a reshard's transfers; barriers carry no bytes)
    assert counts[0] == counts[1] == {"all_reduce": 1, "all_gather": 1, "send": 1}


def test_distributed_tensors_and_manual_collectives_mix() -> None:
    value = np.arange(12.0).reshape(4, 3)

    def program(me: int) -> np.ndarray:
        mesh = dist.ProcessMesh([0, 1])
        d = dist.shard_tensor(value, mesh, [dist.Shard(0)])
        local = dist.to_tensor(d.local_tensor())  # this rank's rows
        dist.all_reduce(local)  # rows 0-1 + rows 2-3, by hand
        back = dist.dtensor_from_local(local.numpy() * (me + 1), mesh, [dist.Shard(0)])
        return back.full_tensor()

    results = per_rank(2, program)
    summed = value[:2] + value[2:]
    for r in range(2):
        np.testing.assert_array_equal(results[r], np.concatenate([summed, 2 * summed]))


def test_c_identity_and_mp_allreduce_backward_match_one_device() -> None:
    """A column/row split of y = relu(x @ w1) @ w2 gives one device's gradients."""
    rng = np.random.default_rng(0)
    x, w1, w2 = rng.standard_normal((3, 4)), rng.standard_normal((4, 5)), rng.standard_normal((5, 2))
    xs = dist.to_tensor(x, stop_gradient=False)
    w1s, w2s = dist.to_tensor(w1, stop_gradient=False), dist.to_tensor(w2, stop_gradient=False)
    dist.sum(dist.matmul(dist.nn.functional.relu(dist.matmul(xs, w1s)), w2s)).backward()
    cols = [np.arange(0, 3), np.arange(3, 5)]  # uneven split of the inner size

    def program(me: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        xi = dist.to_tensor(x, stop_gradient=False)
        a = dist.to_tensor(w1[:, cols[me]], stop_gradient=False)
        b = dist.to_tensor(w2[cols[me], :], stop_gradient=False)
        h = dist.nn.functional.relu(dist.matmul(c_identity(xi), a))
        dist.sum(mp_allreduce(dist.matmul(h, b))).backward()
        return xi.grad.numpy(), a.grad.numpy(), b.grad.numpy()

    results = per_rank(2, program)
    for me in range(2):
        gx, ga, gb = results[me]  # type: ignore[misc]
        np.testing.assert_allclose(gx, xs.grad.numpy(), rtol=1e-12)
        np.testing.assert_allclose(ga, w1s.grad.numpy()[:, cols[me]], rtol=1e-12)
        np.testing.assert_allclose(gb, w2s.grad.numpy()[cols[me], :], rtol=1e-12)


def test_the_launcher_detects_manual_scripts(tmp_path: object) -> None:
    examples = os.path.join(REPO, "examples")
    assert all(uses_manual_api(os.path.join(examples, f"paddle_manual/{k}.py")) for k in ("dp", "sharding", "mp", "pp"))
    assert not any(
        uses_manual_api(os.path.join(examples, f"paddle_auto/primer_{k}.py")) for k in ("dp", "sharding", "mp", "pp")
    )
    assert not uses_manual_api(os.path.join(examples, "gpt.py"))
    assert not uses_manual_api(os.path.join(REPO, "tests", "scripts", "reshard_tour.py"))


def test_cli_reports_a_mismatch_within_15_seconds() -> None:
    script = os.path.join(REPO, "tests", "scripts", "manual_mismatch.py")
    out, seconds = launch("-m", "simulator", "-n", "4", script, timeout=60)
    assert out.returncode == 1
    assert seconds < 15, seconds
    assert "python -m simulator: collective mismatch on group [0, 1, 2, 3] (call #1 on that group)" in out.stderr
    assert "rank 0 calls all_reduce(sum) float32[4], rank 1 calls all_gather float32[4]" in out.stderr


def test_cli_reports_a_deadlock_within_15_seconds() -> None:
    script = os.path.join(REPO, "tests", "scripts", "manual_mismatch.py")
    out, seconds = launch("-m", "simulator", "-n", "3", script, "--deadlock", timeout=60)
    assert out.returncode == 1
    assert seconds < 15, seconds
    assert "rank 0: recv float32[4] from rank 2: rank 2 never sends it" in out.stderr
    assert "rank 2: barrier on group [0, 1, 2] (call #1 on that group), waiting for rank(s) [0]" in out.stderr


def test_each_rank_has_its_own_numpy_and_python_generators() -> None:
    """As each process under mpiexec: a rank that seeds ``np.random`` (or ``random``) and draws
    from it between collectives gets its own stream, whatever the other ranks draw meanwhile."""
    import random

    def draws(me: int) -> list[float]:
        np.random.seed(7)
        random.seed(7)
        out = []
        for _ in range(3):
            out += [float(np.random.random()), random.random()]
            for _ in range(me):  # rank 1 draws more: it must not shift rank 0's stream
                np.random.random()
                random.random()
            dist.all_reduce(dist.to_tensor(np.ones(2, "float32")))  # the ranks take turns here
        return out

    np.random.seed(7)
    random.seed(7)
    want = []
    for _ in range(3):
        want += [float(np.random.random()), random.random()]
    np.random.seed(7)
    random.seed(7)
    skipping = [(float(np.random.random()), random.random()) for _ in range(6)][::2]  # rank 1's
    results = per_rank(2, draws)
    assert results[0] == want
    assert results[1] == [v for pair in skipping for v in pair]


def test_traced_plans_count_manual_collectives_like_reshards(tmp_path: object) -> None:
    from mpipar.compile.plan import Plan
    from mpipar.compile.trace import trace
    from viz.comm import comm_table

    def program(me: int) -> Plan:
        with trace() as rec:
            t = dist.to_tensor(np.ones(6, "float32"))
            dist.all_reduce(t)
            dist.all_gather([], t)
            out = dist.to_tensor(np.zeros(3, "float32"))
            dist.reduce_scatter(out, t)
            dist.broadcast(t, src=1)
            if me == 0:
                dist.send(t, dst=1)
            elif me == 1:
                dist.recv(t, src=0)
        return rec.plan()

    plans = per_rank(2, program)
    plan = plans[0]
    assert plan.comm_counts() == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1, "transfer": 2}
    assert [r.reason for r in plan.reshards] == [
        "manual all_reduce on group [0, 1]", "manual all_gather on group [0, 1]",
        "manual reduce_scatter on group [0, 1]", "manual broadcast from rank 1 on group [0, 1]",
        "manual send to rank 1 on group [0, 1]",
    ]  # fmt: skip
    assert plan.reshards[3].steps[0].pieces == ((1, 0, 24),)
    # each rank's recorder keeps its own program's calls, as each process's does under MPI
    assert plans[1].comm_counts() == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1, "transfer": 1}
    assert not plans[0].ops and not plans[1].ops  # no op ran inside the traces
    path = f"{tmp_path}/plan.json"
    plan.save(path)
    again = Plan.load(path)
    rows = {(row["collective"], row["axes"]): row["count"] for row in comm_table(again)}
    assert rows == {
        ("all_reduce", "group"): 1,
        ("all_gather", "group"): 1,
        ("reduce_scatter", "group"): 1,
        ("transfer", "group"): 2,
    }
