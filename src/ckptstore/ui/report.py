"""``ckpt report --html FILE``: every browser view in one self-contained static HTML file.

Links become in-page anchors; the CSS and all plots are inline, so the file can be mailed,
attached to an issue or archived next to a paper without a server. Checkpoint sections are
bounded (newest first) so the file stays readable for large catalogs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore.catalog import mask_url
from ckptstore.errors import StorageError
from ckptstore.ui.render import render
from ckptstore.ui.views import (
    MAX_GRAPH_SCAN,
    checkpoint_view,
    lineage_view,
    run_view,
    runs_view,
    tiers_view,
)

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = ["DEFAULT_MAX_CHECKPOINTS", "ReportLinks", "render_report", "write_report"]

logger = logging.getLogger(__name__)

#: Checkpoint sections in a report by default (newest committed first).
DEFAULT_MAX_CHECKPOINTS = 200


@dataclass(frozen=True)
class ReportLinks:
    """In-page anchors; checkpoints without a section get no link."""

    checkpoints: frozenset[str] = field(default_factory=frozenset)

    def runs(self) -> str:
        """``#runs``."""
        return "#runs"

    def run(self, name: str) -> str:
        """``#run-<name>`` (run names hold no spaces or quotes)."""
        return f"#run-{name}"

    def checkpoint(self, ckpt_id: str) -> str:
        """``#ckpt-<id>`` when the report has that section, else ``""``."""
        return f"#ckpt-{ckpt_id}" if ckpt_id in self.checkpoints else ""

    def lineage(self) -> str:
        """``#lineage``."""
        return "#lineage"

    def tiers(self) -> str:
        """``#tiers``."""
        return "#tiers"

    def compare(self, runs: Sequence[str], metric: str = "loss") -> str:
        """``""``: the comparison needs the live app (one page per choice of runs)."""
        return ""


def render_report(
    store: CheckpointStore, *, max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS
) -> str:
    """Render the runs list, lineage graph, tiers, every run and recent checkpoints.

    Args:
        store: The store to describe.
        max_checkpoints: Most checkpoint sections (newest committed first, plus the
            parents they link to).

    Returns:
        One HTML document with no external references.
    """
    everything = store.list(state=None, order_by="-created_at", limit=MAX_GRAPH_SCAN)
    committed = store.list(order_by="-created_at", limit=max(max_checkpoints, 1))
    chosen = [c.id for c in committed[:max_checkpoints]]
    # A section's "parent" link should work, so parents of included checkpoints come too.
    by_id = {c.id: c for c in everything}
    for cid in list(chosen):
        parent = by_id.get(cid)
        if parent is not None and parent.parent_id and parent.parent_id not in chosen:
            chosen.append(parent.parent_id)
    links = ReportLinks(frozenset(chosen))
    runs_page = runs_view(store, links)
    run_pages = [
        run_view(store, r["name"], links, all_checkpoints=everything) for r in runs_page["runs"]
    ]
    checkpoint_pages = []
    for cid in chosen:
        try:
            checkpoint_pages.append(checkpoint_view(store, cid, links))
        except Exception:  # one unreadable record must not lose the whole report
            logger.warning("skipping checkpoint %s in the report", cid, exc_info=True)
    total = sum(r["checkpoints"] for r in runs_page["runs"])
    return render(
        "report.html",
        links,
        title="Catalog report",
        store_label=mask_url(store.settings.resolved_catalog_url),
        generated=datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        runs_page=runs_page,
        lineage_page=lineage_view(store, links, all_checkpoints=everything),
        tiers_page=tiers_view(store, links, scan=False),
        run_pages=run_pages,
        checkpoint_pages=checkpoint_pages,
        omitted_checkpoints=max(total - len(committed[:max_checkpoints]), 0),
    )


def write_report(
    store: CheckpointStore,
    path: str | os.PathLike[str],
    *,
    max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS,
) -> Path:
    """Write :func:`render_report` to ``path`` (through a temp file, then renamed).

    Returns:
        The path written.

    Raises:
        StorageError: If the file cannot be written.
    """
    target = Path(path)
    text = render_report(store, max_checkpoints=max_checkpoints)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError(
            exc.errno or 0,
            f"cannot write the report to {target}: {exc.strerror or exc}; "
            "check that the directory exists and is writable",
        ) from exc
    return target
