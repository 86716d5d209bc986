"""The dashboard in a real browser: ``streamlit run viz/app.py`` on 127.0.0.1, driven by playwright in chromium.

Needs Debian's chromium at ``/usr/bin/chromium`` (``apt-get install -y chromium``; ``.ci/run``
installs it) -- never ``playwright install``. Screenshots of every view go to
``test-artifacts/`` (gitignored).

    .venv/bin/python -m pytest -m browser tests/browser
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

CHROMIUM = "/usr/bin/chromium"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(REPO, "test-artifacts")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
VIEWS = {  # view -> a text only that view shows, to know its own content (not the previous view's) is up
    "Layout": "What each rank holds",
    "Propagation": "trace as text",
    "Reshard stepper": "Each rank before and after",
    "Communication": "Traffic of",
    "Pipeline": "Chrome trace (Perfetto)",
    "Memory": "Device capacity line",
    "What-if": "What-if pipeline timeline",
}

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install -y chromium)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sys.path.insert(0, REPO)
    from viz.__main__ import streamlit_command

    port = _free_port()
    log_path = tmp_path_factory.mktemp("streamlit") / "server.log"
    env = {**os.environ, "PYTHONPATH": REPO}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(streamlit_command([], port=port), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
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


def _settle(page: object) -> None:
    """Wait until the script run finished: no running icon, no element left over from the last run."""
    page.wait_for_timeout(600)  # type: ignore[attr-defined]  # Streamlit shows the running icon after ~500 ms
    page.wait_for_function(  # type: ignore[attr-defined]
        "() => !document.querySelector('[data-testid=\"stStatusWidgetRunningIcon\"]')"
        " && !document.querySelector('[data-stale=\"true\"]')",
        timeout=60_000,
    )


def test_every_view_renders_in_chromium(server: str) -> None:
    from playwright.sync_api import sync_playwright

    os.makedirs(ARTIFACTS, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(server, wait_until="domcontentloaded", timeout=60_000)
            page.wait_for_selector('[data-testid="stRadio"]', timeout=60_000)
            for view, marker in VIEWS.items():
                page.locator('[data-testid="stRadio"] label').filter(has_text=view).first.click()
                page.wait_for_selector(f'h2:has-text("{view}")', timeout=60_000)
                page.get_by_text(marker).first.wait_for(timeout=60_000)
                _settle(page)
                page.wait_for_selector('[data-testid="stImage"] img, [data-testid="stDataFrame"]', timeout=60_000)
                assert page.locator('[data-testid="stException"]').count() == 0, view
                slug = view.lower().replace(" ", "-")
                page.screenshot(path=os.path.join(ARTIFACTS, f"viz-{slug}.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
    for view in VIEWS:
        path = os.path.join(ARTIFACTS, f"viz-{view.lower().replace(' ', '-')}.png")
        assert os.path.getsize(path) > 10_000, path  # a rendered page, not a blank one
