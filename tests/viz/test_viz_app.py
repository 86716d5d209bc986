"""The Streamlit app, driven headless by ``AppTest``: every view, its widgets, files from the command line.

Each test drives the real script (``viz/app.py``) in-process: no browser, no server. The
browser test (``tests/browser/``) covers the same app in Debian's chromium.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("streamlit")

from streamlit.testing.v1 import AppTest

from viz.sample import build_sample

APP = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "viz", "app.py")


def _app(argv: list[str] | None = None) -> AppTest:
    """The app on the built-in sample (the sidebar's "Open" choice; the GPT default has its own tests)."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.session_state["open_plan"] = "built-in sample"
    sys.argv = [APP, *(argv or [])]
    at.run()
    return at


@pytest.fixture(autouse=True)
def _argv() -> Iterator[None]:
    saved = list(sys.argv)
    yield
    sys.argv = saved


def _clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _view(at: AppTest, name: str) -> AppTest:
    at.radio(key="view").set_value(name).run()
    _clean(at)
    assert at.header[0].value == name
    return at


def test_every_view_renders_the_sample() -> None:
    at = _app()
    _clean(at)
    assert "built-in sample" in at.sidebar.caption[0].value
    for name in ("Layout", "Propagation", "Reshard stepper", "Communication", "Pipeline", "Memory", "What-if"):
        _view(at, name)
        assert at.get("image") or at.dataframe, name  # each view shows a figure or a table


def test_layout_pick_a_tensor_and_the_stepper_slider() -> None:
    at = _app()
    box = at.selectbox(key="layout_tensor")
    before = [img.proto.imgs[0].url for img in at.get("image")] if at.get("image") else []
    box.select_index(len(box.options) - 1).run()
    _clean(at)
    assert at.selectbox(key="layout_tensor").index == len(box.options) - 1
    after = [img.proto.imgs[0].url for img in at.get("image")]
    assert len(after) == 2 and after != before  # tiles and mesh grid, redrawn for the new tensor
    _view(at, "Reshard stepper")
    reshard = at.selectbox(key="step_reshard").value
    slider = at.slider(key=f"step_slider_{reshard.index}")
    assert slider.max == len(reshard.steps) > 1
    for step in range(1, int(slider.max) + 1):
        slider.set_value(step).run()
        _clean(at)
        assert f"step {step}:" in at.markdown[0].value


def test_propagation_filters_and_pipeline_schedule_switch() -> None:
    at = _view(_app(), "Propagation")
    at.selectbox(key="trace_collective").set_value("transfer").run()
    _clean(at)
    frame = at.dataframe[0].value
    frame = frame.data if hasattr(frame, "data") else frame
    assert len(frame) == 2 and set(frame["row"]) == {"reshard"}  # the two hand-offs, forward and backward
    _view(at, "Pipeline")
    for kind in ("FThenB", "ZBH1", "Interleaved1F1B"):
        at.selectbox(key="pipe_kind").set_value(kind).run()
        _clean(at)
    at.number_input(key="pipe_m").set_value(8).run()
    _clean(at)


def test_whatif_knobs_change_the_diff_and_zero3_is_not_offered() -> None:
    at = _view(_app(), "What-if")
    assert 3 not in at.selectbox(key="wi_zero").options and "ZeRO-3" in at.selectbox(key="wi_zero").help
    at.number_input(key="wi_dp").set_value(4).run()
    _clean(at)
    rows = {r["metric"]: r for r in at.dataframe[0].value.to_dict("records")}
    assert rows["world size"]["loaded"] == "8" and rows["world size"]["what-if"] == "16"
    at.selectbox(key="wi_kind").set_value("ZBH1").run()
    _clean(at)
    at.number_input(key="wi_dp").set_value(2).run()
    at.selectbox(key="wi_zero").set_value(2).run()
    _clean(at)
    rows = {r["metric"].strip(): r for r in at.dataframe[0].value.to_dict("records")}
    assert rows["reduce_scatter calls"]["what-if"] == "9"  # ZeRO-2: gradients reduce-scattered over dp
    at.selectbox(key="wi_recompute").set_value("full").run()
    _clean(at)
    rows = {r["metric"].strip(): r for r in at.dataframe[0].value.to_dict("records")}
    assert float(rows["peak memory"]["what-if / loaded"].rstrip("x")) < 1


def test_memory_rank_and_capacity() -> None:
    at = _view(_app(), "Memory")
    at.selectbox(key="mem_rank").set_value(7).run()
    _clean(at)
    caps = at.selectbox(key="mem_capacity").options
    h100 = next(c for c in caps if c.startswith("h100"))
    at.selectbox(key="mem_capacity").set_value(h100).run()
    _clean(at)
    assert len(at.get("image")) == 2


def test_files_from_the_command_line(tmp_path: object) -> None:
    plan, timeline = build_sample(2, 2, 2, "ZBH1", 4)
    plan_path, t_path = f"{tmp_path}/plan.json", f"{tmp_path}/timeline.json"
    plan.save(plan_path)
    timeline.save(t_path)
    measured = json.loads(timeline.to_json())
    measured["meta"]["source"] = "measured"
    with open(f"{tmp_path}/measured.json", "w") as f:
        json.dump(measured, f)
    at = _app([plan_path, t_path, f"{tmp_path}/measured.json"])
    _clean(at)
    assert "plan.json" in at.sidebar.caption[0].value
    _view(at, "Pipeline")
    assert not any("Load a measured timeline" in c.value for c in at.caption)  # the overlay is there


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"format": "mpipar.plan", "version": 1, "meshes": [', "not valid JSON"),
        (b'{"format": "something.else"}', "field format is 'something.else'"),
        (pickle.dumps({"format": "mpipar.plan"}), "never unpickles"),
        (b"\xff\xfe\x00junk", "not UTF-8"),
        (b"[1, 2, 3]", "not an object"),
        (
            b'{"format": "mpipar.plan", "version": 1, "meshes": [], "tensors": [{"id": 0}], "ops": [], "reshards": []}',
            "tensors[0]",
        ),
    ],
)
def test_bad_files_show_a_readable_error(tmp_path: object, content: bytes, expected: str) -> None:
    path = f"{tmp_path}/bad.json"
    with open(path, "wb") as f:
        f.write(content)
    at = _app([path])
    assert not at.exception, [e.value for e in at.exception]
    assert at.error and expected in at.error[0].value and "bad.json" in at.error[0].value
    assert "Traceback" not in at.error[0].value
    assert "built-in sample" in at.sidebar.caption[0].value  # the views still work, on the sample
    _view_no_error_check(at, "Layout")


def _view_no_error_check(at: AppTest, name: str) -> None:
    at.radio(key="view").set_value(name).run()
    assert not at.exception
