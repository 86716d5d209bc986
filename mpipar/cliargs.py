"""Bounded command-line inputs, shared by every mpipar, simulator and dashboard command.

A command line is input like any file: a number may be ``inf``, a mesh may name ten billion
ranks, an output path may lead nowhere. Each type here refuses such a value at parse time,
so argparse prints one line (``prog: error: argument --x: ...``) and exits with status 2,
instead of a loop that never ends, a ``MemoryError`` after gigabytes, or a traceback.

Exit statuses, the same for every command: 0 done, 1 a failure while working (a file that
cannot be written after all, a script that raises), 2 bad input.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

MAX_WORLD = 1 << 20
"""Meshes of more ranks are refused unless a command is told otherwise (``--max-world``)."""
MAX_PARAMS = 1e16
"""Parameter counts at or above this are refused (the largest published models have ~2e12)."""

_UNITS = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def int_range(low: int, high: int, what: str = "an integer") -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: {what} from {low} to {high}")
        return value

    parse.__name__ = what  # argparse names the type in its own messages
    return parse


port = int_range(1, 65535, "a TCP port")
positive_int = int_range(1, 1 << 62, "a positive integer")


def finite_float(
    low: float = -math.inf, high: float = math.inf, what: str = "a finite number"
) -> Callable[[str], float]:
    """An argparse type: a finite float in ``[low, high]``."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: {what} from {low:g} to {high:g}")
        return value

    parse.__name__ = what
    return parse


def parse_count(text: str, flag: str = "--params", limit: float = MAX_PARAMS) -> float:
    """``175e9``, ``175B``, ``1.3b``, ``350M`` -> a positive finite number below ``limit``."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * _UNITS[t[-1]] if t and t[-1] in _UNITS else float(t)
    except ValueError:
        raise ValueError(f"{flag}: cannot read {text!r}; write e.g. 175e9, 175B or 350M") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{flag}: {text!r} is not a positive finite count; write e.g. 175e9, 175B or 350M")
    if value >= limit:
        raise ValueError(f"{flag}: {text!r} is {value:.3g}, at or above the limit of {limit:.0e}")
    return value


def parse_degrees(
    text: str, axes: Sequence[str] = ("dp", "tp", "pp"), flag: str = "--mesh", max_world: int = MAX_WORLD
) -> dict[str, int]:
    """``dp=8,tp=8,pp=16`` -> degrees per axis (1 where not given).

    Refuses unknown axes, an axis given twice, degrees below 1, and a product of degrees above
    ``max_world`` (showing every factor).
    """
    degrees = dict.fromkeys(axes, 1)
    seen: set[str] = set()
    example = ",".join(f"{a}=2" for a in axes)
    for part in filter(None, text.replace(" ", "").split(",")):
        key, _, value = part.partition("=")
        if key not in degrees or not value.isdigit() or len(value) > 12 or int(value) < 1:
            raise ValueError(f"{flag}: cannot read {part!r}; write e.g. {example} (axes {', '.join(axes)})")
        if key in seen:
            raise ValueError(f"{flag}: axis {key} is given twice in {text!r}; give each axis once")
        seen.add(key)
        degrees[key] = int(value)
    world = math.prod(degrees.values())
    if world > max_world:
        factors = " * ".join(f"{k}({v})" for k, v in degrees.items())
        raise ValueError(f"{flag}: {factors} = {world} ranks is over the limit of {max_world}")
    return degrees


def check_world(dims: Sequence[int], flag: str, max_world: int = MAX_WORLD) -> int:
    """The product of mesh ``dims``, refusing one above ``max_world`` before anything is allocated."""
    world = math.prod(dims)
    if world > max_world:
        raise ValueError(
            f"{flag}: {' x '.join(str(d) for d in dims)} = {world} ranks is over the limit of {max_world} "
            "(raise it with --max-world if you mean it)"
        )
    return world


MAX_LAYERS = 1 << 16
"""Transformer layers a command line may ask for (the largest published models have ~100)."""
MAX_SCHEDULE_SLOTS = 1 << 16
"""Pipeline slots (micro-batches x stages x chunks) a command line may ask a schedule to lay out:
the product, not each count, is what costs time (``simulator estimate`` spends about 0.2 ms of
CPU per slot here, so the limit bounds it near 15 s)."""


def check_product(counts: dict[str, int], limit: int, what: str) -> int:
    """The product of ``counts`` (flag -> value), refusing one above ``limit`` before any work
    sized by it starts; the message names every flag and its value."""
    product = math.prod(counts.values())
    if product > limit:
        factors = " x ".join(f"{k} {v}" for k, v in counts.items())
        raise ValueError(f"{factors} = {product} {what}, over the limit of {limit}")
    return product


def output_path(text: str) -> str:
    """An argparse type: a file path whose directory exists and is writable (checked now, not
    after minutes of tracing)."""
    if not text or "\x00" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a file path")
    directory = os.path.dirname(os.path.abspath(text)) or "."
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"{text}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: the directory {directory} is not writable")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    return text


def fail(prog: str, message: str, status: int = 1) -> int:
    """Print ``prog: message`` on one line to stderr and return ``status`` (for ``return fail(...)``)."""
    print(f"{prog}: {message}", file=sys.stderr)
    return status


def write_failure(prog: str, path: str, exc: OSError) -> int:
    """One line for a file that could not be written after all (status 1)."""
    return fail(prog, f"cannot write {path}: {exc.strerror or exc}")


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (``prog: error: ...``), status 2.

    The usage text stays behind ``-h``: a wrong value deserves the value and the fix, not a
    screen of flags.
    """

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")
