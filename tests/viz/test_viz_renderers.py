"""Dashboard renderers: text snapshots (golden), PNG smoke tests, and what the pictures claim.

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/viz/test_viz_renderers.py -k golden   # rewrite snapshots

The sample plan (2 x 2 x 2 hybrid MLP, traced numerically) is deterministic, so its text
renderings are pinned; a change in the rules, the planner or a renderer shows up in review.
"""

from __future__ import annotations

import io
import itertools
import os
import struct

import numpy as np
import pytest

pytest.importorskip("matplotlib")

import mpipar as dist
from mpipar.debug.timeline import Span, Timeline
from mpipar.mesh import ProcessMesh
from mpipar.spec import box_numel
from viz import comm, layout, memory, propagation, stepper, timeline_view, whatif
from viz.figures import artist_count, to_png, to_svg
from viz.planinfo import tensor_spec
from viz.sample import build_sample
from viz.simulate import compatible_kinds, simulate_plan, simulate_plan_lanes

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "viz")


@pytest.fixture(scope="module")
def sample() -> tuple:
    return build_sample(2, 2, 2, "1F1B", 4, hidden=16, batch=8)


def _golden(name: str, text: str) -> None:
    path = os.path.join(GOLDEN, name)
    if os.environ.get("UPDATE_GOLDEN"):
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    with open(path, encoding="utf-8") as f:
        assert text == f.read(), f"{name} changed; rerun with UPDATE_GOLDEN=1 if intended"


def _spec(shape: tuple[int, ...], ids: np.ndarray, names: list[str], pls: str) -> dist.DistSpec:
    return dist.DistSpec(shape, ProcessMesh(ids, names), dist.parse_placements(pls))


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# ------------------------------------------------------------------------------ golden text
def test_golden_layout_text_uneven_partial_and_3d() -> None:
    ids = np.arange(8).reshape(2, 4)
    parts = [
        layout.layout_text(_spec((5, 3, 7), ids, ["dp", "tp"], "S(0)S(2)"), "uneven3d", 4),
        layout.layout_text(_spec((3, 16), ids, ["dp", "tp"], "P(sum)S(0)"), "partial_with_empty", 4),
        layout.layout_text(_spec((4, 6), ids, ["dp", "tp"], "RS(1)"), "replicated", 8),
    ]
    _golden("layout.txt", "\n".join(parts))


def test_golden_sample_trace_stepper_comm(sample: tuple) -> None:
    plan, _ = sample
    handoff = next(r for r in plan.reshards if any(s.kind == "transfer" for s in r.steps))
    text = "\n".join(
        [
            plan.summary() + "\n",
            propagation.trace_text(plan, layer="stage0"),
            propagation.trace_text(plan, collective="all_reduce", phase="backward"),
            *(stepper.stepper_text(plan, handoff, i) for i in range(len(handoff.steps))),
            comm.comm_text(plan),
        ]
    )
    _golden("sample_views.txt", text)


def test_golden_pipeline_memory_whatif_unit_cost() -> None:
    plan, _ = build_sample(2, 2, 2, "1F1B", 4, hidden=16, batch=8)
    unit = _unit_copy(plan)
    t = simulate_plan(unit)
    curve = memory.rank_curve(plan, 5)
    assert curve is not None
    rows = whatif.diff_rows(whatif.plan_metrics(unit, t), whatif.plan_metrics(unit, simulate_plan(unit, "FThenB")))
    _golden(
        "pipeline_memory_whatif.txt",
        "\n".join(
            [
                timeline_view.timeline_text(t),
                memory.memory_text(curve, capacity=2**20),
                whatif.diff_text(rows),
            ]
        ),
    )


def _unit_copy(plan):  # type: ignore[no-untyped-def]
    """The plan with its costs removed: the unit cost model gives exact, stable times."""
    import dataclasses

    pipe = {k: v for k, v in plan.pipeline.items() if k not in ("cost", "step_end")}
    return dataclasses.replace(plan, pipeline=pipe)


# ------------------------------------------------------------------------------ claims
@pytest.mark.parametrize(
    ("shape", "pls"),
    [
        ((5, 3, 7), "S(0)S(2)"),
        ((3, 16), "P(sum)S(0)"),
        ((7, 5), "S(1)S(1)"),
        ((9,), "S(0)R"),
        ((), "RR"),
        ((2, 9), "S(0)S(0)"),
    ],
)
def test_tiles_cover_the_slice_exactly_once(shape: tuple[int, ...], pls: str) -> None:
    spec = _spec(shape, np.arange(8).reshape(2, 4), ["dp", "tp"], pls)
    dims = layout.default_dims(spec)
    blocks = layout.visible_blocks(spec, dims)
    rows = shape[dims[0]] if len(dims) == 2 else 1
    cols = shape[dims[-1]] if dims else 1
    area = sum(
        (b.box[dims[0]][1] - b.box[dims[0]][0] if len(dims) == 2 else 1)
        * (b.box[dims[-1]][1] - b.box[dims[-1]][0] if dims else 1)
        for b in blocks
    )
    assert area == rows * cols  # no gap, no overlap: blocks partition the slice
    holders = sorted(r for b in layout.layout_blocks(spec) for r in b.ranks)
    assert holders == list(range(8))
    table = layout.rank_table(spec, 4)
    assert sum(row["bytes"] for row in table) == sum(box_numel(spec.boxes[r]) * 4 for r in range(8))
    empty = [row["rank"] for row in table if row["empty"]]
    assert empty == [r for r in range(8) if box_numel(spec.boxes[r]) == 0 and shape]


def test_replication_and_partial_counts() -> None:
    spec = _spec((4, 6), np.arange(8).reshape(2, 4), ["dp", "tp"], "RS(1)")
    assert {row["replicas"] for row in layout.rank_table(spec, 4)} == {2}
    spec = _spec((4, 6), np.arange(8).reshape(2, 4), ["dp", "tp"], "P(sum)S(1)")
    rows = layout.rank_table(spec, 4)
    assert {row["replicas"] for row in rows} == {1} and {row["partial holders"] for row in rows} == {2}


def test_bad_dims_are_refused_with_the_fix() -> None:
    spec = _spec((5, 3, 7), np.arange(8).reshape(2, 4), ["dp", "tp"], "S(0)S(2)")
    with pytest.raises(ValueError, match="pick 2 distinct dims"):
        layout.tensor_tiles_figure(spec, dims=(0, 0))
    with pytest.raises(ValueError, match="outside its size"):
        layout.tensor_tiles_figure(spec, dims=(0, 2), at=(0, 9, 0))


def test_trace_places_reshards_before_the_op_that_asked(sample: tuple) -> None:
    plan, _ = sample
    rows = propagation.trace_rows(plan)
    assert sum(r["row"] == "op" for r in rows) == len(plan.ops)
    assert sum(r["row"] == "reshard" for r in rows) == len(plan.reshards)
    for i, row in enumerate(rows):
        if row["row"] == "reshard":
            r = plan.reshards[row["index"]]
            if r.op is not None:
                nxt = next(x for x in rows[i + 1 :] if x["row"] == "op")
                assert nxt["index"] == r.op
    only = propagation.trace_rows(plan, collective="transfer")
    assert only and all(r["row"] == "reshard" and "transfer" in r["collectives"] for r in only)
    layer = propagation.trace_rows(plan, layer="stage1.block0.fc1")
    assert layer and all(r["layer"].startswith("stage1.block0.fc1") for r in layer if r["row"] == "op")
    w = next(t for t in plan.tensors if t.name == "stage0.block0.fc1.weight" and t.kind == "parameter")
    assert all(
        w.id in plan.ops[r["index"]].inputs + plan.ops[r["index"]].outputs
        for r in propagation.trace_rows(plan, tensor=w.id)
        if r["row"] == "op"
    )


def test_stepper_boxes_follow_the_steps(sample: tuple) -> None:
    plan, _ = sample
    handoff = next(r for r in plan.reshards if any(s.kind == "transfer" for s in r.steps))
    views = stepper.reshard_steps(plan, handoff)
    assert [v.step.kind for v in views] == [s.kind for s in handoff.steps]
    for a, b in itertools.pairwise(views):
        assert a.after == b.before  # each step starts where the previous ended
    transfer = next(v for v in views if v.step.kind == "transfer")
    received = {}
    for _, d, box in transfer.pieces:
        received[d] = received.get(d, 0) + box_numel(box)
    assert received == {d: box_numel(transfer.after.boxes[d]) for d in transfer.after.mesh.process_ids}
    gather = next((v for v in views if v.step.kind in ("all_gather", "all_reduce")), None)
    if gather is not None:
        mesh = gather.before.mesh
        assert sorted(r for g in gather.groups for r in g) == sorted(mesh.process_ids)


def test_traffic_matrix_adds_up_to_the_plan(sample: tuple) -> None:
    plan, _ = sample
    _, m = comm.traffic_matrix(plan)
    assert np.all(np.diag(m) == 0)
    expected = 0.0
    for r in plan.reshards:
        for s in r.steps:
            if s.kind == "transfer":
                expected += sum(p[2] for p in s.pieces if p[0] != p[1])
            elif s.kind in propagation.COMM_KINDS and s.axes:
                from viz.planinfo import group_size, plan_mesh

                mesh = plan_mesh(plan, r.src_mesh)
                n = group_size(mesh, s.axes)
                expected += s.bytes_per_rank * mesh.size if n > 1 else 0.0
    assert m.sum() == pytest.approx(expected)
    table = comm.comm_table(plan)
    assert sum(row["count"] for row in table) == sum(plan.comm_counts().values())
    assert sum(row["bytes/rank"] for row in table) == pytest.approx(plan.comm_bytes())


def test_simulated_lanes_match_the_schedule_and_memory_model(sample: tuple) -> None:
    plan, timeline = sample
    assert timeline.ranks == (0, 1) and timeline.meta["lane_ranks"] == {"0": [0, 1, 2, 3], "1": [4, 5, 6, 7]}
    computes = [s for s in timeline.spans if s.kind in ("F", "B")]
    assert len(computes) == 2 * 2 * 4  # F and B of 2 stages x 4 micro-batches
    assert {s.kind for s in timeline.spans} >= {"F", "B", "SEND", "RECV", "COLL", "OPT"}
    curve = memory.rank_curve(plan, 5)
    mem = next(e for e in plan.memory["ranks"] if e["rank"] == 5)
    state = mem["parameters"] + mem["gradients"] + mem["optimizer_state"]
    in_flight = plan_schedule_peak(plan)[1]
    _, peak, at = curve.peak()
    assert at["activations"] == mem["activations"]["1"] * in_flight
    assert peak == pytest.approx(state + at["activations"] + at["comm_buffers"])
    assert set(compatible_kinds(plan)) == {"FThenB", "1F1B", "ZBH1", "Interleaved1F1B"}
    other = simulate_plan_lanes(plan, "FThenB")
    assert other.meta["schedule"] == "FThenB" and other.memory is not None


def plan_schedule_peak(plan):  # type: ignore[no-untyped-def]
    from viz.simulate import plan_schedule

    return plan_schedule(plan).peak_in_flight()


def test_whatif_diff_reports_the_change(sample: tuple) -> None:
    plan, timeline = sample
    new_plan, new_t = whatif.whatif_sample(4, 2, 2, "1F1B", 4)
    assert whatif.whatif_sample(4, 2, 2, "1F1B", 4)[0] is new_plan  # cached
    rows = {
        r["metric"]: r
        for r in whatif.diff_rows(whatif.plan_metrics(plan, timeline), whatif.plan_metrics(new_plan, new_t))
    }
    assert rows["world size"]["loaded"] == "8" and rows["world size"]["what-if"] == "16"
    assert rows["world size"]["what-if / loaded"] == "2x"


def test_overlay_of_other_unit_is_normalized() -> None:
    predicted = Timeline([Span(0, "0F0", "F", 0, 0, 0.0, 1.0), Span(1, "1F0", "F", 1, 0, 1.0, 2.0)], time_unit="unit")
    measured = Timeline(
        [Span(0, "0F0", "F", 0, 0, 0.0, 0.003), Span(1, "1F0", "F", 1, 0, 0.003, 0.007)],
        time_unit="s",
        meta={"source": "measured"},
    )
    fig = timeline_view.timeline_figure(predicted, overlay=measured)
    assert "both scaled to their step" in fig.axes[0].get_title()
    assert fig.axes[0].get_xlim()[1] == pytest.approx(1.12)


# ------------------------------------------------------------------------------ PNG smoke
def _figures(sample: tuple) -> dict[str, object]:
    plan, timeline = sample
    w = next(t for t in plan.tensors if t.kind == "parameter" and len(t.shape) == 2)
    spec = tensor_spec(plan, w)
    handoff = next(r for r in plan.reshards if any(s.kind == "transfer" for s in r.steps))
    curve = memory.rank_curve(plan, 0)
    rows = whatif.diff_rows(whatif.plan_metrics(plan, timeline), whatif.plan_metrics(plan, timeline))
    return {
        "tiles": layout.tensor_tiles_figure(spec, w.name),
        "mesh": layout.mesh_grid_figure(spec, 4, w.name),
        "stepper": stepper.stepper_figure(plan, handoff, 1),
        "comm": comm.comm_figure(plan),
        "traffic": comm.traffic_figure(plan),
        "timeline": timeline_view.timeline_figure(timeline),
        "side_by_side": timeline_view.side_by_side_figure(timeline, simulate_plan_lanes(plan, "ZBH1")),
        "memory": memory.memory_figure(curve, capacity=80 * 2**30),
        "peaks": memory.peaks_figure(memory.rank_peaks(plan), 80 * 2**30),
        "whatif": whatif.diff_figure(rows),
    }


def test_png_and_svg_smoke(sample: tuple) -> None:
    for name, fig in _figures(sample).items():
        png = to_png(fig, dpi=50)  # type: ignore[arg-type]
        width, height = _png_size(png)
        w_in, h_in = fig.get_size_inches()  # type: ignore[attr-defined]
        assert (width, height) == (round(w_in * 50), round(h_in * 50)), name
        from PIL import Image

        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"))
        assert pixels.std() > 5, f"{name} is blank"  # something was drawn
        assert to_svg(fig).lstrip().startswith(b"<?xml"), name  # type: ignore[arg-type]
        assert artist_count(fig) > 0, name  # type: ignore[arg-type]


def test_chrome_trace_download_is_the_timelines(sample: tuple) -> None:
    import json

    _, timeline = sample
    data = json.loads(timeline_view.chrome_trace_bytes(timeline))
    assert data == json.loads(json.dumps(timeline.to_chrome_trace()))
    assert any(e.get("ph") == "s" for e in data["traceEvents"])  # send -> recv arrows


def test_sample_zero_and_recompute_knobs_change_the_plan() -> None:
    base, _ = build_sample(2, 2, 2, "1F1B", 2, hidden=16, batch=8)
    z1, _ = build_sample(2, 2, 2, "1F1B", 2, zero=1, hidden=16, batch=8)
    z2, _ = build_sample(2, 2, 2, "1F1B", 2, zero=2, hidden=16, batch=8)
    full, _ = build_sample(2, 2, 2, "1F1B", 2, recompute="full", hidden=16, batch=8)
    sel, _ = build_sample(2, 2, 2, "1F1B", 2, recompute="selective", hidden=16, batch=8)
    mem = {
        name: p.memory["ranks"][0] for name, p in (("base", base), ("z1", z1), ("z2", z2), ("full", full), ("sel", sel))
    }
    # ZeRO-1: velocities split over dp (ln vectors of 16 split too), the new parameters all-gathered.
    assert mem["z1"]["optimizer_state"] == mem["base"]["optimizer_state"] // 2
    assert mem["z1"]["gradients"] == mem["base"]["gradients"]
    assert z1.comm_counts("optimizer") == {"all_gather": 8} and not base.comm_counts("optimizer")
    # ZeRO-2: + gradients kept split: the dp reduction of the 8 parameters is a reduce_scatter.
    assert mem["z2"]["gradients"] == mem["base"]["gradients"] // 2
    assert z2.comm_counts("backward").get("reduce_scatter") == 8
    # Recompute: full keeps only each block's input; selective drops fc1 + gelu (the widest).
    rows, h = 8 // 2, 16
    assert mem["full"]["activations"]["0"] == rows * h * 4
    assert mem["full"]["activations"]["0"] < mem["sel"]["activations"]["0"] < mem["base"]["activations"]["0"]
    recomputed = [o for o in full.ops if o.phase == "backward" and "recompute" in o.scope.split(".")]
    assert {o.op for o in recomputed} >= {"layer_norm", "matmul", "gelu"}
    with pytest.raises(ValueError, match="ZeRO-3"):
        build_sample(zero=3)
