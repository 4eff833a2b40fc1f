"""The catalog browser over real HTTP: pages, errors, headers, read-only, loopback only."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import pytest

from ckptstore.errors import InvalidNameError
from ckptstore.ui.app import CSP, BackgroundUI, check_loopback, start_background
from ckptstore.ui.views import restore_snippets


def fetch(url: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=20) as resp:
            headers = {k.lower(): v for k, v in resp.headers.items()}
            return resp.status, headers, resp.read().decode()
    except urllib.error.HTTPError as exc:
        headers = {k.lower(): v for k, v in exc.headers.items()}
        return exc.code, headers, exc.read().decode()


def test_runs_page(ui_server: BackgroundUI) -> None:
    status, headers, body = fetch(ui_server.url)
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert headers["content-security-policy"] == CSP and "script-src" not in CSP
    assert headers["x-content-type-options"] == "nosniff"
    for run in ("base", "tuned", "solo"):
        assert f'href="/runs/{run}"' in body
    assert "<script" not in body


def test_run_page_plots_and_lineage(ui_server: BackgroundUI, ui_store: Any) -> None:
    status, _, body = fetch(ui_server.url + "runs/base")
    assert status == 200
    assert body.count('class="plot"') == 2  # acc and loss
    assert body.count('<path class="series"') == 2
    assert "1 DELETED" in body  # the pruned version is counted, not listed
    assert f'href="/checkpoints/{ui_store.base_head}"' in body
    assert "tuned@v1" in body  # "runs started from this one"
    # Run config is user text: it is shown escaped, never as markup.
    assert "alert(" in body and "<script>" not in body
    status, _, body = fetch(ui_server.url + "runs/tuned")
    assert status == 200 and "Started from" in body and "base@v3" in body


def test_checkpoint_page(ui_server: BackgroundUI, ui_store: Any) -> None:
    status, _, body = fetch(ui_server.url + f"checkpoints/{ui_store.tuned_first}")
    assert status == 200
    assert f'href="/checkpoints/{ui_store.base_head}"' in body  # its parent
    assert "ckpt --store" in body and "restore tuned@v1" in body
    assert "store.load(&#39;tuned@v1&#39;)" in body
    assert "float32" in body and "PRESENT" in body
    status, _, body = fetch(ui_server.url + f"checkpoints/{ui_store.base_head}")
    assert 'data-relation="child"' in body
    status, _, body = fetch(ui_server.url + f"checkpoints/{ui_store.pruned}")
    assert status == 200 and "DELETED" in body and "cannot be restored" in body
    status, _, body = fetch(ui_server.url + f"checkpoints/{ui_store.solo}")
    assert "converted-from" in body and "base@v2" in body


def test_lineage_and_tiers_pages(ui_server: BackgroundUI, ui_store: Any) -> None:
    status, _, body = fetch(ui_server.url + "lineage")
    assert status == 200
    assert f'data-id="{ui_store.base_head}"' in body and f'data-id="{ui_store.tuned_first}"' in body
    assert 'class="edge parent"' in body and 'class="edge converted-from"' in body
    assert f'data-id="{ui_store.pruned}"' not in body  # pruned and not part of any lineage
    status, _, body = fetch(ui_server.url + "tiers")
    assert status == 200 and 'data-tier="hot"' in body and "nightly" not in body
    status, _, body = fetch(ui_server.url + "tiers?scan=1")
    assert status == 200 and "listed bytes" in body


@pytest.mark.parametrize(
    ("path", "code", "text"),
    [
        ("runs/nope", 404, "does not exist"),
        ("runs/bad%20name", 400, "Bad request"),
        ("checkpoints/0b2c5c9e-0000-4000-8000-000000000000", 404, "Not found"),
        # Not an id, so read as a reference (checkpoints/run-a@latest): a bad one is a 400.
        ("checkpoints/not..an-id", 400, "contains &#39;..&#39;"),
        ("nowhere", 404, ""),
    ],
)
def test_errors_are_pages_not_tracebacks(
    ui_server: BackgroundUI, path: str, code: int, text: str
) -> None:
    status, _headers, body = fetch(ui_server.url + path)
    assert status == code and text in body
    assert "Traceback" not in body


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_read_only(ui_server: BackgroundUI, ui_store: Any, method: str) -> None:
    for path in ("", "runs/base", f"checkpoints/{ui_store.tuned_first}"):
        status, _, _ = fetch(ui_server.url + path, method=method)
        assert status == 405


def test_loopback_only(ui_store: Any) -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert check_loopback(host) == host
    for host in ("0.0.0.0", "192.168.1.4", "::", "example.com"):
        with pytest.raises(InvalidNameError, match="loopback only"):
            check_loopback(host)
    with pytest.raises(InvalidNameError):
        start_background(ui_store.store, host="0.0.0.0")


def test_restore_snippets_name_the_store(ui_store: Any) -> None:
    snippets: dict[str, Any] = restore_snippets(ui_store.store, "run-a@v2")
    root = str(ui_store.store.settings.root.resolve())
    assert snippets["cli"] == f"ckpt --store {root} restore run-a@v2"
    assert f"CheckpointStore.open({root!r})" in snippets["python"]
    assert "store.load('run-a@v2')" in snippets["python"]
