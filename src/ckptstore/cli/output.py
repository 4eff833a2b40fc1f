"""Rendering for the ``ckpt`` command: rich tables for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from ckptstore.numeric import human_bytes
from ckptstore.records import Checkpoint
from ckptstore.redact import scrub

__all__ = [
    "LS_COLUMNS",
    "LS_WIDE_COLUMNS",
    "checkpoint_json",
    "checkpoint_row",
    "console",
    "err_console",
    "human_bytes",
    "print_error",
    "print_error_json",
    "print_json",
    "print_table",
]

console = Console()
err_console = Console(stderr=True)


def _default(obj: object) -> Any:
    if isinstance(obj, datetime):
        return obj.isoformat()
    if hasattr(obj, "__dataclass_fields__"):
        return {k: getattr(obj, k) for k in obj.__dataclass_fields__}
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def print_json(data: Any) -> None:
    """Write ``data`` as indented JSON to stdout (dataclasses and datetimes supported)."""
    sys.stdout.write(json.dumps(data, default=_default, indent=2, sort_keys=False) + "\n")


def print_error_json(kind: str, message: str) -> None:
    """Write a failure as ``{"error": {"type": ..., "message": ...}}`` to stdout (``--json``).

    The message is scrubbed of credentials first (:func:`ckptstore.redact.scrub`): it may
    quote a driver's or a backend's own text.

    Args:
        kind: The error's class name (``CheckpointNotFoundError``, ``UsageError``, ...).
        message: What failed and what to do, as the text output says it.
    """
    print_json({"error": {"type": kind, "message": scrub(message)}})


def print_error(message: str) -> None:
    """Write a failure as one ``error: ...`` line to stderr, scrubbed of credentials.

    One line whatever its length (soft_wrap: the terminal wraps it, rich does not), so logs
    and grep see the whole message.
    """
    err_console.print(f"error: {scrub(message)}", markup=False, highlight=False,
                      soft_wrap=True)


def print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    title: str | None = None,
    no_wrap: Sequence[str] = (),
) -> None:
    """Print a compact table that stays readable at 80 columns.

    Args:
        columns: Header names.
        rows: Cell values.
        title: Optional title.
        no_wrap: Columns that must stay on one line (references, numbers).
    """
    table = Table(title=title, show_edge=False, pad_edge=False, header_style="bold")
    for col in columns:
        table.add_column(col, overflow="fold", no_wrap=col in no_wrap)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    console.print(table)


def _metrics_text(metrics: dict[str, float], limit: int = 2) -> str:
    items = list(metrics.items())[:limit]
    text = " ".join(f"{k}={v:.4g}" for k, v in items)
    return text + (" …" if len(metrics) > limit else "")


LS_COLUMNS = ["checkpoint", "step", "stored", "tiers", "metrics", "tags"]
LS_WIDE_COLUMNS = [*LS_COLUMNS, "created", "id"]


def checkpoint_row(ck: Checkpoint, *, wide: bool = False) -> list[str]:
    """The columns ``ckpt ls`` shows for one checkpoint (fits 80 columns unless ``wide``)."""
    flags = " ".join((["pinned"] if ck.pinned else []) + [f"={a}" for a in ck.aliases])
    row = [
        ck.ref,
        str(ck.step),
        human_bytes(ck.stored_bytes),
        ",".join(ck.tiers) or "-",
        _metrics_text(ck.metrics, limit=1 if not wide else 4),
        (" ".join(ck.tags) + (" " + flags if flags else "")).strip(),
    ]
    if wide:
        row += [ck.created_at.strftime("%Y-%m-%d %H:%M"), ck.id]
    return row


def checkpoint_json(ck: Checkpoint) -> dict[str, Any]:
    """A checkpoint as ``ckpt ls --json`` prints it (the record every command shares)."""
    from ckptstore.records import checkpoint_dict

    return checkpoint_dict(ck)
