"""What each page of the catalog browser shows, gathered from the store as plain data.

Shared by the live app and the static report: a view function takes the store and a
:class:`Links` (how to link to another page) and returns a dict the templates render. Views
only read; nothing here changes the catalog or the tiers.

One function per page, all here: each is short, and together they are the one place that
says what the browser shows.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import shlex
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote, urlencode

from ckptstore.catalog.config_filter import CONFIG_OPS, parse_config_filter
from ckptstore.errors import CkptError, InvalidNameError
from ckptstore.names import validate_metric_name, validate_name
from ckptstore.numeric import rounded
from ckptstore.ops.reading.prefetch import PREFETCH_EVENTS, prefetch_by_host
from ckptstore.ops.reading.reproduce import how_to_reproduce
from ckptstore.ops.reading.show import hosts_overview, part_dict
from ckptstore.ops.upkeep.history import ALERT_EVENT
from ckptstore.records import Checkpoint, CheckpointState, Event
from ckptstore.ui.svg import (
    CurveMarker,
    CurveSeries,
    Edge,
    Node,
    PlotPoint,
    curve_plot,
    dag_svg,
    group_colors,
    line_plot,
)

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = [
    "CURVE_POINTS",
    "MAX_COMPARE",
    "MAX_GRAPH_NODES",
    "MAX_PLOTS",
    "AppLinks",
    "Links",
    "checkpoint_view",
    "compare_view",
    "lineage_view",
    "restore_snippets",
    "run_view",
    "runs_view",
    "tiers_view",
]

logger = logging.getLogger(__name__)

#: Metric plots on a run page (the rest are listed in the table).
MAX_PLOTS = 6
#: Checkpoints read for the lineage graph (newest first); older ones are left out.
MAX_GRAPH_SCAN = 5000
#: Boxes drawn in the lineage graph.
MAX_GRAPH_NODES = 300
#: Points drawn per training curve (the catalog may hold more; neighbours merge for display).
CURVE_POINTS = 600
#: Loss alerts read per run for its curve.
MAX_ALERTS = 500
#: Runs overlaid on one comparison plot.
MAX_COMPARE = 8
#: Prefetch figures on the tiers page count the newest this many events of each kind.
PREFETCH_WINDOW = 2000
_HISTORY_STATES = frozenset(
    {CheckpointState.COMMITTED, CheckpointState.DELETING, CheckpointState.DELETED}
)


class Links(Protocol):
    """How pages link to each other (URLs in the app, anchors in the static report)."""

    def runs(self) -> str:
        """The runs list."""
        ...

    def run(self, name: str) -> str:
        """One run's page."""
        ...

    def checkpoint(self, ckpt_id: str) -> str:
        """One checkpoint's page; ``""`` when the page is not available."""
        ...

    def lineage(self) -> str:
        """The lineage graph."""
        ...

    def tiers(self) -> str:
        """The tiers and usage page."""
        ...

    def compare(self, runs: Sequence[str], metric: str = "loss") -> str:
        """The training curves of ``runs`` overlaid; ``""`` when the page is not available."""
        ...


@dataclass(frozen=True)
class AppLinks:
    """URLs of the live app."""

    def runs(self) -> str:
        """``/``."""
        return "/"

    def run(self, name: str) -> str:
        """``/runs/<name>``."""
        return f"/runs/{quote(name, safe='')}"

    def checkpoint(self, ckpt_id: str) -> str:
        """``/checkpoints/<id>``."""
        return f"/checkpoints/{quote(ckpt_id, safe='')}"

    def lineage(self) -> str:
        """``/lineage``."""
        return "/lineage"

    def tiers(self) -> str:
        """``/tiers``."""
        return "/tiers"

    def compare(self, runs: Sequence[str], metric: str = "loss") -> str:
        """``/compare?run=a&run=b[&metric=m]``."""
        query = [("run", r) for r in runs] + ([("metric", metric)] if metric != "loss" else [])
        return "/compare" + (f"?{urlencode(query)}" if query else "")


def _metric_text(metrics: dict[str, float], limit: int = 3) -> str:
    items = sorted(metrics.items())[:limit]
    text = " ".join(f"{k}={v:.4g}" for k, v in items)
    return text + (" …" if len(metrics) > limit else "")


# --------------------------------------------------------------------------- runs
def runs_view(store: CheckpointStore, links: Links, *, q: str = "", sort: str = "name",
              where: str = "") -> dict[str, Any]:
    """The runs list: each run with its size, newest checkpoint, tiers and config.

    Args:
        store: The store.
        links: Link builder.
        q: Keep runs whose name, experiment or code version contains this text.
        sort: One of :data:`RUN_SORTS`, ``-`` prefixed to descend.
        where: Config filters (``config.lr<1e-3``; several joined by ``,``), evaluated
            like ``store.list(where=...)``.

    Returns:
        ``{"runs": [...], "total_bytes", "total_checkpoints", "config_columns", "q",
        "sort", "where", "sorts"}``.

    Raises:
        InvalidNameError: For an unknown sort key or a bad filter.
    """
    usage = store.usage()
    bytes_by_run: dict[str, int] = defaultdict(int)
    tiers_by_run: dict[str, set[str]] = defaultdict(set)
    for row in usage:
        bytes_by_run[row.run] += row.bytes
        tiers_by_run[row.run].add(row.tier)
    rows: list[dict[str, Any]] = []
    for info in store.runs():
        latest: Checkpoint | None = None
        if info.checkpoints:
            try:
                latest = store.catalog.latest(info.name)
            except CkptError:
                latest = None
        rows.append(
            {
                "name": info.name,
                "href": links.run(info.name),
                "experiment": info.experiment,
                "checkpoints": info.checkpoints,
                "created_at": info.created_at,
                "code_version": info.code_version,
                "bytes": bytes_by_run.get(info.name, 0),
                "tiers": sorted(tiers_by_run.get(info.name, ())),
                "latest": latest,
                "latest_href": links.checkpoint(latest.id) if latest else "",
                "latest_metrics": _metric_text(latest.metrics) if latest else "",
                "config": info.config,
                "status": run_status(info),
            }
        )
    rows = _filter_runs(rows, q=q, where=where)
    rows = _sort_runs(rows, sort)
    columns = sorted({k for r in rows for k, v in (r["config"] or {}).items()
                      if not isinstance(v, dict | list)})[:MAX_CONFIG_COLUMNS]
    for r in rows:
        r["config_cells"] = [_cell((r["config"] or {}).get(k)) for k in columns]
    return {
        "runs": rows,
        "total_bytes": sum(r.bytes for r in usage),
        "total_checkpoints": sum(r["checkpoints"] for r in rows),
        "config_columns": columns,
        "q": q,
        "sort": sort,
        "where": where,
        "sorts": [*RUN_SORTS, *(f"-{k}" for k in RUN_SORTS)],
    }


#: Keys the runs list sorts by.
RUN_SORTS = ("name", "created", "checkpoints", "stored", "experiment")
#: The most config keys shown as columns of the runs list.
MAX_CONFIG_COLUMNS = 8


def run_status(info: Any) -> str:
    """The status shown for a run: ``closed`` once its manager closed it (the catalog's
    ``runs.status``), else ``active``."""
    return str(info.status or "active")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _filter_runs(rows: list[dict[str, Any]], *, q: str, where: str) -> list[dict[str, Any]]:
    if q:
        needle = q.lower()
        rows = [r for r in rows if any(needle in (r.get(k) or "").lower()
                                       for k in ("name", "experiment", "code_version"))]
    for text in (w.strip() for w in where.split(",") if w.strip()):
        key, (op, value) = parse_config_filter(text)
        rows = [r for r in rows if _config_match(r["config"], key, op, value)]
    return rows


def _config_match(config: dict[str, Any] | None, key: str, op: str, value: Any) -> bool:
    """Python twin of the catalog's config filters (catalog/config_filter.py)."""
    current: Any = config or {}
    for part in key.split(".")[1:]:
        if not isinstance(current, dict) or part not in current:
            return False
        current = current[part]
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if numeric != (isinstance(current, int | float) and not isinstance(current, bool)):
        return False
    if not numeric and op not in ("==", "!="):
        raise InvalidNameError(f"{key}: strings compare with == or !=, not {op}")
    return bool(CONFIG_OPS[op](current, value))


def _sort_runs(rows: list[dict[str, Any]], sort: str) -> list[dict[str, Any]]:
    descending = sort.startswith("-")
    key = sort.lstrip("-") or "name"
    if key not in RUN_SORTS:
        raise InvalidNameError(f"cannot sort runs by {sort!r}; use one of "
                               f"{', '.join(RUN_SORTS)} (prefix '-' to descend)")
    field = {"created": "created_at", "stored": "bytes"}.get(key, key)
    return sorted(rows, key=lambda r: (r[field] is None, r[field] or ""), reverse=descending) \
        if field == "experiment" else sorted(rows, key=lambda r: r[field], reverse=descending)


# --------------------------------------------------------------------------- one run
def _ck_row(ck: Checkpoint, links: Links) -> dict[str, Any]:
    return {
        "ck": ck,
        "href": links.checkpoint(ck.id),
        "metrics": _metric_text(ck.metrics),
        "tiers": ",".join(ck.tiers) or "-",
        "flags": (["pinned"] if ck.pinned else []) + [f"@{a}" for a in ck.aliases],
    }


def run_view(
    store: CheckpointStore,
    name: str,
    links: Links,
    *,
    all_checkpoints: Iterable[Checkpoint] | None = None,
) -> dict[str, Any]:
    """One run: its record, checkpoints table, metric plots and cross-run lineage.

    Args:
        store: The store.
        name: Run name.
        links: Link builder.
        all_checkpoints: Every catalogued checkpoint, if the caller already has them (the
            report reads them once for all runs); used to find runs derived from this one.

    Returns:
        ``{"run", "checkpoints", "plots", "other_states", "parents", "children"}``.

    Raises:
        CheckpointNotFoundError: If the run does not exist.
        InvalidNameError: If the name is not a valid run name.
    """
    info = store.catalog.get_run(name)
    cks = store.list(run=name, order_by="step")
    history = store.list(run=name, state=None, order_by="step")
    other_states = Counter(str(c.state) for c in history if c.state != CheckpointState.COMMITTED)
    metric_names = sorted({m for c in cks for m in c.metrics})
    plots = []
    for metric in metric_names[:MAX_PLOTS]:
        points = [
            PlotPoint(float(c.step), float(c.metrics[metric]), c.ref, links.checkpoint(c.id))
            for c in cks
            if metric in c.metrics
        ]
        plots.append({"metric": metric, "svg": line_plot(points, title=metric)})
    own = {c.id for c in history}
    parents: dict[str, Checkpoint] = {}
    for ck in history:
        if ck.parent_id and ck.parent_id not in own and ck.parent_id not in parents:
            try:
                parents[ck.parent_id] = store.catalog.get_any(ck.parent_id)
            except CkptError:
                logger.debug("parent %s of %s is gone", ck.parent_id, ck.ref)
    if all_checkpoints is None:
        all_checkpoints = store.list(state=None, order_by="-created_at", limit=MAX_GRAPH_SCAN)
    children = [c for c in all_checkpoints if c.parent_id in own and c.run != name]
    curves, alerts = _run_curves(store, name, cks, links)
    compare_with = [
        {"run": other, "href": links.compare([name, other])}
        for other in _runs_with_history(store) if other != name
    ]
    contexts = store.catalog.run_contexts(name)
    context = how_to_reproduce(contexts[-1]) if contexts else None
    return {
        "context": context,
        "config_rows": _config_rows(context["config"] if context else info.config),
        "curves": curves,
        "alerts": alerts[:20],
        "alert_count": len(alerts),
        "compare_links": [c for c in compare_with if c["href"]][:MAX_COMPARE * 2],
        "run": info,
        "checkpoints": [_ck_row(c, links) for c in cks],
        "metric_names": metric_names,
        "plots": plots,
        "more_metrics": metric_names[MAX_PLOTS:],
        "other_states": dict(sorted(other_states.items())),
        "parents": [
            {"ck": p, "href": links.checkpoint(p.id), "run_href": links.run(p.run)}
            for p in parents.values()
        ],
        "children": [
            {"ck": c, "href": links.checkpoint(c.id), "run_href": links.run(c.run)}
            for c in sorted(children, key=lambda c: (c.run, c.version))
        ],
    }


def _config_rows(config: Any) -> list[tuple[str, str]]:
    """A config as (dotted key, value) rows for a table."""
    if not isinstance(config, dict):
        return []
    rows: list[tuple[str, str]] = []

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            rows.append((prefix, _cell(value) if not isinstance(value, list) else
                         json.dumps(value)))

    walk(config, "")
    return rows


# --------------------------------------------------------------------------- curves
def _alerts(store: CheckpointStore, run: str) -> list[Event]:
    try:
        return store.catalog.events(run=run, kind=ALERT_EVENT, limit=MAX_ALERTS)
    except CkptError:
        logger.debug("alerts of %s unavailable", run, exc_info=True)
        return []


def _runs_with_history(store: CheckpointStore, metric: str = "loss") -> list[str]:
    try:
        return store.catalog.metric_history_runs(metric)
    except CkptError:
        logger.debug("metric history unavailable", exc_info=True)
        return []


def _markers(run: str, cks: Iterable[Checkpoint], alerts: Iterable[Event], metric: str,
             links: Links) -> list[CurveMarker]:
    """Checkpoints of ``run`` and its alerts on ``metric`` as curve markers."""
    out = [
        CurveMarker(run, float(c.step), f"{c.ref}: checkpoint at step {c.step}",
                    href=links.checkpoint(c.id) or None)
        for c in cks
    ]
    for event in alerts:
        detail = event.detail
        step = detail.get("step")
        if not isinstance(step, int) or detail.get("metric", "loss") != metric:
            continue
        value = detail.get("loss")
        out.append(CurveMarker(
            run, float(step), f"{detail.get('kind', 'alert')} at step {step}: "
            f"{rounded(detail.get('reason', ''))}",
            y=float(value) if isinstance(value, int | float) else None, kind="alert",
        ))
    return out


def _run_curves(store: CheckpointStore, run: str, cks: Sequence[Checkpoint], links: Links
                ) -> tuple[list[dict[str, Any]], list[Event]]:
    """The run's training curves (one per recorded metric) and its loss alerts."""
    try:
        names = store.catalog.metric_history_names(run)
    except CkptError:
        logger.debug("metric history of %s unavailable", run, exc_info=True)
        return [], []
    alerts = _alerts(store, run) if names else []
    color = group_colors([run])[run]
    curves = []
    for metric in names[:MAX_PLOTS]:
        points = store.catalog.metric_history(run, metric, max_points=CURVE_POINTS)
        markers = _markers(run, cks, alerts, metric, links)
        curves.append({
            "metric": metric,
            "logged": sum(p.count for p in points),
            "svg": curve_plot([CurveSeries(run, points, color)], title=metric,
                              markers=markers),
        })
    return curves, alerts


def compare_view(
    store: CheckpointStore, runs: Sequence[str], links: Links, *, metric: str = "loss",
    log: bool = False,
) -> dict[str, Any]:
    """Several runs' training curves overlaid on one plot, with their checkpoints and alerts.

    Args:
        store: The store.
        runs: Run names (duplicates dropped; at most :data:`MAX_COMPARE`).
        links: Link builder.
        metric: The series to compare.
        log: Draw the values on a log10 scale (values <= 0 are left out).

    Returns:
        ``{"svg", "runs", "metric", "metrics", "toggles", "truncated", "log",
        "log_href", "config_diff"}``; ``svg`` is empty when no run is chosen;
        ``config_diff``: ``[{"key", "values": [per run]}]`` for every config key whose
        value differs among the runs.

    Raises:
        CheckpointNotFoundError: If a run does not exist.
        InvalidNameError: If a run or metric name is invalid.
    """
    metric = validate_metric_name(metric)
    chosen = list(dict.fromkeys(validate_name(r) for r in runs))
    truncated = len(chosen) > MAX_COMPARE
    chosen = chosen[:MAX_COMPARE]
    colors = group_colors(chosen)
    series: list[CurveSeries] = []
    markers: list[CurveMarker] = []
    rows = []
    metrics: set[str] = set()
    for run in chosen:
        store.catalog.get_run(run)  # a clear "no such run" before anything is drawn
        metrics.update(store.catalog.metric_history_names(run))
        points = store.catalog.metric_history(run, metric, max_points=CURVE_POINTS)
        cks = store.list(run=run, order_by="step")
        alerts = _alerts(store, run)
        run_markers = _markers(run, cks, alerts, metric, links)
        if log:
            points = [_log_point(p) for p in points]
            run_markers = [dataclasses.replace(m, y=_log10(m.y) if m.y is not None else None)
                           for m in run_markers]
        series.append(CurveSeries(run, points, colors[run]))
        markers += run_markers
        others = [r for r in chosen if r != run]
        rows.append({
            "name": run, "href": links.run(run), "color": colors[run],
            "logged": sum(p.count for p in points), "checkpoints": len(cks),
            "alerts": sum(1 for a in alerts if a.detail.get("metric", "loss") == metric),
            "remove_href": links.compare(others, metric),
        })
    available = _runs_with_history(store, metric)
    href = links.compare(chosen, metric)
    title = f"log10({metric})" if log else metric
    return {
        "svg": curve_plot(series, title=title, markers=markers) if series else "",
        "log": log,
        "log_href": (href + ("&" if "?" in href else "?") + "log=1") if href and not log
        else href,
        "config_diff": _config_diff(store, chosen),
        "runs": rows,
        "metric": metric,
        "metrics": [
            {"name": m, "href": links.compare(chosen, m), "current": m == metric}
            for m in sorted(metrics | {metric})
        ],
        "toggles": [
            {"name": r, "href": links.compare([*chosen, r], metric)}
            for r in available if r not in chosen
        ][:50],
        "truncated": truncated,
    }


def _log10(value: float) -> float:
    return math.log10(value) if value > 0 else math.nan


def _log_point(p: Any) -> Any:
    """A history point on a log10 scale (non-positive values become NaN: not drawn)."""
    return dataclasses.replace(p, mean=_log10(p.mean), min=_log10(p.min), max=_log10(p.max),
                               last=_log10(p.last))


def _config_diff(store: CheckpointStore, runs: Sequence[str]) -> list[dict[str, Any]]:
    """Config keys whose values differ among ``runs`` (each run's recorded config)."""
    if len(runs) < 2:
        return []
    flat = [dict(_config_rows(store.catalog.get_run(r).config)) for r in runs]
    keys = sorted(set().union(*flat))
    return [{"key": k, "values": [f.get(k, "-") for f in flat]}
            for k in keys if len({f.get(k, "-") for f in flat}) > 1]


# --------------------------------------------------------------------------- checkpoint
def restore_snippets(store: CheckpointStore, ref: str) -> dict[str, str]:
    """The exact command and Python lines that restore ``ref`` from this store.

    Returns:
        ``{"cli": "ckpt --store ... restore <ref>", "python": "..."}``.
    """
    settings = store.settings
    if settings.source is not None:
        where = f"--config {shlex.quote(str(settings.source))}"
        open_args = f"config={str(settings.source)!r}"
    else:
        root = str(settings.root.resolve())
        where = f"--store {shlex.quote(root)}"
        open_args = repr(root)
    cli = f"ckpt {where} restore {shlex.quote(ref)}"
    python = (
        "from ckptstore import CheckpointStore\n\n"
        f"with CheckpointStore.open({open_args}) as store:\n"
        f"    state = store.load({ref!r})\n"
        "    # model.load_state_dict(state['model'])  # or store.load(ref, into=state)"
    )
    return {"cli": cli, "python": python}


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return len(text) == 36


def _neighbour(ck: Checkpoint, links: Links, relation: str) -> dict[str, Any]:
    return {
        "ck": ck,
        "relation": relation,
        "href": links.checkpoint(ck.id),
        "run_href": links.run(ck.run),
    }


def checkpoint_view(store: CheckpointStore, ckpt_id: str, links: Links) -> dict[str, Any]:
    """One checkpoint: record, manifest summary, replicas, lineage neighbours, restore.

    Args:
        store: The store.
        ckpt_id: The checkpoint id (any state: pruned checkpoints keep their page), or a
            reference such as ``run-a@latest``.
        links: Link builder.

    Returns:
        A dict for ``_checkpoint.html``.

    Raises:
        CheckpointNotFoundError: If no checkpoint has this id.
    """
    # An id (any state: pruned checkpoints keep their page) or a reference (run-a@latest).
    ck = store.catalog.get_any(ckpt_id) if _is_uuid(ckpt_id) else store.get(ckpt_id)
    manifest: dict[str, Any] | None = None
    manifest_error: str | None = None
    reproduction: dict[str, Any] = {}
    merge: dict[str, Any] | None = None
    if ck.state == CheckpointState.COMMITTED:
        try:
            info = store.show(ck.id)
        except CkptError as exc:
            manifest_error = str(exc)
        else:
            found = info.get("manifest") or {}
            if "error" in found:
                manifest_error = str(found["error"])
            else:
                manifest = found
            reproduction = info.get("reproduction") or {}
            merge = info.get("merge")
    else:
        manifest_error = f"the checkpoint is {ck.state}; its data is no longer readable"
    neighbours: list[dict[str, Any]] = []
    if ck.parent_id:
        try:
            neighbours.append(_neighbour(store.catalog.get_any(ck.parent_id), links, "parent"))
        except CkptError:
            logger.debug("parent %s of %s is gone", ck.parent_id, ck.id)
    if ck.base_id and ck.base_id != ck.parent_id:
        try:
            neighbours.append(_neighbour(store.catalog.get_any(ck.base_id), links, "delta base"))
        except CkptError:
            logger.debug("base %s of %s is gone", ck.base_id, ck.id)
    if ck.state == CheckpointState.COMMITTED:
        try:
            for child in store.catalog.descendants(ck.id):
                if child.parent_id == ck.id:
                    neighbours.append(_neighbour(child, links, "child"))
        except CkptError:
            logger.debug("descendants of %s unavailable", ck.id, exc_info=True)
    try:
        edges = store.catalog.links(ck.id)
    except CkptError:
        edges = []
    for link in edges:
        other, relation = (
            (link.dst, f"{link.kind} (derived)") if link.src == ck.id else (link.src, link.kind)
        )
        if link.weight is not None:
            relation += f" · weight {link.weight:.4g}"
        try:
            neighbours.append(_neighbour(store.catalog.get_any(other), links, relation))
        except CkptError:
            logger.debug("edge end %s is gone", other)
    try:
        events = store.catalog.events(ck.id, limit=20)
    except CkptError:
        events = []
    parts: list[dict[str, Any]] = []
    if ck.parted:
        try:
            parts = [part_dict(p) for p in store.catalog.parts(ck.id)]
        except CkptError:
            logger.debug("parts of %s unavailable", ck.id, exc_info=True)
    return {
        "ck": ck,
        "parts": parts,
        "run_href": links.run(ck.run),
        "manifest": manifest,
        "manifest_error": manifest_error,
        "reproduction": reproduction,
        "merge": merge,
        "neighbours": neighbours,
        "events": events,
        "restore": restore_snippets(store, ck.ref),
        "restorable": ck.state == CheckpointState.COMMITTED,
    }


# --------------------------------------------------------------------------- lineage
def _all_edges(store: CheckpointStore, ids: Iterable[str]) -> list[Edge]:
    """Derivation edges among ``ids`` (converted-from, merged-from with its weight...)."""
    try:
        links = store.catalog.links_among(ids)
    except CkptError:
        # The graph still shows parent links and run lanes without the derivation edges.
        logger.warning("derivation edges unavailable for the lineage graph", exc_info=True)
        return []
    return [Edge(link.src, link.dst, link.kind, _weight_text(link.weight)) for link in links]


def _weight_text(weight: float | None) -> str:
    return "" if weight is None else f"w={weight:.3g}"


def lineage_view(
    store: CheckpointStore,
    links: Links,
    *,
    all_checkpoints: Iterable[Checkpoint] | None = None,
) -> dict[str, Any]:
    """The lineage graph across runs.

    Nodes are the checkpoints that take part in lineage (a parent, a child, or an end of a
    derivation edge) plus each run's newest committed checkpoint; consecutive nodes of one
    run are joined by a dotted "same run" edge so each run reads as a lane.

    Returns:
        ``{"svg", "legend", "nodes", "edges", "truncated", "runs_left_out"}``.
    """
    if all_checkpoints is None:
        all_checkpoints = store.list(state=None, order_by="-created_at", limit=MAX_GRAPH_SCAN)
    by_id = {c.id: c for c in all_checkpoints if c.state in _HISTORY_STATES}
    involved: set[str] = set()
    edges: list[Edge] = []
    for ck in by_id.values():
        if ck.parent_id and ck.parent_id in by_id:
            involved.update((ck.id, ck.parent_id))
            edges.append(Edge(ck.parent_id, ck.id, "parent"))
    for edge in _all_edges(store, by_id):
        involved.update((edge.src, edge.dst))
        edges.append(edge)
    # Each run's newest committed checkpoint joins too, so every run shows up as a lane that
    # ends at its current head (a run without lineage is a single box).
    heads: dict[str, Checkpoint] = {}
    for ck in by_id.values():
        if ck.state == CheckpointState.COMMITTED:
            head = heads.get(ck.run)
            if head is None or (ck.step, ck.version) > (head.step, head.version):
                heads[ck.run] = ck
    involved.update(c.id for c in heads.values())
    chosen = sorted((by_id[i] for i in involved), key=lambda c: c.created_at, reverse=True)
    truncated = len(chosen) > MAX_GRAPH_NODES
    chosen = sorted(chosen[:MAX_GRAPH_NODES], key=lambda c: (c.run, c.step, c.version))
    keep = {c.id for c in chosen}
    edges = [e for e in edges if e.src in keep and e.dst in keep]
    lanes: dict[str, list[Checkpoint]] = defaultdict(list)
    for ck in chosen:
        lanes[ck.run].append(ck)
    for lane in lanes.values():
        for before, after in itertools.pairwise(lane):
            edges.append(Edge(before.id, after.id, "same-run"))
    nodes = [
        Node(
            id=c.id,
            label=c.ref,
            sublabel=f"step {c.step}" + (f" · {_metric_text(c.metrics, 1)}" if c.metrics else ""),
            href=links.checkpoint(c.id) or None,
            group=c.run,
            muted=c.state != CheckpointState.COMMITTED,
        )
        for c in chosen
    ]
    colors = group_colors(list(lanes))
    all_runs = {c.run for c in by_id.values() if c.state == CheckpointState.COMMITTED}
    return {
        "svg": dag_svg(nodes, edges, title="checkpoint lineage across runs"),
        "legend": [
            {"run": run, "color": colors[run], "href": links.run(run)} for run in sorted(lanes)
        ],
        "nodes": len(nodes),
        "edges": len(edges),
        "truncated": truncated,
        "runs_left_out": [
            {"run": run, "href": links.run(run)} for run in sorted(all_runs - set(lanes))
        ],
    }


# --------------------------------------------------------------------------- tiers
def tiers_view(store: CheckpointStore, links: Links, *, scan: bool = False) -> dict[str, Any]:
    """Usage by run and tier, and the health of each configured tier.

    Args:
        store: The store.
        links: Link builder.
        scan: Also list each tier to count objects (one LIST pass per tier).

    Returns:
        ``{"usage", "tiers", "tiers_error", "scan", "hosts", "prefetch",
        "prefetch_window"}`` (hosts: see :func:`ckptstore.ops.reading.show.hosts_overview`;
        prefetch: :func:`ckptstore.ops.reading.prefetch.prefetch_by_host` over the newest
        ``prefetch_window`` events of each kind).
    """
    from ckptstore.observability.tiers import tier_statuses

    usage = store.usage()
    tiers_error: str | None = None
    try:
        statuses = tier_statuses(store.settings, usage, listing=scan)
    except CkptError as exc:
        statuses, tiers_error = [], str(exc)
    try:
        hosts = hosts_overview(store)
    except CkptError:
        hosts = []
    return {
        "hosts": hosts,
        "prefetch": prefetch_by_host([
            event for kind in PREFETCH_EVENTS
            for event in store.catalog.events(kind=kind, limit=PREFETCH_WINDOW)
        ]),
        "prefetch_window": PREFETCH_WINDOW,
        "usage": [
            {"row": r, "href": links.run(r.run)} for r in usage
        ],
        "total_bytes": sum(r.bytes for r in usage),
        "tiers": statuses,
        "tiers_error": tiers_error,
        "scan": scan,
    }
