"""The documentation: the site builds, the CLI page is current, links stay inside the repository,
the README stays a front door, and every code block of the docs runs as written.

    .venv/bin/python -m pytest -q tests/unit/test_docs.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, VENV_BIN

sys.path.insert(0, os.path.join(REPO, "tools"))
import doc_blocks  # tools/ is not a package: found through sys.path above

ENV = {
    **os.environ,
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "PATH": VENV_BIN + os.pathsep + os.environ["PATH"],
}
ENV.pop("MPIPAR_BACKEND", None)
ENV.pop("MPIPAR_TRACE", None)
LINKED_DIRS = ("examples", "tests", "benchmarks", "viz", "docs")
"""What a docs command may name by a relative path: linked into each page's scratch directory."""


def test_mkdocs_build_is_strict_clean(tmp_path: Path) -> None:
    """A dead link, a missing page, a bad anchor or a docstring mkdocstrings cannot render fails here."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env={**ENV, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "api" / "mpipar" / "index.html").stat().st_size > 10_000


@pytest.mark.parametrize("generator", ["tools/cli_reference.py", "benchmarks/results.py"])
def test_generated_page_is_current(generator: str) -> None:
    """docs/cli.md is what the argparse parsers say; benchmarks/RESULTS.md is what the benchmarks'
    --json records say."""
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, generator), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert out.returncode == 0, out.stderr


_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _markdown_files() -> list[str]:
    tops = ["README.md", "CHANGELOG.md", "CONTRIBUTING.md", os.path.join("benchmarks", "RESULTS.md")]
    return [p for p in tops if os.path.exists(os.path.join(REPO, p))] + [
        p for p in doc_blocks.doc_pages() if p not in tops
    ]


@pytest.mark.parametrize("page", _markdown_files())
def test_links_stay_inside_the_repository(page: str) -> None:
    """Every link is a public http(s) URL or a path to a file of this repository."""
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        text = f.read()
    bad = []
    for target in _LINK.findall(text):
        if target.startswith(("https://", "http://", "#", "mailto:")):
            continue
        path = target.split("#")[0]
        resolved = os.path.normpath(os.path.join(REPO, os.path.dirname(page), path))
        if not resolved.startswith(REPO + os.sep) or not os.path.exists(resolved):
            bad.append(target)
    assert not bad, f"{page}: links that leave the repository or lead nowhere: {bad}"


def test_readme_is_a_front_door() -> None:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert text.count("\n") <= 250
    assert not re.search(r"issue #?\d|\b20\d\d-\d\d-\d\d\b", text, re.IGNORECASE)
    first_screen = "\n".join(text.split("\n")[:40])
    for page in ("quickstart.md", "concepts.md#meshes", "launching.md", "dashboard.md", "planner.md"):
        assert f"docs/{page}" in first_screen, page
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    for command in re.findall(r"```bash\n(.*?)\n```", text, re.DOTALL)[:2]:
        assert command.strip() in ci, command  # the README's install and test commands are what CI runs


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a docs block in its own process group: on a timeout the whole group is killed (a
    command that starts a server must not outlive the test)."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[-1][:200]} ran over 300 s\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _pages_with_code() -> list[str]:
    return [p for p in doc_blocks.doc_pages() if any(b.skip is None for b in doc_blocks.blocks(p))]


@pytest.mark.parametrize("page", _pages_with_code())
def test_code_blocks_run(page: str, tmp_path: Path) -> None:
    """Each shell block runs in order (bash -e, in a scratch directory), then the page's Python
    blocks run as one script; every one must exit 0."""
    for name in (*LINKED_DIRS, ".venv"):
        target = os.path.dirname(VENV_BIN) if name == ".venv" else os.path.join(REPO, name)
        os.symlink(target, tmp_path / name)
    runnable = [b for b in doc_blocks.blocks(page) if b.skip is None]
    for block in (b for b in runnable if b.lang == "shell"):
        out = _run(["bash", "-e", "-o", "pipefail", "-c", block.code], tmp_path)
        assert out.returncode == 0, f"{page}:{block.line}\n{block.code}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    python = [b for b in runnable if b.lang == "python"]
    if python:
        script = tmp_path / "page.py"
        script.write_text("".join(f"# {page}:{b.line}\n{b.code}" for b in python))
        out = _run([sys.executable, str(script)], tmp_path)
        assert out.returncode == 0, f"{page}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def test_dashboard_page_shows_every_view() -> None:
    """Each view the browser test walks has its screenshot on the dashboard page."""
    sys.path.insert(0, os.path.join(REPO, "tests", "viz"))
    from test_viz_browser import DOCS_IMAGES, VIEWS

    with open(os.path.join(REPO, "docs", "dashboard.md"), encoding="utf-8") as f:
        page = f.read()
    for view in VIEWS:
        slug = view.lower().replace(" ", "-")
        assert f"(images/dashboard/{slug}.png)" in page, view
        assert os.path.getsize(os.path.join(DOCS_IMAGES, f"{slug}.png")) > 10_000, view


def test_a_benchmark_writes_its_json_record(tmp_path: Path) -> None:
    """``--json PATH``: the run's printed output, the command without the flag, machine and date."""
    path = tmp_path / "reshard.json"
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "reshard.py"),
            "--mib",
            "1",
            "--repeat",
            "1",
            "--json",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from results import load_record

    record = load_record(str(path))
    assert record["benchmark"] == "reshard"
    assert record["command"] == "OPENBLAS_NUM_THREADS=1 python benchmarks/reshard.py --mib 1 --repeat 1"
    assert record["output"] == out.stdout and record["output"].strip()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "mpipar.benchmark-result", "benchmark": 3}')
    with pytest.raises(ValueError, match="field 'benchmark' must be a string"):
        load_record(str(bad))
