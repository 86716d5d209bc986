"""Training steps with and without overlapped gradient reduction: the same bits, the same bytes.

    mpiexec -n 4 python tests/mpi_scripts/overlap_step.py --layout dp
    mpiexec -n 4 python tests/mpi_scripts/overlap_step.py --layout dp_tp --hidden 67 --inner 1100 --bucket-mib 1

A four-layer MLP (float64; layer 0's weight is used twice and a scale vector three times, so
leaves get several gradient contributions) trains a few SGD steps twice from the same start:
once as usual, once under ``overlap_grad_reduction`` with small buckets. Rank 0 prints one
line per fact the tests check: the losses and parameters agree bit for bit, all-reduce bytes
are equal and counts are as bucketed, and the first bucket started before backward's last op.
``run`` is also imported by ``tests/mpi/test_overlap.py`` to do the same in the simulator.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import numpy as np

import mpipar as dist

HIDDEN, INNER, BATCH = 16, 48, 8


def _mesh(layout: str) -> tuple[dist.ProcessMesh, list[Any], list[Any], list[Any]]:
    """The mesh and the placements of the batch, the column-split and the row-split weights."""
    if layout == "dp":
        mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        return mesh, [dist.Shard(0)], [dist.Replicate()], [dist.Replicate()]
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    return mesh, [dist.Shard(0), dist.Replicate()], [dist.Replicate(), dist.Shard(1)], [dist.Replicate(), dist.Shard(0)]


def run(
    layout: str,
    overlap: bool,
    bucket_mib: float = 0.004,
    steps: int = 3,
    hidden: int = HIDDEN,
    inner: int = INNER,
    zero: int = 0,
) -> dict[str, Any]:
    """Train ``steps`` steps (``zero``: with that ZeRO stage over dp); the losses, each parameter's global value, the all-reduce counts
    and bytes of the last step, and (with overlap) the recorded start/op order of its backward."""
    mesh, data_pl, col_pl, row_pl = _mesh(layout)
    rng = np.random.default_rng(7)
    names = ["w0", "w1", "w2", "w3", "scale"]
    shapes = [(hidden, inner), (inner, hidden), (hidden, inner), (inner, hidden), (hidden,)]
    places = [col_pl, row_pl, col_pl, row_pl, [dist.Replicate()] * mesh.ndim]
    params = []
    for shape, pl in zip(shapes, places, strict=True):
        p = dist.shard_tensor(dist.to_tensor(rng.standard_normal(shape) * 0.2), mesh, pl)
        p.stop_gradient = False
        params.append(p)
    w0, w1, w2, w3, scale = params
    opt = dist.optimizer.SGD(learning_rate=0.1, parameters=params)
    if zero:  # ZeRO-2/3 over dp: gradients reduce-scattered, not all-reduced (never bucketed)
        opt = dist.shard_optimizer(opt, {2: dist.ShardingStage2, 3: dist.ShardingStage3}[zero]("dp"))
    losses: list[float] = []
    record: dict[str, Any] = {}
    # Without overlap: the per-gradient path (the default buckets turned off), the baseline.
    setting = dist.overlap_grad_reduction(bucket_mib=bucket_mib if overlap else None, record=True)
    for step in range(steps):
        x = dist.shard_tensor(
            dist.to_tensor(np.random.default_rng(100 + step).standard_normal((BATCH, hidden))), mesh, data_pl
        )
        h = dist.tanh(dist.matmul(dist.multiply(x, scale), w0))
        h = dist.matmul(h, w1)
        h = dist.multiply(h, scale)
        h = dist.tanh(dist.matmul(h, w2))
        h = dist.matmul(dist.multiply(h, dist.tanh(dist.matmul(x, w0))), w3)  # w0 again
        y = dist.multiply(h, scale)
        loss = dist.mean(dist.multiply(y, y))
        with dist.CommDebugMode() as comm:
            if setting is not None:
                setting.events.clear()
                with setting:
                    loss.backward()
            else:
                loss.backward()
        record = {"counts": comm.counts(), "bytes": comm.bytes_by_op()}
        if setting is not None:
            record["events"] = list(setting.events)
        losses.append(float(loss))
        assert all(p.grad is not None for p in params)
        opt.step()
        opt.clear_grad()
    values = {n: np.asarray(p.full_tensor()) for n, p in zip(names, params, strict=True)}
    return {"losses": losses, "values": values, **record}


def started_cases(seed: int = 5) -> tuple[int, list[str]]:
    """``all_reduce_start(...).wait()`` against the blocking ``all_reduce``, bit for bit, on the
    current backend's communicator: small and large, even and uneven sizes, every op, float
    and integer dtypes, several started at once and waited for in reverse order. Returns the
    number of cases and the kinds of ``Pending`` the communicator handed out."""
    backend = dist.current_backend()
    comm = backend.comm
    world = dist.get_world_size()
    groups = [tuple(range(world)), tuple(range(0, world, 2)), (world - 1,)]
    cases = 0
    kinds: set[str] = set()
    rng = np.random.default_rng(seed)
    for size in (1, 3, 1000, 16381, 70000):
        for dtype in ("float64", "float32", "int64"):
            for op in ("sum", "avg", "max", "min"):
                if dtype == "int64" and op == "avg":
                    continue
                started, blocking = [], []
                for group in groups:
                    hosted = [r for r in group if backend.hosts(r)]
                    if not hosted:
                        continue
                    values = {r: (rng.standard_normal(size) * 100).astype(dtype) for r in group}
                    bufs = {r: values[r] for r in hosted}
                    started.append(comm.all_reduce_start(group, bufs, op))
                    blocking.append(comm.all_reduce(group, bufs, op))
                for pending, want in reversed(list(zip(started, blocking, strict=True))):
                    kinds.add(type(pending).__name__)
                    got = pending.wait()
                    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
                    for r in got:
                        assert got[r].dtype == want[r].dtype and got[r].tobytes() == want[r].tobytes(), (
                            size,
                            dtype,
                            op,
                            r,
                        )
                    cases += 1
    return cases, sorted(kinds)


def _starts(result: dict[str, Any]) -> int:
    return sum(1 for e in result["events"] if e[0] == "start")


def digest(result: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for loss in result["losses"]:
        h.update(np.float64(loss).tobytes())
    for name in sorted(result["values"]):
        h.update(result["values"][name].tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["dp", "dp_tp"], default="dp")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--inner", type=int, default=INNER)
    ap.add_argument("--bucket-mib", type=float, default=0.004)
    ap.add_argument("--cases", action="store_true", help="check started all-reduces against blocking ones instead")
    args = ap.parse_args()
    if args.cases:
        dist.ProcessMesh(list(range(4)))  # starts the backend
        cases, kinds = started_cases()
        dist.print_once(f"ok {cases} started all-reduces ({', '.join(kinds)})")
        return
    sizes = {"hidden": args.hidden, "inner": args.inner}
    plain = run(args.layout, overlap=False, **sizes)
    over = run(args.layout, overlap=True, bucket_mib=args.bucket_mib, **sizes)
    one = run(args.layout, overlap=True, bucket_mib=0.0, **sizes)
    events = over["events"]
    first_start = next(i for i, e in enumerate(events) if e[0] == "start")
    last_op = max(i for i, e in enumerate(events) if e[0] == "op")
    starts_during = sum(1 for e in events[:last_op] if e[0] == "start")
    dist.print_once(f"digest plain {digest(plain)} overlap {digest(over)} per-gradient {digest(one)}")
    dist.print_once(f"losses {plain['losses']}")
    dist.print_once(
        f"all_reduce plain {plain['counts'].get('all_reduce', 0)} x {plain['bytes'].get('all_reduce', 0)} B, "
        f"overlap {over['counts'].get('all_reduce', 0)} x {over['bytes'].get('all_reduce', 0)} B, "
        f"per-gradient {one['counts'].get('all_reduce', 0)} x {one['bytes'].get('all_reduce', 0)} B"
    )
    dist.print_once(f"buckets overlap {_starts(over)} per-gradient {_starts(one)}")
    other = {k: v for k, v in plain["counts"].items() if k != "all_reduce"}
    other_over = {k: v for k, v in over["counts"].items() if k != "all_reduce"}
    dist.print_once(f"other collectives plain {sorted(other.items())} overlap {sorted(other_over.items())}")
    dist.print_once(
        f"first start at event {first_start}, last backward op at {last_op}, buckets started before it {starts_during}"
    )


if __name__ == "__main__":
    main()
