"""Server-side SVG: ticks, the metric plot and the layered lineage graph."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from ckptstore.ui.svg import (
    Edge,
    Node,
    PlotPoint,
    dag_svg,
    group_colors,
    layered_layout,
    line_plot,
    nice_ticks,
)

SVG = "{http://www.w3.org/2000/svg}"


def test_nice_ticks() -> None:
    assert nice_ticks(0, 100, 5) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(1.37, 2.91, 4) == pytest.approx([1.5, 2.0, 2.5])
    assert nice_ticks(5, 5) == [5]
    assert len(nice_ticks(0, 1e-300, 5)) <= 15


def test_line_plot_is_valid_svg_with_one_marker_per_point() -> None:
    points = [PlotPoint(float(s), 1 / s, f"r@v{i}", f"/c/{i}") for i, s in
              enumerate((300, 100, 200), 1)]
    svg = line_plot([*points, PlotPoint(400.0, float("nan"), "bad")], title="loss")
    root = ET.fromstring(svg)
    path = root.find(f"{SVG}path[@class='series']")
    assert path is not None
    commands = re.findall(r"[ML]", path.get("d", ""))
    assert commands == ["M", "L", "L"]  # NaN skipped, points sorted by step
    xs = [float(x) for x in re.findall(r"[ML]([\d.]+),", path.get("d", ""))]
    assert xs == sorted(xs)
    links = root.findall(f"{SVG}a")
    assert [a.get("href") for a in links] == ["/c/2", "/c/3", "/c/1"]
    assert root.get("data-metric") == "loss"


def test_line_plot_edge_cases_and_escaping() -> None:
    empty = line_plot([], title="acc")
    assert "no values" in empty
    one = ET.fromstring(line_plot([PlotPoint(5.0, 2.0, "x")], title="<b>&"))
    assert one.find(f"{SVG}path[@class='series']") is not None
    assert one.get("data-metric") == "<b>&"  # parsed back from escaped attributes
    assert "<b>" not in line_plot([PlotPoint(5.0, 2.0, "<script>")], title="<b>")


def test_layered_layout_places_chains_and_diamonds() -> None:
    nodes = [Node(n, n, group=g) for n, g in
             (("a", "r1"), ("b", "r1"), ("c", "r2"), ("d", "r2"), ("e", "r3"))]
    edges = [Edge("a", "b"), Edge("a", "c"), Edge("b", "d"), Edge("c", "d")]
    places = layered_layout(nodes, edges)
    assert places["a"][0] == 0 and places["b"][0] == 1 and places["c"][0] == 1
    assert places["d"][0] == 2 and places["e"][0] == 0
    assert {places["b"][1], places["c"][1]} == {0, 1}


def test_layered_layout_survives_a_cycle_and_unknown_ends() -> None:
    nodes = [Node("a", "a"), Node("b", "b")]
    places = layered_layout(nodes, [Edge("a", "b"), Edge("b", "a"), Edge("a", "zz")])
    assert set(places) == {"a", "b"}


def test_dag_svg_draws_every_node_and_edge() -> None:
    nodes = [Node("p", "base@v3", "step 100", "/checkpoints/p", "base"),
             Node("c", "tuned@v1", "step 1", "/checkpoints/c", "tuned"),
             Node("old", "base@v1", "step 10", None, "base", muted=True)]
    edges = [Edge("p", "c"), Edge("old", "p", "same-run"), Edge("p", "missing")]
    root = ET.fromstring(dag_svg(nodes, edges))
    groups = root.findall(f"{SVG}g")
    assert sorted(g.get("data-id") or "" for g in groups) == ["c", "old", "p"]
    assert [g.get("class") for g in groups if g.get("data-id") == "old"] == ["node muted"]
    paths = root.findall(f"{SVG}path")
    assert sorted(p.get("class") or "" for p in paths) == ["edge parent", "edge same-run"]
    assert "no lineage" in dag_svg([], [])


def test_group_colors_are_stable_and_distinct() -> None:
    colors = group_colors(["b", "a", "c"])
    assert colors == group_colors(["c", "b", "a"])
    assert len(set(colors.values())) == 3
