"""CLI command ``ckpt gc``: remove the staging that dead saves left behind."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptstore.cli.common import ascii_float, open_store
from ckptstore.cli.output import console, print_json

__all__ = ["gc_cmd", "register"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def gc_cmd(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report.")] = False,
    older_than: Annotated[
        float, typer.Option(parser=ascii_float,
                            help="Hours after which a pending save of another host is dead.")
    ] = 24.0,
    as_json: JsonOpt = False,
) -> None:
    """Remove staging left by dead saves (never touches committed data).

    JSON: {"removed_dirs": [paths], "failed_rows": [ids marked FAILED], "dry_run"}.
    """
    with open_store(ctx) as store:
        report = store.gc(dry_run=dry_run, older_than_s=older_than * 3600)
    if as_json:
        print_json(report)
        return
    verb = "would remove" if dry_run else "removed"
    if report.empty:
        console.print("nothing to clean")
    for path in report.removed_dirs:
        console.print(f"{verb} {path}")
    for ckpt_id in report.failed_rows:
        console.print(f"{'would mark' if dry_run else 'marked'} {ckpt_id} FAILED")


def register(app: typer.Typer) -> None:
    """Add ``gc`` to the ``ckpt`` command."""
    app.command("gc")(gc_cmd)
