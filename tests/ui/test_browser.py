"""The catalog browser in real headless Chromium (Playwright driving /usr/bin/chromium).

Chromium comes from Debian (``apt-get install -y chromium``; ``make test`` installs it) and
only Playwright's Python package is used: no browser download. Without them these tests skip
and say what to install.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore.ui.app import BackgroundUI
from ckptstore.ui.report import write_report

CHROMIUM = os.environ.get("CKPT_CHROMIUM", "/usr/bin/chromium")

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="pip install playwright (Python package only)"
)
if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
    pytest.skip(
        f"no Chromium at {CHROMIUM}: apt-get install -y chromium (make test does this)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
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


def test_click_from_run_to_checkpoint_to_parent(
    page: Any, ui_server: BackgroundUI, ui_store: Any, tmp_path: Path,
    screenshot_painted: Any,
) -> None:
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(ui_server.url)
    assert page.title() == "Runs · ckptstore"
    page.click("a.run-link:text-is('tuned')")
    page.wait_for_url("**/runs/tuned")
    assert page.locator("h1").inner_text() == "Run tuned"
    # The metric plot: a real path with one marker per checkpoint that has the metric.
    plot = page.locator("svg.plot[data-metric='loss']")
    d = plot.locator("path.series").get_attribute("d") or ""
    assert d.startswith("M") and d.count("L") == 1
    assert plot.locator("circle.marker").count() == 2
    box = plot.bounding_box()
    assert box is not None and box["width"] > 300 and box["height"] > 100  # actually laid out
    page.click("a.ckpt-link:text-is('tuned@v1')")
    page.wait_for_url(f"**/checkpoints/{ui_store.tuned_first}")
    assert "tuned@v1" in page.locator("h1").inner_text()
    assert "restore tuned@v1" in page.locator("pre.restore-cli").inner_text()
    page.click("a.neighbour-link[data-relation='parent']")
    page.wait_for_url(f"**/checkpoints/{ui_store.base_head}")
    assert "base@v3" in page.locator("h1").inner_text()
    assert page.locator("a.neighbour-link[data-relation='child']").inner_text() == "tuned@v1"
    shot = tmp_path / "parent-checkpoint.png"
    screenshot_painted(page, shot, full_page=True)
    assert shot.stat().st_size > 10_000
    assert errors == []  # nothing blocked by the CSP, nothing broken


def test_lineage_graph_renders_nodes_and_edges(
    page: Any, ui_server: BackgroundUI, ui_store: Any, tmp_path: Path,
    screenshot_painted: Any,
) -> None:
    page.goto(ui_server.url + "lineage")
    nodes = page.locator("svg.dag g.node")
    ids = {nodes.nth(i).get_attribute("data-id") for i in range(nodes.count())}
    assert {ui_store.base_head, ui_store.tuned_first, ui_store.solo} <= ids
    parent = page.locator(
        f"svg.dag path.edge.parent[data-src='{ui_store.base_head}']"
        f"[data-dst='{ui_store.tuned_first}']"
    )
    assert parent.count() == 1
    assert page.locator("svg.dag path.edge.converted-from").count() == 1
    # Boxes are laid out left to right: the child sits right of its parent.
    base_box = page.locator(f"svg.dag g.node[data-id='{ui_store.base_head}'] rect").first
    child_box = page.locator(f"svg.dag g.node[data-id='{ui_store.tuned_first}'] rect").first
    b, c = base_box.bounding_box(), child_box.bounding_box()
    assert b is not None and c is not None and c["x"] > b["x"] + b["width"]
    screenshot_painted(page, tmp_path / "lineage.png", full_page=True)
    page.click(f"svg.dag g.node[data-id='{ui_store.tuned_first}'] a")
    page.wait_for_url(f"**/checkpoints/{ui_store.tuned_first}")


def test_static_report_navigates_by_anchors(
    page: Any, ui_store: Any, tmp_path: Path, screenshot_painted: Any
) -> None:
    path = write_report(ui_store.store, tmp_path / "report.html")
    page.goto(path.as_uri())
    assert page.locator("section.report-page").count() >= 6
    page.click("#runs ~ table a.run-link:text-is('tuned')")
    assert page.url.endswith("#run-tuned")
    assert page.locator("#run-tuned").is_visible()
    assert page.locator("svg.plot path.series").count() >= 3
    assert page.locator("svg.dag g.node").count() >= 3
    screenshot_painted(page, tmp_path / "report.png")
