"""CLI commands that query the catalog: ls, show, runs, du, events (lineage:
:mod:`ckptstore.cli.lineage`).

Each reads through the store and prints a table for people or, with ``--json``, one JSON
document for scripts; none of them changes the store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckptstore.cli.common import ascii_int, open_catalog, open_core, parse_where
from ckptstore.cli.merge import merge_rows
from ckptstore.cli.output import (
    checkpoint_json,
    console,
    err_console,
    human_bytes,
    print_json,
    print_table,
)
from ckptstore.cli.reproduce import context_rows, runs_diff_cmd
from ckptstore.errors import UsageError

if TYPE_CHECKING:
    from ckptstore.records import Checkpoint

__all__ = [
    "du_cmd",
    "events_cmd",
    "ls_cmd",
    "ls_columns",
    "ls_row",
    "register",
    "runs_cmd",
    "show_cmd",
]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


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
        typer.Option(help="Metric filter such as 'loss<2.0', or config filter such as "
                          "'config.lr<1e-3' or 'config.optim==adam' (repeatable; "
                          "< <= > >= == !=)."),
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
    columns: Annotated[str | None, typer.Option(
        "--columns",
        help="Comma-separated columns to show, in order: checkpoint, step, stored, logical, "
             "tiers, tags, kind, created, id, and metric names (default: the fixed columns "
             "and every metric that fits the terminal).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List committed checkpoints, one column per metric (as many as fit; --columns picks).

    JSON: a list of records with id, ref, run, step, version, state, kind, base_id,
    parent_id, created_at, metrics, tags, logical_bytes, stored_bytes, codec,
    manifest_digest, lossy, error_bound, lossy_scope, pinned, aliases and replicas (tier,
    state, bytes, verified_at, manifest_digest). Other commands print records of this shape.
    """
    # config.<key> filters go to the run's recorded config; the rest are metric filters.
    configs = [w for w in (where or []) if w.lstrip().startswith("config.")]
    metrics = dict(parse_where(w) for w in (where or []) if w not in configs)
    step_range = (min_step, max_step) if min_step is not None or max_step is not None else None
    with open_catalog(ctx) as store:
        items = store.list(
            run=run,
            experiment=experiment,
            tag=tag,
            step_range=step_range,
            metrics=metrics or None,
            tier=tier,
            order_by=order_by,
            limit=limit,
            where=configs or None,
        )
    if as_json:
        print_json([checkpoint_json(c) for c in items])
        return
    if not items:
        err_console.print("no checkpoints match")
        return
    chosen, hidden = ls_columns(items, columns, wide=wide, width=console.width)
    print_table(chosen, (ls_row(c, chosen) for c in items),
                no_wrap=[c for c in chosen if c != "tags"])
    if hidden:
        err_console.print(f"not shown: {', '.join(hidden)} (choose columns with --columns)",
                          markup=False, highlight=False, soft_wrap=True)


#: What ``ckpt ls --columns`` accepts besides metric names, and how each cell reads.
_LS_CELLS: dict[str, Callable[[Checkpoint], str]] = {
    "checkpoint": lambda c: c.ref,
    "step": lambda c: str(c.step),
    "stored": lambda c: human_bytes(c.stored_bytes),
    "logical": lambda c: human_bytes(c.logical_bytes),
    "tiers": lambda c: ",".join(c.tiers) or "-",
    "tags": lambda c: " ".join([*c.tags, *(["pinned"] if c.pinned else []),
                                *(f"={a}" for a in c.aliases)]),
    "kind": lambda c: c.kind,
    "created": lambda c: c.created_at.strftime("%Y-%m-%d %H:%M"),
    "id": lambda c: c.id,
}
# Room a metric column takes (header or a 4-significant-digit value, and the gap).
_METRIC_WIDTH = 11


def ls_columns(items: Sequence[Checkpoint], columns: str | None, *, wide: bool,
               width: int) -> tuple[list[str], list[str]]:
    """The columns ``ckpt ls`` shows, and the metrics left out for want of room.

    Raises:
        UsageError: For a column that is neither a fixed one nor a metric of the rows.
    """
    metrics = sorted({name for c in items for name in c.metrics})
    if columns is not None:
        chosen = [c.strip() for c in columns.split(",") if c.strip()]
        unknown = [c for c in chosen if c not in _LS_CELLS and c not in metrics]
        if unknown or not chosen:
            raise UsageError(
                f"--columns: unknown column {', '.join(unknown) or '(none given)'}; use "
                f"{', '.join(_LS_CELLS)}" + (f" or a metric ({', '.join(metrics)})"
                                             if metrics else ""))
        return chosen, []
    fixed = ["checkpoint", "step", "stored", "tiers"]
    tail = ["tags", *(["created", "id"] if wide else [])]
    # Widths of the fixed columns as the rows fill them, so the metrics get the rest.
    used = sum(max(len(name), *(len(_LS_CELLS[name](c)) for c in items)) + 2
               for name in [*fixed, *tail])
    room = max(1, (width - used) // _METRIC_WIDTH) if not wide else len(metrics)
    shown = metrics[:room]
    return [*fixed, *shown, *tail], metrics[len(shown):]


def ls_row(ck: Checkpoint, columns: Sequence[str]) -> list[str]:
    """One row of ``ckpt ls``: the chosen columns' cells (a metric this checkpoint lacks:
    "-"; values rounded to 4 significant digits, exact in --json)."""
    return [_LS_CELLS[name](ck) if name in _LS_CELLS
            else (f"{ck.metrics[name]:.4g}" if name in ck.metrics else "-")
            for name in columns]


def show_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    as_json: JsonOpt = False,
    tensors: Annotated[bool, typer.Option(help="Also list every tensor.")] = False,
) -> None:
    """Show a checkpoint: catalog record, manifest summary and how to reproduce it.

    JSON: {"checkpoint": the record (keys as in `ckpt ls --json`), "reproduction": the run's
    experiment, config, code_version, data_version, host, parents, metrics_at_save, edges,
    context (how to reproduce: commit, branch, remote, dirty, change, command, cwd, config,
    data_version, python, torch, cuda, cudnn, platform, packages, lock, env, rng_seeds,
    world_size, notes; null when none was recorded),
    "manifest": format_version, codec, kind, tensors, dtypes, arrays, chunks, logical_bytes,
    stored_bytes, delta (or {"error": ...}), "copies": per copy tier, state, self_contained,
    reads (refs of the checkpoints whose chunks it reads), and for a sealed copy of an
    encrypted tier "encrypted": true and recipients (how many keys it was encrypted to),
    "tensors" with --tensors: [key, dtype, shape],
    "parts" for a checkpoint saved across hosts: every copy of every host's part (tier, part,
    stored_on (null on a shared tier), state, bytes, files, verified_at), "merge" for a
    merged checkpoint: method, accumulate, keys, weights_from_metric, inputs (id, ref,
    state, weight, position)}.
    """
    from ckptstore.ops.reading.show import show_checkpoint

    with open_core(ctx) as core:
        info = show_checkpoint(core, ref)
        if tensors:
            from ckptstore.ops.reading.load import read_any_manifest

            manifest = read_any_manifest(core, ref)
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
        *_copy_rows(info.get("copies") or []),
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
    if info.get("merge"):
        rows += merge_rows(info["merge"])
    rows += context_rows(repro.get("context"))
    rows.append(("reproduce with", f"ckpt reproduce {ck['ref']} --dir DIR"))
    rows.append(("restore with", f"ckpt restore {ck['ref']}  |  store.load({ck['ref']!r})"))
    print_table(["field", "value"], rows)
    if tensors:
        print_table(
            ["tensor", "dtype", "shape"],
            ((t["key"], t["dtype"], t["shape"]) for t in info["tensors"]),
        )


def _encrypted(recipients: object) -> str:
    """How ``show`` says a copy is sealed (an encrypted tier)."""
    if isinstance(recipients, int):
        return f", encrypted to {recipients} recipient{'' if recipients == 1 else 's'}"
    return ", encrypted"


def _copy_rows(copies: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One ``ckpt show`` row: per copy, self-contained or the checkpoints it reads."""
    if not copies:
        return []
    text = "; ".join(
        f"{c['tier']}: " + ("self-contained" if c["self_contained"]
                            else f"reads chunks of {', '.join(c['reads'])}")
        + (_encrypted(c.get("recipients")) if c.get("encrypted") else "")
        for c in copies)
    return [("copies", text)]


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


def runs_cmd(
    ctx: typer.Context,
    action: Annotated[
        str | None, typer.Argument(help="diff: compare runs A and B (config, code, "
                                        "environment).", show_default=False)
    ] = None,
    a: Annotated[str | None, typer.Argument(help="With diff: a run or checkpoint.",
                                            show_default=False)] = None,
    b: Annotated[str | None, typer.Argument(help="With diff: another one.",
                                            show_default=False)] = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs with their checkpoint counts; `ckpt runs diff A B` compares two.

    JSON: a list of runs with name, created_at, experiment, config, code_version,
    data_version, host, status, checkpoints; with diff: {"a", "b", "differences":
    [{"field", "a", "b"}]}.
    """
    if action is not None:
        if action != "diff" or a is None or b is None:
            raise typer.BadParameter("write `ckpt runs` or `ckpt runs diff A B`")
        runs_diff_cmd(ctx, a, b, as_json=as_json)
        return
    with open_catalog(ctx) as store:
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


def du_cmd(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Storage used by run and tier.

    JSON: a list of rows with run, tier, checkpoints, bytes.
    """
    with open_catalog(ctx) as store:
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
    with open_catalog(ctx) as store:
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


def register(app: typer.Typer) -> None:
    """Add ``ls``, ``show``, ``runs``, ``du`` and ``events`` to the ``ckpt`` command."""
    app.command("ls")(ls_cmd)
    app.command("show")(show_cmd)
    app.command("runs")(runs_cmd)
    app.command("du")(du_cmd)
    app.command("events")(events_cmd)
