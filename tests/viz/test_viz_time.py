"""Time for any plan: the dashboard prices ``mpipar plan``'s GPT plan with the simulator's cost model.

The pipeline view's total must be what ``simulator.op_cost.PlanCosts`` predicts for the plan's
own ops and reshards on the chosen preset, simulated on the plan's own schedule; recomputed
here rank by rank, without the dashboard's code. Also: profiles from files are validated,
measured timelines land on the pipeline lanes, the app opens on the GPT plan by default and
every view draws it without a "no data" notice, and the Deploy button is configured away.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("streamlit")

from streamlit.testing.v1 import AppTest

from mpipar.compile.plan import Plan
from mpipar.debug.timeline import Span, Timeline
from mpipar.pipeline import Schedule
from simulator import simulate_schedule
from simulator.cost import HardwareProfile, PipelineCost, load_profile
from simulator.op_cost import PlanCosts
from viz.__main__ import streamlit_command
from viz.plan_time import ProfileError, measured_on_lanes, priced, profile_from_bytes, profile_from_path
from viz.planinfo import stage_meshes, stage_of
from viz.simulate import lane_ranks, plan_cost, simulate_plan

ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "viz" / "app.py")
VIEWS = ("Layout", "Propagation", "Reshard stepper", "Communication", "Pipeline", "Memory", "What-if")
NO_DATA = ("nothing to draw", "No memory", "no data", "has no pipeline", "could be loaded")


@pytest.fixture(autouse=True)
def _argv() -> Iterator[None]:
    saved = list(sys.argv)
    yield
    sys.argv = saved


def _app(argv: list[str], clean: bool = True, **state: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    for k, v in state.items():
        at.session_state[k] = v
    sys.argv = [APP, *argv]
    at.run()
    if clean:
        _clean(at)
    else:
        assert not at.exception, [e.value for e in at.exception]
    return at


def _clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _expected_parts(
    plan: Plan, preset: str | HardwareProfile
) -> tuple[tuple[float, ...], tuple[float, ...], dict[str, list[float]], list[float]]:
    """The cost model's seconds for the plan's ops on ``preset``, recomputed rank by rank
    (PlanCosts.op_time / reshard_time): per stage the busiest rank's forward and backward, the
    hand-offs between stages, and each stage's gradient sync (the parameters' gradient reshards)."""
    costs = PlanCosts(plan, load_profile(preset) if isinstance(preset, str) else preset)
    stages = stage_meshes(plan)
    n = len(stages)
    ranks = {s: plan.mesh(m).process_ids for s, m in stages.items()}
    mesh_stage = {m: s for s, m in stages.items()}
    params = {t.name for t in plan.tensors if t.kind == "parameter"}
    per_rank = {(ph, s): dict.fromkeys(ranks[s], 0.0) for ph in ("forward", "backward", "sync") for s in range(n)}
    for op in plan.ops:
        s = stage_of(plan, op)
        for r in costs.op_ranks(op):
            per_rank[(op.phase, s)][r] += costs.op_time(op, r)
    send = {"forward": [0.0] * (n - 1), "backward": [0.0] * (n - 1)}
    for res in plan.reshards:
        if res.src_mesh != res.dst_mesh:
            edge = min(mesh_stage[res.src_mesh], mesh_stage[res.dst_mesh])
            send[res.phase][edge] += max(costs.reshard_time(res, r) for r in costs.reshard_ranks(res))
            continue
        s = stage_of(plan, plan.ops[res.op]) if res.op is not None else mesh_stage[res.src_mesh]
        named = res.reason.split("'")[1] if res.reason.startswith("gradient of DistTensor '") else None
        phase = "sync" if res.op is None and named in params else res.phase
        for r in costs.reshard_ranks(res):
            per_rank[(phase, s)][r] += costs.reshard_time(res, r)
    fwd = tuple(max(per_rank[("forward", s)].values()) for s in range(n))
    bwd = tuple(max(per_rank[("backward", s)].values()) for s in range(n))
    return fwd, bwd, send, [max(per_rank[("sync", s)].values()) for s in range(n)]


def _expected_step(plan: Plan, preset: str) -> float:
    """The plan's own schedule simulated with ``_expected_parts``' stage times, then each lane's
    gradient sync once (as simulator.estimate prices it)."""
    fwd, bwd, send, sync = _expected_parts(plan, preset)
    n = len(fwd)
    cost = PipelineCost(fwd, bwd, (0.0,) * n, tuple(send["forward"]), tuple(send["backward"]), "s")
    timeline = simulate_schedule(Schedule.from_dict(plan.pipeline["schedule"]), cost)
    # one stage per lane here: lane s ends its step with stage s's gradient sync
    return max(max(sp.end for sp in timeline.lane(s)) + sync[s] for s in range(n))


def test_gpt_pipeline_total_is_the_cost_models_prediction(gpt_plan_path: str) -> None:
    plan = Plan.load(gpt_plan_path)
    assert plan.pipeline["schedule"]["kind"] == "1F1B" and not any(op.phase == "optimizer" for op in plan.ops)
    at = _app([gpt_plan_path], view="Pipeline", hw="h100-nvlink-ib")
    expected = _expected_step(plan, "h100-nvlink-ib")
    assert at.metric[0].value == f"{expected:.6g} s"
    assert not any("time units" in c.value for c in at.caption)
    # 1F1B over 2 stages and 2 micro-batches: the step is longer than either lane's own work
    table = {r["stage"]: r for r in at.dataframe[1].value.to_dict("records")}
    for s, row in table.items():
        assert expected * 1e3 > 2 * (row["F ms"] + row["B ms"] + row["W ms"]) > 0, s
    for preset in ("h100-nvlink-ib", "cpu-local", "a100-nvlink-ib"):
        step = simulate_plan(priced(plan, load_profile(preset))).makespan
        assert step == pytest.approx(_expected_step(plan, preset), rel=1e-9), preset
    cpu = _expected_step(plan, "cpu-local")
    assert expected < cpu / 5  # an H100 runs this step far faster than a CPU host


def test_an_eager_runtime_profile_reduces_in_every_backward(gpt_plan_path: str) -> None:
    """On a calibrated CPU profile (mpipar's measured host costs: it prices mpipar's eager
    runtime) the dashboard prices as ``simulator.estimate`` does there: each micro-batch's
    gradient sync in its stage's backward, hand-offs holding both ranks, no sync at step end."""
    plan = Plan.load(gpt_plan_path)
    eager = dataclasses.replace(load_profile("cpu-local"), op_overhead_s=2e-4, reshard_overhead_s=5e-4)
    assert eager.prices_eager_runtime
    pipeline = priced(plan, eager).pipeline
    assert pipeline["cost"]["blocking_transfers"] is True
    assert all(item["name"] != "gradient sync" for items in pipeline["step_end"].values() for item in items)
    fwd, bwd, send, sync = _expected_parts(plan, eager)
    n = len(fwd)
    with_sync = tuple(b + y for b, y in zip(bwd, sync, strict=True))
    cost = PipelineCost(
        fwd, with_sync, (0.0,) * n, tuple(send["forward"]), tuple(send["backward"]), "s", blocking_transfers=True
    )
    expected = simulate_schedule(Schedule.from_dict(plan.pipeline["schedule"]), cost).makespan
    assert simulate_plan(priced(plan, eager)).makespan == pytest.approx(expected, rel=1e-9)
    assert min(sync) > 0


def test_memory_and_pipeline_are_in_seconds(gpt_plan_path: str) -> None:
    plan = Plan.load(gpt_plan_path)
    assert plan_cost(plan).time_unit == "unit"  # mpipar plan writes no costs
    timed = priced(plan, load_profile("a100-nvlink-ib"))
    assert plan_cost(timed).time_unit == "s" and timed.pipeline["cost"]["profile"] == "a100-nvlink-ib"
    assert all(v > 0 for v in timed.pipeline["cost"]["forward"])
    assert simulate_plan(timed).time_unit == "s"


def test_a_plan_without_pipeline_gets_a_lane_per_stage_mesh(tmp_path: Path, gpt_plan_path: str) -> None:
    """An eager script's plan (no pipeline section) whose stage meshes share no rank (a pipeline
    run by reshards alone): one micro-batch through the stages, each on its own lane with its own
    ranks (every stage drawn, not one lane for the largest mesh), then each lane's sync."""
    staged = Plan.load(gpt_plan_path)
    plan = dataclasses.replace(staged, pipeline=None)
    fwd, bwd, send, sync = _expected_parts(staged, "cpu-local")
    down = fwd[0] + send["forward"][0] + fwd[1] + bwd[1]
    expected = max(down + sync[1], down + send["backward"][0] + bwd[0] + sync[0])
    timed = priced(plan, load_profile("cpu-local"))
    timeline = simulate_plan(timed)
    assert timeline.makespan == pytest.approx(expected, rel=1e-9)
    assert min(send["forward"]) > 0 and max(sync) > 0  # the hand-offs and the gradient sync are in the step
    assert timeline.ranks == (0, 1)
    assert lane_ranks(timed) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert timeline.meta["lane_ranks"] == {"0": [0, 1, 2, 3], "1": [4, 5, 6, 7]}  # the lanes' labels
    path = tmp_path / "eager.json"
    plan.save(path)
    at = _app([str(path)], view="Pipeline")
    assert at.metric[0].value == f"{expected:.6g} s"
    at.radio(key="view").set_value("Memory").run()
    _clean(at)
    assert len(at.get("image")) == 2 and not at.info  # memory derived once priced as one stage


def test_profile_files_are_untrusted(tmp_path: Path, gpt_plan_path: str) -> None:
    good = load_profile("h100-nvlink-ib").to_dict()
    cases = {
        b"": "empty",
        pickle.dumps(good): "pickle",
        b'{"format": "mpipar.hardware", "version": 1, "links": 3, "flops_per_s": {}}': "field links",
        json.dumps({**good, "flops_per_s": {"float32": -1}}).encode(): "flops_per_s",
        json.dumps({**good, "wings": 2}).encode(): "'wings'",
        b'{"format": "mpipar.hardware", "version": 1e999}': "1e999",
        # nested past the depth limit, padded so that it is not refused first for its bracket density
        b"[" * 70 + b" " * 20_000 + b"]" * 70: "deep",
    }
    for data, word in cases.items():
        with pytest.raises(ProfileError, match=r"bad\.json") as info:
            profile_from_bytes(data, "bad.json")
        assert word in str(info.value), (word, str(info.value))
    with pytest.raises(ProfileError, match="cannot"):
        profile_from_path(str(tmp_path / "missing.json"))
    with pytest.raises(ProfileError, match=r"not a regular file|directory"):
        profile_from_path(str(tmp_path))
    # in the app: a bad path is an error naming the field, a calibrated file prices the plan
    (tmp_path / "bad.json").write_text(json.dumps({**good, "compute_efficiency": 7}))
    load_profile("h100-nvlink-ib").save(tmp_path / "mine.json")
    at = _app(
        [gpt_plan_path], False, view="Layout", hw="calibrated profile file...", hw_path=str(tmp_path / "bad.json")
    )
    errors = [e.value for e in at.sidebar.error]
    assert errors and "compute_efficiency" in errors[0] and "bad.json" in errors[0]
    at.text_input(key="hw_path").set_value(str(tmp_path / "mine.json"))
    at.radio(key="view").set_value("Pipeline").run()
    _clean(at)
    expected = _expected_step(Plan.load(gpt_plan_path), "h100-nvlink-ib")
    assert at.metric[0].value == f"{expected:.6g} s"


def test_measured_timeline_lands_on_pipeline_lanes(tmp_path: Path, gpt_plan_path: str) -> None:
    plan = Plan.load(gpt_plan_path)
    predicted = simulate_plan(priced(plan, load_profile("cpu-local")))
    assert predicted.meta["lane_ranks"] == {"0": [0, 1, 2, 3], "1": [4, 5, 6, 7]}
    # a measured run: one lane per rank (as MPIPAR_TRACE writes), rank r busy for (r + 1) ms
    spans = [Span(r, "matmul", "F", None, None, 0.0, (r + 1) * 1e-3, "compute") for r in range(8)]
    spans += [Span(r, "all_reduce(sum) on [0, 2]", "COLL", None, None, 0.01, 0.011, "comm") for r in range(8)]
    measured = Timeline(spans, time_unit="s", meta={"source": "measured"})
    lanes = measured_on_lanes(measured, predicted)
    assert lanes.ranks == (0, 1) and lanes.meta["measured_ranks"] == [0, 4]
    assert [s.end for s in lanes.lane(0, "compute")] == [1e-3] and [s.end for s in lanes.lane(1, "compute")] == [5e-3]
    assert measured_on_lanes(lanes, predicted) is lanes  # already on lanes
    path = tmp_path / "measured.json"
    measured.save(path)
    at = _app([gpt_plan_path, str(path)], view="Pipeline")
    # the ranks come from a file: shown as a literal code span (viz.escape.literal)
    assert any("Measured outlines: ranks ` 0, 4 `" in c.value for c in at.caption), [c.value for c in at.caption]


def test_every_view_draws_the_gpt_plan(gpt_plan_path: str) -> None:
    """Item 5 without a browser: each view draws a figure or a table and no "no data" notice."""
    at = _app([gpt_plan_path])
    assert "plan.json" in at.sidebar.caption[-1].value
    _walk(at)


def test_default_is_the_gpt_plan_and_the_sample_is_one_click_away(gpt_plan_path: str) -> None:
    at = _app([], view="Memory")
    assert at.radio(key="open_plan").value.startswith("GPT")
    assert "examples/gpt.py" in at.sidebar.caption[-1].value and "dp=2,tp=2,pp=2" in at.sidebar.caption[-1].value
    # The default plan (traced shape-only) has the ops of the same step ``mpipar plan`` traces numerically.
    ops = len(Plan.load(gpt_plan_path).ops)
    assert f"plan: {ops} ops," in at.sidebar.text[0].value
    assert len(at.get("image")) == 2 and not at.info  # memory per rank, derived from the plan
    at.radio(key="open_plan").set_value("built-in sample").run()
    _clean(at)
    assert "built-in sample" in at.sidebar.caption[-1].value
    hw = at.selectbox(key="hw")
    assert (
        hw.value == "cpu-local" and hw.options[0] == "as loaded (cpu-local)"
    )  # the choice stays; its own costs offered
    hw.set_value("as loaded (cpu-local)").run()
    _clean(at)
    assert len(at.get("image")) == 2  # the sample's memory, on its own costs


def _walk(at: AppTest) -> None:
    for view in VIEWS:
        at.radio(key="view").set_value(view).run()
        _clean(at)
        assert at.get("image") or at.dataframe, view
        notices = [n.value for n in (*at.info, *at.warning)]
        assert not [n for n in notices if any(w in n for w in NO_DATA)], (view, notices)


def test_the_deploy_button_is_configured_away() -> None:
    # `streamlit run viz/app.py` reads viz/.streamlit/config.toml (tomllib is 3.11+: read the section by hand)
    section, settings = "", dict[str, str]()
    for line in (ROOT / "viz" / ".streamlit" / "config.toml").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line:
            key, value = (x.strip() for x in line.split("=", 1))
            settings[f"{section}.{key}"] = value.strip('"')
    assert settings["client.toolbarMode"] == "viewer"
    cmd = streamlit_command([])
    assert cmd[cmd.index("--client.toolbarMode") + 1] == "viewer"  # `mpipar viz`
