"""``mpipar viz --run SCRIPT [args]``: the plan and a measured timeline in a run directory, then the dashboard.

Nothing here starts a server: ``--prepare-only`` writes the run directory and prints the
dashboard command, and the app is driven headless on the two files.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("streamlit")

from conftest import REPO
from streamlit.testing.v1 import AppTest

from mpipar import cli
from mpipar.compile.plan import Plan
from mpipar.debug.timeline import Timeline
from viz import __main__ as viz_main


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    saved = list(sys.argv)
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    yield
    sys.argv = saved


def test_run_prepares_the_plan_and_a_measured_timeline_and_opens_both(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = f"{tmp_path}/run"
    rc = viz_main.main(
        [
            "--prepare-only",
            "--run-dir",
            run_dir,
            "--steps",
            "2",
            "--run",
            "examples/gpt.py",
            "--mesh",
            "dp=2",
            "--tiny",
            "--sample",
            "0",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    plan = Plan.load(f"{run_dir}/plan.json")
    assert plan.meta["script"] == "examples/gpt.py" and plan.meta["args"] == [
        "--mesh",
        "dp=2",
        "--tiny",
        "--sample",
        "0",
    ]
    assert plan.comm_counts("backward").get("all_reduce")  # dp=2: the gradients are all-reduced
    timeline = Timeline.load(f"{run_dir}/measured.json")
    assert timeline.meta["source"] == "measured" and sorted(timeline.ranks) == [0, 1]
    with open(f"{run_dir}/run.log") as f:
        log = f.read()
    assert "--steps 2" in log and "step 1" in log and "step 2" not in log.replace("--steps 2", "")
    command = shlex.split(out.strip().splitlines()[-1].removeprefix("open them with: "))
    assert command[-3:] == ["--", os.path.abspath(f"{run_dir}/plan.json"), os.path.abspath(f"{run_dir}/measured.json")]
    assert command[command.index("--server.address") + 1] == "127.0.0.1"
    at = AppTest.from_file(os.path.join(REPO, "viz", "app.py"), default_timeout=120)
    sys.argv = [command[command.index("--") - 1], *command[command.index("--") + 1 :]]
    at.run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    assert "plan.json" in at.sidebar.caption[0].value


def test_run_refuses_files_and_a_missing_script(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        viz_main.main(["plan.json", "--run", "examples/gpt.py"])
    assert "either files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        viz_main.main(["--run-dir", f"{tmp_path}/r", "--run", "examples/nope.py"])
    assert "'examples/nope.py': not a .py file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        viz_main.main(["--run"])
    assert "--run needs a script" in capsys.readouterr().err
    assert not os.path.exists(f"{tmp_path}/r/plan.json")
    with open(f"{tmp_path}/file", "w") as f:
        f.write("x")
    with pytest.raises(SystemExit):
        viz_main.main(["--run-dir", f"{tmp_path}/file", "--run", "examples/gpt.py"])
    assert "exists and is not a directory" in capsys.readouterr().err
    assert viz_main.run_directory(str(tmp_path)) == str(tmp_path)  # an existing run directory is reused


def test_mpipar_viz_forwards_run_and_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr("subprocess.call", lambda argv, **_: seen.append(argv) or 0)
    assert (
        cli.main(
            [
                "viz",
                "--prepare-only",
                "--launcher",
                "mpiexec",
                "--run",
                "examples/gpt.py",
                "--mesh",
                "dp=2,tp=2",
                "--tiny",
            ]
        )
        == 0
    )
    argv = seen[0]
    assert argv[1:3] == ["-m", "viz"] and "--prepare-only" in argv
    assert argv[argv.index("--launcher") + 1] == "mpiexec"
    assert argv[argv.index("--run") :] == ["--run", "examples/gpt.py", "--mesh", "dp=2,tp=2", "--tiny"]
