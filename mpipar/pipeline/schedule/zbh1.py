"""ZBH1 (zero bubble, handcrafted H1): 1F1B with backward split into B (input grad) and W (weights).

Only B is on the critical path between stages; W of a micro-batch can run any time after its
B, so ZBH1 delays it to fill the bubbles 1F1B leaves in its cool-down. Stage ``i`` of ``p``
runs triples ``(F x, B x-(p-1-i), W x-(p-1))``, skipping indices outside ``0..m-1``::

    for x in range(m + p - 1):
        F x              if x < m
        B x-(p-1-i)      if 0 <= x-(p-1-i) < m
        W x-(p-1)        if 0 <= x-(p-1) < m

With F, B, W times tF, tB, tW and tW <= min(tF, tB), the bubble per rank is (p-1)(tF+tB-tW):
a third of 1F1B's when all three are equal (a longer W no longer fits the cool-down gaps).
Stage 0 still holds at most ``p`` micro-batches in flight, as in 1F1B (Qi et al.,
"Zero Bubble Pipeline Parallelism", 2023). ``python -m simulator schedule ZBH1 -p 4 -m 8``.
"""

from __future__ import annotations

from mpipar.pipeline.actions import Action, B, F, W


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
            if 0 <= x - (p - 1) < m:
                row.append(W(stage, x - (p - 1)))
        orders.append(row)
    return orders
