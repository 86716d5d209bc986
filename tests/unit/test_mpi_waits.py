"""MPICH's waits sleep instead of spin where a host runs more ranks than it has cores."""

from __future__ import annotations

from mpipar.runtime import waits


def test_oversubscribed_host_gets_sleeping_waits() -> None:
    env = {"MPI_LOCALNRANKS": "4"}
    assert waits.prefer_sleeping_waits(env, cores=2)
    assert env[waits.HEAVY_YIELD] == "1"


def test_a_core_per_rank_keeps_polling() -> None:
    env = {"MPI_LOCALNRANKS": "2"}
    assert not waits.prefer_sleeping_waits(env, cores=2)
    assert waits.HEAVY_YIELD not in env


def test_an_explicit_setting_is_the_opt_out() -> None:
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "8", waits.HEAVY_YIELD: "0"}
    assert not waits.prefer_sleeping_waits(env, cores=2)
    assert env[waits.HEAVY_YIELD] == "0"


def test_no_launcher_no_change() -> None:
    env: dict[str, str] = {"MPI_LOCALNRANKS": "many"}
    assert not waits.prefer_sleeping_waits(env, cores=1)
    assert waits.HEAVY_YIELD not in env


def _bound(env: dict[str, str], allowed: set[int]) -> tuple[int | None, list[set[int]]]:
    calls: list[set[int]] = []
    return waits.bind_to_one_core(env, allowed=allowed, bind=calls.append), calls


def test_oversubscribed_ranks_each_keep_one_core() -> None:
    """Four ranks on two cores: local rank i on the (i % 2)-th core, as ``-bind-to core``."""
    for me, core in ((0, 4), (1, 6), (2, 4), (3, 6)):
        got, calls = _bound({"MPI_LOCALNRANKS": "4", "MPI_LOCALRANKID": str(me)}, {6, 4})
        assert (got, calls) == (core, [{core}])
    got, calls = _bound({"OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, {0, 1})
    assert (got, calls) == (0, [{0}])


def test_binding_only_where_ranks_outnumber_cores_and_nobody_bound_them() -> None:
    cases = [
        {"MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1"},  # a core per rank
        {"MPI_LOCALNRANKS": "4"},  # no local rank named
        {"MPI_LOCALRANKID": "1"},  # no rank count
        {"MPI_LOCALNRANKS": "4", "MPI_LOCALRANKID": "1", "MPIPAR_BIND_CORES": "0"},  # the opt-out
    ]
    for env in cases:
        assert _bound(env, {0, 1}) == (None, []), env
    # the launcher bound the rank to one core already
    assert _bound({"MPI_LOCALNRANKS": "4", "MPI_LOCALRANKID": "1"}, {1}) == (None, [])


def test_a_refused_binding_leaves_the_rank_where_it_is() -> None:
    def refuse(cores: set[int]) -> None:
        raise PermissionError("not in this container")

    env = {"MPI_LOCALNRANKS": "4", "MPI_LOCALRANKID": "1"}
    assert waits.bind_to_one_core(env, allowed={0, 1}, bind=refuse) is None


def test_a_bad_opt_out_value_is_named() -> None:
    env = {"MPI_LOCALNRANKS": "4", "MPI_LOCALRANKID": "1", "MPIPAR_BIND_CORES": "sometimes"}
    try:
        waits.bind_to_one_core(env, allowed={0, 1}, bind=lambda cores: None)
    except ValueError as exc:
        assert "MPIPAR_BIND_CORES" in str(exc) and "sometimes" in str(exc)
    else:
        raise AssertionError("a value that is no flag was accepted")
