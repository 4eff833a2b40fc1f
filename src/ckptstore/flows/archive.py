"""Archive flow (hot → warm, verified) and demote flow (warm → cold)."""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow, unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from ckptstore.errors import ConfigError, StorageError
from ckptstore.flows.common import collect, open_store
from ckptstore.ops.tiering.reencode import check_codec
from ckptstore.tasks.archive import archive_task, demote_task

__all__ = ["archive_flow", "demote_flow"]

logger = logging.getLogger(__name__)


@flow(name="ckpt-archive", task_runner=ThreadPoolTaskRunner(max_workers=4))  # type: ignore[arg-type]
def archive_flow(
    store_root: str | None = None,
    config: str | None = None,
    run: str | None = None,
    tier: str = "warm",
    reencode: str | None = None,
    ref: str | None = None,
) -> dict[str, Any]:
    """Copy committed checkpoints that lack a PRESENT replica on ``tier`` there.

    One task per run, runs in parallel (within a run the operation goes oldest first, so a
    delta's base is archived before the delta). Each task copies → verifies → records, and is
    retried on transient failures; already archived checkpoints are skipped, so running the
    flow twice is harmless.

    Args:
        store_root: Store directory.
        config: Config file path.
        run: Only this run.
        tier: Destination tier (``warm`` by default).
        reencode: Codec preset to re-encode with (default: the config's ``archive_codec``).
        ref: Only this checkpoint.

    Returns:
        ``{"tier", "archived": [ids], "bytes", "skipped": {id: why}, "reencode",
        "reencoded": {id: {"source_bytes", "bytes"}}, "reports", "failed"}``.

    Raises:
        ConfigError: If the tier is not configured or ``reencode`` is not a codec preset.
        StorageError: If some run could not be archived (the others are done).
    """
    with open_store(store_root, config) as store:
        if tier not in store.settings.tier_urls():
            raise ConfigError(
                f"tier {tier!r} is not configured; set it under [tiers] in the config"
            )
        reencode = reencode or store.settings.archive_codec
        if reencode is not None:
            check_codec(reencode)  # a typo fails the flow before any task copies anything
        if ref is not None:
            futures = [archive_task.submit(store, ref=ref, tier=tier, reencode=reencode)]
            labels = [ref]
        else:
            runs = [run] if run is not None else sorted({ck.run for ck in store.list()})
            futures = list(
                archive_task.map(
                    unmapped(store), run=runs, tier=unmapped(tier), reencode=unmapped(reencode)
                )
            ) if runs else []
            labels = [f"run {r}" for r in runs]
        reports, failures = collect(futures, labels)
    summary = {
        "tier": tier,
        "archived": [cid for rep in reports for cid in rep.get("archived", [])],
        "bytes": sum(int(rep.get("bytes", 0)) for rep in reports),
        "skipped": {k: v for rep in reports for k, v in rep.get("skipped", {}).items()},
        "reencode": reencode,
        "reencoded": {k: v for rep in reports for k, v in rep.get("reencoded", {}).items()},
        "reports": reports,
        "failed": failures,
    }
    logger.info(
        "archive to %s: %d copied, %d task(s) failed", tier,
        sum(len(rep.get("archived", [])) for rep in reports),
        len(failures),
    )
    if failures:
        raise StorageError(
            f"archiving to {tier} failed for {len(failures)} task(s): " + "; ".join(failures[:5])
            + "; fix the cause and rerun the archive flow (finished copies are kept)"
        )
    return summary


@flow(name="ckpt-demote")
def demote_flow(
    older_than_days: float | None = None,
    store_root: str | None = None,
    config: str | None = None,
    src: str = "warm",
    dst: str = "cold",
) -> dict[str, Any]:
    """Move replicas older than ``older_than_days`` from ``src`` to ``dst``.

    Args:
        older_than_days: Age threshold (default: the config's ``cold_after_days``).
        store_root: Store directory.
        config: Config file path.
        src: Source tier.
        dst: Destination tier.

    Returns:
        The demote report as a dict.

    Raises:
        ConfigError: If no threshold is given or configured.
    """
    with open_store(store_root, config) as store:
        days = older_than_days if older_than_days is not None else store.settings.cold_after_days
        if days is None:
            raise ConfigError(
                "demote needs an age: pass older_than_days or set cold_after_days in the config"
            )
        result: dict[str, Any] = demote_task(store, float(days), src=src, dst=dst)
    return result
