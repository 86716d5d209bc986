"""The Memory view's peak per rank is ``dist.memory_report`` for the same strategy.

For gpt.py --tiny strategies, ``mpipar plan`` traces the plan the dashboard shows (priced on
the app's default profile, memory derived by ``viz.plan_memory``), and ``examples/gpt_memory.py``
runs the same strategy in the simulator and reports ``memory_report`` at the view's peak
instant: after forward, before backward, in a step after the first (optimizer states and
gradient buffers present), with the micro-batches the schedule has in flight on the rank.
Per rank and category the two agree exactly; the view's peak adds only a pipeline message in
transit (``comm_buffers``), which the runtime's report does not count.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from plans import plan_command

from mpipar.compile.plan import KEPT_KEY, Plan, PlanFormatError
from simulator.cost import load_profile
from viz import memory
from viz.plan_memory import memory_section, with_memory
from viz.plan_time import priced

ROOT = Path(__file__).resolve().parents[2]
APP_DEFAULT_PROFILE = "cpu-local"  # viz/app.py's DEFAULT_PRESET: what the view prices a plan on
STATE = ("parameters", "gradients", "optimizer_state")
STRATEGIES: dict[str, tuple[int, list[str]]] = {
    "eager": (4, ["--mesh", "dp=2,tp=2"]),
    "zero3": (4, ["--mesh", "dp=2,tp=2", "--zero", "3"]),
    "recompute": (4, ["--mesh", "dp=2,tp=2", "--recompute", "full"]),
    "static": (8, ["--mesh", "dp=2,tp=2,pp=2", "--schedule", "1F1B"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Plan, dict[int, dict[str, Any]]]]:
    """Per strategy: its plan and its per-rank report (all subprocesses at once: they mostly wait)."""
    tmp = tmp_path_factory.mktemp("memeq")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    for name, (n, args) in STRATEGIES.items():
        plan_cmd = plan_command(str(tmp / f"{name}.plan.json"), n, "examples/gpt.py", "--tiny", *args)
        report_cmd = [
            sys.executable,
            "-m",
            "simulator",
            "-n",
            str(n),
            "examples/gpt_memory.py",
            "--tiny",
            *args,
            "-o",
            str(tmp / f"{name}.report.json"),
        ]
        for cmd in (plan_cmd, report_cmd):
            procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out.decode()[-2000:]
    result = {}
    for name in STRATEGIES:
        report = json.loads((tmp / f"{name}.report.json").read_text())
        result[name] = (Plan.load(tmp / f"{name}.plan.json"), {r["rank"]: r for r in report["ranks"]})
    return result


def shown(plan: Plan) -> Plan:
    """The plan the Memory view draws (viz/app.py: memory derived, priced, memory derived)."""
    return with_memory(priced(with_memory(plan), load_profile(APP_DEFAULT_PROFILE)))


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_view_peak_is_memory_report(runs: dict[str, tuple[Plan, dict[int, dict[str, Any]]]], name: str) -> None:
    plan, report = runs[name]
    assert isinstance(plan.meta.get(KEPT_KEY), list) and plan.meta[KEPT_KEY]
    rows = memory.rank_peaks(shown(plan))
    assert sorted(r["rank"] for r in rows) == sorted(report) == list(range(STRATEGIES[name][0]))
    for row in rows:
        want = report[row["rank"]]
        for cat in (*STATE, "activations"):
            assert row[cat] == want[cat] > 0, (name, row["rank"], cat, row[cat], want[cat])
        total = sum(want[c] for c in (*STATE, "activations"))
        # the one thing the view adds: a pipeline hand-off in transit at the peak
        assert row["peak"] == total + row["comm_buffers"], (name, row["rank"])
        if name == "static":
            assert want["in_flight"] == (2 if row["rank"] < 4 else 1)  # 1F1B, 2 stages, 2 micro-batches
        else:
            assert row["comm_buffers"] == 0


def test_strategies_move_the_right_categories(runs: dict[str, tuple[Plan, dict[int, dict[str, Any]]]]) -> None:
    """The agreement is not vacuous: ZeRO-3 shrinks the state, recompute the activations."""
    base, zero3, recompute = (runs[n][1][0] for n in ("eager", "zero3", "recompute"))
    assert zero3["parameters"] < base["parameters"] and zero3["optimizer_state"] < base["optimizer_state"]
    assert zero3["activations"] == base["activations"]  # a ZeRO-3 weight kept for backward counts zero
    assert recompute["activations"] < base["activations"] and recompute["parameters"] == base["parameters"]


def test_to_static_plan_records_gradients_and_optimizer_states(
    runs: dict[str, tuple[Plan, dict[int, dict[str, Any]]]],
) -> None:
    plan, _ = runs["static"]
    kinds = [t.kind for t in plan.tensors]
    params = {t.name for t in plan.tensors if t.kind == "parameter"}
    grads = {t.name for t in plan.tensors if t.kind == "gradient"}
    assert grads == {f"{p}@GRAD" for p in params} and params
    assert kinds.count("optimizer_state") == 2 * len(params)  # AdamW: two moments per parameter
    assert plan.pipeline and plan.pipeline["schedule"]  # still the pipelined plan


def test_plan_without_the_record_keeps_the_older_estimate(
    runs: dict[str, tuple[Plan, dict[int, dict[str, Any]]]],
) -> None:
    """Older plans (no kept_for_backward) count forward outputs; the record counts what the tape keeps."""
    plan, report = runs["eager"]
    with_record = shown(plan)
    old = shown(dataclasses.replace(plan, meta={k: v for k, v in plan.meta.items() if k != KEPT_KEY}))
    new_acts = {e["rank"]: e["activations"] for e in with_record.memory["ranks"]}
    old_acts = {e["rank"]: e["activations"] for e in old.memory["ranks"]}
    for r, acts in new_acts.items():
        assert sum(acts.values()) == report[r]["activations"]
        assert sum(old_acts[r].values()) > 0 and old_acts[r] != acts
    # the state categories do not depend on the record
    assert [{c: e[c] for c in STATE} for e in with_record.memory["ranks"]] == [
        {c: e[c] for c in STATE} for e in old.memory["ranks"]
    ]


@pytest.mark.parametrize(
    ("kept", "field"),
    [
        ("x", f"meta.{KEPT_KEY}"),
        ([[0]], f"meta.{KEPT_KEY}[0]"),
        ([[10**9, 0]], f"meta.{KEPT_KEY}[0][0]"),
        ([[True, 0]], f"meta.{KEPT_KEY}[0][0]"),
        ([[0, 10**9]], f"meta.{KEPT_KEY}[0][1]"),
        ([[0, "op"]], f"meta.{KEPT_KEY}[0][1]"),
    ],
)
def test_forged_kept_record_is_refused(
    runs: dict[str, tuple[Plan, dict[int, dict[str, Any]]]], kept: Any, field: str
) -> None:
    plan, _ = runs["eager"]
    doc = plan.to_dict()
    assert Plan.from_dict(doc) == plan  # the record round-trips
    doc["meta"][KEPT_KEY] = kept
    with pytest.raises(PlanFormatError) as err:
        Plan.from_dict(doc)
    assert err.value.field == field


def test_memory_section_skips_record_entries_naming_nothing(
    runs: dict[str, tuple[Plan, dict[int, dict[str, Any]]]],
) -> None:
    """memory_section reads a Plan built in code too (not through from_dict): bad pairs count nothing."""
    viewed = shown(runs["eager"][0])
    forged = dataclasses.replace(viewed, meta={**viewed.meta, KEPT_KEY: [*viewed.meta[KEPT_KEY], [10**9, 0], "x", [1]]})
    assert memory_section(forged) == memory_section(viewed)
    assert any(e["activations"] for e in memory_section(viewed)["ranks"])
