"""CLI commands for incremental checkpoints: what changed between two checkpoints
(``ckpt diff A B``) and rewriting a delta as a full checkpoint (``ckpt compact REF``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ckptstore.cli.common import open_store, progress_bar
from ckptstore.cli.output import (
    LS_COLUMNS,
    checkpoint_row,
    console,
    err_console,
    print_json,
    print_table,
)

if TYPE_CHECKING:
    from ckptstore.records import Checkpoint

__all__ = ["compact_cmd", "diff_cmd", "register"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def diff_cmd(
    ctx: typer.Context,
    a: Annotated[str, typer.Argument(help="First (older) checkpoint reference.")],
    b: Annotated[str, typer.Argument(help="Second (newer) checkpoint reference.")],
    all_tensors: Annotated[
        bool, typer.Option("--all", help="List unchanged tensors too.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Per tensor: elements and chunks changed between A and B, and the largest change.

    Tensors whose chunks hash the same on both sides are not read. Changes are bit-wise
    (NaN payloads and -0.0 count); the largest change is over finite differences.

    JSON: a, b, lossy, summary (tensors by status, elements, elements_changed,
    chunks_changed, max_abs_change) and tensors (one entry per tensor).
    """
    from ckptstore.ops.upkeep.diff import diff_checkpoints, render_rows

    with open_store(ctx) as store:
        report = diff_checkpoints(store, a, b)
    if as_json:
        print_json(report.to_dict())
        return
    summary = report.summary()
    counts = ", ".join(f"{n} {status}" for status, n in sorted(summary["tensors"].items()))
    console.print(f"{report.a} -> {report.b}: {counts or 'no tensors'}")
    console.print(
        f"elements changed: {summary['elements_changed']:,} of {summary['elements']:,}; "
        f"chunks changed: {summary['chunks_changed']}; "
        f"largest change: {summary['max_abs_change']:.3g}"
        + ("  (lossy checkpoint: includes quantization error)" if report.lossy else "")
    )
    rows = render_rows(report, all_tensors=all_tensors)
    if rows:
        print_table(
            ["tensor", "status", "dtype", "shape", "elements changed", "chunks", "max |Δ|"],
            rows,
            no_wrap=("status", "dtype", "chunks", "max |Δ|"),
        )


def compact_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference (a delta).")],
    as_json: JsonOpt = False,
) -> None:
    """Rewrite a delta checkpoint as a full one: a new version of the same run and step.

    The new version reads no other checkpoint's chunks (its bases may then be pruned) and
    gets a converted-from edge from the source. Running it again returns the same version.
    Nothing moves silently: a note says when run@latest now names the new version, and
    which aliases and pin stay with the source.

    JSON: the compacted checkpoint's record (keys as in `ckpt ls --json`) and "notes".
    """
    from ckptstore.ops.upkeep.compact import compact_checkpoint
    from ckptstore.records import checkpoint_dict

    with open_store(ctx) as store, progress_bar(f"compacting {ref}",
                                                enabled=not as_json) as advance:
        src = store.get(ref)
        latest_before = store.get(f"{src.run}@latest")
        new = compact_checkpoint(store, ref, progress=advance)
        latest_after = store.get(f"{src.run}@latest")
    notes = _compact_notes(src, new, latest_before, latest_after)
    if as_json:
        print_json({**checkpoint_dict(new), "notes": notes})
        return
    print_table(LS_COLUMNS, [checkpoint_row(new)], no_wrap=("checkpoint", "step", "stored"))
    for note in notes:
        err_console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)


def _compact_notes(src: Checkpoint, new: Checkpoint, latest_before: Checkpoint,
                   latest_after: Checkpoint) -> list[str]:
    """What a compaction changed besides adding a version, said out loud: ``@latest`` now
    naming the new version, and the aliases and pin that stay with the source."""
    if new.id == src.id:
        return []
    notes = []
    if latest_after.id != latest_before.id:
        notes.append(f"{src.run}@latest now names {latest_after.ref} (was "
                     f"{latest_before.ref}); load a version by name (run@vN) or an alias "
                     "to keep reading the one you chose")
    if src.aliases:
        notes.append(f"alias{'es' if len(src.aliases) > 1 else ''} "
                     f"{', '.join(src.aliases)} still name{'' if len(src.aliases) > 1 else 's'} "
                     f"{src.ref}; move {'them' if len(src.aliases) > 1 else 'it'} with "
                     f"`ckpt alias {new.ref} NAME` if the compacted copy should be used")
    if src.pinned:
        notes.append(f"{src.ref} stays pinned; {new.ref} is not (`ckpt pin {new.ref}`)")
    return notes


def register(app: typer.Typer) -> None:
    """Add ``diff`` and ``compact`` to the ``ckpt`` command."""
    app.command("diff")(diff_cmd)
    app.command("compact")(compact_cmd)
