"""The one reader of ``MPIPAR_*`` environment variables: each is input, parsed strictly.

An environment variable is as much outside input as a file: a typo must not silently leave a
feature on (``MPIPAR_STACK_GEMMS=false`` once did) or produce an error that never names the
variable. Every ``MPIPAR_*`` variable is declared in ``VARIABLES`` (name, kind, default,
meaning; ``docs/environment.md`` is its table) and read through one of:

* ``env_flag``   booleans: ``1/true/on/yes`` and ``0/false/off/no``, any case, spaces around
  ignored; unset or empty is the default; anything else is a ``ValueError`` naming the
  variable and the value;
* ``env_choice`` one of a fixed set of words (case-insensitive);
* ``env_number`` a finite number within bounds;
* ``env_text``   free text (a path), stripped; empty is unset.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str
    default: str
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "MPIPAR_BACKEND",
        "choice: sim, reference, shape-only, mpi, nccl (and plugins)",
        "sim; mpi (nccl with a GPU) under mpiexec",
        "the backend a script runs on",
    ),
    Variable(
        "MPIPAR_TIMEOUT",
        "number of seconds > 0",
        "300",
        "how long one collective may wait before the job is aborted with the missing ranks named",
    ),
    Variable(
        "MPIPAR_CHECK_COLLECTIVES",
        "flag",
        "0",
        "before each collective, every member's full signature is compared (an extra small all-gather per call)",
    ),
    Variable(
        "MPIPAR_AGREE",
        "flag",
        "1",
        "each collective's signature travels in its own messages and is compared by the receiver (docs/trust.md)",
    ),
    Variable(
        "MPIPAR_REDUCE",
        "choice: ordered, native",
        "ordered",
        "ordered: every sum in group order, bit-identical to the simulator; native: the MPI library's own sums",
    ),
    Variable(
        "MPIPAR_COMM_CACHE_MIB",
        "number >= 0",
        "256",
        "MiB of idle result buffers a communicator keeps for reuse (0 turns the cache off)",
    ),
    Variable(
        "MPIPAR_STDERR_SENTINEL",
        "flag",
        "1",
        "relay each rank's stderr through a process that adds a hint to MPI's truncation errors",
    ),
    Variable("MPIPAR_STACK_GEMMS", "flag", "1", "run same-shaped GEMMs of a step as one stacked GEMM"),
    Variable(
        "MPIPAR_GRAD_BUCKET_MIB",
        "number of MiB >= 0, or off",
        "25",
        "data-parallel gradients are all-reduced in buckets of this size, overlapped with backward; off: one all-reduce per gradient",
    ),
    Variable(
        "MPIPAR_BACKWARD_REPLAY",
        "flag",
        "1",
        "replay a backward pass seen twice alike as its list of kernels (bit-identical); off: every pass through the gradient functions",
    ),
    Variable(
        "MPIPAR_BIND_CORES",
        "flag",
        "1",
        "on a host running more ranks than it has cores, each rank is kept on one core (local rank modulo the cores), unless the launcher bound it",
    ),
    Variable(
        "MPIPAR_GC",
        "choice: freeze, off",
        "freeze",
        "freeze: one garbage collection and gc.freeze() after the warm-up steps; off: Python's collector as is",
    ),
    Variable(
        "MPIPAR_LAUNCH_DIR",
        "path (set by mpipar launch)",
        "unset",
        "the launch attempt's folder: each rank writes its heartbeat and logs there",
    ),
    Variable(
        "MPIPAR_HEARTBEAT_S",
        "number of seconds > 0 (clamped to 0.05..60)",
        "1",
        "how often each rank's heartbeat is written under mpipar launch",
    ),
    Variable(
        "MPIPAR_LIFELINE",
        "@name (set by mpipar launch)",
        "unset",
        "the launcher's socket each rank on its machine connects to, so it sees the order in which ranks die",
    ),
    Variable(
        "MPIPAR_HOST_MAP",
        "host*count,... (set by mpipar launch)",
        "unset",
        "each rank's host as the launcher placed it (reported, and used by host_mesh)",
    ),
    Variable(
        "MPIPAR_RESTART_ATTEMPT",
        "integer >= 0 (set by mpipar launch)",
        "0",
        "which restart of the job this attempt is (0: the first attempt)",
    ),
    Variable(
        "MPIPAR_MAX_RESTARTS",
        "integer >= 0 (set by mpipar launch)",
        "0",
        "how many restarts the launcher allows",
    ),
    Variable(
        "MPIPAR_RESUME_FROM",
        "path (set by mpipar launch)",
        "unset",
        "on a restart: the latest complete checkpoint the launcher found, to resume from",
    ),
    Variable(
        "MPIPAR_TRACE",
        "path",
        "unset",
        "write a measured timeline of the run to this file (every rank's spans, gathered at exit)",
    ),
    Variable(
        "MPIPAR_PROFILE",
        "path",
        "unset",
        "the hardware profile (JSON) the simulator's cost model and the auto planner use",
    ),
)
_DECLARED = {v.name for v in VARIABLES}

TRUE_WORDS = ("1", "true", "on", "yes")
FALSE_WORDS = ("0", "false", "off", "no")


def _raw(name: str, env: Mapping[str, str] | None) -> str:
    if name not in _DECLARED:  # a reader of an undeclared variable is a bug of ours, caught by any test
        raise KeyError(f"{name} is not declared in mpipar.env.VARIABLES")
    return (os.environ if env is None else env).get(name, "").strip()


def env_flag(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """A boolean variable (see the module docstring)."""
    raw = _raw(name, env)
    if not raw:
        return default
    word = raw.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(
        f"{name}={raw!r} is not a boolean; use 1/true/on/yes or 0/false/off/no "
        f"(unset it for the default, {'on' if default else 'off'})"
    )


def env_choice(
    name: str, choices: Sequence[str], default: str, env: Mapping[str, str] | None = None, *, explain: str = ""
) -> str:
    """One of ``choices`` (lower-cased), or ``default`` when unset; ``explain`` says what each means."""
    raw = _raw(name, env)
    if not raw:
        return default
    word = raw.lower()
    if word not in choices:
        raise ValueError(
            f"{name}={raw!r} is not one of {', '.join(choices)}{f' ({explain})' if explain else ''}; "
            f"unset it for the default, {default}"
        )
    return word


def env_number(
    name: str,
    default: float,
    *,
    minimum: float,
    strict: bool,
    unit: str,
    env: Mapping[str, str] | None = None,
) -> float:
    """A finite number ``> minimum`` (``strict``) or ``>= minimum``, or ``default`` when unset."""
    raw = _raw(name, env)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        bound = f"{'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name}={raw!r} is not a number of {unit} {bound} (unset it for the default, {default:g})")
    return value


def env_int(name: str, default: int, *, maximum: int, env: Mapping[str, str] | None = None) -> int:
    """A decimal integer in ``[0, maximum]``, or ``default`` when unset."""
    raw = _raw(name, env)
    if not raw:
        return default
    if not raw.isdigit() or int(raw) > maximum:
        raise ValueError(f"{name}={raw!r} is not an integer in [0, {maximum}] (unset it for the default, {default})")
    return int(raw)


def env_text(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """Free text (a path), or None when unset or empty."""
    return _raw(name, env) or None
