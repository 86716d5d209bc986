"""A hostile file in a real browser: its text is shown as text, and the page fetches nothing outside.

A plan whose ``format`` field was a Markdown image made the dashboard's refusal (``st.error``
renders Markdown) fetch a URL of the file author's choosing. Here ``mpipar viz``'s command line
opens such a file (an image, an HTML tag, bare and angle-bracket links, a Streamlit colour
directive, LaTeX, a terminal escape and a bidi override) in chromium; every request the page
makes is recorded, and any to a host other than the dashboard's is a failure. The refusal
must show the field's text literally.

    .venv/bin/python -m pytest -m browser tests/browser/test_viz_hostile.py
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
from test_viz_browser import CHROMIUM, CHROMIUM_ARGS, REPO, _free_port, _serve, _settle

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install -y chromium)"),
]

OUTSIDE = "198.51.100.7"  # TEST-NET-2: never a real host
HOSTILE = (
    f"![pixel](http://{OUTSIDE}:9/md.png) <img src='http://{OUTSIDE}:9/html.png'> "
    f"<http://{OUTSIDE}:9/angle> https://{OUTSIDE}:9/bare www.{OUTSIDE}.example "
    ":red[colour] $x^2$ \x1b]0;title\x07 \u202eevil"
)


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sys.path.insert(0, REPO)
    from viz.__main__ import streamlit_command

    tmp = tmp_path_factory.mktemp("hostile")
    plan = tmp / "plan.json"
    plan.write_text(json.dumps({"format": HOSTILE, "meshes": []}))
    yield from _serve(streamlit_command([str(plan)], port=_free_port()), REPO, tmp / "server.log")


def test_a_hostile_plan_is_shown_as_text_and_nothing_outside_is_fetched(hostile_server: str) -> None:
    from playwright.sync_api import Route, sync_playwright

    own = urlparse(hostile_server).hostname
    outside: list[str] = []

    def guard(route: Route) -> None:
        host = urlparse(route.request.url).hostname
        if host not in (own, "localhost"):
            outside.append(route.request.url)
            route.abort()
        else:
            route.continue_()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.route("**/*", guard)
            page.goto(hostile_server, wait_until="domcontentloaded", timeout=60_000)
            page.wait_for_selector('[data-testid="stAlert"]', timeout=120_000)
            _settle(page)
            page.wait_for_timeout(1500)  # images and links get their chance to load
            alerts = " ".join(page.locator('[data-testid="stAlert"]').all_inner_texts())
            assert f"![pixel](http://{OUTSIDE}:9/md.png)" in alerts, alerts
            assert "<img src=" in alerts and ":red[colour]" in alerts and "$x^2$" in alerts, alerts
            assert "\\x1b]0;title\\x07" in alerts and "\\u202eevil" in alerts, alerts
            images = page.locator('[data-testid="stAlert"] img').count()
            links = page.locator('[data-testid="stAlert"] a').count()
            hrefs = [page.locator('[data-testid="stAlert"] a').nth(k).get_attribute("href") for k in range(links)]
            assert (images, links) == (0, 0), hrefs
        finally:
            browser.close()
    assert outside == []
