"""The dashboard in a real browser: ``streamlit run viz/app.py`` on 127.0.0.1, driven by playwright in chromium.

Two servers: plain ``streamlit run viz/app.py`` (settings from ``viz/.streamlit/config.toml``)
with no file, which opens on the GPT example's plan, and the launcher's command line
(``mpipar viz``'s) on a plan ``mpipar plan`` traces from ``examples/gpt.py`` into a temporary
directory. Both walk every view; neither shows Streamlit's "Deploy" button (viewer toolbar).

Needs Debian's chromium at ``/usr/bin/chromium`` (``apt-get install -y chromium``; ``.ci/run``
installs it) -- never ``playwright install``. Screenshots of every view go to
``test-artifacts/`` (gitignored); with ``MPIPAR_DOCS_SCREENSHOTS=1`` the GPT plan's walk also
writes them into ``docs/images/dashboard/`` for the dashboard's documentation page.

    .venv/bin/python -m pytest -m browser tests/viz/test_viz_browser.py
    MPIPAR_DOCS_SCREENSHOTS=1 .venv/bin/python -m pytest -m browser tests/viz/test_viz_browser.py -k gpt_plan
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(REPO, "test-artifacts")
DOCS_IMAGES = os.path.join(REPO, "docs", "images", "dashboard")
"""Where ``MPIPAR_DOCS_SCREENSHOTS=1`` puts the GPT plan's views (docs/dashboard.md shows them)."""
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWS = {  # view -> a text only that view shows, to know its own content (not the previous view's) is up
    "Layout": "What each rank holds",
    "Propagation": "trace as text",
    "Reshard stepper": "Each rank before and after",
    "Communication": "Traffic of",
    "Pipeline": "Chrome trace (Perfetto)",
    "Memory": "Device capacity line",
    "What-if": "Strategy search",  # the GPT plan re-traces its own script; the search is always there
}

NO_DATA = ("nothing to draw", "No memory", "no data", "has no pipeline", "could be loaded")
"""Notices a view shows instead of its content: none may appear on the GPT plan."""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install -y chromium)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(cmd: list[str], cwd: str, log_path: Path) -> Iterator[str]:
    """Run ``cmd`` (a Streamlit server on 127.0.0.1), wait until healthy, yield its URL, stop it."""
    port = int(cmd[cmd.index("--server.port") + 1])
    env = {**os.environ, "PYTHONPATH": REPO, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"streamlit did not start (exit {proc.poll()}):\n{log_path.read_text()}")
            time.sleep(0.3)
        text = log_path.read_text()
        assert f"127.0.0.1:{port}" in text and "Network URL" not in text, text  # bound to localhost only
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Plain ``streamlit run viz/app.py`` from another directory: only the config beside the script applies."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        os.path.join(REPO, "viz", "app.py"),
        "--server.port",
        str(_free_port()),
    ]
    yield from _serve(cmd, str(cwd), cwd / "server.log")


@pytest.fixture(scope="module")
def gpt_server(tmp_path_factory: pytest.TempPathFactory, gpt_plan_path: str) -> Iterator[str]:
    """``mpipar viz``'s command line on ``mpipar plan``'s GPT plan (dp=2, tp=2, pp=2, 1F1B; the session's)."""
    sys.path.insert(0, REPO)
    from viz.__main__ import streamlit_command

    tmp = tmp_path_factory.mktemp("gpt")
    yield from _serve(streamlit_command([gpt_plan_path], port=_free_port()), REPO, tmp / "server.log")


def _settle(page: object) -> None:
    """Wait until the script run finished: no running icon, no element left over from the last run."""
    page.wait_for_timeout(600)  # type: ignore[attr-defined]  # Streamlit shows the running icon after ~500 ms
    page.wait_for_function(  # type: ignore[attr-defined]
        "() => !document.querySelector('[data-testid=\"stStatusWidgetRunningIcon\"]')"
        " && !document.querySelector('[data-stale=\"true\"]')",
        timeout=60_000,
    )


def _walk(url: str, prefix: str, docs_images: str | None = None) -> None:
    """Open ``url``, click through every view: each draws a figure or a table, no exception, no notice.
    With ``docs_images``, each view's visible window is also saved there as ``<view>.png``."""
    from playwright.sync_api import sync_playwright

    os.makedirs(ARTIFACTS, exist_ok=True)
    if docs_images:
        os.makedirs(docs_images, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            page.wait_for_selector('[data-testid="stRadio"]', timeout=120_000)
            _settle(page)
            # client.toolbarMode = "viewer": the toolbar is up, without the "Deploy" button
            page.wait_for_selector('[data-testid="stMainMenu"]', timeout=60_000)
            assert page.locator('[data-testid="stAppDeployButton"]').count() == 0
            assert page.get_by_text("Deploy", exact=True).count() == 0
            for view, marker in VIEWS.items():
                page.locator('[data-testid="stRadio"] label').filter(has_text=view).first.click()
                page.wait_for_selector(f'h2:has-text("{view}")', timeout=60_000)
                page.get_by_text(marker).first.wait_for(timeout=60_000)
                _settle(page)
                page.wait_for_selector('[data-testid="stImage"] img, [data-testid="stDataFrame"]', timeout=60_000)
                assert page.locator('[data-testid="stException"]').count() == 0, view
                notices = page.locator('[data-testid="stAlert"]').all_inner_texts()
                assert not [n for n in notices if any(word in n for word in NO_DATA)], (view, notices)
                slug = view.lower().replace(" ", "-")
                page.screenshot(path=os.path.join(ARTIFACTS, f"{prefix}-{slug}.png"), full_page=True)
                if docs_images:
                    page.screenshot(path=os.path.join(docs_images, f"{slug}.png"))
            assert not errors, errors
        finally:
            browser.close()
    for view in VIEWS:
        path = os.path.join(ARTIFACTS, f"{prefix}-{view.lower().replace(' ', '-')}.png")
        assert os.path.getsize(path) > 10_000, path  # a rendered page, not a blank one


def test_every_view_renders_in_chromium(server: str) -> None:
    """No file: the app opens on the GPT example's plan (plain ``streamlit run``)."""
    _walk(server, "viz")


def test_every_view_renders_the_gpt_plan_in_chromium(gpt_server: str) -> None:
    """``mpipar plan``'s GPT plan, opened the way ``mpipar viz plan.json`` does."""
    docs = DOCS_IMAGES if os.environ.get("MPIPAR_DOCS_SCREENSHOTS") == "1" else None
    _walk(gpt_server, "viz-gpt", docs)
