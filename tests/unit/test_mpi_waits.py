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
