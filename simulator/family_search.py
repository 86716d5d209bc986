"""Strategy search over the GPT/Llama family's layouts: dp x cp x tp x pp, micro-batch size,
schedule, sequence parallelism, recompute, ZeRO 1-3 and overlap, priced by ``simulator.family_cost``.

    result = search_family(preset("llama3-405b"), devices=16384, global_batch=2048, hardware="h100-sxm")
    result.ranked[0].strategy          # FamilyStrategy(dp=..., tp=..., pp=..., cp=..., ...)

Every candidate that divides is enumerated (``enumerate_family``): heads and key/value heads by
tp, the sequence by ``2 cp``, the batch by dp and the micro-batch size; pipelines of 1F1B or
interleaved with 2 or 4 chunks (interleaved needs micro-batches a multiple of pp; layers that
do not divide the stages are split by ``stage_layer_counts``). Nothing is sampled. Two kinds of
proof keep the space small:

* **dominance** (``dominance=True``): a knob setting another setting is never worse than, in
  time and memory both, under this cost model, is not enumerated: ZeRO 1 over
  ZeRO 0 when ``dp * cp > 1`` (the same reduction bytes, a split optimizer); overlap on for
  ZeRO 0-2 (it only hides time and costs no memory; ZeRO 3's prefetch buffer makes it a real
  choice, so both are kept); ``selective`` recompute with fused attention (nothing to recompute:
  identical to ``none``). ``tests/test_family_search.py`` checks each on priced pairs.
* **bounds**: memory per rank is computed exactly before any timing (``family_cost.memory``) and
  what exceeds the limit is dropped, with every larger micro-batch of the same candidate
  (memory never shrinks as the micro-batch grows); the rest are priced best-first by
  ``step_time_lower_bound`` (the busiest pipeline rank's layers for every micro-batch) and the
  search stops once that bound reaches the ``top_k``-th best step found. ``exhaustive=True``
  prices every candidate that fits: the test checks both give the same top ``k``.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from simulator.candidate import Priced, search_inputs
from simulator.cost import HardwareProfile
from simulator.family import PRESETS, ModelShape, divisors
from simulator.family_cost import (
    FamilyStrategy,
    busiest_lane_layers,
    layer_costs,
    memory,
    price,
    state_bytes,
)

INTERLEAVED_CHUNKS = (2, 4)
Raw = tuple[int, int, int, int, bool, str, int, int, str, int, bool, int]
"""A candidate before it is built: ``FamilyStrategy``'s fields in order, then the micro-batch size."""


@dataclass(frozen=True)
class FamilyCandidate(Priced[FamilyStrategy]):
    def estimate_flags(self, model_flags: str, hardware: str) -> str:
        """``python -m simulator estimate`` flags that price this candidate again."""
        st = self.strategy
        flags = [
            model_flags,
            f"--micro-batch-size {self.micro_batch_size}",
            f"--mesh {st.mesh_text()}",
            f"--micro-batches {st.micro_batches}",
            f"--schedule {st.schedule}",
            f"--recompute {st.recompute}",
            f"--zero {st.zero}",
            f"--hardware {hardware}",
            "--mixed-precision",
        ]
        if st.chunks > 1:
            flags.append(f"--chunks {st.chunks}")
        if st.sequence_parallel:
            flags.append("--sequence-parallel")
        if st.overlap:
            flags.append("--overlap-grad-reduce")
        return " ".join(f for f in flags if f)

    def row(self) -> dict[str, object]:
        st = self.strategy
        return {
            "dp": st.dp,
            "tp": st.tp,
            "pp": st.pp,
            "cp": st.cp,
            "micro_batch_size": self.micro_batch_size,
            "micro_batches": st.micro_batches,
            "schedule": st.schedule,
            "chunks": st.chunks,
            "sequence_parallel": st.sequence_parallel,
            "recompute": st.recompute,
            "zero": st.zero,
            "overlap": st.overlap,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "peak_bytes": self.peak_bytes,
            "bubble_fraction": self.bubble_fraction,
        }

    def describe(self) -> str:
        st = self.strategy
        sched = st.schedule if st.chunks == 1 else f"{st.schedule} x{st.chunks}"
        knobs = [f"recompute {st.recompute}", f"ZeRO-{st.zero}"]
        if st.sequence_parallel:
            knobs.insert(0, "SP")
        if st.overlap:
            knobs.append("overlap")
        return (
            f"dp={st.dp} tp={st.tp} pp={st.pp} cp={st.cp} mbs={self.micro_batch_size} m={st.micro_batches} {sched} "
            + " ".join(knobs)
        )


@dataclass
class FamilySearchResult:
    shape: ModelShape
    devices: int
    global_batch: int
    hardware: str
    memory_limit: int
    ranked: list[FamilyCandidate]
    enumerated: int
    priced: int
    pruned: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    smallest: FamilyCandidate | None = None
    """When nothing fits: the candidate with the least memory, priced (for the advice)."""

    def advice(self) -> str:
        if self.ranked or self.smallest is None:
            return ""
        c = self.smallest
        return (
            f"nothing fits in {self.memory_limit / 2**30:.2f} GiB: the smallest candidate ({c.describe()}) needs "
            f"{c.peak_bytes / 2**30:.2f} GiB; try more devices, --recompute full or a longer pipeline"
        )


def enumerate_family(
    shape: ModelShape,
    devices: int,
    global_batch: int,
    pruned: dict[str, int],
    *,
    dominance: bool = True,
    state_limit: float | None = None,
    **space: object,
) -> Iterator[tuple[FamilyStrategy, int]]:
    """Every (strategy, micro-batch size) that divides (module docstring); ``pruned`` counts what
    it drops and why. ``space``: ``recomputes``, ``zero_stages``, ``schedules``,
    ``micro_batch_sizes`` (only these), ``context_parallel`` (only these cp degrees).
    ``state_limit``: drop (and count) what holds more model state than this alone."""

    def drop(reason: str, n: int = 1) -> None:
        pruned[reason] = pruned.get(reason, 0) + n

    for c in _candidates(shape, devices, global_batch, drop, dominance, state_limit, **space):  # type: ignore[arg-type]
        yield FamilyStrategy(*c[:11]), c[11]


def _candidates(
    shape: ModelShape,
    devices: int,
    global_batch: int,
    drop: Callable[..., None],
    dominance: bool,
    state_limit: float | None,
    *,
    recomputes: tuple[str, ...] = ("none", "selective", "full"),
    zero_stages: tuple[int, ...] = (0, 1, 2, 3),
    schedules: tuple[str, ...] = ("1F1B", "Interleaved1F1B"),
    micro_batch_sizes: tuple[int, ...] | None = None,
    context_parallel: tuple[int, ...] | None = None,
) -> Iterator[Raw]:
    """``enumerate_family``'s candidates as ``Raw`` tuples (a strategy's fields, then the micro-batch size)."""
    for tp in divisors(devices):
        if shape.heads % tp or (shape.kv % tp and tp % shape.kv):
            drop("heads or key/value heads not divisible by tp")
            continue
        for cp in divisors(devices // tp):
            if context_parallel is not None and cp not in context_parallel:
                continue
            if cp > 1 and shape.seq % (2 * cp):
                drop("sequence not divisible by 2 x cp")
                continue
            for pp in divisors(devices // tp // cp):
                if pp > shape.layers:
                    drop("more pipeline stages than layers")
                    continue
                dp = devices // tp // cp // pp
                if global_batch % dp:
                    drop("batch not divisible by dp")
                    continue
                yield from _knobs(
                    shape,
                    tp,
                    cp,
                    pp,
                    dp,
                    global_batch // dp,
                    dominance,
                    recomputes,
                    zero_stages,
                    schedules,
                    micro_batch_sizes,
                    drop,
                    state_limit,
                )


def _knobs(
    shape: ModelShape,
    tp: int,
    cp: int,
    pp: int,
    dp: int,
    per_replica: int,
    dominance: bool,
    recomputes: tuple[str, ...],
    zero_stages: tuple[int, ...],
    schedules: tuple[str, ...],
    micro_batch_sizes: tuple[int, ...] | None,
    drop: Callable[..., None],
    state_limit: float | None,
) -> Iterator[Raw]:
    replicas = dp * cp
    sps = (False, True) if tp > 1 else (False,)
    zeros = [z for z in zero_stages if replicas > 1 or z == 0]
    if dominance and replicas > 1 and 1 in zeros and 0 in zeros:
        zeros.remove(0)
    rcs = [r for r in recomputes if not (dominance and shape.attention == "fused" and r == "selective")]
    for mbs in divisors(per_replica):
        if micro_batch_sizes is not None and mbs not in micro_batch_sizes:
            continue
        m = per_replica // mbs
        for schedule in schedules if pp > 1 else ("1F1B",):
            for chunks in INTERLEAVED_CHUNKS if schedule == "Interleaved1F1B" else (1,):
                if chunks > 1 and (m % pp or shape.layers < pp * chunks):
                    drop("interleaved: micro-batches not a multiple of pp, or too few layers")
                    continue
                for sp in sps:
                    for zero in zeros:
                        if replicas == 1:
                            overlaps: tuple[bool, ...] = (False,)  # nothing to reduce or gather
                        else:
                            overlaps = (True,) if dominance and zero < 3 else (False, True)
                        for overlap in overlaps:
                            if (
                                state_limit is not None
                                and max(state_bytes(shape, tp, pp, chunks, replicas, zero, overlap)) > state_limit
                            ):
                                drop("model state alone over the memory limit", len(rcs))
                                continue
                            for rc in rcs:
                                yield (dp, tp, pp, cp, sp, rc, zero, m, schedule, chunks, overlap, mbs)


def search_family(
    shape: ModelShape,
    devices: int,
    global_batch: int,
    hardware: HardwareProfile | str = "h100-sxm",
    *,
    memory_limit: int | None = None,
    top_k: int = 5,
    exhaustive: bool = False,
    dominance: bool = True,
    progress: Callable[[int, int], None] | None = None,
    **space: object,
) -> FamilySearchResult:
    """The ``top_k`` fastest candidates within ``memory_limit`` (default: the profile's device
    memory), fastest first (module docstring). ``global_batch``: sequences per step.

    Best-first: every candidate gets its step-time lower bound (cheap: one layer's costs, shared
    by all candidates of a micro-batch size, tp, cp, sequence parallelism and recompute); they
    are taken in order of it, each checked for memory (exactly) and priced, until the bound
    reaches the ``top_k``-th best step found: no candidate left can be faster, whether it fits
    or not, so the rest are never built."""
    hw, limit = search_inputs(hardware, memory_limit, devices=devices, global_batch=global_batch, top_k=top_k)
    started = time.perf_counter()
    pruned: dict[str, int] = {}

    def drop(reason: str, n: int = 1) -> None:
        pruned[reason] = pruned.get(reason, 0) + n

    raw = list(
        _candidates(shape, devices, global_batch, drop, dominance, None if exhaustive else limit, **space)  # type: ignore[arg-type]
    )
    enumerated = len(raw) + sum(pruned.values())
    sized = {mbs: shape.sized(mbs) for mbs in {c[-1] for c in raw}}
    per_layer: dict[tuple[object, ...], float] = {}
    busiest: dict[tuple[int, int], int] = {}

    def lower_bound(c: Raw) -> float:
        """``step_time_lower_bound`` from the raw tuple (module docstring)."""
        tp, pp, cp, sp, rc, m, schedule, chunks, mbs = c[1], c[2], c[3], c[4], c[5], c[7], c[8], c[9], c[11]
        key = (mbs, tp, cp, sp, rc)
        if key not in per_layer:
            work = layer_costs(sized[mbs], FamilyStrategy(tp=tp, cp=cp, sequence_parallel=sp, recompute=rc), hw)
            per_layer[key] = work.forward + work.backward + work.weight
        if (pp, chunks) not in busiest:
            busiest[(pp, chunks)] = busiest_lane_layers(shape, FamilyStrategy(pp=pp, chunks=chunks, schedule=schedule))
        return m * busiest[(pp, chunks)] * per_layer[key]

    heap = [(0.0 if exhaustive else lower_bound(c), i) for i, c in enumerate(raw)]
    heapq.heapify(heap)
    total = len(heap)
    tokens = global_batch * shape.seq
    flops = shape.model_flops_per_token * tokens

    def candidate(c: Raw) -> FamilyCandidate:
        st, mbs = FamilyStrategy(*c[:11]), c[11]
        est = price(sized[mbs], st, hw)
        t = est.step_time_s
        return FamilyCandidate(
            st,
            mbs,
            t,
            est.peak_bytes,
            est.bubble_fraction,
            tokens / t,
            flops / (t * devices * est.peak_flops_per_device),
            est.peak_bytes <= limit,
        )

    # Memory never shrinks as the micro-batch grows with everything else kept (activations grow
    # with it; the micro-batches in flight, min(m, ...), times the size of one, never fall): once
    # a micro-batch size is over the limit, every larger one of the same candidate is too.
    over: dict[tuple[object, ...], int] = {}
    best: list[tuple[float, int, FamilyCandidate]] = []  # max-heap on step time (negated)
    priced = 0
    smallest: tuple[int, int] | None = None
    while heap:
        lb, i = heapq.heappop(heap)
        if len(best) >= top_k and lb >= -best[0][0]:
            drop("slower than the top candidates (bound)", len(heap) + 1)
            break
        c = raw[i]
        key, mbs = c[:11], c[11]
        if key in over and mbs >= over[key]:
            drop("over the memory limit (a smaller micro-batch already is)")
            continue
        peak = memory(sized[mbs], FamilyStrategy(*key), checked=True).peak
        if smallest is None or peak < smallest[0]:
            smallest = (peak, i)
        if peak > limit:
            drop("over the memory limit")
            over[key] = min(mbs, over.get(key, mbs))
            continue
        cand = candidate(c)
        priced += 1
        if progress is not None:
            progress(priced, total)
        item = (-cand.step_time_s, -i, cand)
        if len(best) < top_k:
            heapq.heappush(best, item)
        elif item > best[0]:
            heapq.heapreplace(best, item)
    ranked = [c for _, _, c in sorted(best, key=lambda x: (-x[0], -x[1]))]
    result = FamilySearchResult(shape, devices, global_batch, hw.name, limit, ranked, enumerated, priced, pruned)
    if not ranked:
        # Nothing fits: the candidate with the least memory, priced, for the advice.
        raw = list(_candidates(shape, devices, global_batch, lambda *a: None, dominance, None, **space))  # type: ignore[arg-type]
        sized = {mbs: shape.sized(mbs) for mbs in {c[-1] for c in raw}}
        peaks = [memory(sized[c[11]], FamilyStrategy(*c[:11]), checked=True).peak for c in raw]
        if peaks:
            result.smallest = candidate(raw[peaks.index(min(peaks))])
    result.seconds = time.perf_counter() - started
    return result


def model_flags(shape: ModelShape, preset_name: str | None = None) -> str:
    """``estimate``/``search`` flags that name ``shape`` (its preset, plus what differs from it)."""
    base = PRESETS.get(preset_name) if preset_name else None
    flags = []
    if base is not None:
        flags.append(f"--model {preset_name}")
    for name, flag in (
        ("layers", "--layers"),
        ("hidden", "--hidden"),
        ("heads", "--heads"),
        ("seq", "--seq"),
        ("vocab", "--vocab"),
        ("kv_heads", "--kv-heads"),
        ("ffn_hidden", "--ffn-hidden"),
        ("mlp", "--mlp"),
        ("norm", "--norm"),
        ("attention", "--attention"),
    ):
        value = getattr(shape, name)
        if value is None or (base is not None and getattr(base, name) == value):
            continue
        flags.append(f"{flag} {value}")
    if shape.untied and (base is None or not base.untied):
        flags.append("--untied")
    return " ".join(flags)
