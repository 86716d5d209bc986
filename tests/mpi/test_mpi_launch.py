"""``mpipar launch`` under mpiexec: logs, two loopback aliases, kill -9 restarts, hangs, Ctrl-C.

A run with per-rank logs; a host file naming two aliases of this machine (hydra's fork launcher:
no ssh, nothing beyond loopback), dry run and real run; ``kill -9`` of random ranks at random
steps under ``--max-restarts`` against the uninterrupted run's losses; a hung rank named with its
stack within the documented bound; Ctrl-C forwarded, no restart. The launcher's parts are tested
in ``tests/unit/test_launch.py``; the guide is ``docs/launching.md``.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from conftest import REPO

from mpipar.launch.attempt import hang_bound

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
FAULTS = os.path.join("tests", "scripts", "launch_faults.py")
GPT = os.path.join("examples", "gpt.py")
LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.M)

pytestmark = pytest.mark.mpi


def launch(*argv: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")} | {"MPIPAR_HEARTBEAT_S": "0.2"}
    return subprocess.run(
        [sys.executable, "-m", "mpipar.cli", "launch", *argv],
        cwd=REPO,
        env=full | (env or {}),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_launch_writes_a_log_per_rank_and_shows_rank_0_live(tmp_path: Any) -> None:
    logs = tmp_path / "logs"
    run = launch("-n", "2", "--log-dir", str(logs), "--", FAULTS, "--steps", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert [ln for ln in run.stdout.splitlines() if ln.startswith("step ")] == [
        f"step {i} total {4 * i:g}" for i in range(3)
    ]
    assert "step 2 total 8" in (logs / "attempt-0" / "workerlog.0").read_text()
    assert (logs / "attempt-0" / "workerlog.1").exists()
    assert run.stderr.strip().splitlines()[-1].startswith("mpipar launch: ok: 2 ranks | ")
    beat = json.loads((logs / "attempt-0" / "heartbeat" / "rank-1.json").read_text())
    assert (beat["state"], beat["step"]) == ("exited", 2)
    again = launch("-n", "2", "--log-dir", str(logs), "--", FAULTS, "--steps", "1")  # the first run's logs are kept
    assert again.returncode == 0 and (logs / "earlier-0" / "attempt-0" / "workerlog.0").exists()


def test_a_host_file_of_two_loopback_aliases_dry_run_and_run(tmp_path: Any) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1:1\nlocalhost:2\n")  # 4 ranks on 3 slots: hydra wraps to the first host
    args = ["-n", "4", "--hostfile", str(hostfile), "--log-dir", str(tmp_path / "logs")]
    script = [FAULTS, "--steps", "2", "--report-host", "--tp-mesh"]
    dry = launch(*args, "--dry-run", "--", *script)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[1].startswith(f"  {MPIEXEC} -n 4 -launcher fork -f {hostfile} -outfile-pattern ")
    assert "-genv MPIPAR_HOST_MAP '127.0.0.1,localhost*2,127.0.0.1'" in lines[1]
    assert lines[2:5] == ["ranks on hosts (4 ranks):", "  127.0.0.1: ranks 0,3", "  localhost: ranks 1-2"]
    assert not (tmp_path / "logs").exists()  # a dry run starts nothing
    trace = tmp_path / "timeline.json"
    run = launch(*args, "--", *script, env={"MPIPAR_TRACE": str(trace)})
    assert run.returncode == 0, run.stdout + run.stderr
    expected = ["127.0.0.1", "localhost", "localhost", "127.0.0.1"]
    for rank, host in enumerate(expected):  # hydra placed each rank where the launcher said, and the rank knows it
        log = (tmp_path / "logs" / "attempt-0" / f"workerlog.{rank}").read_text()
        assert f"host {rank} {host} {host}" in log, log
    assert "mpipar: 4 ranks on 127.0.0.1: ranks 0,3; localhost: ranks 1-2" in run.stdout  # the job header
    assert "along 'tp' span hosts, e.g. ranks [0, 1] on ['127.0.0.1', 'localhost']" in run.stdout
    meta = json.loads(trace.read_text())["meta"]
    assert meta["hosts"] == {str(r): h for r, h in enumerate(expected)}


def test_restarts_after_kill_9_at_random_steps_end_with_the_uninterrupted_losses(tmp_path: Any) -> None:
    steps, seed = 16, int.from_bytes(os.urandom(4), "little")  # room for a second kill after a late resume
    rng = random.Random(seed)
    gpt = [GPT, "--tiny", "--steps", str(steps), "--sample", "0", "--save-every", "2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")} | {"MPIPAR_TIMEOUT": "60"}
    oracle = subprocess.run(
        [MPIEXEC, "-n", "4", sys.executable, *gpt, "--save-dir", str(tmp_path / "oracle")],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert oracle.returncode == 0, oracle.stderr[-3000:]
    want = dict(LOSS.findall(oracle.stdout))
    assert len(want) == steps

    logs, kills = tmp_path / "logs", []
    stop = threading.Event()

    def killer() -> None:
        """kill -9 a random rank of attempts 0 and 1 once it reports a random step past its resume point."""
        last = None
        for attempt in range(2):
            # a random rank, never the last one killed: the same rank killed twice after the same step
            # would read as a failure that repeats (which stops the restarts, as it should)
            rank, target = rng.choice([r for r in range(4) if r != last]), None
            last = rank
            path = logs / f"attempt-{attempt}" / "heartbeat" / f"rank-{rank}.json"
            while not stop.is_set():
                try:
                    beat = json.loads(path.read_text())
                except (OSError, ValueError):
                    time.sleep(0.02)
                    continue
                if beat["state"] != "running":
                    return  # the attempt ended before our step: no more kills
                if target is None and beat["step"] is not None:
                    if beat["step"] + 1 > steps - 2:
                        return  # too near the end to kill before it finishes
                    # within 2 steps of where it resumed: the first kill leaves room for the second
                    target = rng.randint(beat["step"] + 1, min(beat["step"] + 2, steps - 2))
                if target is not None and beat["step"] is not None and beat["step"] >= target:
                    os.kill(beat["pid"], signal.SIGKILL)
                    kills.append((attempt, rank, beat["step"]))
                    break
                time.sleep(0.02)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        run = launch(
            "-n", "4", "--log-dir", str(logs), "--max-restarts", "2", "--", *gpt, "--save-dir", str(tmp_path / "ck")
        )
    finally:
        stop.set()
        thread.join(timeout=10)
    context = f"seed {seed}, kills {kills}\n{run.stderr[-4000:]}"
    assert run.returncode == 0, context
    assert len(kills) == 2, context  # a kill within 2 steps of the resume point lands well before the end
    printed = LOSS.findall(run.stdout)
    assert {s for s, _ in printed} == set(want), context
    for step, loss in printed:  # every line, repeated steps after a resume too, is the uninterrupted run's
        assert loss == want[step], f"step {step}: {loss} != {want[step]}; {context}"
    last = run.stderr.strip().splitlines()[-1]
    assert last.count("killed by signal 9") == len(kills), context
    for attempt, rank, _ in kills:
        assert f"attempt {attempt} (" in last and f"rank {rank} killed by signal 9" in last, context
    assert re.search(r"attempt 1 \((resumed from step \d+|from the start)", last), context


def test_a_hung_rank_is_named_with_its_stack_within_the_bound(tmp_path: Any) -> None:
    start = time.monotonic()
    run = launch(
        "-n", "4", "--log-dir", str(tmp_path / "logs"), "--hang-timeout", "2",
        "--", FAULTS, "--steps", "6", "--fault", "hang", "--rank", "2", "--at", "3",
    )  # fmt: skip
    seconds = time.monotonic() - start
    assert run.returncode != 0
    err = run.stderr
    assert re.search(r"rank 2 on \S+ hung after step 2: it waits for no peer", err), err
    stack = err.split("its Python stack:", 1)[1]
    assert "in spin_forever" in stack and "launch_faults.py" in stack, err
    assert "hb.py" not in stack and "_run" not in stack  # the main thread's stack, not the heartbeat's
    assert "ranks: 0-1,3 ended with the job (waiting in all_gather on group [0, 1, 2, 3]), 2 hung" in err
    # startup (a few seconds on 2 busy cores) plus the documented bound after the last step
    assert seconds < 30 + hang_bound(2, 0.2), seconds


def test_ctrl_c_reaches_the_ranks_and_stops_without_a_restart(tmp_path: Any) -> None:
    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")} | {"MPIPAR_HEARTBEAT_S": "0.2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpipar.cli", "launch", "-n", "2", "--log-dir", str(logs), "--max-restarts", "2",
         "--", FAULTS, "--steps", "5", "--fault", "hang", "--rank", "1", "--at", "2"],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        beat = logs / "attempt-0" / "heartbeat" / "rank-1.json"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (beat.exists() and '"step": 1' in beat.read_text()):
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted by SIGINT" in err and "interrupted: no restart" in err
    assert not (logs / "attempt-1").exists()
    assert "step 1 total" in out  # rank 0's lines came through live before the interrupt
