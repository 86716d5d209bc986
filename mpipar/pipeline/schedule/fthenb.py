"""FThenB (GPipe): every micro-batch forward, then every micro-batch backward, on each stage.

Rank ``r`` (stage ``r``) runs ``rF0 .. rF(m-1)`` then ``rB0 .. rB(m-1)``. Simple and with the
same bubble as 1F1B, (p-1)/(m+p-1), but every stage holds all ``m`` micro-batches' activations
at its peak. ``python -m simulator schedule FThenB -p 4 -m 8`` shows it.
"""

from __future__ import annotations

from mpipar.pipeline.actions import Action, B, F


def compute_order(num_ranks: int, num_chunks: int, num_microbatches: int) -> list[list[Action]]:
    assert num_chunks == 1
    return [
        [F(rank, mb) for mb in range(num_microbatches)] + [B(rank, mb) for mb in range(num_microbatches)]
        for rank in range(num_ranks)
    ]
