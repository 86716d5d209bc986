"""The launcher's loop: build the command, run attempts, restart from checkpoints, summarize.

Every rank gets, besides the launcher's own environment:

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1   (unless already set: ranks share cores)
    MPIPAR_LAUNCH_DIR      the attempt's folder (logs, heartbeats)
    MPIPAR_HOST_MAP        each rank's host as placed (host*count,...)
    MPIPAR_RESTART_ATTEMPT / MPIPAR_MAX_RESTARTS / MPIPAR_RESUME_FROM   (mpipar.checkpoint.training)
    MPIPAR_TIMEOUT         hang timeout + 60 s, unless set: the heartbeat, which can show the hung
                           rank's stack, fires before the waiting ranks' collective timeout

A restart happens when an attempt fails (a rank killed, an error raised, a hang) and restarts
are left. Before it, stale leftovers of the killed attempt in the checkpoint folder are cleared
(a save's ``.partial-*`` folder without metadata that carries mpipar's marker; a save's
``.<name>.mpipar-lock`` file no live process holds; nothing of anyone else's), and
the latest complete checkpoint is handed on. Restarts stop early when two attempts in a row fail
on the same rank after the same step with the same error: a deterministic failure would only
repeat.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from typing import IO

from mpipar.checkpoint.format import LOCK_SUFFIX, PARTIAL_TAG
from mpipar.checkpoint.ownership import is_partial_ours, parse_step
from mpipar.checkpoint.training import (
    MAX_RESTARTS_ENV,
    RESTART_ATTEMPT_ENV,
    RESUME_FROM_ENV,
    resolve_checkpoint,
    series_steps,
)
from mpipar.launch.attempt import Interrupts, Outcome, run_attempt
from mpipar.launch.options import LaunchOptions, checkpoint_dir
from mpipar.runtime import heartbeat as hb
from mpipar.runtime.hosts import HOST_MAP_ENV, encode_map, format_map, ranges

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
TIMEOUT_MARGIN_S = 60.0
RESTART_PAUSE_S = 1.0


def mpiexec_path() -> str:
    """The mpiexec of this Python's environment (the mpich wheel puts it beside the interpreter)."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec") or here


def is_this_machine(host: str) -> bool:
    """Does ``host`` name this machine (a loopback alias, its own name or address)?"""
    name = host.strip("[]")
    if name in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        if ipaddress.ip_address(name).is_loopback:
            return True
    except ValueError:
        pass
    try:
        theirs = {str(a[4][0]) for a in socket.getaddrinfo(name, None)}
        mine = {str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in theirs) or bool(theirs & mine)


def rank_hosts(opts: LaunchOptions) -> list[str]:
    return opts.rank_hosts() or [socket.gethostname()] * opts.nprocs


def rank_env(opts: LaunchOptions, attempt: int, attempt_dir: str, resume: str | None) -> dict[str, str]:
    """The variables the launcher sets for every rank of an attempt (module docstring)."""
    env = {v: "1" for v in THREAD_VARS if v not in os.environ}
    env.update(opts.env)
    env[hb.DIR_ENV] = attempt_dir
    if not opts.simulate:
        env[HOST_MAP_ENV] = encode_map(rank_hosts(opts))
    env[RESTART_ATTEMPT_ENV] = str(attempt)
    env[MAX_RESTARTS_ENV] = str(opts.max_restarts)
    if resume is not None:
        env[RESUME_FROM_ENV] = resume
    if "MPIPAR_TIMEOUT" not in os.environ:
        env["MPIPAR_TIMEOUT"] = f"{opts.hang_timeout + TIMEOUT_MARGIN_S:g}"
    return env


def command(opts: LaunchOptions, attempt_dir: str, env: dict[str, str]) -> list[str]:
    """The exact command of an attempt: mpiexec (or the simulator) with the script."""
    script = [sys.executable, "-u", opts.script, *opts.args]
    if opts.simulate:
        return [sys.executable, "-u", "-m", "simulator", "-n", str(opts.nprocs), opts.script, *opts.args]
    cmd = [mpiexec_path(), "-n", str(opts.nprocs)]
    launcher = opts.mpi_launcher
    if launcher is None and opts.hosts and all(is_this_machine(h) for h, _ in opts.hosts):
        launcher = "fork"  # every host is this machine: no ssh needed (nor, often, running)
    if launcher:
        cmd += ["-launcher", launcher]
    if opts.host_source:
        flag, _, value = opts.host_source.partition(" ")
        cmd += [flag, os.path.abspath(value) if flag == "-f" else value]
    pattern = os.path.join(attempt_dir, "workerlog.%r")
    cmd += ["-outfile-pattern", pattern, "-errfile-pattern", pattern]
    for name, value in env.items():  # on the command line, so a dry run shows them and remote hosts get them
        cmd += ["-genv", name, value]
    return cmd + script


# ------------------------------------------------------------------------------ folders
def attempt_dir(log_dir: str, attempt: int) -> str:
    return os.path.join(os.path.abspath(log_dir), f"attempt-{attempt}")


def set_aside_earlier(log_dir: str) -> str | None:
    """Move a previous launch's ``attempt-*`` folders into ``earlier-<n>/`` (nothing is deleted)."""
    if not os.path.isdir(log_dir):
        return None
    old = sorted(e for e in os.listdir(log_dir) if e.startswith("attempt-"))
    if not old:
        return None
    n = 0
    while os.path.exists(os.path.join(log_dir, f"earlier-{n}")):
        n += 1
    dest = os.path.join(log_dir, f"earlier-{n}")
    os.makedirs(dest)
    for e in old:
        os.replace(os.path.join(log_dir, e), os.path.join(dest, e))
    return dest


def clear_stale(directory: str | None) -> list[str]:
    """Leftovers of a killed attempt that could stand in the next one's way (module docstring)."""
    if directory is None or not os.path.isdir(directory):
        return []
    removed = []
    for entry in sorted(os.listdir(directory)):
        full = os.path.join(directory, entry)
        base, tag, _ = entry.partition(PARTIAL_TAG)
        if tag and parse_step(base) is not None and is_partial_ours(base, directory, entry):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(entry)
        elif (
            entry.startswith(".")
            and entry.endswith(LOCK_SUFFIX)
            and os.path.isfile(full)
            and not os.path.islink(full)
            and _unheld(full)
        ):
            with contextlib.suppress(OSError):
                os.unlink(full)
                removed.append(entry)
    return removed


def _unheld(path: str) -> bool:
    """No process holds a lock on ``path``, of either kind (``flock`` or POSIX ``lockf``: Linux
    keeps them apart); the process that did was killed with its attempt."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        for take, release in ((fcntl.flock, fcntl.flock), (fcntl.lockf, fcntl.lockf)):
            try:
                take(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False
            release(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def latest_checkpoint(directory: str | None) -> tuple[str, int] | None:
    if directory is None or not series_steps(directory):
        return None
    path = resolve_checkpoint(directory)
    step = parse_step(os.path.basename(path))
    return path, step if step is not None else -1


# ------------------------------------------------------------------------------ the loop
def say(text: str, err: IO[bytes]) -> None:
    with contextlib.suppress(OSError, ValueError):
        err.write(f"mpipar launch: {text}\n".encode())
        err.flush()


def dry_run(opts: LaunchOptions, out: IO[bytes]) -> int:
    folder = attempt_dir(opts.log_dir, 0)
    env = rank_env(opts, 0, folder, None)
    lines = ["command:", "  " + shlex.join(command(opts, folder, env))]
    if not opts.simulate:
        lines.append(f"ranks on hosts ({opts.nprocs} rank{'s' * (opts.nprocs != 1)}):")
        lines += [f"  {line}" for line in format_map(rank_hosts(opts))]
    else:
        lines.append(f"ranks: {opts.nprocs} virtual ranks in one process (the simulator)")
    lines.append(f"logs: {folder}/workerlog.<rank>")
    out.write(("\n".join(lines) + "\n").encode())
    out.flush()
    return 0


def header(opts: LaunchOptions) -> str:
    if opts.simulate:
        where = f"{opts.nprocs} virtual ranks in one process"
    else:
        where = f"{opts.nprocs} rank{'s' * (opts.nprocs != 1)} on " + "; ".join(format_map(rank_hosts(opts)))
    restarts = f", up to {opts.max_restarts} restart(s)" if opts.max_restarts else ""
    return f"{opts.script}: {where}{restarts}; logs in {os.path.abspath(opts.log_dir)}"


def run(opts: LaunchOptions, out: IO[bytes] | None = None, err: IO[bytes] | None = None) -> int:
    """Launch ``opts`` (with restarts); the exit status for the launcher's process."""
    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    if not os.path.isfile(opts.script):
        say(f"no such script: {opts.script}", err)
        return 2
    if opts.dry_run:
        return dry_run(opts, out)
    os.makedirs(opts.log_dir, exist_ok=True)
    moved = set_aside_earlier(opts.log_dir)
    if moved:
        say(f"the previous launch's attempt folders are now in {moved}", err)
    ckpt_dir = checkpoint_dir(opts)
    interval = hb.interval_from_env()
    say(header(opts), err)
    outcomes: list[Outcome] = []
    start = time.monotonic()
    resume: tuple[str, int] | None = None
    stop_reason = ""
    with Interrupts() as interrupts:
        for attempt in range(opts.max_restarts + 1):
            folder = attempt_dir(opts.log_dir, attempt)
            env = rank_env(opts, attempt, folder, resume[0] if resume else None)
            cmd = command(opts, folder, env)
            outcome = run_attempt(
                attempt,
                cmd,
                {**os.environ, **env},
                folder,
                opts.nprocs,
                opts.simulate,
                opts.hang_timeout,
                interval,
                interrupts,
                out,
                err,
            )
            if resume is not None and outcome.resumed_step is None:
                outcome.resumed_step = resume[1]
            outcomes.append(outcome)
            if outcome.ok:
                break
            say(f"attempt {attempt} failed after {outcome.seconds:.1f} s: {outcome.cause}", err)
            if outcome.hang is not None:
                say(outcome.hang.describe(opts.hang_timeout), err)
            if outcome.interrupted:
                stop_reason = "interrupted: no restart"
                break
            if attempt == opts.max_restarts:
                if opts.max_restarts:
                    stop_reason = f"no restart left (--max-restarts {opts.max_restarts})"
                break
            if len(outcomes) >= 2 and _same_failure(outcomes[-2], outcome):
                who = f"on rank {outcome.culprit} " if outcome.culprit is not None else ""
                stop_reason = (
                    f"attempts {attempt - 1} and {attempt} both failed {who}after step "
                    f"{_step_text(outcome.last_step)} with {outcome.error!r}: the failure repeats, so restarts stop"
                )
                break
            cleared = clear_stale(ckpt_dir)
            if cleared:
                say(f"cleared what the failed attempt left in {ckpt_dir}: {', '.join(cleared)}", err)
            resume = latest_checkpoint(ckpt_dir)
            where = f"from {resume[0]} (step {resume[1]})" if resume else "from the start (no complete checkpoint yet)"
            if ckpt_dir is None:
                where += "; give --checkpoint-dir (or the script's --save-dir) to resume from checkpoints"
            say(f"restart {attempt + 1} of {opts.max_restarts} {where}", err)
            time.sleep(RESTART_PAUSE_S)  # the killed ranks' ports and files are released
            if interrupts.signum:  # Ctrl-C between attempts: no new one
                outcome.interrupted = interrupts.signum
                stop_reason = "interrupted: no restart"
                break
    if stop_reason:
        say(stop_reason, err)
    say(summary(opts, outcomes, time.monotonic() - start), err)
    last = outcomes[-1]
    if last.ok:
        return 0
    if last.interrupted:
        return 128 + last.interrupted
    return last.returncode if 0 < last.returncode < 128 else 1


def _same_failure(a: Outcome, b: Outcome) -> bool:
    """The same rank failed after the same step with the same error: it would only repeat."""
    return bool(a.error) and (a.culprit, a.last_step, a.error) == (b.culprit, b.last_step, b.error)


def _step_text(step: int | None) -> str:
    return "(none reported)" if step is None else str(step)


def summary(opts: LaunchOptions, outcomes: Sequence[Outcome], seconds: float) -> str:
    """One line: ranks, wall time, the result; per attempt the step it resumed from and how it ended."""
    last = outcomes[-1]
    status = "ok" if last.ok else "FAILED"
    parts = [f"{status}: {opts.nprocs} rank{'s' * (opts.nprocs != 1)}", f"{seconds:.1f} s"]
    if len(outcomes) > 1 or not last.ok:
        attempts = []
        for o in outcomes:
            resumed = f"resumed from step {o.resumed_step}" if o.resumed_step is not None else "from the start"
            ended = "ok" if o.ok else o.cause + (f" after step {o.last_step}" if o.last_step is not None else "")
            attempts.append(f"attempt {o.attempt} ({resumed}, {o.seconds:.1f} s): {ended}")
        parts.append("; ".join(attempts))
    if not last.ok and last.ranks:
        by_status: dict[str, list[int]] = {}
        for r, t in sorted(last.ranks.items()):
            by_status.setdefault(t, []).append(r)
        groups = sorted(by_status.items(), key=lambda item: item[1][0])
        parts.append("ranks: " + ", ".join(f"{ranges(rs)} {t}" for t, rs in groups))
    return " | ".join(parts)
