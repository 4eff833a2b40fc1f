"""The ``ckpt`` command: browse, query and manage a checkpoint store.

Exit codes: 0 success, 1 the operation failed (the message says why and what to do),
2 bad usage (unknown option, missing argument). With ``--json`` every command prints one JSON
document on stdout, a failure included: ``{"error": {"type": ..., "message": ...}}`` with the
same exit code.

This module is the command's root: global options, error handling and the query and
management commands; commands with a theme of their own live in the sibling modules and are
registered here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from rich.markup import escape

from ckptstore.cli import deltas, overview, prefetch, remote, transfer, trust
from ckptstore.cli.common import (
    State,
    ascii_float,
    ascii_int,
    configure_logging,
    install_global_options,
    open_store,
    parse_where,
)
from ckptstore.cli.output import (
    LS_COLUMNS,
    LS_WIDE_COLUMNS,
    checkpoint_row,
    console,
    err_console,
    human_bytes,
    print_error_json,
    print_json,
    print_table,
)
from ckptstore.errors import CkptError, InvalidNameError, ThawPendingError
from ckptstore.extras import extra_for, missing_extra

__all__ = ["app", "main"]

app = typer.Typer(
    name="ckpt",
    help=(
        "Manage PyTorch checkpoints: list, inspect, archive, prune, restore, convert.\n\n"
        "The store is chosen by --store PATH (a directory holding catalog.db and hot/), "
        "--config FILE (TOML; else $CKPT_CONFIG, else ./ckptstore.toml), and the CKPT_* "
        "variables ($CKPT_ROOT, $CKPT_CATALOG_URL, ...); default ./ckpt. `ckpt config` "
        "shows what was resolved. References: a uuid, run@latest, run@<step>, run@v<version>, "
        "run@best:<metric>[:max] or an alias. The global options (--store, --config, "
        "--verbose) go before or after the command name. Every command that prints a result "
        "takes --json.\n\n"
        "Exit codes: 0 done; 1 error (one line says what failed and what to do); 2 bad usage; "
        f"{prefetch.EXIT_THAW_PENDING} the checkpoint's only copy is in GLACIER and is "
        "thawing: retry later, or wait with `ckpt thaw REF --wait`."
    ),
    no_args_is_help=True,
    # --install-completion / --show-completion: tab completion for bash, zsh, fish, pwsh.
    add_completion=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Catalog schema migrations (Alembic).", no_args_is_help=True)
app.add_typer(db_app, name="db")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
TextJsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def version_text() -> str:
    """What ``ckpt --version`` prints: "ckpt" and the installed distribution's version."""
    try:
        version = importlib.metadata.version("ckptstore")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        from ckptstore import __version__ as version
    return f"ckpt {version}"


def _print_version(value: bool) -> None:
    if value:
        console.print(version_text(), markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    store: Annotated[
        str | None, typer.Option("--store", "-s", help="Store directory (default ./ckpt).")
    ] = None,
    config: Annotated[
        str | None,
        typer.Option("--config", "-c",
                     help="TOML config file (default $CKPT_CONFIG, else ./ckptstore.toml)."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True,
                     help="Print the version (ckpt <version>) and exit."),
    ] = False,
) -> None:
    configure_logging(verbose)
    ctx.obj = State(store=store, config=config, verbose=verbose)


# --------------------------------------------------------------------------- queries
@app.command("ls")
def ls_cmd(
    ctx: typer.Context,
    run: Annotated[str | None, typer.Option("--run", "-r", help="Only this run.")] = None,
    experiment: Annotated[str | None, typer.Option(help="Only runs of this experiment.")] = None,
    tag: Annotated[str | None, typer.Option(help="Only checkpoints with this tag.")] = None,
    min_step: Annotated[
        int | None, typer.Option(parser=ascii_int, help="Smallest step.")
    ] = None,
    max_step: Annotated[
        int | None, typer.Option(parser=ascii_int, help="Largest step.")
    ] = None,
    where: Annotated[
        list[str] | None,
        typer.Option(help="Metric filter such as 'loss<2.0' (repeatable; < <= > >= == !=)."),
    ] = None,
    tier: Annotated[str | None, typer.Option(help="Only checkpoints present on this tier.")] = None,
    order_by: Annotated[
        str, typer.Option(help="step, version, created_at, stored_bytes, run, metric:<name>; "
                               "prefix '-' for descending.")
    ] = "run",
    limit: Annotated[
        int | None, typer.Option(parser=ascii_int, help="At most this many rows.")
    ] = None,
    wide: Annotated[bool, typer.Option("--wide", "-w", help="Also show time and id.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """List committed checkpoints.

    JSON: a list of records with id, ref, run, step, version, state, kind, base_id,
    parent_id, created_at, metrics, tags, logical_bytes, stored_bytes, codec,
    manifest_digest, lossy, error_bound, lossy_scope, pinned, aliases and replicas (tier,
    state, bytes, verified_at, manifest_digest). Other commands print records of this shape.
    """
    metrics = dict(parse_where(w) for w in (where or []))
    step_range = (min_step, max_step) if min_step is not None or max_step is not None else None
    with open_store(ctx) as store:
        items = store.list(
            run=run,
            experiment=experiment,
            tag=tag,
            step_range=step_range,
            metrics=metrics or None,
            tier=tier,
            order_by=order_by,
            limit=limit,
        )
    if as_json:
        print_json([_ck_json(c) for c in items])
        return
    if not items:
        err_console.print("no checkpoints match")
        return
    print_table(
        LS_WIDE_COLUMNS if wide else LS_COLUMNS,
        (checkpoint_row(c, wide=wide) for c in items),
        no_wrap=("checkpoint", "step", "stored", "id", "created"),
    )


def _ck_json(ck: Any) -> dict[str, Any]:
    from ckptstore.ops.reading.show import checkpoint_dict

    return checkpoint_dict(ck)


@app.command("show")
def show_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    as_json: JsonOpt = False,
    tensors: Annotated[bool, typer.Option(help="Also list every tensor.")] = False,
) -> None:
    """Show a checkpoint: catalog record, manifest summary and how to reproduce it.

    JSON: {"checkpoint": the record (keys as in `ckpt ls --json`), "reproduction": the run's
    experiment, config, code_version, data_version, host, parents, metrics_at_save, edges,
    "manifest": format_version, codec, kind, tensors, dtypes, arrays, chunks, logical_bytes,
    stored_bytes, delta (or {"error": ...}), "tensors" with --tensors: [key, dtype, shape],
    "parts" for a checkpoint saved across hosts: every copy of every host's part (tier, part,
    stored_on (null on a shared tier), state, bytes, files, verified_at)}.
    """
    with open_store(ctx) as store:
        info = store.show(ref)
        if tensors:
            manifest = store.manifest(ref)
            info["tensors"] = [
                {"key": k, **_tensor_entry(v)} for k, v in manifest.tensors.items()
            ]
    if as_json:
        print_json(info)
        return
    ck = info["checkpoint"]
    man = info.get("manifest", {})
    rows = [
        ("id", ck["id"]),
        ("ref", ck["ref"]),
        ("run / step", f"{ck['run']} / {ck['step']}"),
        ("created", ck["created_at"]),
        ("kind", ck["kind"] + (f" (base {ck['base_id']})" if ck["base_id"] else "")),
        ("codec", ck["codec"]),
        ("bytes", f"{human_bytes(ck['logical_bytes'])} logical, "
                  f"{human_bytes(ck['stored_bytes'])} stored"),
        ("metrics", ", ".join(f"{k}={v}" for k, v in ck["metrics"].items()) or "-"),
        ("tags", ", ".join(ck["tags"]) or "-"),
        ("pinned / aliases", f"{ck['pinned']} / {', '.join(ck['aliases']) or '-'}"),
        ("replicas", ", ".join(f"{r['tier']}:{r['state']}" for r in ck["replicas"]) or "-"),
        *_part_rows(ck, info.get("parts") or []),
        ("lossy", f"yes, max abs error {ck['error_bound']} in {', '.join(ck['lossy_scope'])}"
                  if ck["lossy"] else "no"),
    ]
    if "error" in man:
        rows.append(("manifest", f"unreadable: {man['error']}"))
    elif man:
        rows.append(("tensors", f"{man['tensors']} in {man['arrays']} arrays, "
                                f"{man['chunks']} chunks"))
        rows.append(("dtypes", ", ".join(f"{k} x{v}" for k, v in man["dtypes"].items())))
    repro = info.get("reproduction") or {}
    for key in ("experiment", "code_version", "data_version", "host"):
        if repro.get(key):
            rows.append((key.replace("_", " "), str(repro[key])))
    if repro.get("config"):
        rows.append(("run config", str(repro["config"])))
    if repro.get("parents"):
        rows.append(("parent chain", " ← ".join(str(p) for p in repro["parents"])))
    rows.append(("restore with", f"ckpt restore {ck['ref']}  |  store.load({ck['ref']!r})"))
    print_table(["field", "value"], rows)
    if tensors:
        print_table(
            ["tensor", "dtype", "shape"],
            ((t["key"], t["dtype"], t["shape"]) for t in info["tensors"]),
        )


def _part_rows(ck: dict[str, Any], parts: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``ckpt show`` rows of a checkpoint saved across hosts: its hosts, then per tier each
    host's part and where its copies are."""
    if not ck.get("hosts"):
        return []
    rows = [("hosts", ", ".join(ck["hosts"]))]
    tiers: dict[str, dict[str, list[str]]] = {}
    for p in parts:
        where = p["stored_on"] or p["tier"]
        tiers.setdefault(p["tier"], {}).setdefault(p["part"], []).append(
            f"{where}:{p['state']}" if p["state"] != "PRESENT" else where)
    for tier, by_part in tiers.items():
        text = "; ".join(f"{part} on {', '.join(where)}" for part, where in sorted(by_part.items()))
        missing = [h for h in ck["hosts"] if h not in by_part]
        if missing:
            text += f"; missing: {', '.join(missing)}"
        rows.append((f"parts ({tier})", text))
    return rows


def _tensor_entry(entry: Any) -> dict[str, Any]:
    get = entry.get if isinstance(entry, dict) else lambda k, d=None: getattr(entry, k, d)
    return {"dtype": get("torch_dtype"), "shape": list(get("shape") or [])}


@app.command("runs")
def runs_cmd(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List runs with their checkpoint counts.

    JSON: a list of runs with name, created_at, experiment, config, code_version,
    data_version, host, status, checkpoints.
    """
    with open_store(ctx) as store:
        runs = store.runs()
    if as_json:
        print_json(runs)
        return
    print_table(
        ["run", "experiment", "checkpoints", "created", "code"],
        (
            (r.name, r.experiment or "-", r.checkpoints, r.created_at.strftime("%Y-%m-%d %H:%M"),
             (r.code_version or "-")[:12])
            for r in runs
        ),
    )


@app.command("lineage")
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
    """Show where a checkpoint came from (resumed / fine-tuned from), across runs.

    JSON: {"checkpoint": REF's record, "direction": "ancestors" or "descendants",
    "nodes": [records, nearest first], "edges": [{"from": ref, "to": ref}, ...]}; a record
    has the keys of `ckpt ls --json`.
    """
    if fmt not in ("tree", "dot", "mermaid"):
        raise InvalidNameError(f"unknown --format {fmt!r}; use tree, dot or mermaid")
    with open_store(ctx) as store:
        me = store.get(ref)
        chain = store.descendants(ref) if descendants else store.lineage(ref)
    nodes = [me, *chain]
    if as_json:
        known = {ck.id: ck for ck in nodes}
        print_json({
            "checkpoint": _ck_json(me),
            "direction": "descendants" if descendants else "ancestors",
            "nodes": [_ck_json(ck) for ck in chain],
            "edges": [{"from": known[ck.parent_id].ref, "to": ck.ref} for ck in nodes
                      if ck.parent_id in known],
        })
        return
    if fmt == "tree":
        for depth, ck in enumerate(nodes):
            arrow = "" if depth == 0 else ("└─ derived " if descendants else "└─ from ")
            indent = "   " * max(depth - 1, 0)
            console.print(f"{indent}{arrow}{ck.ref} (step {ck.step}, {ck.id[:8]})")
        return
    edges = []
    by_id = {ck.id: ck for ck in nodes}
    for ck in nodes:
        if ck.parent_id and ck.parent_id in by_id:
            edges.append((by_id[ck.parent_id].ref, ck.ref))
    if fmt == "dot":
        lines = ["digraph lineage {"]
        lines += [f'  "{a}" -> "{b}";' for a, b in edges]
        if not edges:
            lines.append(f'  "{me.ref}";')
        lines.append("}")
    else:
        lines = ["graph TD"]
        lines += [f'  {_mid(a)}["{a}"] --> {_mid(b)}["{b}"]' for a, b in edges]
        if not edges:
            lines.append(f'  {_mid(me.ref)}["{me.ref}"]')
    sys.stdout.write("\n".join(lines) + "\n")


def _mid(ref: str) -> str:
    return "n_" + "".join(c if c.isalnum() else "_" for c in ref)


@app.command("alias")
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
        print_json({"alias": name, "checkpoint": _ck_json(ck)})
        return
    console.print(f"{name} → {ck.ref} ({ck.id})")


@app.command("pin")
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
        print_json(_ck_json(ck))
        return
    console.print(f"pinned {ck.ref}")


@app.command("unpin")
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
        print_json(_ck_json(ck))
        return
    console.print(f"unpinned {ck.ref}")


@app.command("du")
def du_cmd(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Storage used by run and tier.

    JSON: a list of rows with run, tier, checkpoints, bytes.
    """
    with open_store(ctx) as store:
        rows = store.usage()
    if as_json:
        print_json(rows)
        return
    total = sum(r.bytes for r in rows)
    print_table(
        ["run", "tier", "checkpoints", "bytes"],
        [(r.run, r.tier, r.checkpoints, human_bytes(r.bytes)) for r in rows]
        + [("total", "", sum(r.checkpoints for r in rows), human_bytes(total))],
    )


@app.command("events")
def events_cmd(
    ctx: typer.Context,
    ref: Annotated[
        str | None, typer.Argument(help="Checkpoint reference (all if omitted).")
    ] = None,
    limit: Annotated[
        int, typer.Option(parser=ascii_int, help="At most this many events.")
    ] = 50,
    as_json: JsonOpt = False,
) -> None:
    """The audit log: saved, archived, pruned, restored, converted, verified.

    JSON: a list of events with kind, at, checkpoint_id, actor, detail, run.
    """
    with open_store(ctx) as store:
        events = store.events(ref, limit=limit)
    if as_json:
        print_json(events)
        return
    print_table(
        ["when", "event", "checkpoint", "actor", "detail"],
        (
            (e.at.strftime("%m-%d %H:%M:%S"), e.kind, (e.checkpoint_id or "-")[:8],
             (e.actor or "-").split(":")[0], _detail_text(e.detail))
            for e in events
        ),
        no_wrap=("when", "event", "checkpoint"),
    )


def _detail_text(detail: dict[str, Any], limit: int = 48) -> str:
    parts = [f"{k}={v}" for k, v in detail.items() if v not in (None, [], {}, "")]
    text = ", ".join(parts)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@app.command("gc")
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


# --------------------------------------------------------------------------- config
@app.command("config")
def config_cmd(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Print the resolved settings and where each came from (argument, env, file, default).

    Passwords in URLs and credential-like storage options are masked.

    JSON: {"config": {"path", "found_by"}, "settings": {name: {"value", "from", "detail"}}}.
    """
    from ckptstore.config import resolve_settings

    state: State = ctx.obj
    resolved = resolve_settings(state.config, root=state.store)
    settings = resolved.settings
    report: dict[str, dict[str, Any]] = {}
    for name, origin in resolved.origins.items():
        value = getattr(settings, name)
        detail = origin.detail
        if name == "catalog_url" and value is None:
            value, detail = settings.resolved_catalog_url, "the embedded catalog under root"
        elif name == "hot" and value is None:
            value, detail = str(settings.hot_path), "<root>/hot"
        report[name] = {"value": _redacted(_plain(value)), "from": origin.kind,
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


def _redacted(value: Any, key: str = "") -> Any:
    """``value`` without credentials: URL passwords and secret storage options masked."""
    from ckptstore.catalog import mask_url
    from ckptstore.storage.base import is_secret_option

    if key and is_secret_option(key) and value not in (None, ""):
        return "***"
    if isinstance(value, str):
        if "://" in value and "@" in value:
            value = mask_url(value)
        # A password passed as a URL query parameter (?password=...) is not part of userinfo.
        return _SECRET_QUERY.sub(lambda m: f"{m.group(1)}=***", value)
    if isinstance(value, dict):
        return {k: _redacted(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


_SECRET_QUERY = re.compile(r"(?i)\b(password|passwd|secret|token|sslpassword)=[^&\s]+")


def _display(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


# --------------------------------------------------------------------------- db
@db_app.command("upgrade")
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


@db_app.command("current")
def db_current(ctx: typer.Context, as_json: TextJsonOpt = False) -> None:
    """Show the catalog's current schema revision.

    JSON: {"catalog": URL (password masked), "revision": revision id, null when empty}.
    """
    from ckptstore.catalog import mask_url, migrate

    url = ctx.obj.settings().resolved_catalog_url
    revision = migrate.current(url)
    if as_json:
        print_json({"catalog": mask_url(url), "revision": revision})
        return
    console.print(revision or "empty (no schema)")


@db_app.command("history")
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


transfer.register(app)
trust.register(app)
overview.register(app)
deltas.register(app)
prefetch.register(app)
remote.register(app)
# Last, so that every command registered above gets them.
install_global_options(app)
# After them: `remote add` has a --config option of its own (the remote's config file).
remote.register_remote_group(app)


def _wants_json(args: Sequence[str]) -> bool:
    """Whether ``--json`` is among the options (not after a ``--`` separator)."""
    for arg in args:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def _fail(as_json: bool, kind: str, message: str, code: int) -> int:
    if as_json:
        print_error_json(kind, message)
    else:
        # One line whatever its length (soft_wrap: the terminal wraps it, rich does not), so
        # logs and grep see the whole message.
        err_console.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ckpt``; returns the exit code instead of raising.

    Usage errors exit 2; our own errors print one line saying what failed and what to do
    (exit 1; exit 75 for a checkpoint still thawing from GLACIER) instead of a traceback;
    a missing optional package names the extra to install.
    With ``--json`` both go to stdout as ``{"error": {"type": ..., "message": ...}}``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = _wants_json(args)
    try:
        command = typer.main.get_command(app)
        result = command.main(args=args, prog_name="ckpt", standalone_mode=False)
    except SystemExit as exc:  # shell completion exits by itself
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except typer.TyperException as exc:  # bad usage: unknown option, missing argument
        if as_json:
            print_error_json(type(exc).__name__, exc.format_message())
        elif callable(show := getattr(exc, "show", None)):
            show()  # usage line, hint and message, as typer prints them
        else:
            err_console.print(f"error: {exc.format_message()}", markup=False, soft_wrap=True)
        return exc.exit_code
    except typer.Abort:
        return _fail(as_json, "Aborted", "aborted", 1)
    except ThawPendingError as exc:  # a temporary state, told apart so scripts can retry
        return _fail(as_json, type(exc).__name__, str(exc), prefetch.EXIT_THAW_PENDING)
    except CkptError as exc:
        return _fail(as_json, type(exc).__name__, str(exc), 1)
    except ImportError as exc:  # an optional package that no library module checked for
        if exc.name and extra_for(exc.name):
            err = missing_extra(exc.name, "this command")
            return _fail(as_json, type(err).__name__, str(err), 1)
        raise
    except OSError as exc:  # anything our own layers did not wrap
        return _fail(as_json, type(exc).__name__, str(exc), 1)
    # standalone_mode=False hands back typer.Exit's code (or the command's None).
    return result if isinstance(result, int) else 0


if __name__ == "__main__":  # pragma: no cover
    os._exit(main())
