"""``mpipar launch``'s parts, and a simulated launch: host lists, locality, command lines, restarts.

Host lists and hydra's placement, the rank-to-host map, mesh locality (``ProcessMesh.by_hosts``,
the tp-across-hosts warning), the two command lines (``mpipar launch``, Paddle's spelling), the
ranks' environment, the restart variables and ``resume_target``, stale-leftover cleanup, the
summary line; and one launch under ``--simulate`` (no mpiexec) whose repeated error stops the
restarts. The launches under mpiexec are in ``tests/mpi/test_mpi_launch.py``; the guide is
``docs/launching.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import REPO
from hypothesis import given
from hypothesis import strategies as st

from mpipar import ProcessMesh
from mpipar.checkpoint import restart_info, resume_target, save_state_dict
from mpipar.checkpoint.format import MARKER, MARKER_TEXT, CheckpointError
from mpipar.debug.timeline import Timeline
from mpipar.launch.attempt import DeathWatch, HeartbeatWatch, Outcome, _describe, main_stack
from mpipar.launch.options import parse, parse_paddle
from mpipar.launch.supervisor import _same_failure, clear_stale, command, is_this_machine, rank_env, summary
from mpipar.runtime.hosts import (
    decode_map,
    encode_map,
    format_map,
    host_mesh,
    parse_hosts,
    place_ranks,
    read_hostfile,
    spanning_groups,
    warn_if_spans_hosts,
)

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
FAULTS = os.path.join("tests", "scripts", "launch_faults.py")
GPT = os.path.join("examples", "gpt.py")
LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.M)


# ============================================================================ host lists
def test_host_lists_read_as_hydra_reads_them(tmp_path: Any) -> None:
    assert parse_hosts("node1:8,node2") == [("node1", 8), ("node2", 1)]
    assert parse_hosts("[::1]:2,127.0.0.1:3") == [("[::1]", 2), ("127.0.0.1", 3)]
    f = tmp_path / "hosts"
    f.write_text("# two aliases of this machine\n127.0.0.1:2\n\nlocalhost:2  # the second\n")
    assert read_hostfile(str(f)) == [("127.0.0.1", 2), ("localhost", 2)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "comma-separated list"),
        ("a:8,,b", "comma-separated list"),
        ("a:0", "has 0 slots"),
        ("a b:2", "is not a host name"),
        ("a:2:3", "is not a host name"),
        ("a;rm -rf /", "is not a host name"),
    ],
)
def test_bad_host_lists_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hosts(text)


def test_a_bad_host_file_names_its_line(tmp_path: Any) -> None:
    f = tmp_path / "hosts"
    f.write_text("a:2\nb c\n")
    with pytest.raises(ValueError, match=r"line 2: 'b c' is not a host name"):
        read_hostfile(str(f))
    f.write_text("# nothing\n")
    with pytest.raises(ValueError, match="names no host"):
        read_hostfile(str(f))
    with pytest.raises(ValueError, match="cannot read it"):
        read_hostfile(str(tmp_path / "missing"))


def test_placement_fills_hosts_in_order_and_wraps_like_hydra() -> None:
    assert place_ranks([("a", 2), ("b", 2)], 4) == ["a", "a", "b", "b"]
    assert place_ranks([("a", 2), ("b", 2)], 3) == ["a", "a", "b"]
    # more ranks than slots: hydra starts again at the first host (checked against hydra below)
    assert place_ranks([("a", 1), ("b", 2)], 5) == ["a", "b", "b", "a", "b"]


@given(st.lists(st.sampled_from(["a", "b", "node-3", "10.0.0.1"]), min_size=1, max_size=40))
def test_the_host_map_round_trips(hosts: list[str]) -> None:
    text = encode_map(hosts)
    assert decode_map(text, len(hosts)) == hosts
    assert sum(len(line.split("ranks ")[-1]) > 0 for line in format_map(hosts)) == len(set(hosts))


def test_a_host_map_that_does_not_fit_the_world_is_refused() -> None:
    assert encode_map(["a", "a", "b", "a"]) == "a*2,b,a"
    with pytest.raises(ValueError, match="names 3 ranks, but the world has 4"):
        decode_map("a*2,b", 4)
    with pytest.raises(ValueError, match="cannot read"):
        decode_map("a*x", None)
    assert format_map(["a", "a", "b", "a"]) == ["a: ranks 0-1,3", "b: rank 2"]


@given(
    st.sampled_from([(2, 2), (4, 2), (2, 4), (2, 2, 2)]),
    st.sampled_from(["block", "cyclic"]),
    st.booleans(),
)
def test_host_mesh_keeps_each_tp_group_on_one_host(shape: tuple[int, ...], placement: str, tp_first: bool) -> None:
    size = int(np.prod(shape))
    names = ["tp", "dp", "pp"][: len(shape)] if tp_first else ["dp", "pp", "tp"][-len(shape) :]
    tp = shape[names.index("tp")]
    hosts_n = size // tp
    hosts = [f"h{r // tp}" for r in range(size)] if placement == "block" else [f"h{r % hosts_n}" for r in range(size)]
    mesh = host_mesh(shape, names, hosts, inner=("tp",))
    assert sorted(mesh.process_ids) == list(range(size))
    assert list(mesh.shape) == list(shape)
    assert spanning_groups(mesh, "tp", hosts) == []
    naive = ProcessMesh(np.arange(size).reshape(shape), dim_names=names)
    if placement == "cyclic" and hosts_n > 1 and not tp_first:  # row-major with tp last splits tp there
        assert spanning_groups(naive, "tp", hosts)


def test_host_mesh_refuses_a_host_that_cannot_hold_whole_groups() -> None:
    with pytest.raises(ValueError, match=r"by_hosts: host 'a' holds 3 ranks, not a multiple of tp\(2\) = 2"):
        host_mesh([2, 2], ["dp", "tp"], ["a", "a", "a", "b"])
    with pytest.raises(ValueError, match="inner axes"):
        host_mesh([2, 2], ["dp", "x"], None)


def test_a_tp_group_across_hosts_warns_and_one_inside_a_host_does_not() -> None:
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    with pytest.warns(RuntimeWarning, match=r"along 'tp' span hosts, e.g. ranks \[0, 1\] on \['a', 'b'\]"):
        assert warn_if_spans_hosts(mesh, ["a", "b", "a", "b"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_spans_hosts(mesh, ["a", "a", "b", "b"])
        assert not warn_if_spans_hosts(mesh, None)


def test_timelines_name_each_ranks_host_and_ignore_a_malformed_map() -> None:
    timeline = Timeline([], ranks=[0, 1, 2], time_unit="s", meta={"hosts": {"0": "node1", "1": 7}})
    names = [e["args"]["name"] for e in timeline.to_chrome_trace()["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0 @ node1", "rank 1", "rank 2"]
    assert Timeline([], ranks=[0], time_unit="s", meta={"hosts": ["node1"]}).to_chrome_trace()


def test_loopback_aliases_are_this_machine() -> None:
    assert is_this_machine("127.0.0.1") and is_this_machine("localhost") and is_this_machine("[::1]")
    assert not is_this_machine("192.0.2.1")  # TEST-NET-1: documentation only, never this machine


# ============================================================================ command lines
def test_the_launch_command_line_and_the_script_arguments() -> None:
    opts = parse(["-n", "4", "--hosts", "a:2,b:2", "--max-restarts", "2", "--", "train.py", "--dry-run", "-n", "9"])
    assert (opts.nprocs, opts.script, opts.args) == (4, "train.py", ["--dry-run", "-n", "9"])
    assert not opts.dry_run and opts.max_restarts == 2 and opts.rank_hosts() == ["a", "a", "b", "b"]
    assert parse(["-n", "2", "train.py", "a", "--", "b"]).args == ["a", "--", "b"]  # the script's own "--"
    opts = parse(["-n", "2", "--dry-run", "train.py", "--steps", "3"])
    assert opts.dry_run and opts.args == ["--steps", "3"] and opts.rank_hosts() is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2", "--simulate", "--hosts", "a:2", "t.py"], "--hosts/--hostfile do not apply"),
        (["-n", "0", "t.py"], "out of range"),
        (["-n", "2", "--hosts", "a:2", "--hostfile", "f", "t.py"], "not allowed with"),
        (["-n", "2", "--hosts", "a:x", "t.py"], "is not a host name"),
    ],
)
def test_bad_launch_lines_are_refused(argv: list[str], message: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_paddle_flags_map_onto_the_launcher() -> None:
    opts = parse_paddle(["--gpus=0,1", "--log_dir", "logs", "train.py", "--lr", "0.1"])
    assert (opts.nprocs, opts.log_dir, opts.args, opts.env) == (
        2,
        "logs",
        ["--lr", "0.1"],
        {"CUDA_VISIBLE_DEVICES": "0,1"},
    )
    opts = parse_paddle(["--devices", "2,3", "--ips", "10.0.0.1,10.0.0.2", "--max_restart", "3", "t.py"])
    assert opts.nprocs == 4 and opts.max_restarts == 3 and opts.rank_hosts() == ["10.0.0.1"] * 2 + ["10.0.0.2"] * 2
    assert parse_paddle(["--nproc_per_node", "3", "t.py"]).nprocs == 3
    assert parse_paddle(["t.py"]).log_dir == "log"  # Paddle's default


def test_paddle_flags_that_disagree_are_refused(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        parse_paddle(["--gpus", "0,1", "--nproc_per_node", "4", "t.py"])
    assert "disagree" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_paddle(["--gpus", "0,0", "t.py"])
    assert "distinct device numbers" in capsys.readouterr().err


def test_every_rank_gets_the_thread_caps_the_map_and_the_restart_variables(monkeypatch: Any) -> None:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MPIPAR_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    opts = parse(["-n", "3", "--hosts", "a:2,b", "--hang-timeout", "10", "t.py", "x"])
    env = rank_env(opts, 2, "/logs/attempt-2", "/ck/step-4")
    assert env["OPENBLAS_NUM_THREADS"] == env["OMP_NUM_THREADS"] == "1"
    assert env["MPIPAR_HOST_MAP"] == "a*2,b" and env["MPIPAR_RESTART_ATTEMPT"] == "2"
    assert env["MPIPAR_RESUME_FROM"] == "/ck/step-4" and env["MPIPAR_TIMEOUT"] == "70"
    cmd = command(opts, "/logs/attempt-2", env)
    assert cmd[:3] == [MPIEXEC, "-n", "3"] and cmd[-4:] == [sys.executable, "-u", "t.py", "x"]
    assert "-hosts" in cmd and cmd[cmd.index("-hosts") + 1] == "a:2,b"
    assert cmd[cmd.index("-outfile-pattern") + 1] == "/logs/attempt-2/workerlog.%r"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's own setting wins
    assert "OMP_NUM_THREADS" not in rank_env(opts, 0, "/l", None)


# ============================================================================ restarts
def test_restart_variables_choose_the_checkpoint(tmp_path: Any) -> None:
    series = tmp_path / "ck"
    for k in (2, 4):
        save_state_dict({"step": k}, str(series / f"step-{k}"))
    (series / "step-6.partial-0123").mkdir()  # an interrupted save is never picked
    assert restart_info({}).attempt == 0 and not restart_info({}).is_restart
    assert resume_target(None, str(series), {}) is None  # a first attempt starts fresh
    restart = {"MPIPAR_RESTART_ATTEMPT": "1", "MPIPAR_MAX_RESTARTS": "3"}
    assert resume_target(None, str(series), restart) == str(series / "step-4")
    chosen = {**restart, "MPIPAR_RESUME_FROM": str(series / "step-2")}
    assert resume_target("elsewhere", str(series), chosen) == str(series / "step-2")
    assert resume_target(None, str(tmp_path / "none-yet"), restart) is None  # killed before any save
    assert resume_target(str(series), None, {}) == str(series / "step-4")  # --resume on a first attempt
    with pytest.raises(ValueError, match=r"MPIPAR_RESTART_ATTEMPT='-1' is not an integer in \[0, "):
        restart_info({"MPIPAR_RESTART_ATTEMPT": "-1"})
    with pytest.raises(CheckpointError):
        resume_target(None, None, {**restart, "MPIPAR_RESUME_FROM": str(tmp_path / "gone")})


def test_stale_leftovers_are_cleared_and_live_ones_kept(tmp_path: Any) -> None:
    save_state_dict({"step": 2}, str(tmp_path / "step-2"))
    partial = tmp_path / "step-4.partial-00000000000000ff"  # a save the kill interrupted
    partial.mkdir()
    (partial / MARKER).write_bytes(MARKER_TEXT)  # a save writes its marker first
    (partial / "rank00000.safetensors").write_bytes(b"x")
    (tmp_path / "step-5.partial-00000000000000aa").mkdir()  # unmarked: not ours, kept
    (tmp_path / "notes.lock").write_text("")  # not a lock of ours, kept however unheld
    (tmp_path / ".step-4.mpipar-lock").write_text("")  # its holder was killed: nobody holds it
    held = tmp_path / ".step-6.mpipar-lock"
    held.write_text("")
    # fcntl locks belong to a process: another one holds this lock while the cleanup runs
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'r+'); fcntl.lockf(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(held)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        removed = clear_stale(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert removed == [".step-4.mpipar-lock", "step-4.partial-00000000000000ff"]
    assert (tmp_path / "step-2").is_dir() and held.exists()
    assert (tmp_path / "step-5.partial-00000000000000aa").is_dir() and (tmp_path / "notes.lock").exists()
    assert clear_stale(str(tmp_path)) == [".step-6.mpipar-lock"]  # once its holder is gone
    flocked = tmp_path / ".step-7.mpipar-lock"
    flocked.write_text("")
    with open(flocked) as f:  # a BSD flock, which POSIX locks do not see, counts as held too
        fcntl.flock(f, fcntl.LOCK_EX)
        assert clear_stale(str(tmp_path)) == []
    assert clear_stale(str(tmp_path)) == [".step-7.mpipar-lock"]


def test_the_summary_lists_attempts_and_their_resume_steps() -> None:
    opts = parse(["-n", "4", "t.py"])
    ranks = {0: "ended with the job", 2: "killed by signal 9"}
    first = Outcome(0, 9, 3.0, ranks, cause="rank 2 killed by signal 9", error="killed by signal 9", last_step=3)
    second = Outcome(1, 0, 2.0, resumed_step=2)
    line = summary(opts, [first, second], 5.25)
    assert line == (
        "ok: 4 ranks | 5.2 s | attempt 0 (from the start, 3.0 s): rank 2 killed by signal 9 after step 3; "
        "attempt 1 (resumed from step 2, 2.0 s): ok"
    )
    assert summary(opts, [second], 1.0) == "ok: 4 ranks | 1.0 s"
    assert summary(opts, [first], 3.0).endswith("| ranks: 0 ended with the job, 2 killed by signal 9")


def test_only_the_same_rank_failing_the_same_way_after_the_same_step_is_a_repeat() -> None:
    def failed(rank: int, step: int, error: str = "killed by signal 9") -> Outcome:
        return Outcome(0, 9, 1.0, cause=f"rank {rank} {error}", error=error, culprit=rank, last_step=step)

    assert _same_failure(failed(1, 5), failed(1, 5))
    assert not _same_failure(failed(1, 5), failed(2, 5))  # two random kills that met at one step
    assert not _same_failure(failed(1, 5), failed(1, 6))
    assert not _same_failure(failed(1, 5), failed(1, 5, "raised RuntimeError: x"))


def test_the_main_threads_stack_is_cut_from_a_dump_of_all_threads() -> None:
    dump = (
        'Thread 0x00007f00000000aa (most recent call first):\n  File "hb.py", line 1 in _run\n\n'
        'Current thread 0x00007f00000000bb (most recent call first):\n  File "train.py", line 9 in spin\n'
    )
    assert main_stack(dump, 0x7F00000000BB).startswith("Current thread") and "spin" in main_stack(dump, 0x7F00000000BB)
    assert "_run" in main_stack(dump, 0x7F00000000AA) and "spin" not in main_stack(dump, 0x7F00000000AA)
    assert main_stack(dump, None) == dump


# ============================================================================ a simulated launch
def test_a_failure_that_repeats_stops_the_restarts_paddle_spelling_simulated(tmp_path: Any) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}
    run = subprocess.run(
        [sys.executable, "-m", "mpipar.distributed.launch", "--gpus=0,1", "--simulate", "--log_dir",
         str(tmp_path / "log"), "--max_restart", "3", FAULTS, "--steps", "4", "--fault", "raise", "--rank", "0"],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "RuntimeError: boom at step 2" in run.stdout  # the traceback, live from the one process's log
    assert (
        "attempts 0 and 1 both failed on rank 0 after step 1 with 'raised RuntimeError: boom at step 2': "
        "the failure repeats, so restarts stop" in run.stderr
    )
    assert sorted(os.listdir(tmp_path / "log")) == ["attempt-0", "attempt-1"]
    assert "FAILED: 2 ranks" in run.stderr.strip().splitlines()[-1]


@contextlib.contextmanager
def _three_lifelines() -> Iterator[tuple[DeathWatch, dict[int, subprocess.Popen[str]]]]:
    """A death watch and three child processes holding lifelines to it as ranks 0-2, connected."""
    deaths = DeathWatch(3)
    child = "import sys, time; from mpipar.runtime.heartbeat import connect_lifeline as c; " \
            "l = c(int(sys.argv[1])); print(l is not None, flush=True); time.sleep(60)"  # fmt: skip
    env = {**os.environ, "MPIPAR_LIFELINE": deaths.address}
    procs = {
        r: subprocess.Popen([sys.executable, "-c", child, str(r)], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(3)
    }
    try:
        assert all(p.stdout is not None and p.stdout.readline().strip() == "True" for p in procs.values())
        deadline = time.monotonic() + 10
        while len(deaths._lifelines) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert deaths._lifelines == {0, 1, 2}
        yield deaths, procs
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        deaths.close()


def _kill_in_order(procs: dict[int, subprocess.Popen[str]], order: tuple[int, ...]) -> None:
    """kill -9 these ranks' processes one after another, 50 ms apart (as hydra's cleanup follows a death)."""
    for r in order:
        procs[r].kill()
        procs[r].wait()
        time.sleep(0.05)


def _wait_for_deaths(deaths: DeathWatch, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(deaths.died) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_death_watch_names_the_rank_that_died_first_and_ignores_hostile_hellos() -> None:
    """Rank 2 dies, then ranks 0 and 1 (hydra's cleanup, milliseconds later): the lifelines' ends
    come in that order, each its own wake-up; connections that say a wrong rank change nothing."""
    with _three_lifelines() as (deaths, procs):
        assert deaths.address.startswith("@mpipar-lifeline-")
        for hello in (b"7\n", b"x\n", b"1\n", b""):  # out of range, not a number, taken, silent
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + deaths.address[1:])
            s.sendall(hello)
            time.sleep(0.05)
            s.close()
        time.sleep(0.1)
        assert deaths.died == [] and deaths.first() == []
        _kill_in_order(procs, (2, 0, 1))
        _wait_for_deaths(deaths, 3)
        assert [r for r, _ in deaths.died] == [2, 0, 1] and deaths.first() == [2]


def test_lifelines_ending_in_one_wake_up_keep_the_kernels_order() -> None:
    """A launcher starved of CPU sees the culprit's lifeline end and hydra's cleanup of the others
    in one wake-up: epoll lists them in the order they ended, so the first is still named alone.
    (The watch thread is held off the lock while rank 2, then 0, then 1 die.)"""
    with _three_lifelines() as (deaths, procs):
        with deaths._lock:  # the thread wakes for this connection, then waits here for the lock
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + deaths.address[1:])
            time.sleep(0.2)
            _kill_in_order(procs, (2, 0, 1))
        _wait_for_deaths(deaths, 3)
        s.close()
        assert [r for r, _ in deaths.died] == [2, 0, 1]
        assert len({w for _, w in deaths.died}) == 1  # one wake-up saw all three
        assert deaths.first() == [2]


def test_ranks_seen_dead_together_are_told_apart_by_hydras_report_when_it_names_one(tmp_path: Any) -> None:
    attempt_dir = tmp_path / "attempt-0"
    attempt_dir.mkdir()
    report = "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   PID {} RUNNING AT vm\n=   EXIT CODE: 9\n"
    watch = HeartbeatWatch(str(attempt_dir), range(4), 5.0, 0.1)
    watch.last = {r: {"rank": r, "pid": 4240 + r, "node": "vm", "state": "running", "step": 3} for r in range(4)}
    for pid, tied, culprit in ((4242, [0, 2], 2), (4243, [0, 2], 0), (4243, [1], 1)):
        (attempt_dir / "mpiexec.log").write_text(report.format(pid))
        outcome = _describe(0, 9, 1.0, watch, str(attempt_dir), 4, False, None, 0, tied)
        assert outcome.culprit == culprit and outcome.cause == f"rank {culprit} killed by signal 9"
