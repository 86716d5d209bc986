"""Checkpoint throughput in the simulator: save_state_dict / load_state_dict vs np.save / np.load.

    .venv/bin/python benchmarks/checkpoint.py [--mib 256] [--repeat 3] [--dir /tmp]

Builds a model-like state (float32 embedding, linears on two pipeline stages, ZeRO-sharded
moments) of ``--mib`` MiB on dp2 x tp2 x pp2 (8 virtual ranks), and in the same run times:

* save: ``dist.save_state_dict`` (one safetensors file per writing rank, CRC-32C of every
  chunk, fsync of every file, metadata, rename) against ``np.save`` of every tensor's global
  array (the same bytes, one .npy each), both without and with an fsync per file: a checkpoint
  is only a checkpoint once it is on disk, so the fsynced baseline is the fair one;
* load: ``dist.load_state_dict`` into the saved layout (a resume) and into tp4 x dp2 (a
  changed mesh), each chunk read and CRC-checked, against ``np.load`` of every .npy file
  (which neither checks nor distributes anything).

Prints times, GB/s and the ratios (target: at most 1.5x). A load fills every replica: with a
tensor replicated over dp=2 the 8 virtual ranks hold twice its bytes, where ``np.load`` makes
one copy; the last column therefore also compares with ``np.load`` scaled to the bytes the
ranks hold. Best of ``--repeat`` runs; files are in the page cache for both sides, so this
measures the CPU path, not the disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from results import add_json_argument, record

import mpipar as dist
from simulator import SimBackend


def interleaved(
    cases: dict[str, Callable[[int], object]], repeat: int, cleanup: Callable[[str, int], object]
) -> dict[str, float]:
    """Best time of each case, the cases taking turns; each run starts with no dirty pages
    (``os.sync``), so one case's writeback does not slow down the next."""
    best = dict.fromkeys(cases, float("inf"))
    for i in range(repeat):
        for label, fn in cases.items():
            os.sync()
            t0 = time.perf_counter()
            fn(i)
            best[label] = min(best[label], time.perf_counter() - t0)
            cleanup(label, i)
    return best


def model_state(mib: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A 2-stage model's tensors on dp2 x tp2 meshes, about ``mib`` MiB of float32 in all."""
    s0 = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
    s1 = dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["dp", "tp"])
    hidden = 1024
    rows = max(8, mib * 2**20 // 4 // hidden // 8)  # eight tensors of rows x hidden float32
    rng = np.random.default_rng(0)
    R, S = dist.Replicate, dist.Shard
    layout = {
        "embedding.weight": (s0, [R(), S(0)]),
        "stage0.fc1.weight": (s0, [R(), S(1)]),
        "stage0.fc2.weight": (s0, [R(), S(0)]),
        "stage1.fc1.weight": (s1, [R(), S(1)]),
        "stage1.fc2.weight": (s1, [R(), S(0)]),
        "head.weight": (s1, [R(), S(1)]),
        "embedding.weight.moment1": (s0, [S(0), S(0)]),
        "head.weight.moment1": (s1, [S(0), S(1)]),
    }
    values = {name: rng.random((rows, hidden), dtype=np.float32) for name in layout}
    model = {name: dist.shard_tensor(values[name], mesh, pls) for name, (mesh, pls) in layout.items()}
    return {"model": model, "step": 1000}, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    add_json_argument(parser)
    args = parser.parse_args()
    record(args.json, __file__)
    dist.set_backend(SimBackend(8))
    state, values = model_state(args.mib)
    nbytes = sum(v.nbytes for v in values.values())
    root = tempfile.mkdtemp(prefix="mpipar-ckpt-bench-", dir=args.dir)
    print(f"state: {len(values)} float32 tensors, {nbytes / 2**20:.0f} MiB, on dp2 x tp2 x pp2 (8 virtual ranks)")

    def np_save(i: int, fsync: bool) -> None:
        d = os.path.join(root, f"npys{i}" if fsync else f"npy{i}")
        os.mkdir(d)
        for name, v in values.items():
            with open(os.path.join(d, name + ".npy"), "wb") as f:
                np.save(f, v)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

    dirs = {"np.save": "npy", "np.save + fsync": "npys", "save_state_dict": "ck"}
    saves = interleaved(
        {
            "np.save": lambda i: np_save(i, False),
            "np.save + fsync": lambda i: np_save(i, True),
            "save_state_dict": lambda i: dist.save_state_dict(state, os.path.join(root, f"ck{i}")),
        },
        args.repeat,
        lambda label, i: shutil.rmtree(os.path.join(root, f"{dirs[label]}{i}")),
    )

    np_save(0, False)
    dist.save_state_dict(state, os.path.join(root, "ck"))
    npy = os.path.join(root, "npy0")

    same = {n: (t.process_mesh, t.placements) for n, t in state["model"].items()}
    tp4dp2 = dist.ProcessMesh(np.arange(8).reshape(4, 2).T.tolist(), dim_names=["dp", "tp"])

    def targets(layout: Callable[[str], Any]) -> list[dict[str, Any]]:
        out = []
        for _ in range(args.repeat):  # built outside the timed region
            model = {}
            for name, v in values.items():
                mesh, pls = layout(name)
                model[name] = dist.shard_tensor(np.zeros(v.shape, np.float32), mesh, pls)
            out.append({"model": model, "step": 0})
        return out

    def held(model: dict[str, Any]) -> int:
        return sum(t.local_tensor(r).nbytes for t in model.values() for r in t.hosted_ranks)

    same_targets = targets(lambda n: same[n])
    other_targets = targets(lambda n: (tp4dp2, [dist.Replicate(), dist.Shard(1)]))
    ck = os.path.join(root, "ck")
    loads = interleaved(
        {
            "np.load": lambda i: [np.load(os.path.join(npy, n + ".npy")) for n in values],
            "same": lambda i: dist.load_state_dict(same_targets[i], ck),
            "other": lambda i: dist.load_state_dict(other_targets[i], ck),
        },
        args.repeat,
        lambda label, i: None,
    )
    t_np_save, t_np_save_sync, t_save = saves["np.save"], saves["np.save + fsync"], saves["save_state_dict"]
    t_np_load, t_load_same, t_load_other = loads["np.load"], loads["same"], loads["other"]
    held_same, held_other = held(same_targets[0]["model"]), held(other_targets[0]["model"])

    check = {"model": {n: dist.to_tensor(np.zeros_like(v)) for n, v in values.items()}, "step": 0}
    dist.load_state_dict(check, os.path.join(root, "ck"))
    assert all(np.array_equal(check["model"][n].full_tensor(), values[n]) for n in values)
    shutil.rmtree(root)

    gbs = nbytes / 1e9
    rows = [
        ("np.save (no fsync)", t_np_save, None),
        ("np.save + fsync", t_np_save_sync, None),
        ("save_state_dict", t_save, (t_np_save_sync, t_np_save)),
        ("np.load", t_np_load, None),
        ("load_state_dict, same layout", t_load_same, (t_np_load, held_same / nbytes)),
        ("load_state_dict, tp4 x dp2", t_load_other, (t_np_load, held_other / nbytes)),
    ]
    print(f"{'':32} {'time':>9} {'GB/s':>7}  ratio")
    for label, t, base in rows:
        ratio = ""
        if base is not None and label.startswith("save"):
            ratio = f"{t / base[0]:.2f}x np.save+fsync, {t / base[1]:.2f}x np.save"
        elif base is not None:
            ratio = (
                f"{t / base[0]:.2f}x np.load; ranks hold {base[1]:.2f}x the bytes: "
                f"{t / (base[0] * base[1]):.2f}x np.load of as many bytes"
            )
        print(f"{label:32} {t * 1e3:7.1f}ms {gbs / t:7.2f}  {ratio}")
    print("target: at most 1.5x")


if __name__ == "__main__":
    main()
