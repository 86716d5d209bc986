"""Random reshard cases under MPI, each checked against the simulator run in the same process.

    mpiexec -n 4 python tests/mpi_scripts/reshard_cases.py --cases 150 --seed 1

Every rank draws the same seeded cases: meshes up to 3-d over the MPI world (shuffled ids,
subsets of ranks), shapes with uneven and empty shards, every placement including Partial
with each reduce type (genuinely partial sources: each partial coordinate holds its own
values), same-mesh and cross-mesh pairs, float64/float32/int64. For each case it checks

(a) the global value (``full_tensor``, a collective) equals the dense source,
(b) this rank's resulting local shard equals the simulator's bit for bit (the simulator runs
    the same case in-process under ``use_backend(SimBackend(world))``),
(c) the ``CommDebugMode`` events this rank records equal the simulator's events of the groups
    this rank belongs to (op, group, reduce op, dtype, reason, and sizes where the simulator
    reports this rank's buffers),
(d) printing the result, on one rank only in some cases, communicates nothing (a print that
    waited for the other ranks would hang the job), and shows the global value exactly when
    this rank's shard determines it, else this rank's piece labelled as such.

Rank 0 prints ``ok <n> cases`` at the end; any failure raises (and aborts the job).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import mpipar as dist
from mpipar.comm import CommEvent
from mpipar.placement import Partial, Placement, Replicate, Shard
from mpipar.tensor_text import held_value
from simulator import SimBackend

REDUCERS = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}
FAMILIES = [("sum", "avg"), ("max",), ("min",), ("sum",), ("avg",)]


def random_mesh(rng: np.random.Generator, world: int) -> dist.ProcessMesh:
    ndim = int(rng.integers(1, 4))
    shape: list[int] = []
    for _ in range(ndim):
        room = world // int(np.prod(shape or [1]))
        shape.append(int(rng.integers(1, max(1, min(4, room)) + 1)))
    n = int(np.prod(shape))
    ids = rng.permutation(world)[:n]
    return dist.ProcessMesh(ids.reshape(shape), dim_names=["x", "y", "z"][:ndim])


def random_placements(rng: np.random.Generator, mesh: dist.ProcessMesh, ndim: int, dtype: np.dtype) -> list[Placement]:
    # Integer avg floors after each partial axis, so its value is not the dense mean: float only.
    families = FAMILIES if dtype.kind == "f" else [f for f in FAMILIES if "avg" not in f]
    family = families[int(rng.integers(len(families)))]
    options: list[Placement] = [Replicate()] + [Shard(d) for d in range(ndim)] + [Partial(op) for op in family]
    return [options[int(rng.integers(len(options)))] for _ in range(mesh.ndim)]


def make_source(spec: dist.DistSpec, rng: np.random.Generator, dtype: np.dtype) -> tuple[dist.Tensor, np.ndarray]:
    """A tensor laid out as ``spec`` whose partial coordinates hold different values, and its value."""
    p_axes = spec.partial_axes
    k = [spec.mesh.shape[a] for a in p_axes]
    contributions = rng.integers(-50, 50, size=(*k, *spec.shape)).astype(np.float64)
    if dtype.kind == "f":
        contributions += rng.random(contributions.shape)  # inexact sums: bit-identity matters
    contributions = contributions.astype(dtype)
    expected = contributions.astype(np.float64)
    for a in reversed(p_axes):
        op = spec.placements[a].reduce_type  # type: ignore[union-attr]
        expected = REDUCERS[op](expected, axis=len(expected.shape) - len(spec.shape) - 1)

    def local(rank: int) -> np.ndarray:
        coord = spec.mesh.coordinate(rank)
        part = contributions[tuple(coord[a] for a in p_axes)]
        return np.array(part[tuple(slice(s, e) for s, e in spec.local_box(rank))])

    backend = dist.current_backend()
    if backend.name == "mpi":
        # One shard, or none: an empty array still tells a rank outside the mesh the dtype.
        me = backend.rank
        given: Any = local(me) if me in spec.mesh.process_ids else np.empty(0, dtype=dtype)
    else:
        given = local
    t = dist.dtensor_from_local(given, spec.mesh, list(spec.placements), shape=spec.shape)
    return t, expected


def comparable(e: CommEvent, me: int) -> tuple[Any, ...]:
    """What must agree between this rank's MPI event and the simulator's for the same call."""
    return (e.op, e.ranks, e.reduce_type, e.dtype, e.context)


def sizes_agree(mpi: CommEvent, sim: CommEvent, me: int) -> bool:
    """The simulator reports the first member's buffers (the sender's, for a send)."""
    if mpi.op == "send":
        if me == mpi.ranks[0]:
            return (mpi.input_nbytes, mpi.output_nbytes) == (sim.input_nbytes, sim.output_nbytes)
        return mpi.output_nbytes == sim.output_nbytes
    if mpi.op == "broadcast":
        return mpi.output_nbytes == sim.output_nbytes
    if me == mpi.ranks[0]:
        return (mpi.input_nbytes, mpi.output_nbytes) == (sim.input_nbytes, sim.output_nbytes)
    return True


def run_case(index: int, rng: np.random.Generator, world: int, me: int) -> None:
    shape = [int(s) for s in rng.integers(0, 8, size=int(rng.integers(0, 4)))]
    mesh0 = random_mesh(rng, world)
    mesh1 = mesh0 if rng.random() < 0.6 else random_mesh(rng, world)
    dtype = np.dtype(["float64", "float32", "int64"][int(rng.integers(3))])
    src = dist.DistSpec(shape, mesh0, random_placements(rng, mesh0, len(shape), dtype))
    dst = dist.DistSpec(shape, mesh1, random_placements(rng, mesh1, len(shape), dtype))
    data_seed = int(rng.integers(2**31))
    label = f"case {index}: {dtype}{shape} {src} -> {dst}"

    with dist.CommDebugMode() as mpi_log:
        t, expected = make_source(src, np.random.default_rng(data_seed), dtype)
        out = dist.reshard(t, mesh1, list(dst.placements))
    mine = out.local_tensor(me) if me in mesh1.process_ids else None
    full = out.full_tensor()

    with dist.use_backend(SimBackend(world)), dist.CommDebugMode() as sim_log:
        s_t, _ = make_source(src, np.random.default_rng(data_seed), dtype)
        s_out = dist.reshard(s_t, mesh1, list(dst.placements))
    sim_mine = s_out.local_tensor(me) if me in mesh1.process_ids else None

    # (a) the global value
    if src.is_partial or dst.is_partial or dtype != np.float64:
        tol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(full, expected, rtol=tol, atol=tol * 100, err_msg=label)
    else:
        np.testing.assert_array_equal(full, expected, err_msg=label)
    # (b) this rank's shard, bit for bit
    if (mine is None) != (sim_mine is None):
        raise AssertionError(
            f"{label}: rank {me} holds a shard under MPI: {mine is not None}, in the simulator: {sim_mine is not None}"
        )
    if mine is not None:
        mine, sim_mine = np.asarray(mine), np.asarray(sim_mine)
        if mine.dtype != sim_mine.dtype or mine.shape != sim_mine.shape or mine.tobytes() != sim_mine.tobytes():
            raise AssertionError(
                f"{label}: rank {me}'s shard differs from the simulator's:\nMPI {mine.dtype}{list(mine.shape)} "
                f"{mine.tolist()}\nsim {sim_mine.dtype}{list(sim_mine.shape)} {sim_mine.tolist()}"
            )
    # (d) printing: no communication, so a print on some ranks only cannot hang
    if me == index % world or index % 3 == 0:
        with dist.CommDebugMode() as print_log:
            text = str(out)
        if print_log.events:
            raise AssertionError(f"{label}: printing communicated: {print_log.events}")
        whole = held_value(dst, {me: mine} if mine is not None else {})
        if whole is not None:
            np.testing.assert_allclose(whole, full, rtol=0, atol=0, err_msg=label)
        want_label = (
            "GlobalDenseTensor=" if whole is not None
            else "GlobalDenseTensor not on this rank" if mine is None
            else f"LocalDenseTensor(rank {me}, "
        )  # fmt: skip
        if want_label not in text:
            raise AssertionError(f"{label}: rank {me} printed {text!r}, expected {want_label!r} in it")
    # (c) the recorded communication of this rank's groups
    sim_events = [e for e in sim_log.events if me in e.ranks]
    got = [comparable(e, me) for e in mpi_log.events]
    want = [comparable(e, me) for e in sim_events]
    if got != want:
        raise AssertionError(
            f"{label}: rank {me} recorded\n  "
            + "\n  ".join(map(str, mpi_log.events))
            + "\nbut the simulator's events of its groups are\n  "
            + "\n  ".join(map(str, sim_events))
        )
    for m, s in zip(mpi_log.events, sim_events, strict=True):
        if not sizes_agree(m, s, me):
            raise AssertionError(f"{label}: rank {me} event sizes differ: MPI {m} vs simulator {s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    backend = dist.current_backend()
    assert backend.name == "mpi", f"run me under mpiexec (backend is {backend.name})"
    world, me = dist.get_world_size(), dist.get_rank()
    rng = np.random.default_rng([args.seed, world])
    for i in range(args.cases):
        run_case(i, rng, world, me)
    dist.print_once(f"ok {args.cases} cases on {world} ranks")


if __name__ == "__main__":
    main()
