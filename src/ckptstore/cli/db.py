"""CLI command group ``ckpt db``: the catalog's schema migrations (Alembic)."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptstore.cli.output import console, print_json

__all__ = ["db_current", "db_history", "db_upgrade", "register"]

TextJsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def db_upgrade(ctx: typer.Context, as_json: TextJsonOpt = False) -> None:
    """Create or upgrade the catalog schema to the newest revision.

    JSON: {"catalog": URL (password masked), "revision": the revision it is now at}.
    """
    from ckptstore.catalog import mask_url, migrate

    url = ctx.obj.settings().resolved_catalog_url
    migrate.upgrade(url)
    if as_json:
        print_json({"catalog": mask_url(url), "revision": migrate.current(url)})
        return
    console.print(f"catalog at {mask_url(url)} is at head")


def db_current(ctx: typer.Context, as_json: TextJsonOpt = False) -> None:
    """Show the catalog's current schema revision.

    JSON: {"catalog": URL (password masked), "revision": revision id, null when empty}.
    """
    from ckptstore.catalog import mask_url, migrate
    from ckptstore.catalog.presence import require_store

    settings = ctx.obj.settings()
    # A missing embedded catalog is "no store at PATH", not a new, empty file to report on.
    require_store(settings, connect=False)
    url = settings.resolved_catalog_url
    revision = migrate.current(url)
    if as_json:
        print_json({"catalog": mask_url(url), "revision": revision})
        return
    console.print(revision or "empty (no schema)")


def db_history(as_json: TextJsonOpt = False) -> None:
    """List the schema revisions shipped with this version, oldest first.

    JSON: {"revisions": [{"revision", "down_revision", "message", "is_head"}, ...]}.
    """
    from ckptstore.catalog import migrate

    if as_json:
        print_json({"revisions": migrate.revisions()})
        return
    for line in migrate.history():
        console.print(line)

def register(app: typer.Typer) -> None:
    """Add the ``db`` group (upgrade, current, history) to the ``ckpt`` command."""
    group = typer.Typer(help="Catalog schema migrations (Alembic).", no_args_is_help=True)
    group.command("upgrade")(db_upgrade)
    group.command("current")(db_current)
    group.command("history")(db_history)
    app.add_typer(group, name="db")
