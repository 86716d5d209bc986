"""Memory for any plan: ``mpipar plan``'s GPT plan (no memory section) gets one derived from its own tensors."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from plans import trace_plan
from streamlit.testing.v1 import AppTest

from mpipar.compile.plan import Plan
from viz import memory
from viz.plan_memory import memory_section, with_memory
from viz.sample import build_sample

ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "viz" / "app.py")


@pytest.fixture(autouse=True)
def _argv() -> Iterator[None]:
    saved = list(sys.argv)
    yield
    sys.argv = saved


def test_recompute_keeps_fewer_activations_and_the_same_state() -> None:
    """Full recompute keeps only each region's result: fewer activation bytes per rank, same model state."""
    plain, _ = build_sample(2, 2, 2, "1F1B", 4)
    recomputed, _ = build_sample(2, 2, 2, "1F1B", 4, recompute="full")
    a = memory_section(dataclasses.replace(plain, memory=None))["ranks"]
    b = memory_section(dataclasses.replace(recomputed, memory=None))["ranks"]
    for x, y in zip(a, b, strict=True):
        assert x["parameters"] == y["parameters"] > 0
        assert sum(y["activations"].values()) < sum(x["activations"].values()), x["rank"]
        assert x["messages"] == y["messages"] and x["messages"]


def test_gpt_plan_gets_per_rank_memory(gpt_plan_path: str) -> None:
    raw = Plan.load(gpt_plan_path)
    assert raw.memory is None and raw.pipeline
    plan = with_memory(raw)
    entries = {e["rank"]: e for e in plan.memory["ranks"]}
    assert sorted(entries) == list(range(8))
    params = [t for t in raw.tensors if t.kind == "parameter"]
    for mesh in raw.meshes:
        for i, r in enumerate(mesh.process_ids):
            expect = sum(np.dtype(t.dtype).itemsize * _prod(t.local_shapes[i]) for t in params if t.mesh == mesh.id)
            assert entries[r]["parameters"] == expect
            assert entries[r]["parameters"] > 0
            assert entries[r]["activations"], r
    peaks = memory.rank_peaks(plan)
    assert len(peaks) == 8 and all(row["peak"] > row["parameters"] > 0 for row in peaks)


def _prod(shape: list[int] | tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def test_memory_view_draws_the_gpt_plan(gpt_plan_path: str) -> None:
    at = AppTest.from_file(APP, default_timeout=120)
    sys.argv = [APP, gpt_plan_path]
    at.run()
    at.radio(key="view").set_value("Memory").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.info, [i.value for i in at.info]
    assert len(at.get("image")) == 2  # the chosen rank's curve and every rank's peak


def _eager_plan(tmp: Path, *extra: str) -> Plan:
    out = str(tmp / f"plan{len(extra)}.json")
    return Plan.load(trace_plan(out, 4, "examples/gpt.py", "--tiny", "--mesh", "dp=2,tp=2", *extra))


def test_offloaded_optimizer_states_are_host_memory_not_device(tmp_path: Path) -> None:
    """gpt.py --offload: the plan names its optimizer states as host-resident; the memory section
    moves exactly their bytes from the device's optimizer_state to host_optimizer_state."""
    from viz.plan_memory import HOST_KEY, host_tensors

    plain, offloaded = _eager_plan(tmp_path), _eager_plan(tmp_path, "--offload")
    states = {t.id for t in offloaded.tensors if t.kind == "optimizer_state"}
    assert states and host_tensors(offloaded) == states and host_tensors(plain) == set()
    before = {e["rank"]: e for e in memory_section(plain)["ranks"]}
    after = {e["rank"]: e for e in memory_section(offloaded)["ranks"]}
    assert sorted(before) == sorted(after) == [0, 1, 2, 3]
    for r, e in after.items():
        assert before[r]["optimizer_state"] > 0 and HOST_KEY not in before[r]
        assert e["optimizer_state"] == 0 and e[HOST_KEY] == before[r]["optimizer_state"]
        assert e["parameters"] == before[r]["parameters"]
    # meta comes with the file: entries that are not optimizer-state ids name nothing on the host
    params = [t.id for t in offloaded.tensors if t.kind == "parameter"]
    forged = dataclasses.replace(offloaded, meta={**offloaded.meta, "host_tensors": [*params, "x", True, -1]})
    assert host_tensors(forged) == set()
    assert all(HOST_KEY not in e for e in memory_section(forged)["ranks"])
