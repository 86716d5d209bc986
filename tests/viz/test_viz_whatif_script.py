"""What-if on the user's own script, and the strategy search in the What-if view.

The GPT plan is ``mpipar plan --shape-only examples/gpt.py --tiny ...``: the What-if view
re-traces that script with a knob changed, only after the click on the shown command, and
its numbers are those of ``mpipar plan`` run by hand with the same flags. Scripts outside
the directory the dashboard started in are refused; a plan with no script shows no numbers.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("streamlit")

from conftest import REPO
from streamlit.testing.v1 import AppTest

from mpipar.compile.plan import Plan
from simulator.search import Candidate
from simulator.step_trace import GPTStrategy
from viz import script_whatif, search_view, whatif
from viz.plan_memory import with_memory
from viz.simulate import simulate_plan_lanes

APP = os.path.join(REPO, "viz", "app.py")
GPT_ARGS = ["--tiny", "--mesh", "dp=2,tp=1,pp=2", "--schedule", "1F1B"]


def _mpipar_plan(out: str, args: list[str]) -> Plan:
    cmd = [sys.executable, "-m", "mpipar.cli", "plan", "-o", out, "--shape-only", "examples/gpt.py", *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    return Plan.load(out)


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("gpt") / "gpt-plan.json")
    _mpipar_plan(path, GPT_ARGS)
    return path


@pytest.fixture(autouse=True)
def _argv_and_cwd(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    saved = list(sys.argv)
    monkeypatch.chdir(REPO)  # the dashboard's start directory: the repository, where examples/gpt.py is
    yield
    sys.argv = saved


def _whatif(argv: list[str]) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    if not argv:  # no file: the sidebar's built-in sample (the app's default is the GPT plan)
        at.session_state["open_plan"] = "built-in sample"
    sys.argv = [APP, *argv]
    at.run()
    at.radio(key="view").set_value("What-if").run()
    _clean(at)
    return at


def _clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _rows(at: AppTest) -> dict[str, dict[str, str]]:
    return {r["metric"].strip(): r for r in at.dataframe[0].value.to_dict("records")}


def test_whatif_on_the_gpt_plan_retraces_its_own_script_only_after_the_click(gpt_plan: str, tmp_path: object) -> None:
    at = _whatif([gpt_plan])
    assert not any("built-in sample" in w.value for w in at.warning)  # no foreign model's numbers
    at.number_input(key="wis_tp").set_value(2).run()
    _clean(at)
    # Not confirmed yet: the exact command is shown, nothing ran, no numbers.
    command = at.code[0].value
    argv = shlex.split(command)
    assert argv[:4] == [sys.executable, "-m", "mpipar.cli", "plan"] and "--shape-only" in argv
    assert argv[-6:] == [
        os.path.join(REPO, "examples", "gpt.py"),
        "--tiny",
        "--mesh",
        "dp=2,tp=2,pp=2",
        "--schedule",
        "1F1B",
    ]
    out = argv[argv.index("-o") + 1]
    # only the loaded plan's own numbers are shown, no what-if column
    assert not os.path.exists(out) and list(at.dataframe[0].value.columns) == ["metric", "loaded"]
    at.number_input(key="wis_dp").set_value(1).run()  # another knob: still nothing runs
    assert not os.path.exists(out) and all("what-if" not in d.value.columns for d in at.dataframe)
    at.number_input(key="wis_dp").set_value(2).run()
    at.button(key="wi_run").click().run()
    _clean(at)
    assert os.path.exists(out)
    by_hand = with_memory(
        _mpipar_plan(f"{tmp_path}/by-hand.json", ["--tiny", "--mesh", "dp=2,tp=2,pp=2", "--schedule", "1F1B"])
    )
    loaded = with_memory(Plan.load(gpt_plan))
    expected = whatif.diff_rows(
        whatif.plan_metrics(loaded, simulate_plan_lanes(loaded, None, None)),
        whatif.plan_metrics(by_hand, simulate_plan_lanes(by_hand, None, None)),
    )
    rows = _rows(at)
    for r in expected:
        assert rows[r["metric"].strip()]["what-if"] == r["what-if"], r["metric"]
        assert rows[r["metric"].strip()]["loaded"] == r["loaded"], r["metric"]
    assert rows["world size"]["loaded"] == "4" and rows["world size"]["what-if"] == "8"
    assert rows["all_gather calls"]["what-if"] == str(by_hand.comm_counts()["all_gather"])  # tp's own collectives
    assert rows["forward bytes/rank"]["what-if"] != rows["forward bytes/rank"]["loaded"]


def test_script_outside_the_start_directory_is_refused(tmp_path: object) -> None:
    outside = f"{tmp_path}/evil.py"
    marker = f"{tmp_path}/ran"
    with open(outside, "w") as f:
        f.write(f"open({marker!r}, 'w').close()\n")
    link = os.path.join(REPO, "examples", "_whatif_link_test.py")
    plan = _tiny_plan()
    for script in (outside, os.path.relpath(outside, REPO), "examples/../../evil.py"):
        plan.meta.clear()
        plan.meta.update({"script": script, "args": [], "shape_only": True})
        with pytest.raises(script_whatif.ScriptRefused, match="outside the directory"):
            script_whatif.script_ref(plan, REPO)
    os.symlink(outside, link)
    try:
        plan.meta.update({"script": "examples/_whatif_link_test.py"})
        with pytest.raises(script_whatif.ScriptRefused, match="outside the directory"):
            script_whatif.script_ref(plan, REPO)
    finally:
        os.unlink(link)
    # The dashboard says why and offers no command to run.
    plan.meta.update({"script": outside})
    path = f"{tmp_path}/outside-plan.json"
    plan.save(path)
    at = _whatif([path])
    assert any("outside the directory" in i.value for i in at.info)
    # no command to run, and only the loaded plan's own numbers (no what-if column)
    assert not at.code and [list(d.value.columns) for d in at.dataframe] == [["metric", "loaded"]]
    assert not os.path.exists(marker)


def _tiny_plan() -> Plan:
    from viz.sample import build_sample

    return build_sample(1, 2, 1, "1F1B", 1, shape_only=True, hidden=16, batch=4)[0]


def test_a_plan_without_a_script_shows_no_foreign_numbers(tmp_path: object) -> None:
    plan = _tiny_plan()
    plan.meta.clear()  # neither the sample's builder nor a script
    path = f"{tmp_path}/anon.json"
    plan.save(path)
    at = _whatif([path])
    assert any("records no meta.script" in i.value for i in at.info)
    # only the loaded plan's own numbers: no what-if column, no other model's numbers
    assert [list(d.value.columns) for d in at.dataframe] == [["metric", "loaded"]] and not at.warning


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"script": 5}, "meta.script is 5"),
        ({"script": "examples/gpt.py", "args": "--tiny"}, "meta.args is '--tiny'"),
        ({"script": "examples/gpt.py", "args": ["--tiny", 3]}, r"meta.args\[1\] is 3"),
        ({"script": "examples/gpt.py", "args": ["x" * 2000]}, r"meta.args\[0\] is 2000 characters"),
        ({"script": "examples/gpt.py\x00.py"}, "NUL"),
        ({"script": "README.md"}, "not a .py file"),
        ({"script": "examples/gpt.py", "shape_only": "yes"}, "meta.shape_only is 'yes'"),
    ],
)
def test_untrusted_script_fields_are_refused_by_name(meta: dict[str, object], match: str) -> None:
    plan = _tiny_plan()
    plan.meta.clear()
    plan.meta.update(meta)
    with pytest.raises(script_whatif.ScriptRefused, match=match):
        script_whatif.script_ref(plan, REPO)


def test_knobs_rewrite_only_what_changed() -> None:
    args = ["--tiny", "--mesh=dp=2,tp=1,pp=2", "--schedule", "1F1B", "--steps", "3"]
    base = script_whatif.read_knobs(args, 4)
    assert (base.dp, base.tp, base.pp, base.schedule, base.micro_batches, base.zero) == (2, 1, 2, "1F1B", None, 0)
    assert script_whatif.with_knobs(args, base, base) == args
    new = script_whatif.Knobs(2, 2, 2, "ZBH1", 4, 2, 1, "full", True)
    assert script_whatif.with_knobs(args, base, new) == [
        "--tiny",
        "--mesh",
        "dp=2,tp=2,pp=2",
        "--schedule",
        "ZBH1",
        "--steps",
        "3",
        "--micro-batches",
        "4",
        "--zero",
        "1",
        "--recompute",
        "full",
        "--sequence-parallel",
    ]
    eager = script_whatif.Knobs(4, 1, 1, None, 2, 2, 0, "none", False)
    assert script_whatif.with_knobs(args, base, eager) == [
        "--tiny",
        "--mesh",
        "dp=4,tp=1,pp=1",
        "--steps",
        "3",
        "--accumulate-steps",
        "2",
    ]
    assert script_whatif.read_knobs(["--tiny"], 8).dp == 8  # no --mesh: data parallel over the world
    with pytest.raises(script_whatif.ScriptRefused, match="--schedule 'Bogus'"):
        script_whatif.read_knobs(["--schedule", "Bogus"], 1)
    with pytest.raises(script_whatif.ScriptRefused, match="--mesh"):
        script_whatif.read_knobs(["--mesh", "dp=x"], 1)


def _cand(t: float, mem: int, fits: bool = True, dp: int = 1) -> Candidate:
    return Candidate(
        GPTStrategy(dp, 1, 1, False, "none", 0, False, "adamw", 1, "1F1B", 1), 1, t, mem, 0.0, 1.0, 0.1, fits
    )


def test_pareto_front_and_search_figure() -> None:
    points = [
        _cand(1.0, 900),
        _cand(2.0, 500),
        _cand(2.5, 600),
        _cand(3.0, 100),
        _cand(0.5, 5000, fits=False),
        _cand(1.0, 950),
    ]
    assert search_view.pareto_front(points) == [0, 1, 3]  # 2 and 5 are beaten; 4 is over the limit
    fig = search_view.search_figure(points, [0, 1, 3], 1000, selected=2)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "Pareto front" in labels and any(s.startswith("memory limit") for s in labels) and "selected" in labels
    limit = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert limit and limit[0].get_xdata()[0] == pytest.approx(1000 / 2**20)
    text = search_view.search_text(points, [0, 1, 3], 1000)
    assert text.count("\n* ") == 3 and "\nx #4" in text
    assert search_view.candidate_flags(points[0], scheduled=False)["schedule"] is None
    assert search_view.candidate_flags(points[0], scheduled=True)["schedule"] == "1F1B"


def test_search_space_is_bounded() -> None:
    with pytest.raises(ValueError, match="devices = 1000"):
        search_view.run_search(search_view.SearchSpace(2, 16, 2, 16, 128, 1000, 8, "h100-nvlink-ib"))
    with pytest.raises(ValueError, match="global_batch = 100000"):
        search_view.run_search(search_view.SearchSpace(2, 16, 2, 16, 128, 4, 100_000, "h100-nvlink-ib"))
    assert search_view.gpt_example_space(["--tiny", "--batch-size", "999999999"], 4, "h100-nvlink-ib").global_batch == 8
    assert search_view.gpt_example_space(["--batch-size=32"], 4, "h100-nvlink-ib").global_batch == 32
    with pytest.raises(ValueError, match="at least one ZeRO stage"):
        search_view.run_search(search_view.SearchSpace(2, 16, 2, 16, 128, 4, 8, "h100-nvlink-ib", zero_stages=()))


def test_search_in_the_view_loads_a_candidate_of_the_gpt_plan(gpt_plan: str) -> None:
    at = _whatif([gpt_plan])
    assert at.number_input(key="wss_layers").value == 2 and at.number_input(key="wss_devices").value == 4
    at.number_input(key="wss_limit").set_value(1).run()  # 1 MiB: the limit line cuts through the candidates
    at.button(key="wss_go").click().run()
    _clean(at)
    assert at.get("image")
    options = at.selectbox(key="wss_cand").options
    assert any(o.startswith("* ") for o in options)  # the Pareto front is marked
    pick = next(i for i, o in enumerate(options) if "dp=4,tp=1,pp=1" in o)
    at.selectbox(key="wss_cand").set_value(pick).run()
    _clean(at)
    cmd = shlex.split(at.code[-1].value)
    assert cmd[cmd.index("--mesh") + 1] == "dp=4,tp=1,pp=1" and "--schedule" in cmd
    assert not os.path.exists(cmd[cmd.index("-o") + 1])  # shown, not run
    at.button(key="wss_run").click().run()
    _clean(at)
    at.button(key="wss_load").click().run()
    _clean(at)
    assert "dp=4,tp=1,pp=1" in at.sidebar.caption[0].value
    at.radio(key="view").set_value("Communication").run()
    _clean(at)
    at.radio(key="view").set_value("What-if").run()
    at.button(key="wi_back").click().run()
    _clean(at)
    assert "gpt-plan.json" in at.sidebar.caption[0].value


def test_search_on_the_sample_loads_the_sample_with_the_candidates_knobs() -> None:
    at = _whatif([])
    for name, value in (("devices", 4), ("layers", 2), ("heads", 2), ("global_batch", 4)):  # a small space
        at.number_input(key=f"wss_{name}").set_value(value)
    at.run()
    at.button(key="wss_go").click().run()
    _clean(at)
    options = at.selectbox(key="wss_cand").options
    pick = next(i for i, o in enumerate(options) if "dp=1,tp=2,pp=2" in o)
    at.selectbox(key="wss_cand").set_value(pick).run()
    at.button(key="wss_load").click().run()
    _clean(at)
    assert "sample what-if (dp=1,tp=2,pp=2" in at.sidebar.caption[0].value
