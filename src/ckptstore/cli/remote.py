"""CLI commands between stores: ``remote add|ls|rm``, ``push``, ``pull``, ``sync``.

Each parses its options, calls :mod:`ckptstore.ops.sharing.remote` /
:mod:`ckptstore.ops.sharing.push` and prints the result. ``remote add`` takes the remote's
config file as ``--config``, the name the global option has elsewhere: its group is
registered after the global options are installed (:func:`register_remote_group`), so the
global options go before ``remote`` there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckptstore.cli.common import check_usage, open_store, progress_bar, with_global_options
from ckptstore.cli.output import console, print_json, print_table
from ckptstore.cli.trust import DecryptKeyOpt, EncryptToOpt
from ckptstore.errors import CheckpointNotFoundError

if TYPE_CHECKING:
    from ckptstore.core import StoreCore

__all__ = ["register", "register_remote_group"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
TierOpt = Annotated[
    str | None,
    typer.Option("--tier", help="Destination tier (default: its warm tier if it has one, "
                                "else hot)."),
]
SelfContainedOpt = Annotated[
    bool,
    typer.Option("--self-contained",
                 help="Re-encode deltas and dedup'd checkpoints into copies that hold every "
                      "chunk they read, instead of sending their bases along."),
]
CodecOpt = Annotated[
    str, typer.Option("--codec", help="Codec preset of --self-contained copies.")
]
SignatureOpt = Annotated[
    Path | None,
    typer.Option("--require-signature", metavar="PUBKEY",
                 help="PEM public key the destination trusts: each checkpoint must carry a "
                      "valid signature by it, or nothing of it is written."),
]


# --------------------------------------------------------------------------- remote group
def remote_add_cmd(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Name for the other store.")],
    config: Annotated[
        Path, typer.Option("--config", "-c",
                           help="The other store's TOML config file (here --config names "
                                "the remote; this store's config goes before `remote`).")
    ],
    as_json: JsonOpt = False,
    store_dir: Annotated[
        str | None, typer.Option("--store", "-s", help="This store's directory.")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress.")] = False,
) -> None:
    """Add a remote: another store, opened by its config file (catalog URL and tiers).

    The remote is opened once to check that the config works and is not this store. This
    store's own --config goes before `remote`; --store and --verbose go anywhere.

    JSON: {"name", "config", "created_at"}.
    """
    from ckptstore.cli.common import State, configure_logging
    from ckptstore.ops.sharing.remote import add_remote

    state = ctx.ensure_object(State)
    if store_dir is not None:
        state.store = store_dir
    if verbose and not state.verbose:
        state.verbose = True
        configure_logging(True)

    with open_store(ctx) as store:
        info = add_remote(store, name, config)
    if as_json:
        print_json({"name": info.name, "config": info.config, "created_at": info.created_at})
        return
    console.print(f"added remote {info.name}: {info.config}", markup=False, highlight=False)


def remote_ls_cmd(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List the remotes of this store.

    JSON: [{"name", "config", "created_at"}].
    """
    from ckptstore.ops.sharing.remote import list_remotes

    with open_store(ctx) as store:
        found = list_remotes(store)
    if as_json:
        print_json([{"name": r.name, "config": r.config, "created_at": r.created_at}
                    for r in found])
        return
    if not found:
        console.print("no remotes; add one with `ckpt remote add NAME --config FILE`")
        return
    print_table(["name", "config", "added"],
                [[r.name, r.config, r.created_at.strftime("%Y-%m-%d %H:%M")] for r in found])


def remote_rm_cmd(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The remote to forget.")],
    as_json: JsonOpt = False,
) -> None:
    """Forget a remote. Nothing is deleted in either store.

    JSON: {"removed": name}.
    """
    from ckptstore.ops.sharing.remote import remove_remote

    with open_store(ctx) as store:
        remove_remote(store, name)
    if as_json:
        print_json({"removed": name})
        return
    console.print(f"removed remote {name}", markup=False, highlight=False)


# --------------------------------------------------------------------------- push / pull
@contextmanager
def _stores(ctx: typer.Context, name: str) -> Iterator[tuple[StoreCore, StoreCore]]:
    """This store and the remote ``name``, both closed afterwards."""
    from ckptstore.ops.sharing.remote import open_remote

    with open_store(ctx) as store:
        other = open_remote(store, name)
        try:
            yield store, other
        finally:
            other.close()


def _show(report: Any, as_json: bool) -> None:
    if as_json:
        print_json(report.to_json())
        return
    console.print(report.summary(), markup=False,
                  highlight=False)
    for ckpt_id, refs in getattr(report, "lineage_elsewhere", {}).items():
        kept = ", ".join(f"{r['kind']} {r['checkpoint']}" for r in refs)
        console.print(f"lineage of {ckpt_id} kept as references to the source store: {kept}",
                      markup=False, highlight=False)


def push_cmd(
    ctx: typer.Context,
    refs: Annotated[list[str], typer.Argument(help="Checkpoint references to push.")],
    to: Annotated[str, typer.Option("--to", help="The remote to push to.")],
    tier: TierOpt = None,
    self_contained: SelfContainedOpt = False,
    codec: CodecOpt = "zstd-1",
    require_signature: SignatureOpt = None,
    encrypt_to: EncryptToOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Copy checkpoints, with their metadata, into a remote store.

    With --encrypt-to the remote gets sealed copies only those keys can read (its catalog
    records nothing, its tier holds ciphertext; see docs/SHARING.md); pull them with --key.

    Run, step, metrics, tags, code/data versions, lossy bounds, signatures and lineage edges
    travel with the files. Only files the remote lacks are sent (a fine-tune pushed after
    its base sends only its new chunks); delta and dedup'd checkpoints bring their bases
    unless --self-contained. Each checkpoint is copied, verified on the remote, then
    committed in its catalog; a failed push leaves nothing visible there and a rerun
    resumes.

    JSON: {"remote", "direction", "tier", "pushed", "present", "self_contained",
    "bytes_sent", "files_sent", "lineage_elsewhere"}.
    """
    from ckptstore.ops.sharing.push import push_checkpoints

    if encrypt_to:
        from ckptstore.ops.sharing.sealed_remote import push_sealed

        if self_contained or require_signature is not None:
            raise typer.BadParameter("--encrypt-to copies are always self-contained, and "
                                     "signatures are checked where they are decrypted (pull "
                                     "--require-signature)", param_hint="--encrypt-to")
        with _stores(ctx, to) as (store, other), \
                progress_bar(f"pushing to {to} (encrypted)", enabled=not as_json) as advance:
            sealed = push_sealed(store, other, refs, remote=to, encrypt_to=encrypt_to,
                                 tier=tier, progress=advance)
        _show(sealed, as_json)
        return
    with _stores(ctx, to) as (store, other), \
            progress_bar(f"pushing to {to}", enabled=not as_json) as advance:
        report = push_checkpoints(store, other, refs, remote=to, tier=tier,
                                  self_contained=self_contained, codec=codec,
                                  require_signature=require_signature, progress=advance)
    _show(report, as_json)


def pull_cmd(
    ctx: typer.Context,
    refs: Annotated[list[str], typer.Argument(help="Checkpoint references in the remote.")],
    source: Annotated[str, typer.Option("--from", help="The remote to pull from.")],
    tier: TierOpt = None,
    self_contained: SelfContainedOpt = False,
    codec: CodecOpt = "zstd-1",
    require_signature: SignatureOpt = None,
    key: DecryptKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Copy checkpoints, with their metadata, from a remote store into this one.

    The same guarantees as push, in the other direction: references are resolved in the
    remote, each copy is verified here before it is committed in this catalog. With --key
    (or $CKPT_DECRYPT_KEY, or the config's decrypt_key) sealed copies on the remote that the
    key opens are found by id, run@latest or run@<step>, decrypted and verified against
    their manifest's blake3 (with --key, only sealed copies are looked for).

    JSON: as push.
    """
    from ckptstore.format.sealed import decryption_key_path
    from ckptstore.ops.sharing.push import push_checkpoints
    from ckptstore.ops.sharing.sealed_remote import pull_sealed, sealed_copies, sealed_for

    with _stores(ctx, source) as (store, other):
        key_path = decryption_key_path(key, store.settings.decrypt_key)
        # A key from the environment or the config serves only references that name
        # encrypted copies; with --key, only encrypted copies are looked for.
        if key is not None or (key_path is not None and
                               sealed_for(other, refs, remote=source, key=key_path)):
            assert key_path is not None
            with progress_bar(f"pulling from {source} (encrypted)",
                              enabled=not as_json) as advance:
                sealed = pull_sealed(store, other, refs, remote=source, key=key_path,
                                     require_signature=require_signature, progress=advance)
            _show(sealed, as_json)
            return

    with _stores(ctx, source) as (store, other), \
            progress_bar(f"pulling from {source}", enabled=not as_json) as advance:
        try:
            report = push_checkpoints(other, store, refs, remote=source, direction="pull",
                                      tier=tier, self_contained=self_contained, codec=codec,
                                      require_signature=require_signature, progress=advance)
        except CheckpointNotFoundError as exc:
            count = sealed_copies(other)
            if count and key_path is None:
                raise CheckpointNotFoundError(
                    f"{exc}; remote {source!r} holds encrypted copies, which its catalog "
                    "does not list: pull them with --key KEY (or $CKPT_DECRYPT_KEY)"
                ) from exc
            if count:
                raise CheckpointNotFoundError(
                    f"{exc}; remote {source!r} holds {count} encrypted copies, but those the "
                    f"key {key_path} opens do not match {', '.join(refs)}"
                ) from exc
            raise
    _show(report, as_json)


def sync_cmd(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="The run to sync.")],
    to: Annotated[str, typer.Option("--to", help="The remote to push to.")],
    tag: Annotated[str | None, typer.Option(help="Only checkpoints with this tag.")] = None,
    best: Annotated[
        str | None, typer.Option(help="Only the run's best checkpoint by this metric.")
    ] = None,
    mode: Annotated[str, typer.Option(help="min or max, for --best.")] = "min",
    tier: TierOpt = None,
    self_contained: SelfContainedOpt = False,
    require_signature: SignatureOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Push every committed checkpoint of a run that the remote lacks (or only its best).

    Idempotent: what the remote has is skipped, so it can run on a schedule (the `sync`
    flow does).

    JSON: as push.
    """
    from ckptstore.ops.sharing.sync import sync_run

    with _stores(ctx, to) as (store, other), \
            progress_bar(f"syncing {run} to {to}", enabled=not as_json) as advance:
        report = sync_run(store, other, run, remote=to, tag=tag, best=best, mode=mode,
                          tier=tier, self_contained=self_contained,
                          require_signature=require_signature, progress=advance)
    _show(report, as_json)


def register(app: typer.Typer) -> None:
    """Add ``push``, ``pull`` and ``sync`` to the ``ckpt`` app."""
    app.command("push")(push_cmd)
    app.command("pull")(pull_cmd)
    app.command("sync")(sync_cmd)


def _checked(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with its arguments checked first (:func:`check_usage`); for the one command
    that takes no global options after its name."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_usage(func, kwargs)
        return func(*args, **kwargs)

    return wrapper


def register_remote_group(app: typer.Typer) -> None:
    """Add the ``remote`` group; call it after the global options are installed."""
    group = typer.Typer(help="Other stores to push to and pull from (add, ls, rm).",
                        no_args_is_help=True)
    group.command("add")(_checked(remote_add_cmd))
    group.command("ls")(with_global_options(remote_ls_cmd))
    group.command("rm")(with_global_options(remote_rm_cmd))
    app.add_typer(group, name="remote")
