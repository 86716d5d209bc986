"""Hostile plans and timelines (and the dashboard reading them) get named errors.

Each test reproduces one reported failure: ``Plan.load``/``Timeline.load`` letting
``RecursionError``, a 5000-digit ``int`` conversion error or ``UnicodeDecodeError`` through;
``Plan.from_dict`` accepting ``S(9)`` on a 1-d tensor or a mesh that repeats a rank; the
dashboard replacing its page with a traceback for a 5000-digit number; and the Layout view
failing on a legitimate shape-only plan with a 2^40 x 2^40 tensor.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mpipar.compile.plan import Plan, PlanFormatError
from mpipar.debug.timeline import Timeline, TimelineFormatError
from mpipar.untrusted import FileFormatError
from viz.files import VizFileError, load_document, load_path
from viz.sample import build_sample

APP = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "viz", "app.py")
BIG = 1 << 40


@pytest.fixture(scope="module")
def docs() -> tuple[dict[str, Any], dict[str, Any]]:
    plan, timeline = build_sample(2, 2, 2, "1F1B", 2, hidden=16, batch=8)
    return plan.to_dict(), timeline.to_dict()


def big_plan() -> dict[str, Any]:
    """A legitimate shape-only plan: a 2^40 x 2^40 float32 weight all-gathered over tp."""
    half = BIG // 2
    gathered = float(half * half * 4)
    return {
        "format": "mpipar.plan",
        "version": 1,
        "meta": {"shape_only": True, "world_size": 4},
        "meshes": [{"id": 0, "shape": [2, 2], "process_ids": [0, 1, 2, 3], "dim_names": ["dp", "tp"]}],
        "tensors": [
            {
                "id": 0,
                "name": "w",
                "kind": "parameter",
                "shape": [BIG, BIG],
                "dtype": "float32",
                "mesh": 0,
                "placements": "S(0)S(1)",
                "local_shapes": [[half, half]] * 4,
            },
            {
                "id": 1,
                "name": "w.gathered",
                "kind": "activation",
                "shape": [BIG, BIG],
                "dtype": "float32",
                "mesh": 0,
                "placements": "S(0)R",
                "local_shapes": [[half, BIG]] * 4,
            },
            {
                "id": 2,
                "name": "y",
                "kind": "activation",
                "shape": [BIG, BIG],
                "dtype": "float32",
                "mesh": 0,
                "placements": "S(0)R",
                "local_shapes": [[half, BIG]] * 4,
            },
        ],
        "ops": [
            {
                "index": 0,
                "op": "relu",
                "phase": "forward",
                "scope": "m",
                "inputs": [1],
                "outputs": [2],
                "rule": "elementwise",
                "decision": "keep",
                "input_placements": ["S(0)S(1)"],
                "required_placements": ["S(0)R"],
                "output_placements": ["S(0)R"],
                "reshards": [0],
            }
        ],
        "reshards": [
            {
                "index": 0,
                "op": 0,
                "tensor": 0,
                "new_tensor": 1,
                "reason": "relu needs S(0)R",
                "phase": "forward",
                "shape": [BIG, BIG],
                "dtype": "float32",
                "src": {"mesh": 0, "placements": "S(0)S(1)"},
                "dst": {"mesh": 0, "placements": "S(0)R"},
                "bytes_per_rank": gathered,
                "steps": [
                    {
                        "kind": "all_gather",
                        "axes": ["tp"],
                        "reduce_type": None,
                        "src": "S(0)S(1)",
                        "dst": "S(0)R",
                        "bytes_per_rank": gathered,
                        "pieces": [],
                    }
                ],
            }
        ],
        "pipeline": None,
        "memory": None,
    }


def _deep(doc: dict[str, Any]) -> bytes:
    # Deep enough for the parser's recursion limit; not so bracket-dense that the memory bound
    # (tests/test_file_bounds.py) refuses it first.
    return json.dumps(doc)[:-1].encode() + b', "deep": ' + b"[" * 200 + b"]" * 200 + b"}"


def _huge_number(doc: dict[str, Any]) -> bytes:
    text = json.dumps(doc)
    return text.replace('"version": 1', '"version": 1' + "0" * 5000, 1).encode()


def _not_utf8(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).replace('"format"', '"form\xe9t"').encode("latin-1")


HOSTILE: list[tuple[str, Callable[[dict[str, Any]], bytes], str]] = [
    ("deep nesting", _deep, "nests JSON more than 64 levels deep"),
    ("5000-digit number", _huge_number, "is an integer of 5001 digits"),
    ("not UTF-8", _not_utf8, "is not UTF-8 text"),
]


@pytest.mark.parametrize(("what", "make", "problem"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_plan_load_names_every_hostile_file(
    docs: tuple, tmp_path: Path, what: str, make: Callable[[dict[str, Any]], bytes], problem: str
) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(make(docs[0]))
    with pytest.raises(PlanFormatError) as err:
        Plan.load(path)
    assert isinstance(err.value, FileFormatError) and err.value.kind == "plan"
    assert err.value.source == str(path) and str(path) in str(err.value)
    assert problem in str(err.value)


@pytest.mark.parametrize(("what", "make", "problem"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_timeline_load_names_every_hostile_file(
    docs: tuple, tmp_path: Path, what: str, make: Callable[[dict[str, Any]], bytes], problem: str
) -> None:
    path = tmp_path / "timeline.json"
    path.write_bytes(make(docs[1]))
    with pytest.raises(TimelineFormatError) as err:
        Timeline.load(path)
    assert err.value.kind == "timeline" and err.value.source == str(path)
    assert problem in str(err.value)


def test_plan_refuses_a_shard_dim_beyond_the_tensor(docs: tuple) -> None:
    doc = copy.deepcopy(docs[0])
    index, tensor = next((i, t) for i, t in enumerate(doc["tensors"]) if t["mesh"] is not None and len(t["shape"]) == 1)
    n_axes = len(next(m for m in doc["meshes"] if m["id"] == tensor["mesh"])["shape"])
    tensor["placements"] = "S(9)" + "R" * (n_axes - 1)
    with pytest.raises(PlanFormatError) as err:
        Plan.from_dict(doc, source="p.json")
    assert err.value.field == f"tensors[{index}].placements"
    assert "shards dim 9 of a 1-d tensor" in str(err.value) and "p.json" in str(err.value)


@pytest.mark.parametrize(
    ("placements", "problem"),
    [
        ("Z(0)R", "splits dim 0 of size 6 zigzag over 2 ranks (axis 0): it does not divide into 2 x 2 = 4"),
        ("S(1)Z(1)", "splits dim 1 on mesh axis 0 outside its zigzag split Z(1) on axis 1"),
    ],
)
def test_plan_refuses_a_zigzag_split_dist_spec_would_refuse(docs: tuple, placements: str, problem: str) -> None:
    """A plan can only describe layouts mpipar makes: ``DistSpec`` refuses these zigzag splits."""
    doc = copy.deepcopy(docs[0])
    index, tensor = next((i, t) for i, t in enumerate(doc["tensors"]) if t["mesh"] is not None and len(t["shape"]) == 2)
    mesh = next(m for m in doc["meshes"] if m["id"] == tensor["mesh"])
    mesh.update(shape=[2, 2], process_ids=list(range(4)), dim_names=["dp", "tp"])
    tensor.update(shape=[6, 8], placements=placements, local_shapes=[])
    with pytest.raises(PlanFormatError) as err:
        Plan.from_dict(doc, source="p.json")
    assert err.value.field == f"tensors[{index}].placements"
    assert problem in str(err.value)
    tensor["placements"] = "Z(1)R"  # 8 divides into 2 x 2 chunks: the same layout DistSpec makes
    Plan.from_dict(doc, source="p.json")


def test_plan_refuses_a_mesh_that_repeats_a_rank(docs: tuple) -> None:
    doc = copy.deepcopy(docs[0])
    ids = doc["meshes"][0]["process_ids"]
    ids[1] = ids[0]
    with pytest.raises(PlanFormatError, match=r"meshes\[0\]\.process_ids: .* repeats a rank"):
        Plan.from_dict(doc)


def test_plan_refuses_a_number_beyond_its_cap(docs: tuple) -> None:
    doc = copy.deepcopy(docs[0])
    doc["tensors"][0]["shape"][0] = 1 << 70  # a dict built in memory bypasses the JSON digit cap
    with pytest.raises(PlanFormatError, match=r"tensors\[0\]\.shape\[0\]: .* is out of range"):
        Plan.from_dict(doc)


@pytest.mark.parametrize(("what", "make", "problem"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_dashboard_loader_names_every_hostile_file(
    docs: tuple, what: str, make: Callable[[dict[str, Any]], bytes], problem: str
) -> None:
    with pytest.raises(VizFileError) as err:
        load_document(make(docs[0]), "upload.json")  # the upload path: bytes from the browser
    assert str(err.value).startswith("upload.json: ") and problem in str(err.value)


def test_the_big_plan_loads_exactly(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps(big_plan()))
    assert Plan.load(path).to_dict() == big_plan()
    assert load_path(path).to_dict() == big_plan()  # type: ignore[union-attr]


def test_rank_table_of_the_big_plan_converts_to_arrow() -> None:
    pa = pytest.importorskip("pyarrow")
    from viz import layout
    from viz.planinfo import tensor_spec
    from viz.tables import arrow_safe

    plan = Plan.from_dict(big_plan())
    rows = layout.rank_table(tensor_spec(plan, plan.tensors[0]), 4)
    assert rows[0]["bytes"] == (BIG // 2) ** 2 * 4  # exact Python ints from the renderer
    with pytest.raises(OverflowError):
        pa.Table.from_pylist(rows)  # what broke the Layout view
    safe = arrow_safe(rows)
    table = pa.Table.from_pylist(safe)
    assert table.column("bytes")[0].as_py() == f"{(BIG // 2) ** 2 * 4:,}"
    assert table.column("rank").to_pylist() == [0, 1, 2, 3]  # small columns stay numeric


@pytest.fixture
def _argv() -> Iterator[None]:
    saved = list(sys.argv)
    yield
    sys.argv = saved


def _run_app(argv: list[str]) -> Any:
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(APP, default_timeout=120)
    sys.argv = [APP, *argv]
    at.run()
    return at


@pytest.mark.usefixtures("_argv")
def test_dashboard_shows_a_5000_digit_plan_in_its_error_box(docs: tuple, tmp_path: Path) -> None:
    pytest.importorskip("streamlit")
    path = tmp_path / "plan.json"
    path.write_bytes(_huge_number(docs[0]))
    at = _run_app([str(path)])
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.error) == 1 and "plan.json" in at.error[0].value and "5001 digits" in at.error[0].value
    at.radio(key="view").set_value("Communication").run()  # the page keeps working on the sample
    assert not at.exception and at.header[0].value == "Communication"


@pytest.mark.usefixtures("_argv")
def test_dashboard_views_draw_the_2_40_plan(tmp_path: Path) -> None:
    pytest.importorskip("streamlit")
    path = tmp_path / "big.json"
    path.write_text(json.dumps(big_plan()))
    at = _run_app([str(path)])
    for name in ("Layout", "Propagation", "Reshard stepper", "Communication", "Memory", "What-if"):
        at.radio(key="view").set_value(name).run()
        assert not at.exception, (name, [e.value for e in at.exception])
        assert at.header[0].value == name
    at.radio(key="view").set_value("Layout").run()
    cells = {str(v) for df in at.dataframe for v in df.value.to_numpy().ravel()}
    assert cells & {f"{1 << 80:,}", f"{1 << 81:,}"}, cells  # the rank table's exact byte counts, as text


def test_timeline_refuses_lane_ranks_the_dashboard_cannot_label(docs: tuple) -> None:
    # Found by tests/fuzz/test_fuzz_files.py: a null rank in meta.lane_ranks loaded, then crashed
    # the dashboard's lane labels with a TypeError.
    doc = copy.deepcopy(docs[1])
    lane, members = next(iter(doc["meta"]["lane_ranks"].items()))
    members[1] = None
    with pytest.raises(TimelineFormatError, match=rf"meta\.lane_ranks\.{lane}\[1\]: None is not an integer rank"):
        Timeline.from_dict(doc)


@pytest.mark.usefixtures("_argv")
@pytest.mark.parametrize("config", [{"dp": 1000}, {"schedule": "X"}, {"hidden": 10**12}, "junk"])
def test_whatif_ignores_a_hostile_sample_config(docs: tuple, tmp_path: Path, config: Any) -> None:
    # A plan claiming to be the sample's may carry any meta.config: out-of-range knobs failed the
    # number inputs, an unknown schedule the selectbox, a huge hidden size would re-trace for ever.
    pytest.importorskip("streamlit")
    doc = copy.deepcopy(docs[0])
    assert doc["meta"]["builder"] == "viz.sample"
    doc["meta"]["config"] = config if not isinstance(config, dict) else {**doc["meta"]["config"], **config}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    at = _run_app([str(path)])
    at.radio(key="view").set_value("What-if").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("using the" in w.value for w in at.warning), [w.value for w in at.warning]
    assert at.number_input(key="wi_dp").value <= 64


def test_plan_refuses_a_step_over_one_axis_twice() -> None:
    # Found by tests/fuzz/test_fuzz_files.py: axes ["tp", "tp"] loaded, then failed the traffic matrix.
    doc = big_plan()
    doc["reshards"][0]["steps"][0]["axes"] = ["tp", "tp"]
    with pytest.raises(PlanFormatError, match=r"reshards\[0\]\.steps\[0\]\.axes: \['tp', 'tp'\] repeats an axis"):
        Plan.from_dict(doc)


def test_byte_counts_load_exactly_or_not_at_all(docs: tuple) -> None:
    # Found by tests/fuzz/test_fuzz_files.py: 10**29 bytes loaded as the float 1e29, another value.
    plan = big_plan()
    plan["reshards"][0]["bytes_per_rank"] = 10**29
    with pytest.raises(PlanFormatError, match=r"bytes_per_rank: 10{29} is an integer no float holds exactly"):
        Plan.from_dict(plan)
    timeline = copy.deepcopy(docs[1])
    timeline["memory"]["ranks"][0]["bytes"][timeline["memory"]["categories"][0]][0] = 10**29
    with pytest.raises(TimelineFormatError, match="is an integer no float holds exactly"):
        Timeline.from_dict(timeline)
    plan["reshards"][0]["bytes_per_rank"] = 1 << 80  # exact in a float: loads as the same value
    assert Plan.from_dict(plan).reshards[0].bytes_per_rank == 1 << 80


def test_timeline_refuses_a_repeated_memory_category(docs: tuple) -> None:
    # Found by tests/fuzz/test_fuzz_files.py: a repeated category loaded as one, another document.
    doc = copy.deepcopy(docs[1])
    doc["memory"]["categories"].append(doc["memory"]["categories"][0])
    with pytest.raises(TimelineFormatError, match=r"memory\.categories\[\d+\]: .* repeats a category"):
        Timeline.from_dict(doc)


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (
            lambda p: p["pipeline"]["cost"].update(forward=["x"] * len(p["pipeline"]["stages"])),
            "pipeline.cost.forward[0]",
            "not a non-negative number",
        ),
        (lambda p: p["pipeline"]["cost"].update(forward=[1.0]), "pipeline.cost.forward", "entries for"),
        (lambda p: p["pipeline"]["cost"].update(time_unit="fortnight"), "pipeline.cost.time_unit", "'s' or 'unit'"),
        (lambda p: p["pipeline"].update(step_end={"0": ["x"]}), "pipeline.step_end['0'][0]", "not a JSON object"),
        (
            lambda p: p["pipeline"].update(step_end={"0": [{"duration": -1}]}),
            "pipeline.step_end['0'][0].duration",
            "non-negative",
        ),
        (lambda p: p["pipeline"]["stages"][0].update(mesh=999), "pipeline.stages[0].mesh", "names no mesh"),
        (lambda p: p["pipeline"]["stages"][1].update(stage=0), "pipeline.stages[1].stage", "new stage number"),
        (
            lambda p: p["pipeline"]["schedule"].update(num_microbatches=1 << 40),
            "pipeline.schedule.num_microbatches",
            "[1, 2^20]",
        ),
        (lambda p: p["pipeline"]["schedule"]["actions"][0].append("9F9"), "pipeline.schedule", "not a valid schedule"),
        (
            lambda p: p["memory"]["ranks"][0].update(parameters="lots"),
            "memory.ranks[0].parameters",
            "not a non-negative number",
        ),
        (
            lambda p: p["memory"]["ranks"][0].update(activations={"one": 5}),
            "memory.ranks[0].activations",
            "not a stage number",
        ),
        (
            lambda p: p["memory"]["ranks"][1].update(rank=p["memory"]["ranks"][0]["rank"]),
            "memory.ranks[1].rank",
            "repeats",
        ),
        (lambda p: p["memory"].update(capacity_bytes=-1), "memory.capacity_bytes", "non-negative"),
        (lambda p: p["tensors"][0].update(dtype="object"), "tensors[0].dtype", "not an element type"),
        (lambda p: p["reshards"][0].update(dtype="V8"), "reshards[0].dtype", "not an element type"),
    ],
)
def test_plan_refuses_malformed_sections(
    docs: tuple, mutate: Callable[[dict[str, Any]], Any], field: str, words: str
) -> None:
    """The dashboard's views read these fields (dtypes size every tensor; the pipeline, memory
    and what-if views read those sections); a plan from elsewhere with a wrong one is refused at
    load, naming the field, not mid-view."""
    doc = copy.deepcopy(docs[0])
    mutate(doc)
    with pytest.raises(PlanFormatError) as err:
        Plan.from_dict(doc, source="p.json")
    assert err.value.field == field, str(err.value)
    assert words in str(err.value) and "p.json" in str(err.value)


def test_dashboard_keeps_working_on_a_plan_with_a_malformed_pipeline(docs: tuple, tmp_path: Path) -> None:
    pytest.importorskip("streamlit")
    doc = copy.deepcopy(docs[0])
    doc["pipeline"]["step_end"] = {"0": [{"name": "x", "duration": "soon"}]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    at = _run_app([str(path)])
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.error) == 1 and "pipeline.step_end" in at.error[0].value
    at.radio(key="view").set_value("Pipeline").run()
    assert not at.exception and at.header[0].value == "Pipeline"
