"""A priced layout's headline numbers, and the other pieces the traced search and the family
search share: their input checks and the frame of their JSON report."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from simulator.cost import HardwareProfile, load_profile

S = TypeVar("S")


@dataclass(frozen=True)
class Priced(Generic[S]):
    """``strategy`` (the search's own strategy type) priced: step time, peak bytes per device, ..."""

    strategy: S
    micro_batch_size: int
    step_time_s: float
    peak_bytes: int
    bubble_fraction: float
    tokens_per_s: float
    mfu: float
    fits: bool


def ranking_lines(
    head: str, pruned: dict[str, int], ranked: Sequence[Priced[S]], step: str, details: list[list[str]]
) -> list[str]:
    """The searches' text output: ``head``, what was pruned, then each candidate's headline
    (``step``: ``"s"`` or ``"ms"``) and its ``details`` lines."""
    out = [head + "; pruned: " + (", ".join(f"{v} {k}" for k, v in pruned.items()) or "none")]
    for rank, (c, lines) in enumerate(zip(ranked, details, strict=True), 1):
        t = f"{c.step_time_s:.3f} s" if step == "s" else f"{c.step_time_s * 1e3:.2f} ms"
        out.append(
            f"#{rank} step {t}  {c.tokens_per_s:,.0f} tokens/s  MFU {c.mfu:.1%}  "
            f"peak {c.peak_bytes / 2**30:.2f} GiB  bubble {c.bubble_fraction:.1%}"
        )
        out += [f"   {line}" for line in lines]
    return out


def search_inputs(
    hardware: HardwareProfile | str, memory_limit: int | None, **counts: object
) -> tuple[HardwareProfile, int]:
    """Check a search's ``counts`` (each a positive int), then its profile and the memory limit it
    ranks within (default: the profile's device memory)."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"search {name} must be a positive int, got {value!r}")
    hw = load_profile(hardware) if isinstance(hardware, str) else hardware
    limit = memory_limit if memory_limit is not None else hw.memory_bytes
    if limit is None:
        raise ValueError(f"hardware profile {hw.name!r} has no memory_bytes; pass memory_limit (bytes)")
    return hw, limit


class SearchReport(Protocol):
    """What both searches' results report (``SearchResult``, ``FamilySearchResult``)."""

    devices: int
    global_batch: int
    memory_limit: int
    enumerated: int
    priced: int
    pruned: dict[str, int]
    seconds: float

    @property
    def ranked(self) -> Sequence[Priced[Any]]: ...

    def advice(self) -> str: ...


def print_json_report(result: SearchReport, top: list[dict[str, Any]], **first: object) -> None:
    """``search --json``: ``first`` (keys that lead), the search's accounting, then ``top``."""
    json.dump(
        {
            **first,
            "devices": result.devices,
            "global_batch": result.global_batch,
            "memory_limit": result.memory_limit,
            "enumerated": result.enumerated,
            "priced": result.priced,
            "pruned": result.pruned,
            "seconds": result.seconds,
            "advice": result.advice(),
            "top": top,
        },
        sys.stdout,
        indent=1,
    )
    sys.stdout.write("\n")


def print_ranking(result: SearchReport, head: str, step: str, details: list[list[str]]) -> int:
    """The searches' text output (``ranking_lines``), then the advice when nothing fits; the exit
    status: 0 when a candidate fits, 1 when none does."""
    print("\n".join(ranking_lines(head, result.pruned, result.ranked, step, details)))
    if not result.ranked:
        print(result.advice())
        return 1
    return 0
