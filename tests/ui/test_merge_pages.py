"""A merged checkpoint in the catalog browser: weighted arrows in the lineage graph, and the
merge (inputs, weights, method) on its page and its inputs' pages."""

from __future__ import annotations

import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from ckptstore import CheckpointStore
from ckptstore.ui.app import start_background
from ckptstore.ui.svg import Edge, Node, dag_svg

SVG = "{http://www.w3.org/2000/svg}"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as resp:
        return str(resp.read().decode())


def test_merge_in_the_lineage_graph_and_on_the_checkpoint_pages(tmp_path: Path) -> None:
    with CheckpointStore.open(tmp_path / "store") as store:
        inputs = [store.save(run, 1, {"w": torch.full((8,), float(i))})
                  for i, run in enumerate(("site-a", "site-b", "site-c"))]
        merged = store.merge([ck.ref for ck in inputs], run="global", step=1,
                             weights=[1, 1, 2])
        with start_background(store) as ui:
            body = _get(ui.url + "lineage")
            for ck in inputs:
                assert f'class="edge merged-from" data-src="{ck.id}" data-dst="{merged.id}"' \
                    in body
            assert body.count('<text class="edge-label merged-from"') == 3
            assert ">w=0.5</text>" in body and body.count(">w=0.25</text>") == 2
            page = _get(ui.url + f"checkpoints/{merged.id}")
            assert "<h2>Merge</h2>" in page and "weighted, accumulated in auto" in page
            rows = page.split('<tr class="merge-input">')[1:]
            assert [r.split("<code>")[1].split("</code>")[0] for r in rows] == [
                "site-a@v1", "site-b@v1", "site-c@v1"]
            assert "0.25" in rows[0] and "0.5" in rows[2]
            page = _get(ui.url + f"checkpoints/{inputs[2].id}")
            assert "merged-from (derived) · weight 0.5" in page and "global@v1" in page


def test_dag_svg_writes_an_edge_label_beside_its_arrow() -> None:
    nodes = [Node("a", "a@v1"), Node("b", "b@v1"), Node("m", "m@v1")]
    edges = [Edge("a", "m", "merged-from", "w=0.75"), Edge("b", "m", "merged-from", "w=0.25"),
             Edge("a", "b")]
    root = ET.fromstring(dag_svg(nodes, edges))
    labels = {(t.get("data-src"), t.text) for t in root.findall(f"{SVG}text")
              if "edge-label" in (t.get("class") or "")}
    assert labels == {("a", "w=0.75"), ("b", "w=0.25")}
    titles = [p.find(f"{SVG}title").text for p in root.findall(f"{SVG}path")  # type: ignore[union-attr]
              if p.get("data-dst") == "m"]
    assert titles == ["merged-from w=0.75", "merged-from w=0.25"]
