"""A 1024-rank shape-only plan: it loads, and every view does bounded work (artists, simulations, lines).

Timings are in ``benchmarks/viz_scale.py`` (no timed assertion here): the bound asserted is on
the work each renderer does, which is what keeps it under a few seconds on any machine.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

import viz.memory
from mpipar.compile.plan import Plan
from viz import comm, layout, memory, propagation, stepper, timeline_view, whatif
from viz.figures import artist_count
from viz.files import load_document
from viz.planinfo import tensor_spec
from viz.sample import build_sample
from viz.simulate import simulate_plan_lanes

MAX_ARTISTS = 200


@pytest.fixture(scope="module")
def big() -> tuple:
    plan, timeline = build_sample(32, 16, 2, "1F1B", 8, shape_only=True, hidden=1024, batch=64)
    return plan, timeline


def test_big_plan_round_trips_through_the_loader(big: tuple) -> None:
    plan, _ = big
    assert len({r for m in plan.meshes for r in m.process_ids}) == 1024
    data = json.dumps(plan.to_dict()).encode()
    loaded = load_document(data, "big.json")
    assert isinstance(loaded, Plan) and loaded == plan


def test_every_view_draws_a_bounded_number_of_artists(big: tuple) -> None:
    plan, timeline = big
    weights = [t for t in plan.tensors if t.kind == "parameter" and len(t.shape) == 2]
    acts = [t for t in plan.tensors if t.kind == "activation" and t.placements == "S(0)S(1)"]
    figures = {}
    for t in (weights[0], acts[0]):
        spec = tensor_spec(plan, t)
        assert spec is not None and spec.mesh.size == 512
        figures[f"tiles {t.id}"] = layout.tensor_tiles_figure(spec, t.name)
        figures[f"mesh {t.id}"] = layout.mesh_grid_figure(spec, 4, t.name)
        assert len(layout.layout_text(spec, t.name, 4).splitlines()) < 150
    handoff = next(r for r in plan.reshards if any(s.kind == "transfer" for s in r.steps))
    for i in range(len(handoff.steps)):
        figures[f"step {i}"] = stepper.stepper_figure(plan, handoff, i)
        assert len(stepper.stepper_text(plan, handoff, i).splitlines()) < 250
    figures["comm"] = comm.comm_figure(plan)
    figures["traffic"] = comm.traffic_figure(plan)
    figures["timeline"] = timeline_view.timeline_figure(timeline)
    figures["side"] = timeline_view.side_by_side_figure(timeline, simulate_plan_lanes(plan, "ZBH1"))
    figures["memory"] = memory.memory_figure(memory.rank_curve(plan, 1023), 80 * 2**30)
    figures["peaks"] = memory.peaks_figure(memory.rank_peaks(plan), 80 * 2**30)
    new_plan, new_t = whatif.whatif_sample(2, 2, 2, "1F1B", 8)
    figures["whatif"] = whatif.diff_figure(
        whatif.diff_rows(whatif.plan_metrics(plan, timeline), whatif.plan_metrics(new_plan, new_t))
    )
    counts = {name: artist_count(fig) for name, fig in figures.items()}
    assert max(counts.values()) <= MAX_ARTISTS, counts
    rows = propagation.trace_rows(plan)
    assert len(rows) == len(plan.ops) + len(plan.reshards)


def test_traffic_matrix_is_dense_over_every_rank(big: tuple) -> None:
    plan, _ = big
    ranks, m = comm.traffic_matrix(plan)
    assert m.shape == (1024, 1024) and len(ranks) == 1024
    assert m.sum() > 0


def test_peaks_simulate_each_memory_signature_once(big: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    plan, _ = big
    calls = []
    real = viz.memory.simulate_plan

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("memory_rank"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(viz.memory, "simulate_plan", counting)
    rows = memory.rank_peaks(plan)
    assert len(rows) == 1024
    assert len(calls) <= 16  # distinct (lane, bytes) signatures, not 1024 simulations
    assert all(r["peak"] > 0 for r in rows)
