"""Strategy search (fully automatic mode): enumerate GPT training strategies for a
device count and global batch, drop the ones that do not divide or do not fit in memory, price
the rest with ``simulator.estimate`` and rank them by predicted step time.

The search knows nothing of the cost model's internals: it only calls ``estimate`` and reads
``step_time_s`` and ``peak_bytes_per_rank``, so it stays correct when the model changes.
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from mpipar import cliargs
from mpipar.pipeline import resolve_kind
from simulator.candidate import Priced, print_json_report, print_ranking, search_inputs
from simulator.cost import HardwareProfile
from simulator.estimate import Estimate, estimate, parse_count
from simulator.estimate import build_parser as estimate_parser
from simulator.family_cli import (
    add_family_arguments,
    family_shape,
    resolve_family_defaults,
    resolve_gpt_defaults,
    wants_family,
)
from simulator.family_search import model_flags, search_family
from simulator.fast_estimate import (
    TraceCache,
    applicable,
    layer_counts,
    lower_bound_stage_times,
    peak_lower_bound,
    stage_parts,
)
from simulator.step_trace import GPTShape, GPTStrategy

SCHEDULES = ("FThenB", "1F1B", "Interleaved1F1B", "ZBH1")
RECOMPUTES = ("none", "selective", "full")
INTERLEAVED_CHUNKS = (2, 4)


def model_flops_per_step(shape: GPTShape, global_batch: int) -> float:
    """Model FLOPs of one training step, forward and backward, no recompute: Narayanan et al. 2021
    Eq. 3 with 72 for its 96 (which counts a full recompute), as ``Estimate.model_flops`` does."""
    b, s, n, h, v = global_batch, shape.seq, shape.layers, shape.hidden, shape.vocab
    return 72.0 * b * s * n * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * n * h))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Candidate(Priced[GPTStrategy]):
    """A priced strategy: the estimate's headline numbers and the flags that reproduce it."""

    def estimate_flags(self, shape: GPTShape, hardware: str) -> str:
        st = self.strategy
        flags = [
            f"--layers {shape.layers} --hidden {shape.hidden} --heads {shape.heads} --seq {shape.seq} "
            f"--vocab {shape.vocab} --micro-batch-size {self.micro_batch_size}",
            f"--mesh dp={st.dp},tp={st.tp},pp={st.pp}",
            f"--micro-batches {st.micro_batches}",
            f"--schedule {st.schedule}",
            f"--recompute {st.recompute}",
            f"--zero {st.zero}",
            f"--hardware {hardware}",
        ]
        if st.chunks > 1:
            flags.append(f"--chunks {st.chunks}")
        if st.sequence_parallel:
            flags.append("--sequence-parallel")
        if st.mixed_precision:
            flags.append("--mixed-precision")
        return " ".join(flags)

    def gpt_flags(self) -> str:
        """``examples/gpt.py`` flags of the same parallel layout (the example's mesh and pipeline knobs)."""
        st = self.strategy
        flags = f"--mesh dp={st.dp},tp={st.tp},pp={st.pp} --micro-batches {st.micro_batches} --schedule {st.schedule}"
        if st.chunks > 1:
            flags += f" --chunks {st.chunks}"
        return flags


@dataclass
class SearchResult:
    """Ranked candidates (fastest first, all within the memory limit) and the search's accounting."""

    shape: GPTShape
    devices: int
    global_batch: int
    hardware: str
    memory_limit: int
    ranked: list[Candidate]
    enumerated: int
    pruned: dict[str, int] = field(default_factory=dict)
    priced: int = 0
    over_memory: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0

    def advice(self) -> str:
        """Why nothing fits: the closest candidate's shortfall and the knobs that lower memory."""
        if self.ranked or not self.over_memory:
            return ""
        best = min(self.over_memory, key=lambda c: c.peak_bytes)
        st = best.strategy
        knobs = []
        if st.zero < 3:
            knobs.append("a higher ZeRO stage")
        if st.recompute != "full":
            knobs.append("--recompute full")
        knobs.append("more devices (larger tp or pp)")
        return (
            f"nothing fits in {self.memory_limit / 2**30:.2f} GiB: the smallest candidate "
            f"(dp={st.dp},tp={st.tp},pp={st.pp}, zero {st.zero}, recompute {st.recompute}) needs "
            f"{best.peak_bytes / 2**30:.2f} GiB, {(best.peak_bytes - self.memory_limit) / 2**30:.2f} GiB over; "
            f"try {', '.join(knobs)}"
        )


def enumerate_strategies(
    shape: GPTShape,
    devices: int,
    global_batch: int,
    pruned: dict[str, int],
    *,
    zero_stages: tuple[int, ...] = (0, 1, 2, 3),
    recomputes: tuple[str, ...] = RECOMPUTES,
    schedules: tuple[str, ...] = SCHEDULES,
    mixed_precision: bool = True,
    micro_batch_sizes: tuple[int, ...] | None = None,
    grad_clip: float | None = None,
) -> Iterator[tuple[GPTStrategy, int]]:
    """Every (strategy, micro-batch size) that divides: heads by tp, layers by pp x chunks,
    batch by dp x micro-batches x micro-batch size. Counts what it drops in ``pruned``.
    ``micro_batch_sizes``: only these (default: every divisor of the batch per replica).
    ``grad_clip``: every strategy clips gradients to that global norm (the script's optimizer does)."""

    def drop(reason: str) -> None:
        pruned[reason] = pruned.get(reason, 0) + 1

    for tp in divisors(devices):
        if shape.heads % tp:
            drop("heads not divisible by tp")
            continue
        for pp in divisors(devices // tp):
            dp = devices // tp // pp
            if global_batch % dp:
                drop("batch not divisible by dp")
                continue
            per_replica = global_batch // dp
            for mbs in divisors(per_replica):
                if micro_batch_sizes is not None and mbs not in micro_batch_sizes:
                    continue
                micro = per_replica // mbs
                for schedule in schedules if pp > 1 else ("1F1B",):
                    for chunks in INTERLEAVED_CHUNKS if schedule == "Interleaved1F1B" else (1,):
                        if shape.layers % (pp * chunks):
                            drop("layers not divisible by pp x chunks")
                            continue
                        for sp in (False, True) if tp > 1 else (False,):
                            for zero in zero_stages if dp > 1 else (0,):
                                for rc in recomputes:
                                    yield (
                                        GPTStrategy(
                                            dp,
                                            tp,
                                            pp,
                                            sp,
                                            rc,
                                            zero,
                                            mixed_precision,
                                            "adamw",
                                            micro,
                                            schedule,
                                            chunks,
                                            grad_clip,
                                        ),
                                        mbs,
                                    )


def state_lower_bound(shape: GPTShape, strategy: GPTStrategy, layers: int | None = None) -> float:
    """Bytes of model state on a pipeline rank, at least: its share of the layers' weight matrices
    and biases (``12h^2 + 13h`` per layer, split ``tp`` ways, no replicated norms or embedding),
    times the bytes each parameter keeps (parameter, gradient, optimizer states and master
    weights), the ZeRO-split ones over ``dp``. The true state is never smaller: shards are at
    least the average and everything left out only adds. ``layers``: that many layers instead."""
    h = shape.hidden
    per_layer = (12 * h * h + 13 * h) / strategy.tp
    layers = shape.layers // strategy.pp if layers is None else layers
    mixed = strategy.mixed_precision
    param = grad = 2 if mixed else 4
    states = {"adamw": 8, "momentum": 4}[strategy.optimizer] + (4 if mixed else 0)
    dp, z = strategy.dp, strategy.zero
    return (
        layers
        * per_layer
        * (param / (dp if z >= 3 else 1) + grad / (dp if z >= 2 else 1) + states / (dp if z >= 1 else 1))
    )


def state_per_layer_lower_bound(shape: GPTShape, strategy: GPTStrategy) -> float:
    """``state_lower_bound`` of one layer: what every layer a rank holds costs it, at least."""
    return state_lower_bound(shape, strategy, layers=1)


def _chain_bound(stages: list[tuple[float, float, float]], strategy: GPTStrategy) -> float:
    """A step-time lower bound from per-stage (forward, backward input, backward weight) seconds of
    one micro-batch: pipeline rank k cannot start before micro-batch 0 crossed the stages before
    its first, then computes all its actions one at a time, and (unsplit backward) its last
    backward still has to reach stage 0."""
    m, pp = strategy.micro_batches, strategy.pp
    split = resolve_kind(strategy.schedule).split_backward
    best = 0.0
    fill = drain = 0.0
    for k in range(pp):
        work = sum(m * sum(stages[s]) for s in range(k, len(stages), pp))
        best = max(best, fill + work + (0.0 if split else drain))
        fill += stages[k][0]
        drain += stages[k][1] + stages[k][2]
    return best


def _in_flight_lower_bound(strategy: GPTStrategy) -> int:
    """Micro-batches the first pipeline rank holds at once, at least (FThenB: all of them)."""
    if strategy.schedule == "FThenB":
        return strategy.micro_batches
    return min(strategy.micro_batches, strategy.pp)


def search(
    shape: GPTShape,
    devices: int,
    global_batch: int,
    hardware: HardwareProfile | str = "h100-nvlink-ib",
    *,
    memory_limit: int | None = None,
    top_k: int = 5,
    progress: Callable[[int, int], None] | None = None,
    fast: bool = True,
    drop_dominated: bool = False,
    **space: object,
) -> SearchResult:
    """Rank the strategies that divide and fit within ``memory_limit`` (default: the profile's
    device memory) by predicted step time; ``space``: ``enumerate_strategies`` options.

    ``fast`` (default): branch and bound over ``simulator.fast_estimate``, whose numbers equal
    ``estimate``'s. A candidate is dropped unpriced when a lower bound already rules it out:
    model state alone over the limit (``state_lower_bound``), state plus the activations its
    first pipeline rank must hold over the limit, or a step-time lower bound (GEMM FLOPs at the
    profile's best GEMM rate, then the traced costs of its micro-batch size) no better than the
    ``top_k``-th best priced so far. Every candidate it returns was priced exactly.
    ``fast=False`` calls ``estimate`` on every candidate (slow; the reference).

    ``drop_dominated`` (fast path only): a recomputing candidate is dropped unpriced once the
    same strategy and micro-batch size with less recompute was priced and fits: recompute only
    adds work, so it can never be faster, and the ranking then lists distinct layouts, not one
    layout at three recompute levels (``--auto``'s choice and runner-up). Off by default: the
    top k are then exactly the exhaustive search's.
    """
    hw, limit = search_inputs(hardware, memory_limit, devices=devices, global_batch=global_batch)
    started = time.perf_counter()
    pruned: dict[str, int] = {}
    todo = list(enumerate_strategies(shape, devices, global_batch, pruned, **space))  # type: ignore[arg-type]
    enumerated = len(todo) + sum(pruned.values())
    flops = model_flops_per_step(shape, global_batch)
    peak_rate = max(hw.flops_per_s.values()) * devices

    def candidate(strategy: GPTStrategy, mbs: int, t: float, peak: int, bubble: float) -> Candidate:
        return Candidate(
            strategy, mbs, t, peak, bubble, global_batch * shape.seq / t, flops / t / peak_rate, peak <= limit
        )

    def sized(mbs: int) -> GPTShape:
        return GPTShape(shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab, mbs, shape.dropout)

    fitting: list[Candidate] = []
    over: list[Candidate] = []
    if not fast:
        for i, (strategy, mbs) in enumerate(todo):
            est: Estimate = estimate(sized(mbs), strategy, hw)
            cand = candidate(strategy, mbs, est.step_time_s, max(est.peak_bytes_per_rank.values()), est.bubble_fraction)
            (fitting if cand.fits else over).append(cand)
            if progress is not None:
                progress(i + 1, len(todo))
    else:
        fitting, over = _branch_and_bound(
            shape, todo, hw, limit, top_k, pruned, candidate, sized, progress, drop_dominated
        )
    if over:
        pruned["over the memory limit"] = len(over)
    fitting.sort(key=lambda c: c.step_time_s)
    return SearchResult(
        shape,
        devices,
        global_batch,
        hw.name,
        limit,
        fitting[:top_k],
        enumerated,
        pruned,
        len(fitting) + len(over),
        over,
        time.perf_counter() - started,
    )


def _branch_and_bound(
    shape: GPTShape,
    todo: list[tuple[GPTStrategy, int]],
    hw: HardwareProfile,
    limit: int,
    top_k: int,
    pruned: dict[str, int],
    candidate: Callable[..., Candidate],
    sized: Callable[[int], GPTShape],
    progress: Callable[[int, int], None] | None,
    drop_dominated: bool = False,
) -> tuple[list[Candidate], list[Candidate]]:
    """``search``'s fast path: best-first on step-time lower bounds, pricing exactly only what may rank."""
    cache = TraceCache(hw)
    total = len(todo)
    done = 0

    def tick(n: int = 1) -> None:
        nonlocal done
        done += n
        if progress is not None and n:
            progress(done, total)

    reasons: dict[int, str] = {}

    def drop(reason: str, i: int) -> None:
        pruned[reason] = pruned.get(reason, 0) + 1
        reasons[i] = reason
        tick()

    dtype = "float16" if todo and todo[0][0].mixed_precision else "float32"
    best_gemm = max(
        hw.flops_per_s.get(dtype, 0.0), hw.flops_per_s.get("bfloat16" if dtype == "float16" else dtype, 0.0)
    )
    best_gemm *= (
        hw.gemm_efficiency_max if hw.gpu_model else max((e for _, e in hw.gemm_curve), default=hw.compute_efficiency)
    )
    best_gemm /= hw.kernel_scale  # every priced kernel runs that much slower than its rate

    def counts(st: GPTStrategy) -> list[int]:
        return layer_counts(shape.layers, st.pp, st.chunks)

    # Level 0: model state alone; then a bound from the micro-batch size 1 trace of the same
    # layer (GEMM FLOPs and layer activations grow exactly with the micro-batch).
    heap: list[tuple[float, int, int]] = []
    queued: dict[int, float] = {}  # candidate -> its key while in the heap
    resume: dict[int, int] = {}  # a candidate waiting for a lighter sibling (level 3) -> its real level
    index = {key: i for i, key in enumerate(todo)}

    def push(lb: float, level: int, i: int) -> None:
        heapq.heappush(heap, (lb, level, i))
        queued[i] = lb

    def lighter(i: int) -> list[int]:
        """The same strategy and micro-batch size with less recompute (``drop_dominated``)."""
        st, mbs = todo[i]
        if not drop_dominated or st.recompute not in RECOMPUTES[1:]:
            return []
        found = (index.get((replace(st, recompute=r), mbs)) for r in RECOMPUTES[: RECOMPUTES.index(st.recompute)])
        return [j for j in found if j is not None]

    def first_bound(i: int) -> tuple[float, int] | None:
        """The micro-batch size 1 trace's bound and the next level; None when it is dropped."""
        st, mbs = todo[i]
        one = cache.invariant(sized(1), st) if applicable(sized(1), st, hw) == "" else None
        if one is None:
            return 0.0, 2
        parts = stage_parts(st, counts(st))
        act = sum(k * (one.activations.get(p, 0) * (1 if p.kind == "first" else mbs)) for p, k in parts[0])
        if state_lower_bound(shape, st) + act * _in_flight_lower_bound(st) > limit:
            drop("state + activations over the memory limit (bound)", i)
            return None
        stages = [
            (
                mbs * sum(k * one.gemm_flops.get((p, "forward"), 0.0) for p, k in ps) / best_gemm,
                mbs * sum(k * one.gemm_flops.get((p, "backward"), 0.0) for p, k in ps) / best_gemm,
                0.0,
            )
            for ps in parts
        ]
        return _chain_bound(stages, st), 1

    smallest_memory: tuple[float, int] | None = None
    for i, (st, _) in enumerate(todo):
        state = state_lower_bound(shape, st)
        if smallest_memory is None or state < smallest_memory[0]:
            smallest_memory = (state, i)
        if state > limit:
            drop("model state over the memory limit (bound)", i)
            continue
        if lighter(i):  # traced only if its lighter sibling does not settle it (the loop below)
            push(0.0, 0, i)
            continue
        got = first_bound(i)
        if got is not None:
            push(got[0], got[1], i)

    fitting: list[Candidate] = []
    over: list[Candidate] = []
    kth: list[float] = []  # the top_k best fitting step times, as a max-heap (negated)
    fit: set[tuple[GPTStrategy, int]] = set()  # priced and within the limit (drop_dominated)

    def bound() -> float:
        return -kth[0] if len(kth) >= top_k else math.inf

    while heap:
        lb, level, i = heapq.heappop(heap)
        queued.pop(i, None)
        if lb >= bound():
            push(lb, level, i)
            break
        st, mbs = todo[i]
        light = lighter(i)
        if any(todo[j] in fit for j in light):
            drop("the same strategy with less recompute fits (dominated)", i)
            continue
        waits = [queued[j] for j in light if j in queued]
        if waits:
            # Price the lighter sibling first: if it fits, this one is dominated. Its bound is this
            # one's too (recompute only adds work: never faster, checked pairwise on real searches).
            resume.setdefault(i, level)
            push(max(lb, *waits), 3, i)
            continue
        level = resume.pop(i, level)
        if level == 0:
            got = first_bound(i)
            if got is not None:
                push(max(lb, got[0]), got[1], i)
            continue
        if level == 1:  # the traced costs of this micro-batch size: a tighter bound, an exact activation count
            inv = cache.invariant(sized(mbs), st)
            parts = stage_parts(st, counts(st))
            act = sum(k * inv.activations.get(p, 0) for p, k in parts[0])
            if (
                state_lower_bound(shape, st) + act * _in_flight_lower_bound(st) > limit
                # Every lane, with the activations its schedule really holds (an interleaved
                # warm-up holds several times what the first bound assumes, ZBH1 keeps them to
                # W): priced, such a candidate would only be found over the limit, after a
                # trace of its ZeRO stage. FThenB's and 1F1B's first lane holds exactly what
                # the first bound counts, so the walk would add nothing there.
                or (
                    st.schedule in ("Interleaved1F1B", "ZBH1")
                    and peak_lower_bound(st, counts(st), inv, state_per_layer_lower_bound(shape, st)) > limit
                )
            ):
                drop("state + activations over the memory limit (bound)", i)
                continue
            push(max(lb, _chain_bound(lower_bound_stage_times(inv, st, counts(st)), st)), 2, i)
            continue
        fast_est = cache.estimate(sized(mbs), st)
        if fast_est is not None:
            cand = candidate(st, mbs, fast_est.step_time_s, fast_est.peak_bytes, fast_est.bubble_fraction)
        else:  # a layout the shared traces do not cover: the estimator itself
            est = estimate(sized(mbs), st, hw)
            cand = candidate(st, mbs, est.step_time_s, max(est.peak_bytes_per_rank.values()), est.bubble_fraction)
        tick()
        if cand.fits:
            fitting.append(cand)
            fit.add((st, mbs))
            heapq.heappush(kth, -cand.step_time_s)
            if len(kth) > top_k:
                heapq.heappop(kth)
        else:
            over.append(cand)
    if heap:
        pruned["slower than the top candidates (bound)"] = len(heap)
        tick(len(heap))
    if not fitting and not over and smallest_memory is not None:
        # Nothing priced: price the candidate with the least state, so the advice has numbers.
        st, mbs = todo[smallest_memory[1]]
        est = estimate(sized(mbs), st, hw)
        over.append(candidate(st, mbs, est.step_time_s, max(est.peak_bytes_per_rank.values()), est.bubble_fraction))
        reason = reasons[smallest_memory[1]]
        pruned[reason] -= 1
        if not pruned[reason]:
            del pruned[reason]
    return fitting, over


def _progress_bar(done: int, total: int) -> None:
    """A bar redrawn in place on a terminal; plain lines (every tenth) when stderr is a file or pipe."""
    width = 30
    if not sys.stderr.isatty():
        step = max(1, total // 10)
        if done == total or done // step != (done - 1) // step:
            sys.stderr.write(f"search: {done}/{total} candidates resolved\n")
            sys.stderr.flush()
        return
    filled = width * done // total
    if done != total and filled == width * (done - 1) // total:
        return  # redraw only when the bar grows: a line per candidate floods logs
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def build_parser() -> argparse.ArgumentParser:
    p = cliargs.Parser(
        prog="python -m simulator search", description="Find the fastest GPT training strategy that fits in memory."
    )
    base = estimate_parser()
    for action in base._actions:
        if action.dest in ("layers", "hidden", "heads", "params", "seq", "vocab", "dropout", "hardware"):
            p._add_action(action)
    p.add_argument("--devices", type=cliargs.int_range(1, cliargs.MAX_WORLD, "a device count"), required=True)
    p.add_argument("--global-batch", type=cliargs.positive_int, required=True, help="sequences per step")
    p.add_argument(
        "--memory-limit",
        type=cliargs.positive_int,
        default=None,
        metavar="BYTES",
        help="per-device bytes (default: the profile's device memory)",
    )
    p.add_argument("--top", type=cliargs.int_range(1, 1000, "a count"), default=5)
    p.add_argument("--json", action="store_true")
    add_family_arguments(p.add_argument_group("model family (searched with the closed-form family model)"))
    p.add_argument(
        "--micro-batch-size",
        type=cliargs.positive_int,
        action="append",
        default=None,
        help="family model: only this micro-batch size (repeat the flag for several; default: every divisor)",
    )
    p.add_argument(
        "--cp",
        type=cliargs.positive_int,
        action="append",
        default=None,
        help="family model: only this context-parallel degree (repeat for several; default: every divisor)",
    )
    return p


def run_family_search(ns: argparse.Namespace) -> int:
    """``search``'s family path (``simulator.family_search``): the table, or JSON with ``cp`` per row."""
    resolve_family_defaults(ns)
    shape = family_shape(ns)
    result = search_family(
        shape,
        ns.devices,
        ns.global_batch,
        ns.hardware,
        memory_limit=ns.memory_limit,
        top_k=ns.top,
        micro_batch_sizes=tuple(ns.micro_batch_size) if ns.micro_batch_size else None,
        context_parallel=tuple(ns.cp) if ns.cp else None,
    )
    flags = model_flags(shape, ns.model)
    if ns.json:
        top = [{**c.row(), "estimate_flags": c.estimate_flags(flags, ns.hardware)} for c in result.ranked]
        print_json_report(result, top, model=shape.describe())
        return 0 if result.ranked else 1
    print(shape.describe())
    head = (
        f"{result.enumerated} candidates on {result.devices} x {result.hardware}, {result.global_batch} sequences "
        f"per step: {result.priced} priced in {result.seconds:.1f} s"
    )
    details = [[c.describe(), f"estimate: {c.estimate_flags(flags, ns.hardware)}"] for c in result.ranked]
    return print_ranking(result, head, "s", details)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if wants_family(ns) or ns.cp or ns.micro_batch_size:
        try:
            return run_family_search(ns)
        except ValueError as exc:
            parser.error(str(exc))
    resolve_gpt_defaults(ns)
    try:
        if ns.params is not None:
            shape = GPTShape.from_params(parse_count(ns.params), ns.seq, ns.vocab)
        elif None in (ns.layers, ns.hidden, ns.heads):
            raise ValueError("the model needs --layers, --hidden and --heads (or --params N)")
        else:
            shape = GPTShape(ns.layers, ns.hidden, ns.heads, ns.seq, ns.vocab, 1, ns.dropout)
        result = search(
            shape,
            ns.devices,
            ns.global_batch,
            ns.hardware,
            memory_limit=ns.memory_limit,
            top_k=ns.top,
            progress=None if ns.json else _progress_bar,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if ns.json:
        top: list[dict[str, Any]] = [
            {
                "dp": c.strategy.dp,
                "tp": c.strategy.tp,
                "pp": c.strategy.pp,
                "step_time_s": c.step_time_s,
                "tokens_per_s": c.tokens_per_s,
                "mfu": c.mfu,
                "peak_bytes": c.peak_bytes,
                "bubble_fraction": c.bubble_fraction,
                "estimate_flags": c.estimate_flags(shape, ns.hardware),
                "gpt_flags": c.gpt_flags(),
            }
            for c in result.ranked
        ]
        print_json_report(result, top)
        return 0
    details = [
        [f"estimate: {c.estimate_flags(shape, ns.hardware)}", f"gpt.py:   {c.gpt_flags()}"] for c in result.ranked
    ]
    head = f"{result.enumerated} candidates: {result.priced} priced in {result.seconds:.1f} s"
    return print_ranking(result, head, "ms", details)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
