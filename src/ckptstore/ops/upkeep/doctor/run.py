"""One doctor run: its settings, its report, and how findings are recorded and repaired.

:class:`DoctorRun` is what every phase works on (:mod:`~ckptstore.ops.upkeep.doctor.rows`,
:mod:`~ckptstore.ops.upkeep.doctor.replicas`, :mod:`~ckptstore.ops.upkeep.doctor.orphans`): a phase
reports a :class:`~ckptstore.ops.upkeep.doctor.report.Finding` through :meth:`DoctorRun.find`
with the repair that would fix it, and the run applies the repair only with ``fix``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.durable import TEMP_PREFIX
from ckptstore.errors import CkptError, StorageError
from ckptstore.format.constants import COMMIT_NAME, COMMIT_TMP_NAME
from ckptstore.identity import host
from ckptstore.ops.leases import lease_owner
from ckptstore.ops.tiering.replicas import store_tiers
from ckptstore.ops.upkeep.doctor.report import DoctorReport, Finding
from ckptstore.records import Checkpoint, ReplicaState
from ckptstore.storage import Tier

__all__ = ["LEASE_TTL_S", "DoctorRun", "is_temp", "older_than", "remove_tree"]

logger = logging.getLogger(__name__)

# Names of temporary files our writers (and zarr's) leave when killed mid-write.
TEMP_PATTERNS = (re.compile("^" + re.escape(TEMP_PREFIX)), re.compile(r"\.partial$"),
                 re.compile("^" + re.escape(COMMIT_TMP_NAME) + "$"))
LEASE_TTL_S = 600.0


def is_temp(name: str) -> bool:
    """Whether ``name`` is a temporary file a killed write (ours or zarr's) left."""
    return any(p.search(name) for p in TEMP_PATTERNS)


def older_than(path: Path, grace_s: float) -> bool:
    """Whether ``path`` was last modified at least ``grace_s`` ago (False if it is gone)."""
    try:
        return time.time() - path.lstat().st_mtime >= grace_s
    except FileNotFoundError:
        return False


def remove_tree(path: Path, root: Path) -> None:
    """Delete a checkpoint directory: marker first, never following links out of ``root``."""
    if path.is_symlink() and root in path.parent.resolve().parents:
        path.unlink()  # the link itself, never what it points to
        return
    if path.is_symlink() or root not in path.resolve().parents:
        raise StorageError(f"refusing to delete {path}: it is a link or lies outside {root}")
    (path / COMMIT_NAME).unlink(missing_ok=True)
    shutil.rmtree(path)


class DoctorRun:
    """One doctor run (keeps the report and the catalog snapshot together).

    Args:
        store: The open store.
        fix: Apply repairs.
        deep: Re-hash every chunk of every copy.
        grace_s: Unfinished files younger than this are left alone.
        tiers: Only these tiers (default: every configured tier).
        key: The private key that opens encrypted copies (None: the environment's or the
            config's).
    """

    def __init__(self, store: StoreCore, *, fix: bool, deep: bool, grace_s: float,
                 tiers: Iterable[str] | None,
                 key: str | os.PathLike[str] | None = None) -> None:
        self.store = store
        self.fix = fix
        self.deep = deep
        self.key = key
        self.grace_s = grace_s
        self.report = DoctorReport(fix=fix)
        self.owner = "doctor:" + lease_owner()
        all_tiers = store_tiers(store)
        wanted = set(tiers) if tiers is not None else set(all_tiers)
        self.tiers: dict[str, Tier] = {n: t for n, t in all_tiers.items() if n in wanted}
        self.host = host()

    def count(self, what: str, n: int = 1) -> None:
        """Add ``n`` to the report's count of ``what`` was looked at."""
        self.report.checked[what] = self.report.checked.get(what, 0) + n

    def find(self, kind: str, subject: str, detail: str, *, tier: str | None = None,
             repair: Any = None) -> Finding:
        """Record a finding; with ``fix``, run its ``repair`` (a failure is recorded on it).

        Args:
            kind: One of :data:`~ckptstore.ops.upkeep.doctor.report.FINDING_KINDS`.
            subject: What it is about (checkpoint id, path, key prefix).
            detail: What is wrong, and what to do when it is not repaired.
            tier: The tier concerned.
            repair: A callable that repairs it safely, or None when only a person can.
        """
        finding = Finding(kind, subject, detail, tier=tier, fixable=repair is not None)
        self.report.findings.append(finding)
        logger.warning("doctor: %s %s%s: %s", kind, subject, f" [{tier}]" if tier else "",
                       detail)
        if self.fix and repair is not None:
            try:
                repair()
                finding.fixed = True
            except (CkptError, OSError) as exc:
                finding.error = f"{type(exc).__name__}: {exc}"
                logger.warning("doctor could not fix %s %s: %s", kind, subject, exc)
        return finding

    def with_lease(self, ckpt_id: str, purpose: str, action: Any) -> Any:
        """Run ``action`` under the flows' lease ``purpose``, so no flow works on it now."""

        def run() -> None:
            if not self.store.catalog.acquire_lease(ckpt_id, purpose, self.owner, LEASE_TTL_S):
                holder = self.store.catalog.lease_holder(ckpt_id, purpose)
                raise StorageError(f"lease {purpose} is held by {holder}; retry later")
            try:
                action()
            finally:
                self.store.catalog.release_lease(ckpt_id, purpose, self.owner)

        return run

    def mark_damaged(self, ck: Checkpoint, tier: str) -> Any:
        """A repair that records the copy of ``ck`` on ``tier`` as DAMAGED."""
        def mark() -> None:
            self.store.catalog.set_replica(ck.id, tier, state=ReplicaState.DAMAGED)

        return mark

    def remover(self, ck_dir: Path) -> Any:
        """A repair that deletes the hot-tier directory ``ck_dir`` (marker first)."""
        def remove() -> None:
            remove_tree(ck_dir, self.store.hot)

        return remove
