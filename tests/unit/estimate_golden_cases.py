"""The ``python -m simulator estimate`` command lines whose ``--json`` output is pinned in
``tests/golden/estimate/cases.json`` (``test_estimate_golden.py``): pipelines, ZeRO, recompute,
sequence parallelism, interleaving, a calibrated-style CPU profile with host costs, and the
family presets. Rewrite the file (``python tests/unit/estimate_golden_cases.py``) only when the
cost model changes on purpose, and say so in the commit.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
from typing import Any

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "estimate", "cases.json")
SMALL = "--layers 4 --hidden 64 --heads 4 --seq 32 --vocab 128"
CASES: dict[str, list[str]] = {
    "dp2_tp2_pp2_1f1b": shlex.split(f"{SMALL} --mesh dp=2,tp=2,pp=2 --micro-batches 4 --breakdown"),
    "pp4_zbh1_recompute_full": shlex.split(f"{SMALL} --mesh pp=4 --micro-batches 8 --schedule ZBH1 --recompute full"),
    "pp2_interleaved_sp": shlex.split(
        f"{SMALL} --mesh tp=2,pp=2 --micro-batches 4 --schedule Interleaved1F1B --sequence-parallel --recompute selective"
    ),
    "dp4_zero3_mixed_overlap": shlex.split(
        f"{SMALL} --mesh dp=4 --zero 3 --mixed-precision --overlap-grad-reduce --micro-batches 2"
    ),
    "dp2_zero1_offload_momentum": shlex.split(f"{SMALL} --mesh dp=2 --zero 1 --offload --optimizer momentum"),
    "cpu_local_host_costs": shlex.split(
        f"{SMALL} --mesh dp=2,tp=2 --hardware cpu-local --op-overhead 2e-5 --update-overhead 1e-5 --memory-bandwidth 1e10 --grad-clip 1.0"
    ),
    "params_175b_pp16": shlex.split(
        "--params 175e9 --mesh dp=8,tp=8,pp=16 --sequence-parallel --recompute selective --zero 1 --mixed-precision --micro-batches 64"
    ),
    "family_llama3_8b": shlex.split("--model llama3-8b --mesh dp=8,tp=8 --micro-batches 4"),
    "family_llama3_405b_cp": shlex.split(
        "--model llama3-405b --mesh dp=8,tp=8,pp=16,cp=2 --sequence-parallel --micro-batches 16"
    ),
    "family_gpt3_175b": shlex.split("--model gpt3-175b --mesh dp=8,tp=8,pp=16 --micro-batches 32 --zero 1"),
}
"""Each case's command line after ``estimate`` (``--json`` is added)."""
VOLATILE = ("seconds",)
"""Wall-clock keys: the trace's and the command's own run time."""


def _drop_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_drop_volatile(v) for v in value]
    return value


def run_case(argv: list[str]) -> Any:
    """``estimate``'s ``--json`` output for ``argv``, wall-clock keys dropped."""
    from simulator.estimate import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main([*argv, "--json"])
    if rc != 0:
        raise RuntimeError(f"estimate {' '.join(argv)} exited {rc}")
    return _drop_volatile(json.loads(out.getvalue()))


def record() -> None:
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    golden = {name: {"argv": argv, "output": run_case(argv)} for name, argv in CASES.items()}
    with open(GOLDEN, "w") as f:
        json.dump(golden, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    record()
