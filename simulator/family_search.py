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

from simulator.cost import HardwareProfile, load_profile
from simulator.family import ModelShape, divisors
from simulator.family_cost import FamilyStrategy, memory, price, state_bytes, step_time_lower_bound

INTERLEAVED_CHUNKS = (2, 4)


@dataclass(frozen=True)
class FamilyCandidate:
    strategy: FamilyStrategy
    micro_batch_size: int
    step_time_s: float
    peak_bytes: int
    bubble_fraction: float
    tokens_per_s: float
    mfu: float
    fits: bool

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
    recomputes: tuple[str, ...] = ("none", "selective", "full"),
    zero_stages: tuple[int, ...] = (0, 1, 2, 3),
    schedules: tuple[str, ...] = ("1F1B", "Interleaved1F1B"),
    micro_batch_sizes: tuple[int, ...] | None = None,
    context_parallel: tuple[int, ...] | None = None,
    state_limit: float | None = None,
) -> Iterator[tuple[FamilyStrategy, int]]:
    """Every (strategy, micro-batch size) that divides (module docstring); ``pruned`` counts what
    it drops and why. ``context_parallel``: only these cp degrees (default: every one that
    divides). ``state_limit``: drop (and count) what holds more model state than this alone."""

    def drop(reason: str, n: int = 1) -> None:
        pruned[reason] = pruned.get(reason, 0) + n

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
) -> Iterator[tuple[FamilyStrategy, int]]:
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
                                yield (
                                    FamilyStrategy(dp, tp, pp, cp, sp, rc, zero, m, schedule, chunks, overlap),
                                    mbs,
                                )


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
    memory), fastest first (module docstring). ``global_batch``: sequences per step."""
    for name, value in (("devices", devices), ("global_batch", global_batch), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"search {name} must be a positive int, got {value!r}")
    hw = load_profile(hardware) if isinstance(hardware, str) else hardware
    limit = memory_limit if memory_limit is not None else hw.memory_bytes
    if limit is None:
        raise ValueError(f"hardware profile {hw.name!r} has no memory_bytes; pass memory_limit (bytes)")
    started = time.perf_counter()
    pruned: dict[str, int] = {}
    todo = list(
        enumerate_family(
            shape,
            devices,
            global_batch,
            pruned,
            dominance=dominance,
            state_limit=None if exhaustive else limit,
            **space,  # type: ignore[arg-type]
        )
    )
    enumerated = len(todo) + sum(pruned.values())
    sized = {mbs: shape.sized(mbs) for mbs in {mbs for _, mbs in todo}}
    heap: list[tuple[float, int]] = []
    smallest: tuple[int, int] | None = None
    # Memory never shrinks as the micro-batch grows with everything else kept (activations grow
    # with it; the micro-batches in flight, min(m, ...), times the size of one, never fall): once
    # a micro-batch size is over the limit, the larger ones of the same candidate are too. The
    # enumeration yields micro-batch sizes in increasing order.
    over: set[tuple[object, ...]] = set()
    for i, (st, mbs) in enumerate(todo):
        key = (
            st.dp,
            st.tp,
            st.pp,
            st.cp,
            st.sequence_parallel,
            st.recompute,
            st.zero,
            st.schedule,
            st.chunks,
            st.overlap,
        )
        if not exhaustive and key in over:
            pruned["over the memory limit (a smaller micro-batch already is)"] = (
                pruned.get("over the memory limit (a smaller micro-batch already is)", 0) + 1
            )
            continue
        peak = memory(sized[mbs], st, checked=True).peak
        if smallest is None or peak < smallest[0]:
            smallest = (peak, i)
        if peak > limit:
            pruned["over the memory limit"] = pruned.get("over the memory limit", 0) + 1
            over.add(key)
            continue
        heap.append((0.0 if exhaustive else step_time_lower_bound(sized[mbs], st, hw), i))
    heapq.heapify(heap)
    total = len(heap)
    tokens = global_batch * shape.seq
    flops = shape.model_flops_per_token * tokens

    def candidate(i: int) -> FamilyCandidate:
        st, mbs = todo[i]
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

    best: list[tuple[float, int, FamilyCandidate]] = []  # max-heap on step time (negated)
    priced = 0
    while heap:
        lb, i = heapq.heappop(heap)
        if len(best) >= top_k and lb >= -best[0][0]:
            pruned["slower than the top candidates (bound)"] = len(heap) + 1
            break
        cand = candidate(i)
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
    if not ranked and smallest is None and not exhaustive:
        # Every candidate's model state alone was over the limit: find the smallest for the advice.
        todo = list(enumerate_family(shape, devices, global_batch, {}, dominance=dominance, **space))  # type: ignore[arg-type]
        sized = {mbs: shape.sized(mbs) for mbs in {mbs for _, mbs in todo}}
        peaks = [memory(sized[mbs], st, checked=True).peak for st, mbs in todo]
        if peaks:
            smallest = (min(peaks), peaks.index(min(peaks)))
    if not ranked and smallest is not None:
        result.smallest = candidate(smallest[1])
    result.seconds = time.perf_counter() - started
    return result


def model_flags(shape: ModelShape, preset_name: str | None = None) -> str:
    """``estimate``/``search`` flags that name ``shape`` (its preset, plus what differs from it)."""
    from simulator.family import PRESETS

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
