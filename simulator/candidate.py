"""A priced layout's headline numbers, shared by the traced search and the family search."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

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
