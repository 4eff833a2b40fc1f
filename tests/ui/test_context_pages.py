"""The browser's reproduction views over real HTTP: the run's context, the runs list's
search, sort, filter and config columns, the compare view's config difference and log
scale, references in URLs, the HTML 404 page, closed runs."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import torch
from context_support import training_repo

from ckptstore import CheckpointStore
from ckptstore.hooks import CheckpointManager
from ckptstore.ui.app import BackgroundUI, start_background


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=20) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundUI]:
    base = tmp_path_factory.mktemp("ui-context")
    with pytest.MonkeyPatch.context() as mp:
        training_repo(base / "repo", mp)
        store = CheckpointStore.open(base / "store")
        try:
            for run, lr, opt in (("run-a", 1e-4, "adam"), ("run-b", 0.1, "sgd")):
                with CheckpointManager(store, run, save_interval=1, async_save=False,
                                       handle_sigterm=False,
                                       config={"lr": lr, "optim": opt, "api_key": "k"}
                                       ) as mgr:
                    for step in range(1, 4):
                        mgr.step(step, lambda: {"w": torch.ones(4)},
                                 metrics={"loss": 10.0 / step})
            store.save("open-run", 1, {"w": torch.ones(4)}, config={"lr": 0.5})
            with start_background(store) as running:
                yield running
        finally:
            store.close()


def test_run_page_shows_the_context(server: BackgroundUI) -> None:
    status, body = fetch(server.url + "runs/run-a")
    assert status == 200 and "How to reproduce" in body
    for text in ("commit", "dirty", "yes, change of", "command", "Python", "torch",
                 "packages locked", "ckpt reproduce run-a@latest --dir DIR"):
        assert text in body, text
    assert "<code>lr</code></td><td>0.0001</td>" in body
    assert "<code>api_key</code></td><td>***</td>" in body
    assert '<dt>status</dt><dd>closed</dd>' in body  # the manager closed it


def test_runs_list_search_sort_filter_and_config_columns(server: BackgroundUI) -> None:
    status, body = fetch(server.url)
    assert status == 200
    assert '<th class="config-col">lr</th>' in body and '<th class="config-col">optim</th>' in body
    assert body.count('class="run-status">closed<') == 2
    assert body.count('class="run-status">active<') == 1  # open-run: no manager closed it
    _, body = fetch(server.url + "?q=run-b")
    assert 'href="/runs/run-b"' in body and 'href="/runs/run-a"' not in body
    _, body = fetch(server.url + "?where=" + quote("config.lr<1e-3"))
    assert 'href="/runs/run-a"' in body and 'href="/runs/run-b"' not in body
    _, body = fetch(server.url + "?where=" + quote("config.optim==sgd"))
    assert 'href="/runs/run-b"' in body and 'href="/runs/run-a"' not in body
    _, body = fetch(server.url + "?sort=-name")
    assert body.index('href="/runs/run-b"') < body.index('href="/runs/run-a"')
    status, body = fetch(server.url + "?sort=colour")
    assert status == 400 and "cannot sort runs" in body


def test_compare_shows_the_config_difference_and_a_log_scale(server: BackgroundUI) -> None:
    url = server.url + "compare?run=run-a&run=run-b"
    status, body = fetch(url)
    assert status == 200 and "Config differences" in body
    assert "<code>lr</code>" in body and "<code>optim</code>" in body
    assert "<code>api_key</code>" not in body  # the same (masked) in both
    assert 'class="scale-link" href="/compare?run=run-a&amp;run=run-b&amp;log=1"' in body
    status, body = fetch(url + "&log=1")
    assert status == 200 and "log10(loss)" in body and ">linear</a>" in body


def test_refs_in_urls_and_the_html_404(server: BackgroundUI) -> None:
    status, body = fetch(server.url + "checkpoints/run-a@latest")
    assert status == 200 and "run-a@v3" in body
    status, body = fetch(server.url + "checkpoints/run-a@2")
    assert status == 200 and "run-a@v2" in body
    status, body = fetch(server.url + "checkpoints/run-a@99")
    assert status == 404 and "<html" in body.lower()
    status, body = fetch(server.url + "no/such/page")
    assert status == 404 and "<html" in body.lower() and "there is no page at" in body


def test_in_chromium(server: BackgroundUI, tmp_path: Path) -> None:
    """The same pages in headless Chromium (skipped where it is not installed)."""
    import os
    import shutil

    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = os.environ.get("CKPT_CHROMIUM", "/usr/bin/chromium")
    if not (os.path.exists(chromium) or shutil.which(chromium)):
        pytest.skip(f"no Chromium at {chromium}: apt-get install -y chromium")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                     args=["--no-sandbox"], timeout=60_000)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("console",
                    lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.goto(server.url)
            page.fill("input[name=where]", "config.lr<1e-3")
            page.click("form.run-search button")
            page.wait_for_url("**where=*")
            assert page.locator("a.run-link").all_inner_texts() == ["run-a"]
            page.click("a.run-link:text-is('run-a')")
            assert "How to reproduce" in page.locator("#reproduce").inner_text()
            page.goto(server.url + "compare?run=run-a&run=run-b")
            page.click("a.scale-link")
            page.wait_for_url("**log=1")
            assert page.locator("table.config-diff tr").count() == 3
            page.goto(server.url + "checkpoints/run-b@latest")
            assert "run-b@v3" in page.locator("h1").inner_text()
            assert errors == []  # nothing blocked by the CSP (the search form included)
            response = page.goto(server.url + "nowhere")
            assert response.status == 404 and page.locator("h1").inner_text() == "Not found"
        finally:
            browser.close()
