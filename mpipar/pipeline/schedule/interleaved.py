"""Interleaved 1F1B (virtual pipeline stages): each rank holds ``v`` chunks of the model.

With ``p`` ranks and ``v`` chunks there are ``p*v`` stages; stage ``s`` runs on rank ``s mod p``,
so rank ``r`` holds stages ``r, r+p, r+2p, ...`` (chunk ``c`` of rank ``r`` is stage ``c*p + r``).
Micro-batches go through in ``max(1, m // p)`` groups of near-equal size ``g`` (``g = p`` when
``p`` divides ``m``; never below ``min(m, p)``). For each group a rank runs the group's forwards
on chunk 0, then chunk 1, ..., and its backwards on the chunks in reverse order. Rank ``r`` warms
up with ``(v-1)*g + 2*(p-1-r)`` forwards, then alternates one forward and one backward, then
drains the backwards (Narayanan et al. 2021; Megatron-LM's order when ``p`` divides ``m``).

Each chunk does 1/v of a rank's work, so the bubble shrinks to (p-1)/(v*m + p-1). Groups are
near-equal rather than ``p`` plus a short remainder: a short group after a full one makes rank
0's warm-up need forwards that other ranks run only after backwards rank 0 has not yet done.
``python -m simulator schedule Interleaved1F1B -p 4 -v 2 -m 8`` shows it.
"""

from __future__ import annotations

from mpipar.pipeline.actions import Action, B, F


def compute_order(num_ranks: int, num_chunks: int, num_microbatches: int) -> list[list[Action]]:
    p, v, m = num_ranks, num_chunks, num_microbatches
    rounds = max(1, m // p)
    sizes = [m // rounds + (1 if i < m % rounds else 0) for i in range(rounds)]
    starts = [sum(sizes[:i]) for i in range(rounds)]
    groups = [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]
    orders: list[list[Action]] = []
    for rank in range(p):
        forwards = [F(c * p + rank, mb) for group in groups for c in range(v) for mb in group]
        backwards = [B(c * p + rank, mb) for group in groups for c in reversed(range(v)) for mb in group]
        total = len(forwards)
        warmup = min(total, (v - 1) * sizes[0] + 2 * (p - 1 - rank))
        row = forwards[:warmup]
        for k in range(total - warmup):
            row += [forwards[warmup + k], backwards[k]]
        row += backwards[total - warmup :]
        orders.append(row)
    return orders
