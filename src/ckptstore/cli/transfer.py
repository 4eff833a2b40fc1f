"""CLI commands that move checkpoint data: between tiers (archive, prune, restore, verify),
in and out of other formats (convert, import), and on a schedule (serve, and agent: one per
node of a cluster without shared disks).

Each parses its options, calls one function of :mod:`ckptstore.ops` (or
:mod:`ckptstore.convert` for files outside any store) and prints the result; no Prefect is
needed. ``ckpt serve`` is the one command that runs the flows under a Prefect server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ckptstore.cli.common import (
    ascii_float,
    ascii_int,
    open_store,
    progress_bar,
    quiet_logger,
    spinner,
)
from ckptstore.cli.output import console, err_console, human_bytes, print_json
from ckptstore.errors import UsageError
from ckptstore.numeric import counted, decimal_or_none, float_or_none

__all__ = ["register"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def _summary(report: Any) -> Any:
    if hasattr(report, "to_dict"):
        return report.to_dict()
    if hasattr(report, "__dataclass_fields__"):
        return {k: getattr(report, k) for k in report.__dataclass_fields__}
    return report


def archive_cmd(
    ctx: typer.Context,
    run: Annotated[str | None, typer.Option("--run", "-r", help="Only this run.")] = None,
    ref: Annotated[str | None, typer.Option(help="Only this checkpoint.")] = None,
    tier: Annotated[str, typer.Option(help="Destination tier.")] = "warm",
    reencode: Annotated[
        str | None,
        typer.Option(
            "--reencode",
            metavar="CODEC",
            help="Re-encode the copies with this codec preset (none, lz4, zstd-1, zstd-3; "
            "default: archive_codec from the config). Each copy is written self-contained in "
            "that codec, verified on the destination, and loads bit-exactly.",
        ),
    ] = None,
    demote_after_days: Annotated[
        float | None,
        typer.Option(parser=ascii_float,
                     help="Also move warm copies older than this many days to the cold tier."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Copy committed hot checkpoints to the warm tier (S3), verify them, record replicas.

    With --reencode (or archive_codec in the config) the copies are re-encoded with a
    stronger codec, e.g. zstd-3: slower to write, smaller to keep.

    JSON: {"archive": report, "demote": report or null}; a report has src, tier, archived
    (ids), removed (ids), skipped and failed (id -> reason), bytes, reencode, reencoded,
    not_reencoded.
    """
    from ckptstore.ops.tiering.archive import archive_checkpoints, demote_checkpoints
    from ckptstore.ops.tiering.reencode import check_codec

    if reencode is not None:
        check_codec(reencode)  # before opening anything: nothing is copied with a typo
    with open_store(ctx) as store:
        reencode = reencode or store.settings.archive_codec
        # The library announces the total (bytes to copy) once it has listed the candidates.
        with progress_bar(f"archiving to {tier}", enabled=not as_json) as advance:
            report = archive_checkpoints(
                store, run=run, ref=ref, tier=tier, reencode=reencode, progress=advance
            )
        demoted = None
        if demote_after_days is not None:
            with progress_bar("demoting to cold", enabled=not as_json) as advance:
                demoted = demote_checkpoints(
                    store, older_than_days=demote_after_days, progress=advance
                )
    if as_json:
        print_json({"archive": _summary(report), "demote": _summary(demoted)})
        return
    console.print(report.summary())
    for ckpt_id, why in report.failed.items():
        err_console.print(f"failed {ckpt_id}: {why}", markup=False)
    for ckpt_id, sizes in report.reencoded.items():
        console.print(
            f"re-encoded {ckpt_id} to {report.reencode}: chunks "
            f"{human_bytes(sizes['source_bytes'])} -> {human_bytes(sizes['bytes'])}",
            markup=False,
        )
    for ckpt_id, why in report.not_reencoded.items():
        console.print(f"not re-encoded {ckpt_id}: {why}", markup=False)
    if demoted is not None:
        console.print(demoted.summary())


def prune_cmd(
    ctx: typer.Context,
    run: Annotated[str | None, typer.Option("--run", "-r", help="Only this run.")] = None,
    tier: Annotated[str, typer.Option(help="Tier to prune.")] = "hot",
    keep_last: Annotated[
        int | None, typer.Option(parser=ascii_int, help="Keep the newest N per run.")
    ] = None,
    keep_every: Annotated[
        int | None, typer.Option(parser=ascii_int, help="Keep steps that are multiples of K.")
    ] = None,
    keep_best: Annotated[
        str | None, typer.Option(help="METRIC:min|max:N, e.g. val_loss:min:3.")
    ] = None,
    max_age_days: Annotated[
        float | None, typer.Option(parser=ascii_float, help="Delete older than this.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan only.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Apply the retention policy (from the config, overridden by options).

    Never deletes pinned or aliased checkpoints, the newest checkpoint of a run, a base that a
    kept delta needs, anything under a lease, or the last verified copy of a kept checkpoint.

    JSON: the plan and what was done: plan, executed, skipped, failed, freed_bytes.
    """
    from ckptstore.ops.tiering.retention import apply_retention
    from ckptstore.retention import RetentionPolicy

    with open_store(ctx) as store:
        policy = RetentionPolicy.from_settings(store.settings)
        overrides: dict[str, Any] = {}
        if keep_last is not None:
            overrides["keep_last"] = keep_last
        if keep_every is not None:
            overrides["keep_every"] = keep_every
        if max_age_days is not None:
            overrides["max_age_days"] = max_age_days
        if keep_best is not None:
            parts = keep_best.split(":")
            count = decimal_or_none(parts[2]) if len(parts) == 3 else None
            if count is None or parts[1] not in ("min", "max"):
                raise UsageError(
                    f"--keep-best {keep_best!r}: write METRIC:min|max:N, e.g. val_loss:min:3"
                )
            overrides["keep_best"] = (parts[0], parts[1], count)
        if overrides:
            from dataclasses import replace

            policy = replace(policy, **overrides)
        with spinner("planning retention" if dry_run else "pruning", enabled=not as_json):
            result = apply_retention(
                store, run=run, tier=tier, policy=policy, dry_run=dry_run
            )
    if as_json:
        print_json(_summary(result))
        return
    console.print(result.plan.render(), markup=False, highlight=False)
    if not dry_run:
        console.print(
            f"executed {len(result.executed)} action(s), freed {human_bytes(result.freed_bytes)}"
            f"; skipped {len(result.skipped)}, failed {len(result.failed)}"
        )
        for action, why in result.failed:
            err_console.print(f"failed: {action.describe()}: {why}", markup=False)
    if result.failed:
        raise typer.Exit(1)


def restore_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    to: Annotated[
        Path | None, typer.Option(help="Restore into this directory instead of the hot tier.")
    ] = None,
    key: Annotated[
        Path | None,
        typer.Option(help="X25519 private key that opens an encrypted tier copy "
                          "(default: $CKPT_DECRYPT_KEY, else decrypt_key)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Bring a checkpoint back from the fastest tier that has a verified copy.

    A copy on an encrypted tier (tiers.encrypt_to) is decrypted with --key (or
    $CKPT_DECRYPT_KEY, or decrypt_key) and checked chunk by chunk before it lands.

    JSON: {"checkpoint": the record (keys as in `ckpt ls --json`), "path": where it is now}.
    """
    from ckptstore.ops.tiering.restore import restore_checkpoint
    from ckptstore.records import checkpoint_dict

    with open_store(ctx) as store:
        ck = store.get(ref)
        with progress_bar(f"restoring {ck.ref}", ck.stored_bytes,
                          enabled=not as_json) as advance:
            path = restore_checkpoint(store, ref, to=to, progress=advance, key=key)
        ck = store.get(ck.id)
    if as_json:
        print_json({"checkpoint": checkpoint_dict(ck), "path": str(path)})
        return
    console.print(f"restored {ck.ref} to {path}")


def verify_cmd(
    ctx: typer.Context,
    ref: Annotated[str | None, typer.Argument(help="Checkpoint reference.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every checkpoint.")] = False,
    tier: Annotated[str | None, typer.Option(help="Only replicas on this tier.")] = None,
    repair: Annotated[bool, typer.Option(help="Repair damaged replicas from a good one.")] = True,
    signature: Annotated[
        bool, typer.Option("--signature", help="Check REF's Ed25519 signature instead.")
    ] = False,
    pubkey: Annotated[
        Path | None, typer.Option(help="Public key for --signature (PEM).")
    ] = None,
    key: Annotated[
        Path | None,
        typer.Option(help="X25519 private key: check encrypted tier copies in full "
                          "(default: $CKPT_DECRYPT_KEY, else decrypt_key)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-hash replicas; mark damaged ones DAMAGED and repair them from another replica.

    A copy on an encrypted tier (tiers.encrypt_to) is checked in full with a key (--key,
    $CKPT_DECRYPT_KEY or decrypt_key), else its envelope, objects and sizes; a damaged one
    is sealed again from the hot copy.

    Exit status 1 when a damaged replica is left (not repaired, or --no-repair). Each
    array's zarr.json is checked against the manifest's digests too: a changed document
    misleads plain Zarr readers even when every chunk is intact.

    With --signature --pubkey P: refuse (exit 1) unless REF is signed by that key and its
    data still matches the signed manifest digest.

    JSON: checked, ok, damaged (replica -> problems), repaired, unrepaired (replica ->
    reason), skipped; with --signature: {"ref", "id", "pubkey", "valid": true, "deep": true}.
    """
    from ckptstore.ops.upkeep.verify import verify_replicas

    if signature:
        from ckptstore.ops.sharing.signing import verify_signature

        if ref is None or pubkey is None:
            raise UsageError("--signature needs a checkpoint reference and --pubkey PATH")
        with open_store(ctx) as store:
            verify_signature(store, ref, pubkey, deep=True)
            ck = store.get(ref)
        if as_json:
            print_json({"ref": ck.ref, "id": ck.id, "pubkey": str(pubkey), "valid": True,
                        "deep": True})
            return
        console.print(f"{ref}: signature valid ({pubkey})")
        return
    if ref is None and not all_:
        raise UsageError("give a checkpoint reference or --all")
    # The report below names every damaged copy once; the library's own warnings about the
    # same copies (for logs of scheduled runs) would repeat it: shown only with --verbose.
    with open_store(ctx) as store, spinner("verifying replicas", enabled=not as_json), \
            quiet_logger("ckptstore.ops.upkeep.verify", unless=ctx.obj.verbose):
        report = verify_replicas(store, ref=ref, tier=tier, repair=repair, key=key)
    if as_json:
        print_json(_summary(report))
    else:
        console.print(
            f"checked {counted(len(report.checked), 'replica')}: {len(report.ok)} intact, "
            f"{len(report.damaged)} damaged, {len(report.repaired)} repaired, "
            f"{len(report.unrepaired)} unrepaired, {len(report.skipped)} skipped"
        )
        for name, problems in report.damaged.items():
            err_console.print(f"damaged {name}: {'; '.join(problems[:3])}", markup=False)
        for name, why in report.unrepaired.items():
            err_console.print(f"NOT repaired {name}: {why}", markup=False)
    if not report.clean:  # damage left behind, repaired or not tried (--no-repair)
        raise typer.Exit(1)


def convert_cmd(
    ctx: typer.Context,
    ref: Annotated[str | None, typer.Argument(help="Checkpoint reference to export.")] = None,
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="pt (alias pytorch), safetensors, hf or dcp.")
    ] = "pt",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output file/folder.")] = None,
    input_dir: Annotated[
        Path | None, typer.Option(help="Convert plain files in this folder (no store needed).")
    ] = None,
    output_dir: Annotated[Path | None, typer.Option(help="Where --input-dir results go.")] = None,
    keys: Annotated[
        list[str] | None, typer.Option(help="Only tensors matching this pattern (repeatable).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output.")] = False,
    codec: Annotated[
        str | None,
        typer.Option(help="Instead of exporting, rewrite REF with this codec as a new version."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a checkpoint to .pt / safetensors / a Hugging Face folder / DCP.

    safetensors, hf and dcp stream one tensor at a time (memory stays bounded); pt needs the
    whole state in memory because torch.save does.
    Without a store, convert every checkpoint file in a folder:
    `ckpt convert --input-dir D --output-dir O --format pytorch`.

    JSON: {"source": REF or the input folder, "format", "outputs": [paths], "bytes": total};
    with --codec: {"source": REF, "codec", "checkpoint": the new version's record (keys as
    in `ckpt ls --json`)}.
    """
    from ckptstore.ops.upkeep import convert

    fmt = "pt" if fmt == "pytorch" else fmt
    if fmt not in ("pt", "safetensors", "hf", "dcp"):
        raise UsageError(f"unknown --format {fmt!r}; use pt, safetensors, hf or dcp")
    if input_dir is not None:
        if output_dir is None:
            raise UsageError("--input-dir needs --output-dir")
        from ckptstore.convert.directory import convert_directory

        outputs = convert_directory(input_dir, output_dir, fmt)
        if as_json:
            print_json({"source": str(input_dir), "format": fmt,
                        "outputs": [str(p) for p in outputs],
                        "bytes": sum(_size(p) for p in outputs)})
            return
        for path in outputs:
            console.print(f"wrote {path}")
        return
    if ref is not None and codec is not None:
        from ckptstore.records import checkpoint_dict

        with open_store(ctx) as store:
            new = convert.convert_checkpoint(store, ref, codec=codec)
        if as_json:
            print_json({"source": ref, "codec": codec, "checkpoint": checkpoint_dict(new)})
            return
        console.print(f"{ref} re-encoded with {codec} as {new.ref} ({new.id})")
        return
    if ref is None or out is None:
        raise UsageError("give a checkpoint reference and --out PATH (or --input-dir)")
    with open_store(ctx) as store:
        ck = store.get(ref)
        with progress_bar(f"converting {ck.ref}", ck.logical_bytes,
                          enabled=not as_json) as advance:
            path = convert.export_checkpoint(
                store, ref, fmt, out, keys=keys, progress=advance, overwrite=overwrite
            )
    if as_json:
        print_json({"source": ck.ref, "format": fmt, "outputs": [str(path)],
                    "bytes": _size(path)})
        return
    console.print(f"wrote {path} ({human_bytes(_size(path))})")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def import_cmd(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help=".pt/.bin/.safetensors file, HF or DCP folder.")],
    run: Annotated[str, typer.Option("--run", "-r", help="Run to file it under.")],
    step: Annotated[int, typer.Option(parser=ascii_int, help="Step to record.")],
    fmt: Annotated[
        str | None, typer.Option("--format", "-f", help="pt, safetensors, hf or dcp (auto).")
    ] = None,
    tag: Annotated[list[str] | None, typer.Option(help="Tag (repeatable).")] = None,
    metric: Annotated[
        list[str] | None, typer.Option(help="Metric as NAME=VALUE (repeatable).")
    ] = None,
    parent: Annotated[str | None, typer.Option(help="Checkpoint it derives from.")] = None,
    codec: Annotated[str | None, typer.Option(help="Codec preset to store it with.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Import an existing checkpoint (never unpickles: .pt files load with weights_only).

    JSON: the new checkpoint's record (keys as in `ckpt ls --json`).
    """
    from ckptstore.ops.upkeep.convert import import_checkpoint
    from ckptstore.records import checkpoint_dict

    metrics: dict[str, float] = {}
    for item in metric or []:
        name, sep, value = item.partition("=")
        number = float_or_none(value)
        if number is None:
            sep = ""
        else:
            metrics[name] = number
        if not sep:
            raise UsageError(f"--metric {item!r}: write NAME=VALUE, e.g. loss=1.25")
    with open_store(ctx, create=True) as store, progress_bar(f"importing {path.name}",
                                                enabled=not as_json) as advance:
        ck = import_checkpoint(
            store, path, run=run, step=step, fmt=fmt, tags=tuple(tag or ()),
            metrics=metrics or None, parent=parent, codec=codec, progress=advance,
        )
    if as_json:
        print_json(checkpoint_dict(ck))
        return
    console.print(f"imported {path} as {ck.ref} ({ck.id})")


def serve_cmd(
    ctx: typer.Context,
    pool: Annotated[
        str | None,
        typer.Option(
            "--pool",
            metavar="NAME",
            help="Register the deployments on this Prefect process work pool (created if "
            "missing) and exit; then run `prefect worker start --pool NAME` on one or more "
            "worker hosts. Without --pool, this process serves the flows itself until "
            "interrupted.",
        ),
    ] = None,
) -> None:
    """Run every flow as a Prefect deployment with the schedules from the config.

    Needs a Prefect server (PREFECT_API_URL); training hooks then trigger the deployments.
    Without --pool, this command serves the flows until Ctrl-C. With --pool NAME it registers
    them on a process work pool and exits: any number of `prefect worker start --pool NAME`
    processes, on hosts with ckptstore installed, the same config file, the same catalog
    (PostgreSQL) and access to the tiers, then run them; catalog leases keep workers from
    copying or deleting a checkpoint twice.
    """
    import os

    from ckptstore.flows.registry import need_prefect

    need_prefect("ckpt serve")  # before any advice that only matters with Prefect installed
    if pool is not None:
        from ckptstore.flows.deployments import deploy_all

        registered = deploy_all(ctx.obj.settings(), pool)
        for deployment_name in sorted(registered):
            console.print(f"deployed {deployment_name} on work pool {pool}")
        console.print(
            f"start workers on the worker hosts: prefect worker start --pool {pool} "
            "--type process"
        )
        return
    if not os.environ.get("PREFECT_API_URL"):
        err_console.print(
            "warning: PREFECT_API_URL is not set; schedules only fire with a Prefect server "
            "(`prefect server start`)"
        )
    from ckptstore.flows.deployments import serve_all

    serve_all(ctx.obj.settings())


def agent_cmd(
    ctx: typer.Context,
    pool: Annotated[
        str,
        typer.Option("--pool", metavar="NAME",
                     help="Prefect process work pool (created if missing)."),
    ],
    interval: Annotated[
        float, typer.Option(help="Seconds between two heartbeats of this host.")
    ] = 30.0,
    maintenance_interval: Annotated[
        float,
        typer.Option(help="Seconds between two runs of this host's gc (its parts of pruned "
                     "checkpoints, files of failed saves)."),
    ] = 300.0,
    deploy: Annotated[
        bool, typer.Option(help="Register the deployments on the pool first.")
    ] = True,
    shared_hot: Annotated[
        bool,
        typer.Option("--shared-hot",
                     help="This node mounts the same hot tier as the others (one volume, "
                          "NFS): also run the pool's default queue (schedules, checkpoints "
                          "saved by a single process), which any such node can do."),
    ] = False,
) -> None:
    """Serve this node's work queue: run one per node of a cluster without shared disks.

    Registers the deployments on --pool, makes sure the pool has a work queue named after
    this host (CKPT_HOST, default the hostname) and runs a Prefect worker on it, so the
    flows that only this host can run (uploading or pruning the parts of distributed
    checkpoints its disk holds) run here. Records a heartbeat for the host every
    --interval seconds (`ckpt doctor` reports parts on hosts gone silent) and runs this
    host's gc every --maintenance-interval seconds. Runs until Ctrl-C or SIGTERM; needs
    PREFECT_API_URL and the same config file (and PostgreSQL catalog) on every node.
    """
    from ckptstore.flows.registry import need_prefect

    need_prefect("ckpt agent")
    from ckptstore.flows.agent import run_agent

    code = run_agent(ctx.obj.settings(), pool, interval_s=interval,
                     maintenance_s=maintenance_interval, deploy=deploy, shared_hot=shared_hot)
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add archive, prune, restore, verify, convert, import, serve and agent to the ``ckpt``
    app."""
    app.command("archive")(archive_cmd)
    app.command("prune")(prune_cmd)
    app.command("restore")(restore_cmd)
    app.command("verify")(verify_cmd)
    app.command("convert")(convert_cmd)
    app.command("import")(import_cmd)
    app.command("serve")(serve_cmd)
    app.command("agent")(agent_cmd)
