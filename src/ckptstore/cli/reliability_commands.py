"""CLI commands for trust and repair: doctor, sign, verify-signature, export, import-bundle,
keygen.

Each calls one plain function of :mod:`ckptstore.ops` (doctor, signing, bundle). Wire them
into the app with ``reliability_commands.register(app)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptstore.cli.common import ascii_float, open_store
from ckptstore.cli.output import console, print_json

__all__ = ["register"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def doctor_cmd(
    ctx: typer.Context,
    fix: Annotated[bool, typer.Option("--fix", help="Apply the safe repairs.")] = False,
    deep: Annotated[
        bool, typer.Option("--deep", help="Re-hash every chunk (downloads remote copies).")
    ] = False,
    tier: Annotated[
        list[str] | None, typer.Option("--tier", help="Only this tier (repeatable).")
    ] = None,
    grace: Annotated[
        float, typer.Option(parser=ascii_float,
                     help="Leave unfinished files younger than this many seconds.")
    ] = 60.0,
    as_json: JsonOpt = False,
) -> None:
    """Reconcile the catalog with storage: rows without data, data without rows, damaged
    copies, dead saves and dead leases. Exits 1 while problems remain."""
    from ckptstore.ops.doctor import doctor

    with open_store(ctx) as store:
        report = doctor(store, fix=fix, deep=deep, tiers=tier, grace_s=grace)
    if as_json:
        print_json(report.to_dict())
    else:
        console.print(report.render(), markup=False, highlight=False)
    if not report.ok:
        raise typer.Exit(1)


def sign_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    key: Annotated[Path, typer.Option("--key", "-k", help="PEM Ed25519 private key.")],
) -> None:
    """Sign a checkpoint (its id and manifest digest) with an Ed25519 key."""
    from ckptstore.ops.signing import sign_checkpoint

    with open_store(ctx) as store:
        path = sign_checkpoint(store, ref, key)
    console.print(f"signed {ref}: {path}", markup=False, highlight=False)


def verify_signature_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    pubkey: Annotated[Path, typer.Option("--pubkey", "-p", help="PEM Ed25519 public key.")],
    deep: Annotated[bool, typer.Option("--deep", help="Also re-hash every chunk.")] = False,
) -> None:
    """Check that a checkpoint is signed by the given key and untouched since. Exits 1
    (with the reason) if it is unsigned, signed by another key, or tampered with."""
    from ckptstore.ops.signing import verify_signature

    with open_store(ctx) as store:
        verify_signature(store, ref, pubkey, deep=deep)
    console.print(f"{ref}: signature OK", markup=False, highlight=False)


def export_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Bundle file to write (.tar).")],
) -> None:
    """Write a checkpoint (and its signature, if any) as one bundle file."""
    from ckptstore.ops.bundle import export_bundle

    with open_store(ctx) as store:
        path = export_bundle(store, ref, out)
    console.print(f"wrote {path}", markup=False, highlight=False)


def import_bundle_cmd(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="Bundle file (.tar).")],
    run: Annotated[
        str | None, typer.Option("--run", "-r", help="File it under this run.")
    ] = None,
    require_signature: Annotated[
        Path | None,
        typer.Option("--require-signature", help="Refuse unless signed by this public key."),
    ] = None,
) -> None:
    """Import a bundle after checking every file in it (hostile bundles are refused)."""
    from ckptstore.ops.bundle import import_bundle

    with open_store(ctx) as store:
        ck = import_bundle(store, path, run=run, require_signature=require_signature)
    console.print(f"imported {path} as {ck.ref} ({ck.id})", markup=False, highlight=False)


def keygen_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the key files.")],
    name: Annotated[str, typer.Option(help="File name stem.")] = "ckpt-signing",
) -> None:
    """Create an Ed25519 key pair for `ckpt sign` (NAME.key, mode 0600) and checking
    (NAME.pub)."""
    from ckptstore.ops.signing import generate_keypair, key_fingerprint, load_public_key

    private, public = generate_keypair(out, name)
    fingerprint = key_fingerprint(load_public_key(public))
    console.print(f"private key: {private}\npublic key:  {public}\nfingerprint: {fingerprint}",
                  markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    """Add the trust-and-repair commands to the ``ckpt`` app."""
    app.command("doctor")(doctor_cmd)
    app.command("sign")(sign_cmd)
    app.command("verify-signature")(verify_signature_cmd)
    app.command("export")(export_cmd)
    app.command("import-bundle")(import_bundle_cmd)
    app.command("keygen")(keygen_cmd)
