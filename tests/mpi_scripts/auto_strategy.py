"""``dist.Strategy(auto=True)`` on a two-stage GPT: ``auto`` or ``<schedule> <micro-batches>``.

    MPIPAR_PROFILE=cpu-local mpiexec -n 2 python tests/mpi_scripts/auto_strategy.py auto
    python -m simulator -n 2 tests/mpi_scripts/auto_strategy.py ZBH1 2

Three float64 steps of ``to_static`` with dropout; prints ``loss <v>`` per step and ``chosen
<schedule> <micro-batches>`` (the schedule every process ran) on rank 0.
"""

from __future__ import annotations

import sys

import numpy as np

import mpipar as dist
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel, gpt_loss


def main(argv: list[str]) -> None:
    dist.seed(7)
    dist.nn.set_default_dtype("float64")
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.1, dtype="float64")
    model = GPT(cfg, GPTParallel.from_degrees(1, 1, 2))
    opt = dist.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    if argv[0] == "auto":
        strategy = dist.Strategy(auto=True)
    else:
        strategy = dist.Strategy(
            {"pipeline": {"enable": True, "schedule_mode": argv[0], "accumulate_steps": int(argv[1])}}
        )
    step = dist.to_static(model, None, gpt_loss, opt, strategy)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x, y = rng.integers(0, 32, (8, 8)), rng.integers(0, 32, (8, 8))
        dist.print_once(f"loss {float(step(dist.Tensor(x), dist.Tensor(y))):.17g}", flush=True)
    assert step.schedule is not None
    dist.print_once(f"chosen {step.schedule.kind} {step.microbatches}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
