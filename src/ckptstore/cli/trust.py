"""CLI commands for trust and repair: doctor, sign, verify-signature, export, import-bundle,
keygen.

Each parses its options, calls :mod:`ckptstore.ops` (doctor, signing, bundle) and prints the
result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptstore.cli.common import ascii_float, open_store, progress_bar
from ckptstore.cli.output import console, human_bytes, print_json

__all__ = ["register"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
EncryptToOpt = Annotated[
    list[Path] | None,
    typer.Option("--encrypt-to", metavar="PUBKEY",
                 help="Encrypt for this X25519 public key (`ckpt keygen --encryption --out DIR`; "
                      "repeatable): only its private key can read the copy."),
]
DecryptKeyOpt = Annotated[
    Path | None,
    typer.Option("--key", metavar="KEY",
                 help="X25519 private key that opens encrypted copies (default: "
                      "$CKPT_DECRYPT_KEY, else the config's decrypt_key)."),
]


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
    key: DecryptKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reconcile the catalog with storage: rows without data, data without rows, damaged
    copies, dead saves and dead leases. Exits 1 while problems remain. With --deep and a
    decryption key, encrypted copies are decrypted and every chunk checked too.

    JSON: ok, fix, checked (what -> count), findings (kind, subject, detail, tier, fixable,
    fixed, error).
    """
    from ckptstore.ops.upkeep.doctor import doctor

    with open_store(ctx) as store, progress_bar("checking copies", enabled=not as_json,
                                                unit="items") as advance:
        report = doctor(store, fix=fix, deep=deep, tiers=tier, grace_s=grace, progress=advance,
                        key=key)
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
    as_json: JsonOpt = False,
) -> None:
    """Sign a checkpoint (its id and manifest digest) with an Ed25519 key.

    JSON: {"ref", "id", "signature": path of the SIGNATURE file}.
    """
    from ckptstore.ops.sharing.signing import sign_checkpoint

    with open_store(ctx) as store:
        path = sign_checkpoint(store, ref, key)
        ck = store.get(ref)
    if as_json:
        print_json({"ref": ck.ref, "id": ck.id, "signature": str(path)})
        return
    console.print(f"signed {ref}: {path}", markup=False, highlight=False)


def verify_signature_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    pubkey: Annotated[Path, typer.Option("--pubkey", "-p", help="PEM Ed25519 public key.")],
    deep: Annotated[bool, typer.Option("--deep", help="Also re-hash every chunk.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check that a checkpoint is signed by the given key and untouched since. Exits 1
    (with the reason) if it is unsigned, signed by another key, or tampered with.

    JSON: {"ref", "id", "pubkey", "valid": true, "deep"}; a failed check is the error
    object, exit 1.
    """
    from ckptstore.ops.sharing.signing import verify_signature

    with open_store(ctx) as store:
        verify_signature(store, ref, pubkey, deep=deep)
        ck = store.get(ref)
    if as_json:
        print_json({"ref": ck.ref, "id": ck.id, "pubkey": str(pubkey), "valid": True,
                    "deep": deep})
        return
    console.print(f"{ref}: signature OK", markup=False, highlight=False)


def export_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Bundle file to write (.tar).")],
    encrypt_to: EncryptToOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a checkpoint (and its signature, if any) as one self-contained bundle file;
    with --encrypt-to, as an encrypted bundle only those keys' holders can import.

    A checkpoint that reads chunks of others (an unchanged tensor deduplicated against an
    earlier save, a delta) is bundled with those chunks: `ckpt import-bundle` in another
    store gets the same bytes, bit for bit.

    JSON: {"ref", "id", "path": the bundle, "bytes": its size, "encrypted"}.
    """
    from ckptstore.ops.sharing.bundle import export_bundle
    from ckptstore.ops.sharing.sealed import export_sealed

    with open_store(ctx) as store:
        ck = store.get(ref)
        with progress_bar(f"exporting {ck.ref}", enabled=not as_json) as advance:
            if encrypt_to:
                path = export_sealed(store, ref, out, encrypt_to, progress=advance)
            else:
                path = export_bundle(store, ref, out, progress=advance)
    if as_json:
        print_json({"ref": ck.ref, "id": ck.id, "path": str(path),
                    "bytes": path.stat().st_size, "encrypted": bool(encrypt_to)})
        return
    console.print(f"wrote {path} ({human_bytes(path.stat().st_size)})", markup=False,
                  highlight=False)


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
    key: DecryptKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Import a bundle after checking every file in it (hostile bundles are refused). An
    encrypted bundle needs the private key it was encrypted to (--key).

    JSON: the imported checkpoint's record (keys as in `ckpt ls --json`).
    """
    from ckptstore.format.sealed import decryption_key_path
    from ckptstore.ops.sharing.bundle import import_bundle
    from ckptstore.ops.sharing.sealed import import_sealed, is_sealed_bundle
    from ckptstore.records import checkpoint_dict

    with open_store(ctx, create=True) as store, progress_bar(f"importing {path.name}",
                                                enabled=not as_json) as advance:
        if is_sealed_bundle(path):
            ck = import_sealed(store, path,
                               decryption_key_path(key, store.settings.decrypt_key),
                               run=run, require_signature=require_signature,
                               progress=advance)
        else:
            ck = import_bundle(store, path, run=run, require_signature=require_signature,
                               progress=advance)
    if as_json:
        print_json(checkpoint_dict(ck))
        return
    console.print(f"imported {path} as {ck.ref} ({ck.id})", markup=False, highlight=False)


def keygen_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the key files.")],
    name: Annotated[
        str | None,
        typer.Option(help="File name stem (default: ckpt-signing, or ckpt-encryption with "
                          "--encryption)."),
    ] = None,
    encryption: Annotated[
        bool,
        typer.Option("--encryption",
                     help="An X25519 pair for encrypted copies (--encrypt-to NAME.pub, "
                          "--key NAME.key) instead of an Ed25519 signing pair."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Create an Ed25519 key pair for `ckpt sign` (NAME.key, mode 0600) and checking
    (NAME.pub); with --encryption, an X25519 pair for encrypted copies.

    JSON: {"private_key": path, "public_key": path, "fingerprint": sha256 hex, "kind"}.
    """
    if encryption:
        from ckptstore.keyfiles import encryption_fingerprint, load_encryption_key
        from ckptstore.ops.sharing.crypt import generate_encryption_keypair

        private, public = generate_encryption_keypair(out, name or "ckpt-encryption")
        fingerprint = encryption_fingerprint(load_encryption_key(public))
    else:
        from ckptstore.ops.sharing.signing import (
            generate_keypair,
            key_fingerprint,
            load_public_key,
        )

        private, public = generate_keypair(out, name or "ckpt-signing")
        fingerprint = key_fingerprint(load_public_key(public))
    if as_json:
        print_json({"private_key": str(private), "public_key": str(public),
                    "fingerprint": fingerprint,
                    "kind": "x25519" if encryption else "ed25519"})
        return
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
