"""Simulator overhead: one GPT training step on 8 virtual ranks (dp2 x tp4) vs the same step
as one big device (--reference), measured in the same process.

    .venv/bin/python benchmarks/simulator_overhead.py [--steps 3] [--tiny]

Prints the time per step of both and the ratio (target: at most 1.5x). The virtual run does
the same arithmetic split over 8 shards, plus the reshards; replicas that hold the same
arrays compute once.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from results import add_json_argument, record

import mpipar as dist
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
from simulator import ReferenceBackend, SimBackend


def run(backend: dist.backend.Backend, cfg: GPTConfig, batch: int, steps: int) -> tuple[float, list[float]]:
    with dist.use_backend(backend):
        dist.seed(0)
        par = GPTParallel.from_degrees(dp=2, tp=4)
        model = GPT(cfg, par)
        opt = dist.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
        rng = np.random.default_rng(0)
        first, losses, times = par.stage_meshes[0], [], []
        for _ in range(steps + 1):
            idx = rng.integers(0, cfg.vocab_size, (batch, cfg.block_size))
            tgt = rng.integers(0, cfg.vocab_size, (batch, cfg.block_size))
            x = dist.shard_tensor(idx, first, [dist.Shard(0), dist.Replicate()])
            y = dist.shard_tensor(tgt, first, [dist.Shard(0), dist.Replicate()])
            t0 = time.perf_counter()
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            opt.clear_grad()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        return min(times[1:]), losses  # the first step warms rule and plan caches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    add_json_argument(p)
    args = p.parse_args()
    record(args.json, __file__)
    if args.tiny:
        cfg, batch = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32), 8
    else:
        cfg, batch = GPTConfig(vocab_size=128, block_size=128, n_layer=4, n_head=8, n_embd=256), 16
    ref_t, ref_losses = run(ReferenceBackend(), cfg, batch, args.steps)
    sim_t, sim_losses = run(SimBackend(8), cfg, batch, args.steps)
    drift = max(abs(a - b) / abs(a) for a, b in zip(ref_losses, sim_losses, strict=True))
    print(f"GPT {cfg.n_layer} layers, d={cfg.n_embd}, T={cfg.block_size}, batch {batch}, float32")
    print(f"  reference (one device)   {ref_t * 1e3:8.1f} ms/step")
    print(f"  8 virtual ranks dp2xtp4  {sim_t * 1e3:8.1f} ms/step   ratio {sim_t / ref_t:.2f} (target <= 1.5)")
    print(f"  losses agree to {drift:.1e} relative")


if __name__ == "__main__":
    main()
