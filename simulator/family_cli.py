"""The ``--model``/shape flags of ``python -m simulator estimate`` and ``search``, and the commands'
family path (``simulator.family_cost``, ``simulator.family_search``).

    python -m simulator estimate --model llama3-405b --mesh dp=64,tp=8,pp=16,cp=1 --sequence-parallel \\
        --micro-batches 32 --schedule Interleaved1F1B --chunks 4 --zero 1 --overlap-grad-reduce
    python -m simulator search --model llama3-405b --devices 16384 --global-batch 2048

Any of ``--model``, ``--kv-heads``, ``--ffn-hidden``, ``--mlp``, ``--norm``, ``--untied``,
``--attention`` or a ``cp`` degree above 1 selects the family model; without them the commands
trace mpipar's own GPT as before. ``--model NAME`` starts from a preset and every other shape
flag given overrides it (``--model llama3-405b --seq 131072``). ``--attention`` defaults to the
preset's (fused for the Llama presets, plain for ``gpt3-175b``); for a shape given by its sizes,
fused with RMSNorm and plain with LayerNorm, so published GPT runs are priced as they ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from mpipar import cliargs
from simulator.cost import load_profile
from simulator.family import ATTENTIONS, MLPS, NORMS, PRESETS, ModelShape, preset
from simulator.family_cost import FamilyStrategy, price
from simulator.step_trace import GPTShape

FAMILY_FLAGS = ("model", "kv_heads", "ffn_hidden", "mlp", "norm", "untied", "attention")
GPT_DEFAULTS = {"seq": 2048, "vocab": 50257, "dropout": 0.1, "hardware": "h100-nvlink-ib"}
"""The trace path's defaults for flags the family path leaves to the preset."""
FAMILY_HARDWARE = "h100-sxm"
"""The family path's default profile: the H100 with the GPU model's constants."""


def add_family_arguments(group: Any) -> None:
    group.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default=None,
        help="a preset shape (the other shape flags override its fields)",
    )
    group.add_argument("--kv-heads", type=cliargs.positive_int, default=None, help="key/value heads (grouped-query)")
    group.add_argument("--ffn-hidden", type=cliargs.positive_int, default=None, help="MLP inner width (default 4h)")
    group.add_argument("--mlp", choices=MLPS, default=None, help="gelu (two matrices) or swiglu (three)")
    group.add_argument("--norm", choices=NORMS, default=None, help="layernorm (GPT) or rmsnorm (Llama)")
    group.add_argument("--untied", action="store_true", default=None, help="an output layer of its own")
    group.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default=None,
        help="fused (FlashAttention: no s x s activations, scores recomputed in backward) or plain "
        "(default: the preset's; fused with rmsnorm, plain with layernorm)",
    )


def wants_family(ns: argparse.Namespace, cp: int = 1) -> bool:
    return cp > 1 or any(getattr(ns, k, None) not in (None, False) for k in FAMILY_FLAGS)


def resolve_gpt_defaults(ns: argparse.Namespace) -> None:
    """The trace path's defaults where the command line left a shape flag out."""
    for key, value in GPT_DEFAULTS.items():
        if getattr(ns, key, None) is None:
            setattr(ns, key, value)


def resolve_family_defaults(ns: argparse.Namespace) -> None:
    if getattr(ns, "hardware", None) is None:
        ns.hardware = FAMILY_HARDWARE


def family_shape(ns: argparse.Namespace, micro_batch_size: int = 1) -> ModelShape:
    """The ``ModelShape`` the command line names (``ValueError`` naming the flag at fault)."""
    sizes: dict[str, Any] = {k: getattr(ns, k, None) for k in ("layers", "hidden", "heads")}
    if ns.model is not None:
        if getattr(ns, "params", None) is not None:
            raise ValueError("--model and --params both pick a shape; give one")
        shape = preset(ns.model)
        changes: dict[str, Any] = {k: v for k, v in sizes.items() if v is not None}
    elif getattr(ns, "params", None) is not None:
        given = [f"--{k}" for k, v in sizes.items() if v is not None]
        if given:
            raise ValueError(f"--params picks the layers, hidden size and heads; drop {', '.join(given)} or --params")
        gpt = GPTShape.from_params(cliargs.parse_count(ns.params, "--params"))
        shape = ModelShape(gpt.layers, gpt.hidden, gpt.heads)
        changes = {}
    else:
        missing = [f"--{k}" for k, v in sizes.items() if v is None]
        if missing:
            raise ValueError(f"the model needs {', '.join(missing)} (or --model NAME, or --params N)")
        norm = ns.norm or "layernorm"
        shape = ModelShape(sizes["layers"], sizes["hidden"], sizes["heads"], norm=norm)
        changes = {"attention": "fused" if norm == "rmsnorm" else "plain"} if ns.attention is None else {}
    for key, flag in (
        ("seq", "seq"),
        ("vocab", "vocab"),
        ("dropout", "dropout"),
        ("kv_heads", "kv_heads"),
        ("ffn_hidden", "ffn_hidden"),
        ("mlp", "mlp"),
        ("norm", "norm"),
        ("attention", "attention"),
    ):
        value = getattr(ns, flag, None)
        if value is not None:
            changes[key] = value
    if ns.untied:
        changes["untied"] = True
    if "norm" in changes and "dropout" not in changes and shape.norm != changes["norm"]:
        changes["dropout"] = None  # the new norm's family default
    changes["micro_batch_size"] = micro_batch_size
    return dataclasses.replace(shape, **changes)


def family_strategy(ns: argparse.Namespace, degrees: dict[str, int]) -> FamilyStrategy:
    unsupported = [
        flag
        for flag, dest, default in (
            ("--offload", "offload", False),
            ("--host-link-bandwidth", "host_link_bandwidth", None),
            ("--plan", "plan", None),
            ("--memory-bandwidth", "memory_bandwidth", None),
            ("--vector-flops", "vector_flops", None),
            ("--op-overhead", "op_overhead", None),
            ("--reshard-overhead", "reshard_overhead", None),
            ("--update-overhead", "update_overhead", None),
            ("--grad-clip", "grad_clip", None),
        )
        if getattr(ns, dest, default) != default
    ]
    if getattr(ns, "optimizer", "adamw") != "adamw":
        unsupported.append("--optimizer momentum")
    if unsupported:
        raise ValueError(
            f"{', '.join(unsupported)}: not priced by the family model (--model, shape flags, cp); "
            "drop them, or give a GPT shape by --layers/--hidden/--heads without family flags"
        )
    interleaved = ns.schedule.strip().lower() in ("interleaved1f1b", "interleaved", "vpp")
    chunks = ns.chunks if ns.chunks is not None else (2 if interleaved else 1)
    return FamilyStrategy(
        degrees["dp"],
        degrees["tp"],
        degrees["pp"],
        degrees["cp"],
        ns.sequence_parallel,
        ns.recompute,
        ns.zero,
        ns.micro_batches,
        ns.schedule,
        chunks,
        ns.overlap_grad_reduce,
        getattr(ns, "cp_comm", "allgather"),
    )


def run_estimate(ns: argparse.Namespace, degrees: dict[str, int]) -> int:
    """``estimate``'s family path: print the summary (or JSON). Raises ``ValueError`` on bad input."""
    resolve_family_defaults(ns)
    shape = family_shape(ns, ns.micro_batch_size)
    strategy = family_strategy(ns, degrees)
    est = price(shape, strategy, load_profile(ns.hardware))
    if ns.json:
        json.dump(est.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    print(est.summary())
    if ns.breakdown:
        print()
        print("per micro-batch, one rank, ms: " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in est.breakdown.items()))
        for s, row in enumerate(est.stage_seconds):
            print(
                f"stage {s:>3}: {est.layers_per_stage[s]} layers, F {row['forward'] * 1e3:.2f} ms, "
                f"B {row['backward_input'] * 1e3:.2f} ms, W {row['backward_weight'] * 1e3:.2f} ms"
            )
    return 0
