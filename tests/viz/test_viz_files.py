"""Dashboard file loading: every bad input is a VizFileError naming the file, field and value; no pickle."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from typing import Any

import pytest

from mpipar.compile.plan import Plan
from mpipar.debug.timeline import Timeline
from viz.files import VizFileError, load_document, load_path, load_plan_bytes, load_timeline_bytes
from viz.sample import build_sample

VIZ = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "viz")


@pytest.fixture(scope="module")
def docs() -> tuple[dict[str, Any], dict[str, Any]]:
    plan, timeline = build_sample(2, 2, 2, "1F1B", 2, hidden=16, batch=8)
    return plan.to_dict(), timeline.to_dict()


def _bytes(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def test_round_trips_tell_plans_from_timelines(docs: tuple) -> None:
    plan, timeline = docs
    assert isinstance(load_document(_bytes(plan)), Plan)
    assert isinstance(load_document(_bytes(timeline)), Timeline)
    assert load_plan_bytes(_bytes(plan)) == Plan.from_dict(plan)
    with pytest.raises(VizFileError, match="this is a timeline"):
        load_plan_bytes(_bytes(timeline), "t.json")
    with pytest.raises(VizFileError, match="this is a plan"):
        load_timeline_bytes(_bytes(plan), "p.json")


def _mutated(doc: dict[str, Any], fn: Callable[[dict[str, Any]], None]) -> bytes:
    d = json.loads(json.dumps(doc))
    fn(d)
    return _bytes(d)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["tensors"][0].update(placements="S(9)R"), "tensors[0].placements"),
        (lambda d: d["tensors"][0].update(placements="Q"), "tensors[0].placements"),
        (lambda d: d["tensors"][0].update(placements="R"), "tensors[0].placements"),
        (lambda d: d["tensors"][0].update(local_shapes=[[1, 1]]), "tensors[0].local_shapes"),
        (lambda d: d["tensors"][0]["local_shapes"].__setitem__(0, [999, 1]), "tensors[0].local_shapes[0]"),
        (lambda d: d["reshards"][0]["steps"][0].update(axes=["zz"]), "reshards[0].steps[0].axes"),
        (lambda d: d["reshards"][0].update(new_tensor=10**6), "reshards[0].new_tensor"),
        (lambda d: d["reshards"][0]["dst"].update(placements="P(max)P(sum)"), "reshards[0].dst.placements"),
        (lambda d: d["ops"][0].update(reshards=[10**6]), "ops[0].reshards[0]"),
        (lambda d: d["meshes"][0].update(process_ids=[0, 0, 1, 2]), "meshes[0].process_ids"),
        (lambda d: d["meshes"][0].update(dim_names=["a", "a"]), "meshes[0].dim_names"),
        (lambda d: d["tensors"][0].update(kind="weights"), "tensors[0].kind"),
        (lambda d: d.update(version=7), "version"),
    ],
)
def test_malformed_plans_name_the_field(docs: tuple, mutate: Callable[[dict[str, Any]], None], field: str) -> None:
    with pytest.raises(VizFileError) as err:
        load_document(_mutated(docs[0], mutate), "plan.json")
    assert str(err.value).startswith("plan.json: ")
    assert f"field {field}" in str(err.value)


def test_malformed_timeline_names_the_field(docs: tuple) -> None:
    bad = _mutated(docs[1], lambda d: d["spans"][0].update(end=-5.0))
    with pytest.raises(VizFileError, match=r"t.json: timeline field spans\[\d+\]\.end"):
        load_document(bad, "t.json")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (pickle.dumps({"format": "mpipar.plan"}), "never unpickles"),
        (b"\xff\xfeab", "not UTF-8"),
        (b'{"format": "mpipar.plan", "meshes": [{"id": 0', "line 1 column"),
        (b"[" * 100000, "nests JSON more than 64 levels deep|not valid JSON|more than 48x its size in memory"),
        (b'"just a string"', "top level is a JSON str"),
        (b'{"traceEvents": []}', "Chrome trace"),
        (b'{"format": 3}', "field format is 3"),
    ],
)
def test_unreadable_bytes(data: bytes, message: str) -> None:
    with pytest.raises(VizFileError, match=message):
        load_document(data, "x.json")


def test_truncated_files_at_every_tenth(docs: tuple, tmp_path: object) -> None:
    text = _bytes(docs[0])
    for cut in range(1, 10):
        path = f"{tmp_path}/cut{cut}.json"
        with open(path, "wb") as f:
            f.write(text[: len(text) * cut // 10])
        with pytest.raises(VizFileError, match="truncated"):
            load_path(path)
    with pytest.raises(VizFileError, match="cannot read the file"):
        load_path(f"{tmp_path}/missing.json")


def test_the_dashboard_never_unpickles() -> None:
    for root, _, files in os.walk(VIZ):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    source = f.read()
                for banned in ("import pickle", "pickle.load", "import dill", "cloudpickle", "st.cache_data"):
                    assert banned not in source, f"{name} uses {banned}"


def test_server_binds_to_localhost_by_default() -> None:
    with open(os.path.join(VIZ, ".streamlit", "config.toml"), encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    # tomllib is 3.11+; the file is flat enough to read as "[section]" and "key = value" lines.
    config: dict[str, dict[str, str]] = {}
    section = ""
    for line in lines:
        if line.startswith("["):
            section = line.strip("[]")
        else:
            key, _, value = line.partition("=")
            config.setdefault(section, {})[key.strip()] = value.strip()
    assert config["server"]["address"] == '"127.0.0.1"'
    assert config["browser"]["gatherUsageStats"] == "false"
    from viz.__main__ import streamlit_command

    cmd = streamlit_command(["plan.json"])
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[-2:] == ["--", "plan.json"]
