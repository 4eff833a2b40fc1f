"""Server-side SVG: a metric-over-steps line plot, the training curve, and a lineage DAG.

Pure functions from plain data to SVG text (no JavaScript, no external resources), so the
same markup works in the live browser and in the static report. Every piece of text that
came from the catalog is escaped.
"""

from __future__ import annotations

import hashlib
import html
import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from ckptstore.records import MetricPoint

__all__ = [
    "CurveMarker",
    "CurveSeries",
    "Edge",
    "Node",
    "PlotPoint",
    "curve_plot",
    "dag_svg",
    "group_colors",
    "layered_layout",
    "line_plot",
    "nice_ticks",
]

_PALETTE = (
    "#2f6fb0", "#c0504d", "#4f9a4f", "#8064a2", "#d08a1f", "#2aa0a4", "#b0487f", "#6b6b2f",
)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _num(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4g}"


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering ``[low, high]`` (steps of 1, 2 or 5 times a power of 10).

    Args:
        low: Smallest value.
        high: Largest value (> low).
        count: About how many ticks.

    Returns:
        Increasing tick values inside ``[low, high]``.
    """
    span = high - low
    if span <= 0 or not math.isfinite(span):
        return [low]
    raw = span / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    ticks: list[float] = []
    value = first
    for _ in range(count * 3):  # bounded even for pathological float input
        if value > high + step * 1e-9:
            break
        ticks.append(round(value, 12))
        value += step
    return ticks


# --------------------------------------------------------------------------- plot frame
#: Margins of a plot around its data area, in px: left (y tick labels), right, top (title),
#: bottom (x tick labels and the axis label).
_MARGINS = (60, 14, 26, 34)


def _head(kind: str, title: str, x_label: str, width: int, height: int, left: int) -> str:
    """The opening ``<svg>`` of a plot and its title."""
    return (
        f'<svg class="{kind}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'data-metric="{_e(title)}" aria-label="{_e(title)} over {_e(x_label)}">'
        f'<text class="title" x="{left}" y="16">{_e(title)}</text>'
    )


def _empty(head: str, width: int, height: int, text: str) -> str:
    """A plot with nothing to draw: its head and one line saying so."""
    return (
        head + f'<text class="empty" x="{width / 2:.0f}" y="{height / 2:.0f}" '
        f'text-anchor="middle">{text}</text></svg>'
    )


@dataclass(frozen=True)
class _Frame:
    """The data area of a plot: where it lies in px and the data ranges it shows."""

    left: int
    top: int
    width: int
    height: int
    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float

    @classmethod
    def around(cls, xs: Sequence[float], ys: Sequence[float], *, width: int, height: int,
               top: int) -> _Frame:
        """The frame showing every x and y: the x range as it is (widened when it is one
        value), the y range padded by 6 % (10 % of the value, or 1, when it is one value)."""
        left, right, _, bottom = _MARGINS
        x_lo, x_hi = min(xs), max(xs)
        y_lo, y_hi = min(ys), max(ys)
        if x_hi == x_lo:
            x_lo, x_hi = x_lo - 1, x_hi + 1
        pad = (y_hi - y_lo) * 0.06 if y_hi > y_lo else (abs(y_lo) * 0.1 or 1.0)
        return cls(left, top, width - left - right, height - top - bottom,
                   x_lo, x_hi, y_lo - pad, y_hi + pad)

    def sx(self, x: float) -> float:
        """The px column of data ``x``."""
        return self.left + (x - self.x_lo) / (self.x_hi - self.x_lo) * self.width

    def sy(self, y: float) -> float:
        """The px row of data ``y``."""
        return self.top + (1 - (y - self.y_lo) / (self.y_hi - self.y_lo)) * self.height

    def axes(self, x_label: str, svg_height: int) -> str:
        """The axes, the y grid lines, the ticks and the x axis label."""
        left, top = self.left, self.top
        right, bottom = left + self.width, top + self.height
        parts = [
            f'<g class="axes"><line x1="{left}" y1="{bottom}" x2="{right}" '
            f'y2="{bottom}"/><line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}"/>'
        ]
        for tick in nice_ticks(self.y_lo, self.y_hi, 4):
            y = self.sy(tick)
            parts.append(
                f'<line class="grid" x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}"/>'
                f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                f"{_num(tick)}</text>"
            )
        for tick in nice_ticks(self.x_lo, self.x_hi, 6):
            parts.append(
                f'<text class="tick" x="{self.sx(tick):.1f}" y="{bottom + 16}" '
                f'text-anchor="middle">{_num(tick)}</text>'
            )
        parts.append(
            f'<text class="axis-label" x="{right}" y="{svg_height - 4}" text-anchor="end">'
            f"{_e(x_label)}</text></g>"
        )
        return "".join(parts)


# --------------------------------------------------------------------------- line plot
@dataclass(frozen=True)
class PlotPoint:
    """One checkpoint on a metric plot.

    Attributes:
        x: Training step.
        y: Metric value.
        label: Tooltip text (the checkpoint reference).
        href: Link target of the marker, or None.
    """

    x: float
    y: float
    label: str
    href: str | None = None


def line_plot(
    points: Sequence[PlotPoint],
    *,
    title: str,
    x_label: str = "step",
    width: int = 640,
    height: int = 220,
) -> str:
    """A line plot of a metric over steps with one linked marker per checkpoint.

    Args:
        points: The checkpoints (any order; non-finite values are skipped).
        title: Plot title (the metric name).
        x_label: X axis label.
        width: SVG width in px.
        height: SVG height in px.

    Returns:
        ``<svg class="plot">`` markup: axes, ticks, one ``<path class="series">`` and a
        ``<circle class="marker">`` (inside an ``<a>`` when linked) per point.
    """
    good = sorted(
        (p for p in points if math.isfinite(p.x) and math.isfinite(p.y)), key=lambda p: p.x
    )
    left, _, top, _ = _MARGINS
    head = _head("plot", title, x_label, width, height, left)
    if not good:
        return _empty(head, width, height, "no values")
    frame = _Frame.around([p.x for p in good], [p.y for p in good], width=width,
                          height=height, top=top)
    sx, sy = frame.sx, frame.sy
    parts = [head, frame.axes(x_label, height)]
    d = " ".join(
        f"{'M' if i == 0 else 'L'}{sx(p.x):.1f},{sy(p.y):.1f}" for i, p in enumerate(good)
    )
    parts.append(f'<path class="series" d="{d}"/>')
    for p in good:
        circle = (
            f'<circle class="marker" cx="{sx(p.x):.1f}" cy="{sy(p.y):.1f}" r="4">'
            f"<title>{_e(p.label)}: {_e(title)}={_num(p.y)} at {_e(x_label)} {_num(p.x)}"
            "</title></circle>"
        )
        parts.append(f'<a href="{_e(p.href)}">{circle}</a>' if p.href else circle)
    parts.append("</svg>")
    return "".join(parts)


# --------------------------------------------------------------------------- curve
@dataclass(frozen=True)
class CurveSeries:
    """One run's recorded series on a training-curve plot.

    Attributes:
        name: The run (legend text and ``data-run``).
        points: The (downsampled) history, in step order.
        color: Stroke colour (see :func:`group_colors`).
    """

    name: str
    points: Sequence[MetricPoint]
    color: str = _PALETTE[0]


@dataclass(frozen=True)
class CurveMarker:
    """A checkpoint or a loss alert placed on a curve.

    Attributes:
        series: The run it belongs to (its curve gives the height when ``y`` is None).
        x: Training step.
        label: Tooltip text.
        y: Value to place it at; None puts it on the series' curve (or at the top of the
            plot for an alert on a NaN/inf loss, which has no height).
        href: Link target, or None.
        kind: ``checkpoint`` or ``alert`` (the CSS class and ``data-kind``).
    """

    series: str
    x: float
    label: str
    y: float | None = None
    href: str | None = None
    kind: str = "checkpoint"


def _value_at(points: Sequence[MetricPoint], step: float) -> float | None:
    """The series' mean at ``step``, interpolated between neighbouring points."""
    if not points:
        return None
    xs = [(p.step_first + p.step_last) / 2 for p in points]
    if step <= xs[0]:
        return points[0].mean
    for i in range(1, len(points)):
        if step <= xs[i]:
            x0, x1 = xs[i - 1], xs[i]
            t = 0.0 if x1 == x0 else (step - x0) / (x1 - x0)
            return points[i - 1].mean + t * (points[i].mean - points[i - 1].mean)
    return points[-1].mean


def curve_plot(
    series: Sequence[CurveSeries],
    *,
    title: str,
    markers: Sequence[CurveMarker] = (),
    x_label: str = "step",
    width: int = 760,
    height: int = 280,
) -> str:
    """The training curve of one or more runs, with checkpoints and alerts on it.

    Each series is drawn as its mean (``<path class="curve-line">``) over a min-max band
    (``<path class="curve-band">``: a spike merged into a downsampled point still shows).
    Checkpoints are ``<circle class="ckpt-marker">`` (linked to their page), alerts are
    ``<path class="alert-marker">`` triangles; both carry ``data-run`` and ``data-step``.

    Args:
        series: The runs' series (non-finite values are skipped).
        title: Plot title (the metric).
        markers: Checkpoints and alerts.
        x_label: X axis label.
        width: SVG width in px.
        height: SVG height in px.

    Returns:
        ``<svg class="curve">`` markup.
    """
    left, _, top, _ = _MARGINS
    legend = len(series) > 1
    if legend:
        top += 16
    drawn = [
        CurveSeries(s.name, [p for p in s.points if math.isfinite(p.mean) and math.isfinite(
            p.min) and math.isfinite(p.max)], s.color)
        for s in series
    ]
    head = _head("curve", title, x_label, width, height, left)
    every = [p for s in drawn for p in s.points]
    if not every:
        return _empty(head, width, height, "no values recorded")
    by_name = {s.name: s for s in drawn}
    placed: list[tuple[CurveMarker, float, float | None]] = []
    for m in markers:
        if not math.isfinite(m.x):
            continue
        y = m.y if m.y is not None and math.isfinite(m.y) else None
        if y is None and m.kind != "alert":
            owner = by_name.get(m.series)
            y = _value_at(owner.points, m.x) if owner is not None else None
            if y is None:
                continue
        placed.append((m, m.x, y))
    xs = [float(p.step_first) for p in every] + [float(p.step_last) for p in every]
    xs += [x for _, x, _ in placed]
    ys = [p.min for p in every] + [p.max for p in every]
    ys += [y for _, _, y in placed if y is not None]
    frame = _Frame.around(xs, ys, width=width, height=height, top=top)
    sx, sy = frame.sx, frame.sy
    parts = [head]
    if legend:
        x = float(left)
        for s in drawn:
            parts.append(
                f'<g class="legend-item" data-run="{_e(s.name)}"><rect x="{x:.0f}" y="22" '
                f'width="10" height="10" style="fill:{s.color}"/><text x="{x + 14:.0f}" '
                f'y="31">{_e(s.name)}</text></g>'
            )
            x += 24 + 7 * len(s.name)
    parts.append(frame.axes(x_label, height))
    for s in drawn:
        if not s.points:
            continue
        mids = [((p.step_first + p.step_last) / 2, p) for p in s.points]
        upper = " ".join(f"L{sx(x):.1f},{sy(p.max):.1f}" for x, p in mids)
        lower = " ".join(f"L{sx(x):.1f},{sy(p.min):.1f}" for x, p in reversed(mids))
        band = "M" + upper[1:] + " " + lower + " Z"
        line = " ".join(
            f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(p.mean):.1f}" for i, (x, p) in
            enumerate(mids)
        )
        parts.append(
            f'<g class="curve-series" data-run="{_e(s.name)}" data-points="{len(s.points)}">'
            f'<path class="curve-band" d="{band}" style="fill:{s.color}"/>'
            f'<path class="curve-line" d="{line}" style="stroke:{s.color}"/>'
            f"<title>{_e(s.name)}: {_e(title)}</title></g>"
        )
    colors = {s.name: s.color for s in drawn}
    for m, x, y in placed:
        color = colors.get(m.series, _PALETTE[0])
        step = str(int(x)) if x.is_integer() else repr(x)
        attrs = f'data-run="{_e(m.series)}" data-step="{step}" data-kind="{_e(m.kind)}"'
        tip = f"<title>{_e(m.label)}</title>"
        if m.kind == "alert":
            cx, cy = sx(x), sy(y) if y is not None else float(top + 6)
            shape = (
                f'<path class="alert-marker" {attrs} d="M{cx:.1f},{cy - 7:.1f} '
                f'L{cx + 6:.1f},{cy + 4:.1f} L{cx - 6:.1f},{cy + 4:.1f} Z">{tip}</path>'
            )
        else:
            assert y is not None  # placed only with a height
            shape = (
                f'<circle class="ckpt-marker" {attrs} cx="{sx(x):.1f}" cy="{sy(y):.1f}" '
                f'r="4" style="stroke:{color}">{tip}</circle>'
            )
        parts.append(f'<a href="{_e(m.href)}">{shape}</a>' if m.href else shape)
    parts.append("</svg>")
    return "".join(parts)


# --------------------------------------------------------------------------- DAG
@dataclass(frozen=True)
class Node:
    """A box in the lineage graph.

    Attributes:
        id: Unique id (the checkpoint id).
        label: First line (the checkpoint reference).
        sublabel: Second line (step, a metric).
        href: Link target, or None.
        group: Colour group (the run).
        muted: Drawn faded (pruned or deleted checkpoints).
    """

    id: str
    label: str
    sublabel: str = ""
    href: str | None = None
    group: str = ""
    muted: bool = False


@dataclass(frozen=True)
class Edge:
    """An arrow ``src → dst``; ``kind`` becomes its CSS class (``parent``, ``same-run``...).

    ``label`` (a merged-from edge's weight) is written beside the arrow's middle.
    """

    src: str
    dst: str
    kind: str = "parent"
    label: str = ""


def group_colors(groups: Sequence[str]) -> dict[str, str]:
    """A stable colour per group: the same run keeps its colour across pages and reports."""
    out: dict[str, str] = {}
    used: set[str] = set()
    for group in sorted(set(groups)):
        digest = int(hashlib.blake2s(group.encode(), digest_size=4).hexdigest(), 16)
        color = _PALETTE[digest % len(_PALETTE)]
        # Prefer an unused colour while any is left, so few runs never share one.
        if color in used and len(used) < len(_PALETTE):
            color = next(c for c in _PALETTE if c not in used)
        used.add(color)
        out[group] = color
    return out


def layered_layout(
    nodes: Sequence[Node], edges: Sequence[Edge], *, sweeps: int = 2
) -> dict[str, tuple[int, int]]:
    """Place nodes in layers (longest path from a source) and order each layer.

    Args:
        nodes: The nodes, in a preferred initial order.
        edges: Edges; those with an unknown end are ignored.
        sweeps: Barycenter passes (down then up) to reduce crossings.

    Returns:
        ``{node id: (layer, position in layer)}``.
    """
    index = {n.id: i for i, n in enumerate(nodes)}
    succ: dict[str, list[str]] = defaultdict(list)
    pred: dict[str, list[str]] = defaultdict(list)
    for edge in edges:
        if edge.src in index and edge.dst in index and edge.src != edge.dst:
            succ[edge.src].append(edge.dst)
            pred[edge.dst].append(edge.src)
    indegree = {n.id: len(pred[n.id]) for n in nodes}
    layer: dict[str, int] = {}
    ready = deque(n.id for n in nodes if indegree[n.id] == 0)
    for nid in ready:
        layer[nid] = 0
    while ready:
        nid = ready.popleft()
        for nxt in succ[nid]:
            layer[nxt] = max(layer.get(nxt, 0), layer[nid] + 1)
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    # Nodes on a cycle (never produced by the catalog, but data is data) go after their
    # placed predecessors instead of being dropped.
    for n in nodes:
        if n.id not in layer:
            placed = [layer[p] for p in pred[n.id] if p in layer]
            layer[n.id] = max(placed) + 1 if placed else 0
    depth = max(layer.values(), default=-1) + 1
    layers: list[list[str]] = [[] for _ in range(depth)]
    for n in sorted(nodes, key=lambda n: (n.group, index[n.id])):
        layers[layer[n.id]].append(n.id)
    position = {nid: i for row in layers for i, nid in enumerate(row)}

    def reorder(row: list[str], neighbours: dict[str, list[str]]) -> None:
        def key(nid: str) -> tuple[float, int]:
            around = [position[m] for m in neighbours[nid] if m in position]
            center = sum(around) / len(around) if around else float(position[nid])
            return (center, position[nid])

        row.sort(key=key)
        for i, nid in enumerate(row):
            position[nid] = i

    for _ in range(max(sweeps, 0)):
        for row in layers[1:]:
            reorder(row, pred)
        for row in reversed(layers[:-1]):
            reorder(row, succ)
    return {nid: (layer[nid], position[nid]) for nid in index}


_NODE_W, _NODE_H, _GAP_X, _GAP_Y, _PAD = 176, 44, 56, 14, 12


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def dag_svg(nodes: Sequence[Node], edges: Sequence[Edge], *, title: str = "lineage") -> str:
    """Draw a DAG left to right with :func:`layered_layout`.

    Args:
        nodes: Boxes to draw.
        edges: Arrows between them (unknown ends are skipped).
        title: Accessible name of the graph.

    Returns:
        ``<svg class="dag">`` markup with one ``<g class="node" data-id=...>`` per node and
        one ``<path class="edge <kind>">`` per edge (and a ``<text class="edge-label">``
        beside each labelled one).
    """
    if not nodes:
        return (
            '<svg class="dag" xmlns="http://www.w3.org/2000/svg" width="320" height="40" '
            f'role="img" aria-label="{_e(title)}"><text x="8" y="24">no lineage recorded'
            "</text></svg>"
        )
    places = layered_layout(nodes, edges)
    colors = group_colors([n.group for n in nodes])
    layers = max(layer for layer, _ in places.values()) + 1
    rows = max(pos for _, pos in places.values()) + 1
    width = _PAD * 2 + layers * _NODE_W + (layers - 1) * _GAP_X
    height = _PAD * 2 + rows * _NODE_H + (rows - 1) * _GAP_Y

    def origin(nid: str) -> tuple[float, float]:
        layer, pos = places[nid]
        return _PAD + layer * (_NODE_W + _GAP_X), _PAD + pos * (_NODE_H + _GAP_Y)

    parts = [
        f'<svg class="dag" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{_e(title)}">'
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"/>'
        "</marker></defs>"
    ]
    for edge in edges:
        if edge.src not in places or edge.dst not in places or edge.src == edge.dst:
            continue
        sx, sy = origin(edge.src)
        dx, dy = origin(edge.dst)
        x1, y1 = sx + _NODE_W, sy + _NODE_H / 2
        x2, y2 = dx, dy + _NODE_H / 2
        bend = max(abs(x2 - x1) / 2, 24)
        title = f"{edge.kind} {edge.label}".strip()
        parts.append(
            f'<path class="edge {_e(edge.kind)}" data-src="{_e(edge.src)}" '
            f'data-dst="{_e(edge.dst)}" d="M{x1:.1f},{y1:.1f} C{x1 + bend:.1f},{y1:.1f} '
            f'{x2 - bend:.1f},{y2:.1f} {x2:.1f},{y2:.1f}" marker-end="url(#arrow)">'
            f"<title>{_e(title)}</title></path>"
        )
        if edge.label:
            # The middle of the curve (its control points are symmetric about it), a little
            # toward the target so the labels of edges meeting at one node stay apart.
            mx, my = x1 + (x2 - x1) * 0.6, y1 + (y2 - y1) * 0.6
            parts.append(
                f'<text class="edge-label {_e(edge.kind)}" data-src="{_e(edge.src)}" '
                f'data-dst="{_e(edge.dst)}" x="{mx:.1f}" y="{my - 3:.1f}" '
                f'text-anchor="middle">{_e(_clip(edge.label, 12))}</text>'
            )
    for node in nodes:
        x, y = origin(node.id)
        color = colors[node.group]
        body = (
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{_NODE_W}" height="{_NODE_H}" rx="6" '
            f'style="stroke:{color}"/>'
            f'<rect class="band" x="{x:.1f}" y="{y:.1f}" width="6" height="{_NODE_H}" '
            f'style="fill:{color}"/>'
            f'<text class="label" x="{x + 12:.1f}" y="{y + 18:.1f}">{_e(_clip(node.label, 24))}'
            f"</text>"
            f'<text class="sublabel" x="{x + 12:.1f}" y="{y + 34:.1f}">'
            f"{_e(_clip(node.sublabel, 28))}</text>"
            f"<title>{_e(node.label)} {_e(node.sublabel)}</title>"
        )
        if node.href:
            body = f'<a href="{_e(node.href)}">{body}</a>'
        muted = " muted" if node.muted else ""
        parts.append(
            f'<g class="node{muted}" data-id="{_e(node.id)}" data-group="{_e(node.group)}">'
            f"{body}</g>"
        )
    parts.append("</svg>")
    return "".join(parts)
