"""``mpipar viz --run SCRIPT [args]``: a run's whole picture in one command.

    files = prepare_run("examples/gpt.py", ["--mesh", "dp=2,tp=2", "--tiny"], run_dir="mpipar-run", steps=3)
    files.plan, files.timeline      # mpipar-run/plan.json, mpipar-run/measured.json

1. ``mpipar plan`` traces the script's first step into ``RUN_DIR/plan.json`` (values simulator,
   or ``--shape-only``); its ranks give the world size of the run.
2. The script runs ``steps`` training steps (``--steps`` set unless the arguments give it) with
   ``MPIPAR_TRACE=RUN_DIR/measured.json``, in the simulator (``python -m simulator -n WORLD``)
   or under ``mpiexec -n WORLD``; its output goes to ``RUN_DIR/run.log``.
3. Both files are read back through the dashboard's own validation, and the dashboard opens
   on them (``viz.__main__``), unless ``--prepare-only``.

Every command runs in a subprocess with a timeout, from the current directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mpipar.compile.plan import Plan
from mpipar.debug.timeline import Timeline
from viz.files import VizFileError, load_path
from viz.planinfo import all_ranks
from viz.script_whatif import command_text, flag_value, set_flag

LAUNCHERS = ("sim", "mpiexec")
DEFAULT_DIR = "mpipar-run"
DEFAULT_TIMEOUT_S = 900.0


class RunFailed(RuntimeError):
    """A step of the preparation failed; the message names the command and its error output."""


@dataclass
class RunFiles:
    """What ``prepare_run`` wrote, and the commands that wrote it."""

    directory: str
    plan: str
    timeline: str
    log: str
    world: int
    commands: list[list[str]] = field(default_factory=list)


def _mpiexec() -> str:
    """The mpiexec beside this interpreter (the venv's MPICH) or the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.path.exists(here) else shutil.which("mpiexec")
    if found is None:
        raise RunFailed("--launcher mpiexec: no mpiexec beside this Python or on PATH; use --launcher sim")
    return found


def _run(cmd: list[str], log: str, env: dict[str, str], timeout: float) -> None:
    with open(log, "a") as out:
        out.write(f"$ {command_text(cmd)}\n")
        out.flush()
        try:
            done = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise RunFailed(f"`{command_text(cmd)}` did not finish in {timeout:g} s (output in {log})") from None
    if done.returncode != 0:
        with open(log) as f:
            tail = f.read()[-1500:]
        raise RunFailed(f"`{command_text(cmd)}` failed (exit {done.returncode}); the end of {log}:\n{tail}")


def prepare_run(
    script: str,
    args: Sequence[str],
    run_dir: str = DEFAULT_DIR,
    steps: int = 3,
    launcher: str = "sim",
    shape_only: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
    echo: Callable[[str], None] | None = None,
) -> RunFiles:
    """Trace ``script``'s plan, run ``steps`` measured steps, and return the two files' paths."""
    if not os.path.isfile(script) or not script.endswith(".py"):
        raise RunFailed(f"--run {script!r}: not a .py file")
    if launcher not in LAUNCHERS:
        raise RunFailed(f"--launcher {launcher!r}: use one of {', '.join(LAUNCHERS)}")
    if steps < 1:
        raise RunFailed(f"--steps {steps}: run at least one step")
    say = echo or (lambda _line: None)
    os.makedirs(run_dir, exist_ok=True)
    files = RunFiles(
        run_dir,
        os.path.join(run_dir, "plan.json"),
        os.path.join(run_dir, "measured.json"),
        os.path.join(run_dir, "run.log"),
        0,
    )
    for stale in (files.plan, files.timeline, files.log):  # never show an earlier run's file as this one's
        if os.path.exists(stale):
            os.remove(stale)
    env = {k: v for k, v in os.environ.items() if k != "MPIPAR_TRACE"}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")

    trace = [
        sys.executable,
        "-m",
        "mpipar.cli",
        "plan",
        "-o",
        files.plan,
        *(["--shape-only"] if shape_only else []),
        script,
        *args,
    ]
    say(f"tracing the plan: {command_text(trace)}")
    _run(trace, files.log, env, timeout)
    files.commands.append(trace)
    plan = _load(files.plan, Plan)
    files.world = len(all_ranks(plan)) or 1

    run_args = list(args) if flag_value(args, "--steps") is not None else set_flag(args, "--steps", str(steps))
    if launcher == "sim":
        run = [sys.executable, "-m", "simulator", "-n", str(files.world), script, *run_args]
    else:
        run = [_mpiexec(), "-n", str(files.world), sys.executable, script, *run_args]
    say(f"running with the timeline recorded: MPIPAR_TRACE={files.timeline} {command_text(run)}")
    _run(run, files.log, {**env, "MPIPAR_TRACE": os.path.abspath(files.timeline)}, timeout)
    files.commands.append(run)
    timeline = _load(files.timeline, Timeline)
    if timeline.meta.get("source") != "measured":
        raise RunFailed(f"{files.timeline}: meta.source is {timeline.meta.get('source')!r}, not 'measured'")
    say(
        f"wrote {files.plan} ({plan.summary().splitlines()[0]}) and {files.timeline} "
        f"({len(timeline.spans)} spans, {timeline.makespan:.4g} {timeline.time_unit}); log: {files.log}"
    )
    return files


def _load(path: str, kind: type) -> Plan | Timeline:
    try:
        doc = load_path(path)
    except VizFileError as exc:
        raise RunFailed(str(exc)) from None
    if not isinstance(doc, kind):
        raise RunFailed(f"{path}: expected a {kind.__name__.lower()}, got a {type(doc).__name__.lower()}")
    return doc
