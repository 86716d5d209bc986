"""Schedule kinds and ``build_schedule``: one file per kind, each giving per-rank compute orders.

==================  =========================  ===========================================
kind                file                       bubble fraction (unit cost, no comm)
==================  =========================  ===========================================
``FThenB``          ``fthenb.py``              (p-1)/(m+p-1)
``1F1B``            ``one_f_one_b.py``         (p-1)/(m+p-1)
``Interleaved1F1B`` ``interleaved.py``         (p-1)/(v*m+p-1)
``ZBH1``            ``zbh1.py``                bubble time (p-1)(tF+tB-tW) per rank
==================  =========================  ===========================================

A kind only orders F/B/W per rank; ``Schedule.from_compute_orders`` places the sends and
receives (``mpipar/pipeline/lower.py``) and every built schedule is dry-run before it is
returned. To add a kind: a file with ``compute_order(num_ranks, num_chunks, num_microbatches)``
and a row in ``KINDS``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from mpipar.pipeline.actions import Action
from mpipar.pipeline.schedule import fthenb, interleaved, one_f_one_b, zbh1
from mpipar.pipeline.schedule.base import Schedule


@dataclass(frozen=True)
class ScheduleKind:
    name: str
    compute_order: Callable[[int, int, int], list[list[Action]]]
    split_backward: bool
    virtual_stages: bool
    summary: str


KINDS: dict[str, ScheduleKind] = {
    k.name: k
    for k in (
        ScheduleKind("FThenB", fthenb.compute_order, False, False, "all forwards, then all backwards (GPipe)"),
        ScheduleKind("1F1B", one_f_one_b.compute_order, False, False, "warm-up, one forward one backward, drain"),
        ScheduleKind(
            "Interleaved1F1B", interleaved.compute_order, False, True, "1F1B over num_chunks virtual stages per rank"
        ),
        ScheduleKind("ZBH1", zbh1.compute_order, True, False, "zero bubble H1: backward split into B and W"),
    )
}
_ALIASES = {
    "fthenb": "FThenB",
    "f-then-b": "FThenB",
    "gpipe": "FThenB",
    "1f1b": "1F1B",
    "interleaved1f1b": "Interleaved1F1B",
    "interleaved": "Interleaved1F1B",
    "vpp": "Interleaved1F1B",
    "zbh1": "ZBH1",
    "zb-h1": "ZBH1",
    "zb_h1": "ZBH1",
}


def resolve_kind(kind: str) -> ScheduleKind:
    """The schedule kind for a name (case-insensitive; ``GPipe``, ``VPP``, ``ZB-H1`` are aliases)."""
    if not isinstance(kind, str):
        raise TypeError(f"schedule kind must be a string such as '1F1B', got {kind!r}")
    name = _ALIASES.get(kind.strip().lower())
    if name is None:
        raise ValueError(f"unknown pipeline schedule kind {kind!r}; use one of {', '.join(KINDS)}")
    return KINDS[name]


def build_schedule(kind: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Per-rank action lists for ``num_stages`` stages and ``num_microbatches`` micro-batches.

    ``num_chunks`` > 1 only for ``Interleaved1F1B``: ``num_stages = ranks * num_chunks`` and stage
    ``s`` runs on rank ``s mod ranks``. The result is dry-run (rendezvous send/recv) before it is
    returned. Results are cached: a ``Schedule`` is an immutable value.
    """
    spec = resolve_kind(kind)
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches), ("num_chunks", num_chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"build_schedule({spec.name!r}): {name} must be a positive int, got {value!r}")
    if num_chunks != 1 and not spec.virtual_stages:
        raise ValueError(
            f"build_schedule({spec.name!r}): num_chunks={num_chunks} needs virtual stages; use 'Interleaved1F1B' "
            f"or num_chunks=1"
        )
    if num_stages % num_chunks:
        raise ValueError(
            f"build_schedule({spec.name!r}): num_stages ({num_stages}) = ranks x num_chunks ({num_chunks}) has no "
            f"integer number of ranks; pick num_stages a multiple of num_chunks"
        )
    return _build(spec.name, num_stages, num_microbatches, num_chunks)


@functools.lru_cache(maxsize=256)
def _build(name: str, num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
    spec = KINDS[name]
    num_ranks = num_stages // num_chunks
    if name == "Interleaved1F1B" and num_chunks == 1:
        # One chunk per rank is plain 1F1B; Megatron's interleaved warm-up would only add memory.
        orders = one_f_one_b.compute_order(num_ranks, 1, num_microbatches)
    else:
        orders = spec.compute_order(num_ranks, num_chunks, num_microbatches)
    schedule = Schedule.from_compute_orders(
        orders, num_stages, num_microbatches, kind=name, split_backward=spec.split_backward
    )
    schedule.validate()
    return schedule


__all__ = ["KINDS", "Schedule", "ScheduleKind", "build_schedule", "resolve_kind"]
