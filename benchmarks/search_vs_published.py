"""The family model (``simulator.family_cost``) against published large-scale runs, and the search's
best layout on the same devices and batch.

    python benchmarks/search_vs_published.py            # the validation table (markdown)
    python benchmarks/search_vs_published.py --search   # also search each row's devices and batch
    python benchmarks/search_vs_published.py --json benchmarks/results/search_vs_published.json
    python benchmarks/search_vs_published.py --dump     # the rows as JSON on stdout

Validation, not calibration: no row below is read by any fit. The one fitted constant,
``gemm_efficiency_max`` of the ``a100-sxm`` preset, comes from Korthikanti et al. 2022's two
22B rows through this model (``--fit`` redoes it: ``fit_gemm_efficiency``); ``h100-sxm`` takes
the same share of peak (no H100 row is calibrated); every other constant (fused attention's
``exp_per_s`` too) is a vendor specification (``simulator/presets/*.json`` say which).

Rows, each priced at its published layout (tensor, pipeline, context and data degrees,
sequence, batch) and with the knobs each paper reports; where a paper leaves a knob out, the
best of the listed options that fits in memory is taken, as the paper's authors tuned it:

* Narayanan et al. 2021 (SC'21), Table 1: GPT, sequence 2048, vocabulary 51,200, A100 80GB;
  full activation recomputation, no sequence parallelism (it came later), plain attention;
  the best micro-batch size of 1, 2, 4, 8 and the best of 1F1B or the interleaved schedule
  with 2, 3 or 4 chunks, those that split each pipeline rank's layers evenly (Megatron-LM
  runs nothing else: its chunks hold equal whole layers; the 529.6B model's 3 layers per rank
  interleave only as 3 chunks of one, as Korthikanti et al. ran the same model). Throughput in their Eq. 3 convention (``96 B s l
  h^2 (1 + s/6h + V/16lh)``: recomputation counted), TFLOP/s per GPU.
* Korthikanti et al. 2022, 530B on 2240 A100s (tp 8, pp 35, dp 8, batch 2240, micro-batch 1,
  selective recompute and sequence parallelism, interleaved with 3 chunks): the abstract's
  MFU of 54.2%.
* "The Llama 3 Herd of Models" (2024), Table 4: Llama 3 405B on H100 80GB, tp 8, pp 16; 8192
  GPUs dp 64 and 16,384 GPUs dp 128 at sequence 8192, 16,384 GPUs cp 16 dp 8 at 131,072; 16M
  tokens per step; fused attention, no activation checkpointing (section 3.3.2), FSDP-style
  sharding; the interleaved schedule as section 3.3.2 lays it out: one layer fewer on the
  first and last stages, so that the first model chunk on the first stage holds only the
  embedding and the last model chunk on the last stage only the output projection and the
  loss (paraphrased) -- chunks of one layer, ``(126 + 2) / 16 = 8`` per rank
  (``stage_layer_counts``' empty end stages). The micro-batches per chunk (the paper's
  tunable ``N``) are Megatron-LM's ``N = pp``: a larger ``N`` holds more warm-up activations
  and does not fit. The ZeRO stage is the best of 1, 2, 3 (with overlap) that fits at the
  published degrees. Throughput as TFLOP/s per GPU with
  causal attention counted at half the score FLOPs (the work a causal FlashAttention does;
  Megatron-Core counts causal attention the same way); the non-causal figure is printed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass

from results import add_json_argument, record

from simulator.cost import HardwareProfile, load_profile
from simulator.family import ModelShape, preset
from simulator.family_cost import FamilyEstimate, FamilyStrategy, price
from simulator.family_search import search_family
from simulator.published_configs import NARAYANAN_2021_TABLE_1

# Narayanan et al. 2021, Table 1: achieved TFLOP/s per GPU, row by row (1.7B ... 1008B).
NARAYANAN_TFLOPS = (137, 138, 142, 135, 138, 140, 148, 155, 163, 163)


@dataclass(frozen=True)
class Published:
    name: str
    shape: ModelShape
    hardware: str
    dp: int
    tp: int
    pp: int
    cp: int
    global_batch: int
    published: float
    unit: str
    """``TFLOP/s`` (per GPU, in the row's convention) or ``MFU``."""
    convention: str
    """``eq3`` (Narayanan's, recompute counted), ``model`` (no recompute) or ``causal``."""
    space: dict[str, tuple[object, ...]]

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def rows() -> list[Published]:
    out = []
    for run, tflops in zip(NARAYANAN_2021_TABLE_1, NARAYANAN_TFLOPS, strict=True):
        out.append(
            Published(
                f"GPT {run.billions}B (Narayanan T1)",
                ModelShape(run.layers, run.hidden, run.heads, 2048, 51200),
                "a100-sxm",
                run.dp,
                run.tp,
                run.pp,
                1,
                run.batch,
                tflops,
                "TFLOP/s",
                "eq3",
                {
                    "mbs": (1, 2, 4, 8),
                    "chunks": tuple(c for c in (1, 2, 3, 4) if run.layers % (run.pp * c) == 0),
                    "recompute": ("full",),
                    "sp": (False,),
                    "zero": (0,),
                },
            )
        )
    out.append(
        Published(
            "GPT 530B (Korthikanti)",
            ModelShape(105, 20480, 128, 2048, 51200),
            "a100-sxm",
            8,
            8,
            35,
            1,
            2240,
            0.542,
            "MFU",
            "model",
            {"mbs": (1,), "chunks": (3,), "recompute": ("selective",), "sp": (True,), "zero": (0,)},
        )
    )
    llama = preset("llama3-405b")
    one_layer_chunks = (llama.layers + 2) // 16  # the embedding and the output layer each in a chunk of their own
    for gpus_dp, cp, seq, tflops in ((64, 1, 8192, 430), (128, 1, 8192, 400), (8, 16, 131072, 380)):
        out.append(
            Published(
                f"Llama 3 405B, {8 * 16 * cp * gpus_dp} GPUs, seq {seq}",
                dataclasses.replace(llama, seq=seq),
                "h100-sxm",
                gpus_dp,
                8,
                16,
                cp,
                16 * 2**20 // seq,
                tflops,
                "TFLOP/s",
                "causal",
                {
                    "mbs": (1,),
                    "chunks": (one_layer_chunks,),
                    "recompute": ("none",),
                    "sp": (True,),
                    "zero": (1, 2, 3),
                },
            )
        )
    return out


CALIBRATION = (
    # Korthikanti et al. 2022 (Table 3/5 as quoted in issue #16): GPT 22B, 8 A100s, tp 8,
    # micro-batch 4, one micro-batch per step: step seconds.
    (FamilyStrategy(tp=8, sequence_parallel=True, recompute="selective"), 1.10),
    (FamilyStrategy(tp=8, recompute="full"), 1.42),
)
CALIBRATION_SHAPE = ModelShape(48, 6144, 64, 2048, 51200, micro_batch_size=4)


def fit_gemm_efficiency(profile: HardwareProfile) -> float:
    """The ``gemm_efficiency_max`` (to 0.001) that best fits the two calibration rows through the
    family model: least squares of the log ratio of estimated to published step."""

    def loss(e: float) -> float:
        hw = dataclasses.replace(profile, gemm_efficiency_max=e)
        return sum(math.log(price(CALIBRATION_SHAPE, st, hw).step_time_s / t) ** 2 for st, t in CALIBRATION)

    return min((k / 1000 for k in range(200, 1001)), key=loss)


def flops_per_token(shape: ModelShape, convention: str) -> float:
    h, s, n, v = shape.hidden, shape.seq, shape.layers, shape.vocab
    if convention == "eq3":  # Narayanan Eq. 3 per token: one more forward of every layer
        return 96.0 * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    if convention == "causal":  # the scores' FLOPs of the lower triangle only
        return shape.model_flops_per_token - 3.0 * n * 2 * s * h
    return shape.model_flops_per_token


def best_at_layout(row: Published, hw: HardwareProfile, *, fits: bool = True) -> FamilyEstimate | None:
    """The fastest estimate that fits (or, ``fits=False``, whatever its memory) at the row's
    degrees over the knobs ``row.space`` leaves open."""
    best: FamilyEstimate | None = None
    per_replica = row.global_batch // row.dp
    for mbs, chunks, rc, sp, zero in itertools.product(
        *(row.space[k] for k in ("mbs", "chunks", "recompute", "sp", "zero"))
    ):
        if per_replica % mbs:
            continue
        try:
            st = FamilyStrategy(
                row.dp,
                row.tp,
                row.pp,
                row.cp,
                sp,
                rc,
                zero,
                per_replica // mbs,
                "Interleaved1F1B" if chunks > 1 else "1F1B",
                chunks,
                zero > 0,  # the Llama 3 rows overlap their sharded reductions; Megatron's 2021 rows did not
            )
            est = price(row.shape.sized(mbs), st, hw)
        except ValueError:
            continue  # the layers or micro-batches do not divide for this schedule
        limit = (hw.memory_bytes or math.inf) if fits else math.inf
        if est.peak_bytes <= limit and (best is None or est.step_time_s < best.step_time_s):
            best = est
    return best


def _knobs(est: FamilyEstimate) -> str:
    st = est.strategy
    return (
        f"mbs {est.shape.micro_batch_size}, {st.schedule}{'' if st.chunks == 1 else f' x{st.chunks}'}, "
        f"recompute {st.recompute}, ZeRO {st.zero}, bubble {est.bubble_fraction:.3f}"
    )


def measure(est: FamilyEstimate, row: Published) -> float:
    if row.unit == "MFU":
        return est.mfu
    return flops_per_token(row.shape, row.convention) * est.tokens_per_step / est.step_time_s / row.devices / 1e12


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--search", action="store_true", help="also search each row's devices and batch")
    p.add_argument("--dump", action="store_true", help="print the rows as JSON instead of the table")
    add_json_argument(p)
    p.add_argument("--rows", default=None, help="comma-separated row numbers (default: all)")
    p.add_argument("--fit", action="store_true", help="refit gemm_efficiency_max on the calibration rows and print it")
    ns = p.parse_args(argv)
    record(ns.json, __file__)
    if ns.fit:
        a100 = load_profile("a100-sxm")
        best = fit_gemm_efficiency(a100)
        fitted = dataclasses.replace(a100, gemm_efficiency_max=best)
        ratios = [price(CALIBRATION_SHAPE, st, fitted).step_time_s / t for st, t in CALIBRATION]
        print(
            f"fitted gemm_efficiency_max = {best:.3f} (a100-sxm has {a100.gemm_efficiency_max}); calibration rows "
            f"estimate / published: {', '.join(f'{r:.3f}' for r in ratios)}"
        )
    selected = rows()
    if ns.rows:
        selected = [selected[int(i)] for i in ns.rows.split(",")]
    out = []
    started = time.perf_counter()
    for row in selected:
        hw = load_profile(row.hardware)
        est = best_at_layout(row, hw)
        entry: dict[str, object] = {
            "run": row.name,
            "devices": row.devices,
            "layout": f"tp {row.tp} pp {row.pp} cp {row.cp} dp {row.dp}",
            "published": row.published,
            "unit": row.unit,
        }
        if est is None:
            entry["estimate"] = None
        else:
            entry.update(
                estimate=measure(est, row),
                ratio=measure(est, row) / row.published,
                step_time_s=est.step_time_s,
                mfu=est.mfu,
                peak_gib=est.peak_bytes / 2**30,
                knobs=_knobs(est),
            )
            if row.convention == "causal":
                entry["estimate_noncausal"] = measure(est, dataclasses.replace(row, convention="model"))
        unbound = best_at_layout(row, hw, fits=False)
        if unbound is not None and (est is None or unbound.step_time_s < est.step_time_s):
            # What the memory limit costs: the fastest knobs at the layout if memory were no limit.
            entry["unbound"] = {
                "ratio": measure(unbound, row) / row.published,
                "knobs": _knobs(unbound),
                "peak_gib": unbound.peak_bytes / 2**30,
                "lanes_gib": [round(b / 2**30, 1) for b in unbound.peak_bytes_per_lane],
            }
        if ns.search:
            t = time.perf_counter()
            res = search_family(row.shape, row.devices, row.global_batch, hw, top_k=1)
            if res.ranked:
                entry["search"] = res.ranked[0].describe()
                entry["search_speedup"] = est.step_time_s / res.ranked[0].step_time_s if est else None
            entry["search_s"] = time.perf_counter() - t
        out.append(entry)
    if ns.dump:
        json.dump({"load_average": os.getloadavg(), "rows": out}, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    head = (
        "| run | devices | layout | published | estimate | estimate / published | knobs (best that fits) | peak GiB |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for e in out:
        unit = e["unit"]
        fmt = (lambda x: f"{100 * x:.1f}% MFU") if unit == "MFU" else (lambda x: f"{x:.0f} TFLOP/s")
        if e.get("estimate") is None:
            print(f"| {e['run']} | {e['devices']} | {e['layout']} | {fmt(e['published'])} | nothing fits | - | - | - |")
            continue
        extra = f" ({e['estimate_noncausal']:.0f} non-causal)" if "estimate_noncausal" in e else ""
        print(
            f"| {e['run']} | {e['devices']} | {e['layout']} | {fmt(e['published'])} | {fmt(e['estimate'])}{extra} | "
            f"{e['ratio']:.3f} | {e['knobs']} | {e['peak_gib']:.1f} |"
        )
    for e in out:
        if "unbound" in e:
            u = e["unbound"]
            print(
                f"\n{e['run']}: without the memory limit the fastest knobs are {u['knobs']}, "
                f"{u['ratio']:.3f} of the published throughput, needing {u['peak_gib']:.1f} GiB "
                f"(per pipeline rank: {', '.join(f'{x:.1f}' for x in u['lanes_gib'])})"
            )
    if ns.search:
        print()
        for e in out:
            print(
                f"{e['run']}: search's best {e.get('search', 'none')} ({e.get('search_speedup') or 0:.2f}x the "
                f"published layout's estimate), {e['search_s']:.1f} s"
            )
    print(f"\nload average {', '.join(f'{x:.1f}' for x in os.getloadavg())}; {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
