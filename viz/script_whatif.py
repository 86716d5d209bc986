"""What-if on the user's own script: re-trace ``meta.script`` with ``meta.args`` changed.

    ref = script_ref(plan, root=os.getcwd())         # ScriptRefused says why not
    args = with_knobs(ref.args, tp=4, schedule="ZBH1")
    cmd = retrace_command(ref, args)                 # shown to the user, run only once confirmed
    new_plan = retrace(ref, args)                    # a subprocess, with a timeout; cached

A plan records the script that traced it and its arguments (``mpipar plan``), but the plan
file may come from anywhere: both are untrusted. Re-tracing runs that script, so the script
must be a ``.py`` file inside ``root`` (the directory the dashboard was started in) once
symlinks and ``..`` are resolved, and the caller runs the command only after the user has
seen it and confirmed. The re-trace is ``mpipar plan`` itself (``python -m mpipar.cli plan``)
in a subprocess with a timeout, in the loaded plan's mode (``--shape-only`` when the loaded
plan was shape-only, the values simulator otherwise), so the what-if plan is exactly what
that command line gives by hand.

The knobs are the examples' flags: ``--mesh dp=..,tp=..,pp=..``, ``--schedule``,
``--micro-batches`` (``--accumulate-steps`` without a schedule), ``--chunks``, ``--zero``,
``--recompute``, ``--sequence-parallel``. A flag the user does not change keeps its recorded
spelling and place.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpipar import cliargs
from mpipar.compile.plan import Plan
from viz.files import VizFileError, load_path

MAX_ARGS = 200
MAX_ARG_CHARS = 1000
MAX_SCRIPT_CHARS = 4096
RETRACE_TIMEOUT_S = 180.0
SCHEDULES = ("FThenB", "1F1B", "Interleaved1F1B", "ZBH1")
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTES = ("none", "selective", "full")


class ScriptRefused(ValueError):
    """The plan's script cannot be re-traced here; the message says why."""


class RetraceFailed(RuntimeError):
    """The re-trace command ran and failed (or timed out); the message carries its error output."""


@dataclass(frozen=True)
class ScriptRef:
    """A plan's script, checked: ``path`` is real and inside ``root``; ``args`` as recorded."""

    recorded: str
    path: str
    root: str
    args: tuple[str, ...]
    shape_only: bool


def _check_text(value: Any, field: str, limit: int) -> str:
    if not isinstance(value, str):
        raise ScriptRefused(f"the plan's {field} is {value!r:.80}, not a string")
    if len(value) > limit:
        raise ScriptRefused(f"the plan's {field} is {len(value)} characters long (at most {limit})")
    if "\x00" in value:
        raise ScriptRefused(f"the plan's {field} {value!r:.80} contains a NUL character")
    return value


def resolve_script(script: str, root: str) -> str:
    """The real path of ``script`` (relative to ``root`` unless absolute), refused outside ``root``."""
    real_root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(real_root, script))
    if os.path.commonpath([real_root, path]) != real_root:
        raise ScriptRefused(
            f"the plan's meta.script {script!r} resolves to {path}, outside the directory the "
            f"dashboard was started in ({real_root}); only scripts inside it are run"
        )
    if not path.endswith(".py"):
        raise ScriptRefused(f"the plan's meta.script {script!r} is not a .py file")
    if not os.path.isfile(path):
        raise ScriptRefused(f"the plan's meta.script {script!r} is not a file in {real_root}")
    return path


def script_ref(plan: Plan, root: str) -> ScriptRef:
    """The plan's re-traceable script, or ``ScriptRefused`` naming the field and value at fault."""
    meta = plan.meta
    if "script" not in meta:
        raise ScriptRefused("the plan records no meta.script (it was not made by `mpipar plan`)")
    script = _check_text(meta.get("script"), "meta.script", MAX_SCRIPT_CHARS)
    args = meta.get("args", [])
    if not isinstance(args, list):
        raise ScriptRefused(f"the plan's meta.args is {args!r:.80}, not a list of strings")
    if len(args) > MAX_ARGS:
        raise ScriptRefused(f"the plan's meta.args has {len(args)} entries (at most {MAX_ARGS})")
    checked = tuple(_check_text(a, f"meta.args[{i}]", MAX_ARG_CHARS) for i, a in enumerate(args))
    shape_only = meta.get("shape_only", False)
    if not isinstance(shape_only, bool):
        raise ScriptRefused(f"the plan's meta.shape_only is {shape_only!r:.40}, not true or false")
    return ScriptRef(script, resolve_script(script, root), os.path.realpath(root), checked, shape_only)


# ------------------------------------------------------------------------------ flags
def _find(args: Sequence[str], flag: str) -> int | None:
    """Index of the last ``flag`` or ``flag=...`` token, or None."""
    found = None
    for i, a in enumerate(args):
        if a == flag or a.startswith(flag + "="):
            found = i
    return found


def flag_value(args: Sequence[str], flag: str) -> str | None:
    i = _find(args, flag)
    if i is None:
        return None
    if args[i].startswith(flag + "="):
        return args[i][len(flag) + 1 :]
    return args[i + 1] if i + 1 < len(args) else None


def has_switch(args: Sequence[str], flag: str) -> bool:
    return flag in args


def set_flag(args: Sequence[str], flag: str, value: str | None) -> list[str]:
    """``args`` with ``flag`` set to ``value`` in its place (appended if absent), or removed if None."""
    out: list[str] = []
    placed = False
    i = 0
    while i < len(args):
        a = args[i]
        if a == flag or a.startswith(flag + "="):
            i += 1 if a != flag else 2  # the flag and its value token
            if value is not None and not placed:
                out += [flag, value]
                placed = True
            continue
        out.append(a)
        i += 1
    if value is not None and not placed:
        out += [flag, value]
    return out


def set_switch(args: Sequence[str], flag: str, on: bool) -> list[str]:
    out = [a for a in args if a != flag]
    return [*out, flag] if on else out


@dataclass(frozen=True)
class Knobs:
    """The examples' parallel knobs as ``args`` spell them (defaults where a flag is absent)."""

    dp: int
    tp: int
    pp: int
    schedule: str | None
    micro_batches: int | None
    chunks: int
    zero: int
    recompute: str
    sequence_parallel: bool


def _int_flag(args: Sequence[str], flag: str, default: int | None) -> int | None:
    text = flag_value(args, flag)
    if text is None:
        return default
    if not text.isdigit() or len(text) > 9:
        raise ScriptRefused(f"the plan's meta.args give {flag} {text!r:.40}, not a small non-negative integer")
    return int(text)


def read_knobs(args: Sequence[str], world: int) -> Knobs:
    """The knobs ``args`` set; without ``--mesh`` the examples run data parallel over ``world`` ranks."""
    mesh = flag_value(args, "--mesh")
    try:
        degrees = cliargs.parse_degrees(mesh, ("dp", "tp", "pp"), "--mesh") if mesh else {"dp": world, "tp": 1, "pp": 1}
    except ValueError as exc:
        raise ScriptRefused(f"the plan's meta.args: {exc}") from None
    schedule = flag_value(args, "--schedule")
    if schedule is not None and schedule not in SCHEDULES:
        raise ScriptRefused(f"the plan's meta.args give --schedule {schedule!r:.40}; known: {', '.join(SCHEDULES)}")
    micro = _int_flag(args, "--micro-batches" if schedule else "--accumulate-steps", None)
    recompute = flag_value(args, "--recompute") or "none"
    if recompute not in RECOMPUTES:
        raise ScriptRefused(f"the plan's meta.args give --recompute {recompute!r:.40}; known: {', '.join(RECOMPUTES)}")
    zero = _int_flag(args, "--zero", 0)
    if zero not in ZERO_STAGES:
        raise ScriptRefused(f"the plan's meta.args give --zero {zero}; known: 0, 1, 2, 3")
    chunks = _int_flag(args, "--chunks", 2)
    assert chunks is not None and zero is not None
    return Knobs(
        degrees["dp"],
        degrees["tp"],
        degrees["pp"],
        schedule,
        micro,
        chunks,
        zero,
        recompute,
        has_switch(args, "--sequence-parallel"),
    )


def with_knobs(args: Sequence[str], base: Knobs, new: Knobs) -> list[str]:
    """``args`` with the knobs that differ between ``base`` and ``new`` rewritten (the rest untouched)."""
    out = list(args)
    if (new.dp, new.tp, new.pp) != (base.dp, base.tp, base.pp):
        out = set_flag(out, "--mesh", f"dp={new.dp},tp={new.tp},pp={new.pp}")
    if new.schedule != base.schedule:
        out = set_flag(out, "--schedule", new.schedule)
        if new.schedule is None:
            out = set_flag(out, "--micro-batches", None)
        else:
            out = set_flag(out, "--accumulate-steps", None)
    micro_flag = "--micro-batches" if new.schedule else "--accumulate-steps"
    if new.micro_batches != base.micro_batches or (new.schedule != base.schedule and new.micro_batches is not None):
        out = set_flag(out, micro_flag, None if new.micro_batches is None else str(new.micro_batches))
    if new.chunks != base.chunks:
        out = set_flag(out, "--chunks", str(new.chunks))
    if new.zero != base.zero:
        out = set_flag(out, "--zero", str(new.zero))
    if new.recompute != base.recompute:
        out = set_flag(out, "--recompute", new.recompute)
    if new.sequence_parallel != base.sequence_parallel:
        out = set_switch(out, "--sequence-parallel", new.sequence_parallel)
    return out


# ------------------------------------------------------------------------------ running
@functools.lru_cache(maxsize=1)
def _out_dir() -> str:
    """One private directory per dashboard process for the re-traced plans (mode 0700), removed at exit."""
    path = tempfile.mkdtemp(prefix="mpipar-whatif-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _out_path(ref: ScriptRef, args: Sequence[str]) -> str:
    key = hashlib.sha256("\x00".join([ref.path, str(ref.shape_only), *args]).encode()).hexdigest()[:16]
    return os.path.join(_out_dir(), f"plan-{key}.json")


def retrace_command(ref: ScriptRef, args: Sequence[str]) -> list[str]:
    """``mpipar plan`` in the loaded plan's mode on the resolved script: exactly what ``retrace`` runs."""
    return [
        sys.executable,
        "-m",
        "mpipar.cli",
        "plan",
        "-o",
        _out_path(ref, args),
        *(["--shape-only"] if ref.shape_only else []),
        ref.path,
        *args,
    ]


def command_text(cmd: Sequence[str]) -> str:
    return shlex.join(cmd)


def retrace(ref: ScriptRef, args: Sequence[str], timeout: float = RETRACE_TIMEOUT_S) -> Plan:
    """Run ``retrace_command`` in ``ref.root`` and load the plan it writes (validated like any file).

    Only call this after the user confirmed the command. Results are cached by the script's
    path, modification time and arguments: the same what-if never runs twice.
    """
    try:
        mtime = os.stat(ref.path).st_mtime_ns
    except OSError as exc:
        raise ScriptRefused(f"cannot read {ref.path}: {exc.strerror}") from None
    return _retrace_cached(ref, tuple(args), mtime, timeout)


@functools.lru_cache(maxsize=32)
def _retrace_cached(ref: ScriptRef, args: tuple[str, ...], mtime: int, timeout: float) -> Plan:
    del mtime  # part of the cache key: an edited script is traced again
    cmd = retrace_command(ref, args)
    env = {k: v for k, v in os.environ.items() if k != "MPIPAR_TRACE"}  # a re-trace writes no timeline
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        done = subprocess.run(
            cmd, cwd=ref.root, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise RetraceFailed(f"`{command_text(cmd)}` did not finish in {timeout:g} s") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip()[-1500:]
        hint = ""
        if ref.shape_only and "has no values" in tail and flag_value(args, "--schedule") is None:
            hint = (
                " (the plan was traced shape-only, where an eager loop that reads its loss has no value "
                "to read: pick a schedule, which traces a to_static step)"
            )
        raise RetraceFailed(f"`{command_text(cmd)}` failed (exit {done.returncode}): {tail}{hint}")
    try:
        plan = load_path(_out_path(ref, args))
    except VizFileError as exc:
        raise RetraceFailed(f"the re-traced plan cannot be read: {exc}") from None
    if not isinstance(plan, Plan):
        raise RetraceFailed("the re-trace wrote a timeline, not a plan")
    return plan
