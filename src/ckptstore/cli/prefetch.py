"""CLI commands that bring checkpoints closer ahead of need: prefetch, and thaw (GLACIER).

``ckpt prefetch REF`` restores a checkpoint to this host's hot (or memory) tier under a
lease that keeps retention away until it is loaded; ``--host H`` sends the work to host H's
Prefect work queue (its ``ckpt agent``). ``ckpt thaw REF`` asks S3 to restore a GLACIER
copy, or with ``--wait`` polls until it is readable and restores it. A checkpoint that is
still thawing makes any command exit with :data:`EXIT_THAW_PENDING`.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from ckptstore.cli.common import ascii_float, open_store, spinner
from ckptstore.cli.output import console, human_bytes, print_json
from ckptstore.cli.trust import DecryptKeyOpt
from ckptstore.errors import ConfigError
from ckptstore.identity import host

__all__ = ["EXIT_THAW_PENDING", "register"]

#: Exit code of a command stopped by :class:`~ckptstore.errors.ThawPendingError`: the
#: checkpoint's only copy is being thawed from GLACIER; retry later. 75 is EX_TEMPFAIL of
#: sysexits.h ("temporary failure; the user is invited to retry").
EXIT_THAW_PENDING = 75

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def prefetch_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    to: Annotated[str, typer.Option(help="Destination tier on the host: hot or memory.")] = "hot",
    on_host: Annotated[
        str | None,
        typer.Option("--host", help="Prefetch on this host (its `ckpt agent` runs it); "
                                    "default this host, now."),
    ] = None,
    hold: Annotated[
        float,
        typer.Option(parser=ascii_float, metavar="SECONDS",
                     help="Keep retention away this long if nobody loads it."),
    ] = 6 * 3600.0,
    as_json: JsonOpt = False,
) -> None:
    """Bring a checkpoint to a host's fast tier ahead of need, verified and leased.

    From warm or cold (a GLACIER-only copy is thawed first: exit 75 while it thaws, see
    `ckpt thaw`) or another host's part. The prefetch lease keeps retention from removing
    the copy until a load uses it or --hold seconds pass. With --host H for another host,
    the work goes to H's Prefect work queue (needs PREFECT_API_URL and `ckpt agent` on H).

    JSON: what was done (checkpoint_id, ref, to, host, path, bytes_moved, lease_owner,
    lease_expires_at, seconds), or {"sent": host, "checkpoint_id": ...} with --host.
    """
    from ckptstore.ops.reading.prefetch import prefetch_checkpoint, send_prefetch

    if to not in ("hot", "memory"):
        raise typer.BadParameter(f"{to!r} is not hot or memory", param_hint="--to")
    with open_store(ctx) as store:
        if on_host is not None and on_host != host():
            if not os.environ.get("PREFECT_API_URL"):
                raise ConfigError(
                    f"prefetching on host {on_host} needs a Prefect server: set "
                    f"PREFECT_API_URL and run `ckpt agent` on {on_host}"
                )
            ck = send_prefetch(store, ref, on_host, to="memory" if to == "memory" else "hot",
                               hold_s=hold)
            if as_json:
                print_json({"sent": on_host, "checkpoint_id": ck.id, "ref": ck.ref, "to": to})
            else:
                console.print(f"asked {on_host} to prefetch {ck.ref} to {to}")
            return
        with spinner(f"prefetching {ref}", enabled=not as_json):
            result = prefetch_checkpoint(store, ref, to="memory" if to == "memory" else "hot",
                                         hold_s=hold)
    if as_json:
        print_json(result.to_dict())
        return
    console.print(
        f"prefetched {result.ref} to {result.to} on {result.host} "
        f"({human_bytes(result.bytes_moved)} moved); kept until loaded or "
        f"{result.lease_expires_at:%Y-%m-%d %H:%M} UTC"
    )


def thaw_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    wait: Annotated[
        bool, typer.Option("--wait", help="Poll until readable, then restore to hot.")
    ] = False,
    poll: Annotated[
        float, typer.Option(parser=ascii_float, metavar="SECONDS",
                            help="With --wait: seconds between two looks.")
    ] = 300.0,
    timeout: Annotated[
        float | None, typer.Option(parser=ascii_float, metavar="SECONDS",
                                   help="With --wait: give up after this long.")
    ] = None,
    key: DecryptKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Thaw a checkpoint whose only copy is in GLACIER, and restore it once readable.

    Without --wait: asks S3 to restore every object of the copy (if not asked yet) and
    exits 75 while they are not all readable; once they are, restores the checkpoint to the
    hot tier. With --wait: polls every --poll seconds until then. The retrieval speed is
    the cold_restore_tier setting (Expedited, Standard, Bulk). An encrypted copy
    (tiers.encrypt_to) is decrypted with --key (or $CKPT_DECRYPT_KEY, or decrypt_key),
    which is checked against the copy before S3 is asked for anything.

    JSON: {"ref": ..., "path": the restored hot directory}.
    """
    from ckptstore.ops.tiering.thaw_poll import complete_thaw

    with open_store(ctx) as store:
        with spinner(f"thawing {ref}", enabled=not as_json and wait):
            path = complete_thaw(store, ref, poll_s=poll,
                                 timeout_s=timeout if wait else 0.0, key=key)
        ck = store.get(ref)
    if as_json:
        print_json({"ref": ck.ref, "checkpoint_id": ck.id, "path": str(path)})
        return
    console.print(f"restored {ck.ref} to {path}")


def register(app: typer.Typer) -> None:
    """Add prefetch and thaw to the ``ckpt`` app."""
    app.command("prefetch")(prefetch_cmd)
    app.command("thaw")(thaw_cmd)
