"""CLI commands that give an overview of the store: the health of its tiers (``ckpt tiers``),
the catalog browser (``ckpt ui``) and its static report (``ckpt report``).

None of them changes the catalog. ``tiers --probe`` writes and deletes one probe blob per
tier under ``.ckpt-probe/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ckptstore.cli.common import ascii_int, open_store
from ckptstore.cli.output import console, err_console, human_bytes, print_json, print_table
from ckptstore.errors import UsageError

__all__ = ["register"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.0f} MB/s"


def tiers_cmd(
    ctx: typer.Context,
    probe: Annotated[
        bool,
        typer.Option(
            "--probe",
            help="Measure write/read throughput with a temporary blob (64 MiB local, "
            "16 MiB S3), deleted afterwards.",
        ),
    ] = False,
    probe_mib: Annotated[
        int | None,
        typer.Option(parser=ascii_int, help="Probe blob size in MiB (default by backend)."),
    ] = None,
    hosts: Annotated[
        bool,
        typer.Option("--hosts", help="Also list every host: its last heartbeat and the parts "
                     "of distributed checkpoints it holds, per tier."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Each configured tier: reachable, free space, objects and bytes held, throughput.

    Columns: up (reachable), free (local tiers), objects and listed bytes (a listing of the
    tier), catalog (checkpoints / bytes the catalog records as present there).
    With --probe, each rate is flagged against what the tier's role needs (hot > 1 GB/s,
    archive > 100 MB/s). Exits with 1 when a tier is unreachable.

    JSON: one object per tier (name, url, reachable, free_bytes, objects, listed_bytes,
    catalog_checkpoints, catalog_bytes, probe, error). With --hosts: {"tiers": that list,
    "hosts": one object per host (name, first_seen, last_seen, age_s, role, gone, stores:
    tier -> {checkpoints, bytes} of part copies on its disk, parts: tier -> {checkpoints,
    bytes} of copies of its parts anywhere)}.
    """
    from ckptstore.observability.tiers import tier_statuses

    if probe_mib is not None and not 1 <= probe_mib <= 4096:
        raise UsageError(f"--probe-mib must be between 1 and 4096, got {probe_mib}")
    with open_store(ctx) as store:
        statuses = tier_statuses(
            store.settings,
            store.usage(),
            listing=True,
            probe=probe,
            probe_bytes=probe_mib * 2**20 if probe_mib else None,
        )
        from ckptstore.ops.reading.show import hosts_overview

        host_rows = hosts_overview(store) if hosts else []
    healthy = all(s.reachable for s in statuses)
    if as_json:
        tiers_json = [s.to_dict() for s in statuses]
        print_json({"tiers": tiers_json, "hosts": host_rows} if hosts else tiers_json)
    else:
        columns = ["tier", "up", "free", "objects", "listed", "catalog"]
        if probe:
            columns += ["write", "read", "role"]
        rows = []
        for s in statuses:
            row = [
                s.name,
                "yes" if s.reachable else "NO",
                human_bytes(s.free_bytes),
                "-" if s.objects is None else str(s.objects),
                human_bytes(s.listed_bytes),
                f"{s.catalog_checkpoints} / {human_bytes(s.catalog_bytes)}",
            ]
            if probe:
                p = s.probe
                row += (
                    [_rate(p.write_bytes_per_s), _rate(p.read_bytes_per_s),
                     "ok" if p.ok else "SLOW"]
                    if p else ["-", "-", "-"]
                )
            rows.append(row)
        print_table(columns, rows)
        # Long text goes below the table, one line per tier, so the table stays readable at
        # 80 columns.
        for s in statuses:
            console.print(f"{s.name}: {s.url}", markup=False, highlight=False)
            if s.probe is not None and not s.probe.ok:
                console.print(f"  {s.probe.verdict}", markup=False, highlight=False)
            if s.error:
                err_console.print(f"  {s.name}: {s.error}", markup=False, highlight=False)
        if hosts:
            _print_hosts(host_rows)
    if not healthy:
        raise typer.Exit(1)


def _print_hosts(rows: list[dict[str, Any]]) -> None:
    """Hosts: last heartbeat, then per tier what their disks hold and where their parts are."""
    if not rows:
        console.print("no host has saved or sent a heartbeat yet")
        return

    def per_tier(by_tier: dict[str, dict[str, int]]) -> str:
        return ", ".join(f"{t}: {v['checkpoints']} ({human_bytes(v['bytes'])})"
                         for t, v in by_tier.items()) or "-"

    print_table(
        ["host", "last seen", "role", "disk holds", "its parts"],
        [
            [r["name"],
             "-" if r["age_s"] is None else f"{r['age_s']:.0f} s ago" + (" GONE" if r["gone"]
                                                                          else ""),
             r["role"] or "-", per_tier(r["stores"]), per_tier(r["parts"])]
            for r in rows
        ],
    )


def ui_cmd(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Loopback address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(parser=ascii_int, help="TCP port.")] = 8787,
) -> None:
    """Browse the catalog in a web browser (read-only; bound to this machine only)."""
    from ckptstore.ui.app import check_loopback, serve

    check_loopback(host)
    with open_store(ctx) as store:
        err_console.print(f"catalog browser on http://{host}:{port}/ (Ctrl-C stops it)")
        serve(store, host=host, port=port)


def report_cmd(
    ctx: typer.Context,
    html: Annotated[
        Path, typer.Option("--html", help="Write a self-contained HTML report to this file.")
    ],
    max_checkpoints: Annotated[
        int, typer.Option(help="Most checkpoint sections (newest first).")
    ] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Write the browser's views (runs, lineage, tiers, checkpoints) as one static file.

    JSON: {"path": the HTML file, "bytes": its size}.
    """
    from ckptstore.ui.report import write_report

    if max_checkpoints < 0:
        raise UsageError(f"--max-checkpoints must be >= 0, got {max_checkpoints}")
    with open_store(ctx) as store:
        path = write_report(store, html, max_checkpoints=max_checkpoints)
    if as_json:
        print_json({"path": str(path), "bytes": path.stat().st_size})
        return
    console.print(f"wrote {path} ({human_bytes(path.stat().st_size)})")


def register(app: typer.Typer) -> None:
    """Add ``tiers``, ``ui`` and ``report`` to the ``ckpt`` command."""
    app.command("tiers")(tiers_cmd)
    app.command("ui")(ui_cmd)
    app.command("report")(report_cmd)
