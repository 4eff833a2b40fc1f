"""``ckpt lineage REF``: where a checkpoint came from (or what came of it), as a DAG.

Both kinds of parent are followed: the ``parent`` link (resumed / fine-tuned from) and the
``merged-from`` edges of a merged checkpoint, one per input, with the input's weight. The
text tree shows a checkpoint reached twice (two merges of one input) once, and refers back
to it after that; ``dot`` and ``mermaid`` draw every edge.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from rich.markup import escape

from ckptstore.cli.common import open_catalog
from ckptstore.cli.output import checkpoint_json, console, print_json
from ckptstore.errors import UsageError

__all__ = ["lineage_cmd", "register", "render_dot", "render_mermaid", "render_tree"]

FORMATS = ("tree", "dot", "mermaid")


def lineage_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="tree, dot or mermaid.")
    ] = "tree",
    descendants: Annotated[
        bool, typer.Option(help="Show what was derived from it instead of its ancestors.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON instead (overrides --format).")
    ] = False,
) -> None:
    """Show where a checkpoint came from (resumed / fine-tuned / merged from), across runs.

    A merged checkpoint lists every input (`ckpt merge`), with its weight.

    JSON: {"checkpoint": REF's record, "direction": "ancestors" or "descendants",
    "nodes": [records, nearest first], "edges": [{"from": ref, "to": ref, "kind": "parent"
    or "merged-from", "weight" (merged-from only)}, ...]}; a record has the keys of
    `ckpt ls --json`.
    """
    if fmt not in FORMATS:
        raise UsageError(f"unknown --format {fmt!r}; use tree, dot or mermaid")
    with open_catalog(ctx) as store:
        graph = store.catalog.lineage_graph(ref, descendants=descendants)
    refs = {ck.id: ck.ref for ck in [graph.root, *graph.nodes]}
    edges = [_edge(link, refs) for link in graph.links]
    if as_json:
        print_json({
            "checkpoint": checkpoint_json(graph.root),
            "direction": "descendants" if descendants else "ancestors",
            "nodes": [checkpoint_json(ck) for ck in graph.nodes],
            "edges": edges,
        })
        return
    if fmt == "tree":
        steps = {ck.ref: (ck.step, ck.id) for ck in [graph.root, *graph.nodes]}
        for line in render_tree(graph.root.ref, edges, steps, descendants=descendants):
            console.print(escape(line), highlight=False)
        return
    render = render_dot if fmt == "dot" else render_mermaid
    sys.stdout.write("\n".join(render(graph.root.ref, edges)) + "\n")


def _edge(link: Any, refs: dict[str, str]) -> dict[str, Any]:
    edge: dict[str, Any] = {"from": refs[link.src], "to": refs[link.dst], "kind": link.kind}
    if link.weight is not None:
        edge["weight"] = link.weight
    return edge


def _relation(edge: dict[str, Any], descendants: bool) -> tuple[str, str]:
    """The words before a node's reference in the tree, and after it."""
    if edge["kind"] == "parent":
        return ("derived" if descendants else "from"), ""
    weight = f", weight {edge['weight']:.4g}" if edge.get("weight") is not None else ""
    return ("merged into" if descendants else "merged from"), weight


def render_tree(
    root: str,
    edges: list[dict[str, Any]],
    steps: dict[str, tuple[int, str]],
    *,
    descendants: bool = False,
) -> Iterator[str]:
    """Lines of the text tree: the root, then each parent (child) indented under it.

    Args:
        root: The root's reference.
        edges: ``{"from", "to", "kind", "weight"?}`` between references.
        steps: Reference -> (step, id) for every node.
        descendants: Walk from parents to children instead.

    Yields:
        Lines such as ``└─ merged from a@v3 (step 100, 1a2b3c4d), weight 0.5``.
    """
    near, far = ("from", "to") if descendants else ("to", "from")
    nexts: dict[str, list[dict[str, Any]]] = {}
    for edge in edges:
        nexts.setdefault(edge[near], []).append(edge)
    shown: set[str] = set()

    def label(ref: str) -> str:
        step, cid = steps[ref]
        return f"{ref} (step {step}, {cid[:8]})"

    def walk(ref: str, depth: int) -> Iterator[str]:
        for edge in nexts.get(ref, []):
            other = edge[far]
            before, after = _relation(edge, descendants)
            indent = "   " * depth
            if other in shown:
                yield f"{indent}└─ {before} {other} (shown above){after}"
                continue
            shown.add(other)
            yield f"{indent}└─ {before} {label(other)}{after}"
            yield from walk(other, depth + 1)

    shown.add(root)
    yield label(root)
    yield from walk(root, 0)


def render_dot(root: str, edges: list[dict[str, Any]]) -> list[str]:
    """Graphviz lines; merged-from edges dashed and labelled with their weight."""
    lines = ["digraph lineage {"]
    for edge in edges:
        attrs = "" if edge["kind"] == "parent" else f' [label="{_label(edge)}", style=dashed]'
        lines.append(f'  "{edge["from"]}" -> "{edge["to"]}"{attrs};')
    if not edges:
        lines.append(f'  "{root}";')
    lines.append("}")
    return lines


def render_mermaid(root: str, edges: list[dict[str, Any]]) -> list[str]:
    """Mermaid lines; merged-from edges dotted and labelled with their weight."""
    lines = ["graph TD"]
    for edge in edges:
        a, b = edge["from"], edge["to"]
        arrow = "-->" if edge["kind"] == "parent" else f'-. "{_label(edge)}" .->'
        lines.append(f'  {_mid(a)}["{a}"] {arrow} {_mid(b)}["{b}"]')
    if not edges:
        lines.append(f'  {_mid(root)}["{root}"]')
    return lines


def _label(edge: dict[str, Any]) -> str:
    """A derivation edge's label: its kind, and a merge input's weight."""
    weight = edge.get("weight")
    return str(edge["kind"]) + (f" {weight:.4g}" if weight is not None else "")


def _mid(ref: str) -> str:
    return "n_" + "".join(c if c.isalnum() else "_" for c in ref)


def register(app: typer.Typer) -> None:
    """Add ``lineage`` to the ``ckpt`` command."""
    app.command("lineage")(lineage_cmd)
