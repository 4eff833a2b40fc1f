"""The training curves in real headless Chromium (Playwright driving /usr/bin/chromium): laid
out, clickable from a checkpoint marker to its page, runs added and removed on /compare.

As in test_browser.py only Playwright's Python package is used with Debian's Chromium (no
browser download). Without them these tests skip, except under ``CI=true``, where they fail:
CI must not pass with the browser checks silently gone.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore.ui.app import BackgroundUI

CHROMIUM = os.environ.get("CKPT_CHROMIUM", "/usr/bin/chromium")
IN_CI = os.environ.get("CI", "").lower() == "true"


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "pip install playwright (Python package only)"
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        return f"no Chromium at {CHROMIUM}: apt-get install -y chromium (make test does this)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = _missing()
    if missing is not None:
        if IN_CI:
            pytest.fail(f"CI=true but the browser checks cannot run: {missing}")
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # --no-sandbox: tests run as root in CI, where Chromium's sandbox refuses to start.
        launched = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"], timeout=60_000
        )
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(20_000)
    try:
        yield tab
    finally:
        context.close()


def test_curve_with_markers_links_to_the_checkpoint(
    page: Any, curve_server: BackgroundUI, curve_store: Any, tmp_path: Path,
    screenshot_painted: Any,
) -> None:
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(curve_server.url + "runs/alpha")
    curve = page.locator("svg.curve[data-metric='loss']")
    box = curve.bounding_box()
    assert box is not None and box["width"] > 500 and box["height"] > 200  # laid out
    line = curve.locator("path.curve-line").get_attribute("d") or ""
    assert line.startswith("M") and line.count("L") > 100  # the whole run, not 5 points
    assert curve.locator("circle.ckpt-marker").count() == 5
    assert curve.locator("path.alert-marker").count() == len(curve_store.alert_steps)
    # Markers sit inside the plot, left to right in step order.
    xs = [curve.locator("circle.ckpt-marker").nth(i).bounding_box()["x"] for i in range(5)]
    assert xs == sorted(xs) and box["x"] <= xs[0] and xs[-1] <= box["x"] + box["width"]
    screenshot_painted(page, tmp_path / "curve.png", full_page=True)
    ck = curve_store.store.get("alpha@8000")
    page.click("svg.curve circle.ckpt-marker[data-step='8000']")
    page.wait_for_url(f"**/checkpoints/{ck.id}")
    assert "alpha@" in page.locator("h1").inner_text()
    assert errors == []  # nothing blocked by the CSP


def test_compare_adds_and_removes_runs(page: Any, curve_server: BackgroundUI) -> None:
    page.goto(curve_server.url + "runs/alpha")
    page.click("a.compare-link:text-is('beta')")
    page.wait_for_url("**/compare?run=alpha&run=beta")
    series = page.locator("svg.curve g.curve-series")
    assert [series.nth(i).get_attribute("data-run") for i in range(series.count())] == [
        "alpha", "beta"
    ]
    # Two runs in two colours.
    strokes = {series.nth(i).locator("path.curve-line").get_attribute("style")
               for i in range(2)}
    assert len(strokes) == 2
    page.click("a.add-link:text-is('+ gamma')")
    page.wait_for_url("**/compare?run=alpha&run=beta&run=gamma")
    assert page.locator("svg.curve g.curve-series").count() == 3
    page.click("tr[data-run='alpha'] a.remove-link")
    page.wait_for_url("**/compare?run=beta&run=gamma")
    assert page.locator("svg.curve g.curve-series").count() == 2
    assert page.locator("svg.curve circle.ckpt-marker[data-run='alpha']").count() == 0
