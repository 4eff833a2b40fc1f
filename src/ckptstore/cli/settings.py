"""CLI command ``ckpt config``: the resolved settings, where each came from, and no
credentials."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import typer
from rich.markup import escape

from ckptstore.cli.common import State
from ckptstore.cli.output import console, print_json, print_table
from ckptstore.redact import redact_setting

__all__ = ["config_cmd", "register"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def config_cmd(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Print the resolved settings and where each came from (argument, env, file, default).

    Fails (exit 1) where the settings point at no store: an embedded catalog that does not
    exist (`ckpt init` creates one). A catalog server is not contacted.

    Passwords in URLs and credential-like storage options are masked.

    JSON: {"config": {"path", "found_by"}, "settings": {name: {"value", "from", "detail"}}}.
    """
    from ckptstore.catalog.presence import require_store
    from ckptstore.config import resolve_settings

    state: State = ctx.obj
    resolved = resolve_settings(state.config, root=state.store)
    settings = resolved.settings
    require_store(settings, connect=False)  # a catalog server is not contacted
    report: dict[str, dict[str, Any]] = {}
    for name, origin in resolved.origins.items():
        value = getattr(settings, name)
        detail = origin.detail
        if name == "catalog_url" and value is None:
            value, detail = settings.resolved_catalog_url, "the embedded catalog under root"
        elif name == "hot" and value is None:
            value, detail = str(settings.hot_path), "<root>/hot"
        report[name] = {"value": redact_setting(_plain(value), name), "from": origin.kind,
                        "detail": detail}
    found = {"path": str(resolved.config) if resolved.config else None,
             "found_by": resolved.config_found_by or None}
    if as_json:
        print_json({"config": found, "settings": report})
        return
    if resolved.config is not None:
        console.print(f"config file: {resolved.config} ({resolved.config_found_by})",
                      markup=False, highlight=False, soft_wrap=True)
    else:
        console.print("config file: none (no --config, $CKPT_CONFIG or ./ckptstore.toml)",
                      markup=False, highlight=False)
    print_table(
        ["setting", "value", "from"],
        ((escape(name), escape(_display(row["value"])),
          escape(row["from"] + (f" ({row['detail']})" if row["detail"] else "")))
         for name, row in report.items()),
        no_wrap=("setting",),
    )


def _plain(value: Any) -> Any:
    """A setting as plain JSON-able data."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _display(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def register(app: typer.Typer) -> None:
    """Add ``config`` to the ``ckpt`` command."""
    app.command("config")(config_cmd)
