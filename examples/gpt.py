"""A small character-level GPT trained on the Python standard library's own source files.

    python examples/gpt.py                                  # every rank in-process (simulator)
    python -m simulator -n 8 examples/gpt.py --mesh dp=2,tp=2,pp=2 --sequence-parallel
    python -m simulator --reference examples/gpt.py --tiny  # one big device
    mpiexec -n 8 python examples/gpt.py --mesh dp=2,tp=4 --zero 2 --recompute selective

The mesh is dp x tp per pipeline stage, pp stages (naive pipeline by reshard across stage
meshes); see mpipar/models/gpt.py for the layout. The text is the .py files of the running
interpreter's standard library, read in sorted order (characters outside ASCII become '?').
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np
from common import Progress, log_step, parser, setup

import mpipar as dist
from mpipar.io import DataLoader, Dataset, RandomBatchSampler
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel


def load_corpus(max_chars: int) -> np.ndarray:
    """Character codes (0..127) of the stdlib's .py files, sorted by path, up to ``max_chars``."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= max_chars:
                break
        if total >= max_chars:
            break
    if not chunks:
        raise SystemExit(f"no Python sources found under {root}")
    text = np.frombuffer(b"".join(chunks)[:max_chars], dtype=np.uint8).astype(np.int64)
    return np.where(text < 128, text, ord("?"))


class Windows(Dataset):
    """Sample i: the characters at i..i+T (input) and i+1..i+T+1 (target)."""

    def __init__(self, codes: np.ndarray, block: int) -> None:
        self.codes, self.block = codes, block

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.codes[i : i + self.block], self.codes[i + 1 : i + self.block + 1]

    def __len__(self) -> int:
        return len(self.codes) - self.block - 1


def parse_mesh(text: str) -> dict[str, int]:
    degrees = {"dp": 1, "tp": 1, "pp": 1}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in degrees or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--mesh: cannot read {part!r}; write e.g. dp=2,tp=2,pp=2")
        degrees[key] = int(value)
    return degrees


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=200)
    p.add_argument("--mesh", default="dp=1", help="degrees, e.g. dp=2,tp=2,pp=2 (their product is the world size)")
    p.add_argument("--sequence-parallel", action="store_true", help="split LayerNorm/Dropout regions along the sequence")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over the dp axis")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 16, or 8 with --tiny)")
    p.add_argument("--accumulate-steps", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--memory", action="store_true", help="print each rank's memory by category after step 0")
    args = p.parse_args()
    setup(args, seed=args.seed)
    if args.tiny:
        cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.1, dtype=args.dtype)
        batch, chars, lr = args.batch_size or 8, 50_000, args.lr or 3e-3
    else:
        cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0, dtype=args.dtype)
        batch, chars, lr = args.batch_size or 16, 2_000_000, args.lr or 3e-3
    degrees = parse_mesh(args.mesh)
    dp, tp, pp = degrees["dp"], degrees["tp"], degrees["pp"]
    backend = dist.current_backend()
    world = dp * tp * pp
    if (backend.name in ("mpi", "nccl") or getattr(backend, "_fixed", None) is not None) and backend.world_size != world:
        raise SystemExit(f"--mesh: dp({dp}) * tp({tp}) * pp({pp}) = {world} != world size {backend.world_size}")
    if batch % args.accumulate_steps:
        raise SystemExit(f"--batch-size {batch} is not divisible by --accumulate-steps {args.accumulate_steps}: micro-batches must be equal")
    if pp > cfg.n_layer:
        raise SystemExit(f"--mesh pp={pp} exceeds the {cfg.n_layer} layers to spread over stages")
    micro = batch // args.accumulate_steps

    par = GPTParallel.from_degrees(dp, tp, pp, sequence_parallel=args.sequence_parallel, recompute=args.recompute)
    model = GPT(cfg, par)
    opt = dist.optimizer.AdamW(learning_rate=lr, parameters=model.parameters(), weight_decay=0.01,
                               grad_clip=dist.optimizer.ClipGradByGlobalNorm(1.0))
    if args.zero:
        opt = dist.shard_optimizer(opt, [dist.ShardingStage1, dist.ShardingStage2, dist.ShardingStage3][args.zero - 1]("dp"))

    data = Windows(load_corpus(chars), cfg.block_size)
    sampler = RandomBatchSampler(len(data), micro, seed=args.seed, num_batches=args.steps * args.accumulate_steps)
    loader = dist.shard_dataloader(DataLoader(data, batch_sampler=sampler), par.stage_meshes[:1] + par.stage_meshes[-1:], shard_dims="dp")
    batches = iter(loader)
    progress = Progress(args.steps, batch * cfg.block_size)
    for step in range(args.steps):
        total = 0.0
        for _ in range(args.accumulate_steps):
            x, y = next(batches)
            loss = model.loss(x, y)
            if args.memory and step == 0:
                dist.print_once(dist.memory_report(model, opt, loss).table())
            if args.accumulate_steps > 1:
                loss = dist.scale(loss, 1.0 / args.accumulate_steps)
            loss.backward()
            total += float(loss)
        opt.step()
        opt.clear_grad()
        if step % args.log_every == 0 or step == args.steps - 1:
            progress.clear()
            log_step(step, total)
        progress.update(step + 1, total)
    progress.clear()


if __name__ == "__main__":
    main()
