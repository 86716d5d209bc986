"""Fully automatic mode for a training script: which hardware profile to price on, and the search.

``examples/gpt.py --auto`` calls ``resolve_profile`` (``--profile PATH``, else this machine's
cached calibration ``~/.cache/mpipar/profile-<world>.json``, measured by ``python -m simulator
calibrate`` when missing, else the ``cpu-local`` preset) and then ``choose`` (the strategy search
over the script's own model shape, world size and global batch, in a space small enough to take
seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import mpipar as dist
from mpipar.env import env_text
from mpipar.models.gpt import GPT
from simulator.backend import ShapeOnlyBackend
from simulator.cost import HardwareProfile, load_profile
from simulator.estimate import estimate
from simulator.search import RECOMPUTES, SearchResult, divisors, search
from simulator.step_trace import GPTShape, GPTStrategy

FALLBACK_PRESET = "cpu-local"
CALIBRATE_TIMEOUT_S = 180.0
# Launcher variables an MPI job sets: calibrate's own ``mpiexec -n`` must not inherit them, or it
# would try to join the job it runs in instead of starting its own.
_LAUNCH_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "MPICH_", "OMPI_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")


@dataclass(frozen=True)
class ResolvedProfile:
    profile: HardwareProfile
    source: str
    """Where it came from, for the user: the path given, the cache (found or just measured), or the fallback."""


def cache_path(world: int) -> str:
    """This machine's calibrated profile for a world of ``world`` ranks."""
    return os.path.join(os.path.expanduser("~"), ".cache", "mpipar", f"profile-{world}.json")


def calibrate_to(path: str, ranks: int, timeout_s: float = CALIBRATE_TIMEOUT_S) -> None:
    """Run ``python -m simulator calibrate -n ranks -o path`` in a clean environment; raise on failure."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    cmd = [sys.executable, "-m", "simulator", "calibrate", "-n", str(max(2, ranks)), "-o", path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(cmd[1:])}` took over {timeout_s:g} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"`{' '.join(cmd[1:])}` failed (exit {proc.returncode}): {tail[0]}")


def has_cpu_model(profile: HardwareProfile) -> bool:
    """Whether ``profile`` holds the whole measured CPU model ``calibrate`` writes: kernel rates by
    size, the kernel probe behind ``kernel_scale`` (its scale, or why the probe failed), the
    host cost of an optimizer-phase op and a data-parallel gradient reduction's cost."""
    return (
        bool(profile.gemm_curve)
        and "kernel_probe" in (profile.calibration or {})
        and profile.optimizer_op_overhead_s is not None
        and profile.grad_sync_s is not None
    )


def resolve_profile(
    path: str | None,
    world: int,
    can_calibrate: bool,
    say: Callable[[str], None],
    why_not: str = "no launcher fixed the world size (run under `python -m simulator -n N` or mpiexec to calibrate)",
) -> ResolvedProfile:
    """The profile to price on: ``path`` (a file or preset name; an error if unreadable), else the
    cached calibration for ``world`` ranks (measured now when missing or unreadable, if
    ``can_calibrate``; else ``why_not`` says why not), else the ``cpu-local`` preset. ``say`` gets
    one line per decision."""
    if path is not None:
        try:
            return ResolvedProfile(load_profile(path), path)
        except (ValueError, OSError) as exc:  # FileFormatError is a ValueError
            raise ValueError(f"--profile {path!r}: {exc}") from None
    cached = cache_path(world)
    if os.path.isfile(cached):
        try:
            found = load_profile(cached)
            if has_cpu_model(found) or not can_calibrate:
                return ResolvedProfile(found, f"{cached} (cached calibration)")
            # Calibrated before the CPU model (kernel rates by size, host costs per op, the kernel
            # scale of a training step): the search would rank on what this machine's steps do not cost.
            say(
                f"auto: the cached profile {cached} predates the measured CPU model (no gemm_curve or kernel "
                "probe); measuring again"
            )
        except (ValueError, OSError) as exc:
            say(f"auto: the cached profile {cached} is unreadable ({exc}); measuring again")
    if not can_calibrate:
        say(f"auto: no calibrated profile at {cached} and {why_not}; using the {FALLBACK_PRESET!r} preset")
        return ResolvedProfile(load_profile(FALLBACK_PRESET), f"preset {FALLBACK_PRESET} (fallback)")
    say(
        f"auto: {'re' if os.path.isfile(cached) else 'no calibrated profile at ' + cached + ': '}running "
        f"`python -m simulator calibrate -n {max(2, world)}` (once, cached)"
    )
    try:
        calibrate_to(cached, world)
        return ResolvedProfile(load_profile(cached), f"{cached} (calibrated just now)")
    except (RuntimeError, ValueError, OSError) as exc:
        say(f"auto: calibration failed ({exc}); using the {FALLBACK_PRESET!r} preset")
        return ResolvedProfile(load_profile(FALLBACK_PRESET), f"preset {FALLBACK_PRESET} (fallback)")


def memory_limit(profile: HardwareProfile, world: int) -> int:
    """Bytes per rank: the profile's device memory, or (a CPU preset has none) this host's memory
    shared by the ``world`` ranks that run on it."""
    if profile.memory_bytes is not None:
        return profile.memory_bytes
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(host) // max(1, world)


def choose(
    shape: GPTShape,
    world: int,
    global_batch: int,
    profile: HardwareProfile,
    top_k: int = 2,
    limit_bytes: int | None = None,
    grad_clip: float | None = None,
) -> SearchResult:
    """The search over dp x tp x pp of ``world``, sequence parallelism, ZeRO 0-3, recompute none,
    selective and full, every micro-batch count and schedule, in the script's precision (no mixed
    precision), within ``limit_bytes`` per rank (default ``memory_limit(profile, world)``).
    Recompute only trades time for memory, so it wins only where less recompute does not fit: the
    search drops a recomputing candidate unpriced once the same strategy with less recompute was
    priced and fits (``search``'s dominance rule), which keeps the larger space to seconds.
    ``grad_clip``: the global norm the script's optimizer clips to (its clipping is priced).

    Runs under a backend of its own: the traces build meshes of up to ``2 x tp`` ranks, which the
    script's backend (a world fixed at ``world`` ranks, perhaps fewer) would refuse."""
    if limit_bytes is not None and (
        isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 1
    ):
        raise ValueError(f"memory limit must be a positive number of bytes, got {limit_bytes!r}")
    limit = memory_limit(profile, world) if limit_bytes is None else limit_bytes
    with dist.use_backend(ShapeOnlyBackend()):
        return search(
            shape,
            world,
            global_batch,
            profile,
            memory_limit=limit,
            top_k=top_k,
            mixed_precision=False,
            recomputes=RECOMPUTES,
            drop_dominated=True,
            grad_clip=grad_clip,
        )


PIPELINE_SCHEDULES = ("FThenB", "1F1B", "ZBH1")


@dataclass(frozen=True)
class PipelineChoice:
    """``Strategy(auto=True)``'s pick for a model whose layout is fixed: schedule and micro-batches."""

    schedule: str
    micro_batches: int
    step_time_s: float
    runner_up: tuple[str, int, float] | None
    profile: str

    def report(self) -> str:
        line = (
            f"Strategy(auto=True): schedule {self.schedule}, {self.micro_batches} micro-batches "
            f"(predicted step {1e3 * self.step_time_s:.3f} ms on {self.profile})"
        )
        if self.runner_up is not None:
            kind, m, t = self.runner_up
            line += f"; runner-up {kind}, {m} micro-batches ({1e3 * t:.3f} ms)"
        return line


def _degree(mesh: object, axis: str) -> int:
    names = getattr(mesh, "dim_names", [])
    return int(mesh.get_dim_size(axis)) if axis in names else 1  # type: ignore[attr-defined]


def choose_pipeline(layer: object, global_batch: int, world: int, say: Callable[[str], None]) -> PipelineChoice:
    """The fastest pipeline schedule and micro-batch count for a ``mpipar.models.gpt.GPT`` whose
    dp x tp x pp layout, sequence parallelism, recompute and chunks are already built: each
    candidate priced by ``estimate`` on ``$MPIPAR_PROFILE`` (a file or preset), else this
    machine's cached calibration for ``world`` ranks, else ``cpu-local`` (no calibration from
    inside a training step: it launches ``mpiexec``)."""
    if not isinstance(layer, GPT):
        raise ValueError(
            f"Strategy(auto=True) prices mpipar.models.gpt.GPT models, got {type(layer).__name__}; "
            "set strategy.pipeline.schedule_mode and accumulate_steps by hand"
        )
    cfg, par = layer.cfg, layer.par
    meshes = par.stage_meshes or []
    dp = _degree(meshes[0], par.dp) if meshes else 1
    tp = _degree(meshes[0], par.tp) if meshes else 1
    pp = max(1, len(meshes))
    if global_batch % dp:
        raise ValueError(f"Strategy(auto=True): the batch of {global_batch} does not split over dp={dp}")
    shape = GPTShape(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size, 1, cfg.dropout)
    resolved = resolve_profile(
        env_text("MPIPAR_PROFILE"),
        world,
        can_calibrate=False,
        say=say,
        why_not="a training step does not calibrate (run `python -m simulator calibrate` once, or set MPIPAR_PROFILE)",
    )
    hw, limit = resolved.profile, memory_limit(resolved.profile, world)
    schedules = ("Interleaved1F1B",) if par.chunks > 1 else PIPELINE_SCHEDULES if pp > 1 else ("1F1B",)
    per_replica = global_batch // dp
    priced: list[tuple[float, str, int]] = []
    with dist.use_backend(ShapeOnlyBackend()):
        for kind in schedules:
            for m in divisors(per_replica):
                st = GPTStrategy(
                    dp, tp, pp, par.sequence_parallel and tp > 1, par.recompute, 0, False, "adamw", m, kind, par.chunks
                )
                sized = GPTShape(
                    shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab, per_replica // m, shape.dropout
                )
                est = estimate(sized, st, hw)
                if max(est.peak_bytes_per_rank.values()) <= limit:
                    priced.append((est.step_time_s, kind, m))
    if not priced:
        raise ValueError(
            f"Strategy(auto=True): no schedule and micro-batch count fits in {limit / 2**30:.2f} GiB per rank"
        )
    priced.sort()
    (t, kind, m), rest = priced[0], priced[1:]
    return PipelineChoice(kind, m, t, (rest[0][1], rest[0][2], rest[0][0]) if rest else None, hw.name)
