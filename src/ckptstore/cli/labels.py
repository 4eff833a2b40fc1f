"""CLI commands that label checkpoints: alias, pin, unpin (what retention never prunes)."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptstore.cli.common import open_store
from ckptstore.cli.output import checkpoint_json, console, print_json

__all__ = ["alias_cmd", "pin_cmd", "register", "unpin_cmd"]

TextJsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def alias_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    name: Annotated[str, typer.Argument(help="Alias, e.g. prod or best.")],
    as_json: TextJsonOpt = False,
) -> None:
    """Point an alias at a checkpoint (aliased checkpoints are never pruned).

    JSON: {"alias": NAME, "checkpoint": the record, keys as in `ckpt ls --json`}.
    """
    with open_store(ctx) as store:
        store.alias(ref, name)
        ck = store.get(name)
    if as_json:
        print_json({"alias": name, "checkpoint": checkpoint_json(ck)})
        return
    console.print(f"{name} → {ck.ref} ({ck.id})")


def pin_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    as_json: TextJsonOpt = False,
) -> None:
    """Protect a checkpoint from retention pruning.

    JSON: the checkpoint's record (keys as in `ckpt ls --json`; "pinned" is true).
    """
    with open_store(ctx) as store:
        store.pin(ref)
        ck = store.get(ref)
    if as_json:
        print_json(checkpoint_json(ck))
        return
    console.print(f"pinned {ck.ref}")


def unpin_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    as_json: TextJsonOpt = False,
) -> None:
    """Remove a checkpoint's pin.

    JSON: the checkpoint's record (keys as in `ckpt ls --json`; "pinned" is false).
    """
    with open_store(ctx) as store:
        store.unpin(ref)
        ck = store.get(ref)
    if as_json:
        print_json(checkpoint_json(ck))
        return
    console.print(f"unpinned {ck.ref}")


def register(app: typer.Typer) -> None:
    """Add ``alias``, ``pin`` and ``unpin`` to the ``ckpt`` command."""
    app.command("alias")(alias_cmd)
    app.command("pin")(pin_cmd)
    app.command("unpin")(unpin_cmd)
