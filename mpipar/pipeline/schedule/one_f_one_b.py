"""1F1B (PipeDream-flush, Megatron's default): warm up, then alternate one forward, one backward.

Stage ``i`` of ``p`` first runs ``p-1-i`` warm-up forwards, then pairs ``(F x, B x-(p-1-i))``
until the forwards run out, then the remaining backwards. Written as one loop over ``x``::

    for x in range(m + p - 1):
        F x              if x < m
        B x-(p-1-i)      if 0 <= x-(p-1-i) < m

Same bubble as FThenB, (p-1)/(m+p-1), but stage ``i`` holds at most min(p-i, m) micro-batches
of activations. ``python -m simulator schedule 1F1B -p 4 -m 8`` shows it.
"""

from __future__ import annotations

from mpipar.pipeline.actions import Action, B, F


def compute_order(num_ranks: int, num_chunks: int, num_microbatches: int) -> list[list[Action]]:
    assert num_chunks == 1
    p, m = num_ranks, num_microbatches
    orders: list[list[Action]] = []
    for stage in range(p):
        lag = p - 1 - stage
        row: list[Action] = []
        for x in range(m + p - 1):
            if x < m:
                row.append(F(stage, x))
            if 0 <= x - lag < m:
                row.append(B(stage, x - lag))
        orders.append(row)
    return orders
