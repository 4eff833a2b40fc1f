"""``ckpt report --html``: one self-contained file whose in-page links all resolve."""

from __future__ import annotations

import re
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from ckptstore.ui.report import render_report


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []
        self.tags: set[str] = set()
        self.resource_attrs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            elif name == "href" and value is not None:
                self.hrefs.append(value)
            elif name in ("src", "srcset", "data", "poster"):
                self.resource_attrs.append(f"{tag}.{name}={value}")


@pytest.fixture
def ckpt_cli() -> Callable[..., int]:
    from ckptstore.cli.app import main

    return lambda *args: main(list(args))


def test_report_is_self_contained_and_links_resolve(
    ui_store: Any, tmp_path: Path, ckpt_cli: Callable[..., int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "report.html"
    root = str(ui_store.store.settings.root)
    assert ckpt_cli("--store", root, "report", "--html", str(out)) == 0
    assert "wrote" in capsys.readouterr().out
    text = out.read_text("utf-8")
    page = _Collector()
    page.feed(text)
    assert not {"script", "link", "img", "iframe", "object"} & page.tags
    assert page.resource_attrs == []
    # The only URL is the SVG namespace; nothing is fetched from anywhere.
    assert set(re.findall(r"https?://[^\s\"'<]+", text)) == {"http://www.w3.org/2000/svg"}
    anchors = [h for h in page.hrefs if h.startswith("#")]
    assert anchors and all(h[1:] in page.ids for h in anchors), [
        h for h in anchors if h[1:] not in page.ids
    ]
    assert [h for h in page.hrefs if not h.startswith("#")] == []
    for section in ("runs", "lineage", "tiers", "run-base", "run-tuned", "run-solo",
                    f"ckpt-{ui_store.tuned_first}", f"ckpt-{ui_store.base_head}"):
        assert section in page.ids
    assert text.count('<path class="series"') >= 3  # base: acc, loss; tuned: loss
    assert 'class="edge parent"' in text and "restore tuned@v1" in text


def test_report_bounds_checkpoint_sections(ui_store: Any) -> None:
    text = render_report(ui_store.store, max_checkpoints=1)
    ids = set(re.findall(r'id="(ckpt-[^"]+)"', text))
    # The newest checkpoint plus the parent it links to, nothing else.
    assert 1 <= len(ids) <= 2
    assert "older checkpoints have no section" in text


def test_report_to_an_unwritable_place_fails_clearly(
    ui_store: Any, tmp_path: Path, ckpt_cli: Callable[..., int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = str(ui_store.store.settings.root)
    code = ckpt_cli("--store", root, "report", "--html", str(tmp_path / "no" / "r.html"))
    assert code == 1 and "cannot write the report" in capsys.readouterr().err


def test_ui_command_refuses_non_loopback(
    ui_store: Any, ckpt_cli: Callable[..., int], capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(ui_store.store.settings.root)
    assert ckpt_cli("--store", root, "ui", "--host", "0.0.0.0") == 1
    assert "loopback only" in capsys.readouterr().err
