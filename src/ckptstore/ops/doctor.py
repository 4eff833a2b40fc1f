"""Doctor: reconcile the catalog with what is really on every tier, and repair what is safe.

What it looks for (each is a :class:`Finding` of one ``kind``):

* ``missing-replica``: the catalog says a copy is PRESENT, but its directory, marker,
  manifest or files are not there (a row without data); a copy with no file left at all is
  reported as lost.
* ``damaged-replica``: a PRESENT copy whose bytes differ from the manifest (size or hash).
* ``zarr-metadata``: a local copy whose ``zarr.json`` documents do not describe the arrays
  the manifest records (a planted codec, a changed dtype or shape), or that holds Zarr v2
  metadata (``.zarray``/``.zgroup``) that ``zarr.open_group`` would prefer to trust.
* ``orphan-data``: files on a tier with no catalog row, or left behind by a row that no
  longer owns them (FAILED/DELETED checkpoints, DELETED replicas, killed copies).
* ``dead-pending``: PENDING rows whose writer process (on this host) is gone.
* ``stale-copying``: a replica stuck in COPYING: its copy was killed.
* ``dead-lease``: a lease held by a process (on this host) that is gone; until it expires it
  blocks every rerun of the flow that took it.
* ``stray-temp``: temporary files of killed writes inside a committed copy.
* ``interrupted-delete``: a copy or checkpoint left in DELETING (``ckpt prune`` finishes it).

``fix=True`` applies only repairs that cannot lose data: it records the truth (DAMAGED, FAILED,
DELETED for copies that are not there), releases leases of dead local processes, removes
files that no catalog row needs and that carry no commit marker (plus leftovers of rows the
catalog already gave up), and rewrites derived Zarr metadata from the manifest. It never
deletes a committed copy the catalog still counts on, never deletes marked data without a
row (that may be a checkpoint from another catalog: adopt or remove it by hand), and takes
the same leases as the flows, so it cannot pull files from under a running restore or copy.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptError,
    IncompleteCheckpointError,
    IntegrityError,
    StorageError,
)
from ckptstore.format import Manifest, read_manifest, verify_checkpoint
from ckptstore.format.codecs import codec_spec
from ckptstore.format.constants import COMMIT_NAME
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.zarrmeta import build_metadata
from ckptstore.identity import host, owner_is_dead
from ckptstore.ops.gc import DEFAULT_PENDING_GRACE_S, HotDir, classify_hot_dir, writer_is_dead
from ckptstore.ops.leases import lease_owner
from ckptstore.ops.replicas import manifest_on, referenced_chunks, store_tiers
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState, expected_digest
from ckptstore.storage import Tier, is_not_found
from ckptstore.storage.transfer import owned_files

__all__ = [
    "FINDING_KINDS",
    "DoctorReport",
    "Finding",
    "check_zarr_metadata",
    "doctor",
    "read_all",
    "zarr_metadata_problems",
]

logger = logging.getLogger(__name__)

#: Every kind of finding, in report order.
FINDING_KINDS: tuple[str, ...] = (
    "dead-lease",
    "dead-pending",
    "stale-copying",
    "missing-replica",
    "damaged-replica",
    "zarr-metadata",
    "interrupted-delete",
    "orphan-data",
    "stray-temp",
)

# Names of temporary files our writers (and zarr's) leave when killed mid-write.
_TEMP_PATTERNS = (re.compile(r"^\.ckpt-tmp-"), re.compile(r"\.partial$"),
                  re.compile(rf"^{COMMIT_NAME}\.tmp$"))
# Zarr v2 metadata: never part of our checkpoints; zarr.open_group may read it.
_V2_METADATA = frozenset({".zarray", ".zgroup", ".zattrs", ".zmetadata"})
# The codecs our presets produce; anything else in a zarr.json was not written by us.
_OUR_CODECS = frozenset({"bytes", "blosc", "crc32c"})
_MAX_ZARR_JSON = 64 * 1024
_LEASE_TTL_S = 600.0


@dataclass
class Finding:
    """One discrepancy between the catalog and the tiers.

    Attributes:
        kind: One of :data:`FINDING_KINDS`.
        subject: What it is about: a checkpoint id, a path or a tier key.
        detail: What is wrong, and what to do when it is not fixed automatically.
        tier: The tier concerned, if any.
        fixable: Whether ``fix=True`` repairs it.
        fixed: Whether this run repaired it.
        error: Why the repair failed, if it was attempted and failed.
    """

    kind: str
    subject: str
    detail: str
    tier: str | None = None
    fixable: bool = False
    fixed: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "kind": self.kind,
            "subject": self.subject,
            "detail": self.detail,
            "tier": self.tier,
            "fixable": self.fixable,
            "fixed": self.fixed,
            "error": self.error,
        }


@dataclass
class DoctorReport:
    """What :func:`doctor` found and (with ``fix``) repaired.

    Attributes:
        findings: Every finding, fixed or not.
        fix: Whether repairs were applied.
        checked: What was looked at: ``checkpoints``, ``replicas``, ``directories``, ``keys``.
    """

    findings: list[Finding] = field(default_factory=list)
    fix: bool = False
    checked: dict[str, int] = field(default_factory=dict)

    @property
    def problems(self) -> list[Finding]:
        """Findings still standing after this run (not fixed)."""
        return [f for f in self.findings if not f.fixed]

    @property
    def ok(self) -> bool:
        """True when nothing is wrong (any more)."""
        return not self.problems

    def of_kind(self, kind: str) -> list[Finding]:
        """Findings of one kind."""
        return [f for f in self.findings if f.kind == kind]

    def render(self) -> str:
        """Human-readable report, one line per finding."""
        counts = ", ".join(f"{v} {k}" for k, v in sorted(self.checked.items()))
        head = f"doctor checked {counts or 'nothing'}: "
        if not self.findings:
            return head + "catalog and storage agree"
        fixed = sum(1 for f in self.findings if f.fixed)
        lines = [head + f"{len(self.findings)} finding(s), {fixed} fixed"]
        order = {k: i for i, k in enumerate(FINDING_KINDS)}
        for f in sorted(self.findings, key=lambda f: (order.get(f.kind, 99), f.subject)):
            status = "fixed" if f.fixed else ("FIX FAILED" if f.error else
                                              ("fixable" if f.fixable else "manual"))
            where = f" [{f.tier}]" if f.tier else ""
            lines.append(f"  {f.kind:<18} {status:<10} {f.subject}{where}: {f.detail}"
                         + (f" ({f.error})" if f.error else ""))
        if not self.fix and any(f.fixable for f in self.findings):
            lines.append("run `ckpt doctor --fix` to apply the safe repairs")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "ok": self.ok,
            "fix": self.fix,
            "checked": dict(self.checked),
            "findings": [f.to_dict() for f in self.findings],
        }


# ---------------------------------------------------------------------- helpers
def _live_leases(store: StoreCore) -> list[tuple[str, str, str]]:
    """``(checkpoint id, purpose, owner)`` of every unexpired lease."""
    listing = getattr(store.catalog, "leases", None)
    if callable(listing):
        return [(str(row[0]), str(row[1]), str(row[2])) for row in listing()]
    # No listing API on the catalog yet: one read-only query on its engine.
    from sqlalchemy import select

    from ckptstore.catalog.models import LeaseRow, utcnow

    with store.catalog.engine.connect() as conn:
        rows = conn.execute(
            select(LeaseRow.checkpoint_id, LeaseRow.purpose, LeaseRow.owner).where(
                LeaseRow.expires_at > utcnow()
            )
        ).all()
    return [(str(cid), str(purpose), str(owner)) for cid, purpose, owner in rows]


def _is_temp(name: str) -> bool:
    return any(p.search(name) for p in _TEMP_PATTERNS)


def _older_than(path: Path, grace_s: float) -> bool:
    try:
        return time.time() - path.lstat().st_mtime >= grace_s
    except FileNotFoundError:
        return False


def _read_regular(path: Path, limit: int) -> bytes:
    """Read at most ``limit`` bytes of a regular file; never follows a link or blocks on a
    FIFO or device planted in its place."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return read_all(fd, limit)
    finally:
        os.close(fd)


def read_all(fd: int, limit: int) -> bytes:
    """Read up to ``limit`` bytes until EOF, looping over short reads."""
    parts: list[bytes] = []
    total = 0
    while total < limit:
        part = os.read(fd, limit - total)
        if not part:
            break
        parts.append(part)
        total += len(part)
    return b"".join(parts)


def _remove_tree(path: Path, root: Path) -> None:
    """Delete a checkpoint directory: marker first, never following links out of ``root``."""
    if path.is_symlink() and root in path.parent.resolve().parents:
        path.unlink()  # the link itself, never what it points to
        return
    if path.is_symlink() or root not in path.resolve().parents:
        raise StorageError(f"refusing to delete {path}: it is a link or lies outside {root}")
    (path / COMMIT_NAME).unlink(missing_ok=True)
    shutil.rmtree(path)


def check_zarr_metadata(directory: Path, manifest: Manifest) -> list[str]:
    """Check a local copy's Zarr metadata against the manifest.

    Our reader never uses ``zarr.json`` (it reads chunks itself, with the codec the manifest
    names from a fixed preset list), but ``zarr.open_group`` users do. This checks that each
    array's ``zarr.json`` is exactly the document our writer produces for that array (same
    dtype, shape, chunking, and only the bytes/blosc/crc32c codecs), that the group document
    is ours, and that no Zarr v2 metadata file is present.

    Args:
        directory: The checkpoint directory.
        manifest: Its (verified) manifest.

    Returns:
        One line per problem; ``[]`` when the metadata is what the writer wrote.
    """
    problems: list[str] = []
    docs: dict[str, bytes] = {}
    for rel in _expected_metadata(manifest):
        try:
            docs[rel] = _read_regular(directory / rel, _MAX_ZARR_JSON + 1)
        except FileNotFoundError:
            continue  # reported as missing below
        except OSError as exc:
            problems.append(f"{rel}: unreadable ({exc.strerror or exc})")
    problems += zarr_metadata_problems(docs, manifest)
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            if name in _V2_METADATA:
                rel = os.path.relpath(os.path.join(dirpath, name), directory)
                problems.append(f"{rel}: Zarr v2 metadata in a v3 checkpoint (not ours)")
    return problems


def zarr_metadata_problems(docs: dict[str, bytes], manifest: Manifest) -> list[str]:
    """Compare ``zarr.json`` documents (relative path -> bytes) with the manifest.

    Returns:
        One line per missing, oversized, malformed or unexpected document.
    """
    problems: list[str] = []
    for rel, want in _expected_metadata(manifest).items():
        raw = docs.get(rel)
        if raw is None:
            problems.append(f"{rel}: missing")
            continue
        if len(raw) > _MAX_ZARR_JSON:
            problems.append(f"{rel}: over {_MAX_ZARR_JSON} bytes")
            continue
        try:
            got = json.loads(raw)
        except ValueError:
            problems.append(f"{rel}: not valid JSON")
            continue
        if got != want:
            problems.append(f"{rel}: {_describe_difference(got, want)}")
    return problems


def _expected_metadata(manifest: Manifest) -> dict[str, Any]:
    docs: dict[str, Any] = {}
    for name, array in manifest.arrays.items():
        info = dtype_by_name(array.torch_dtype)
        if info is None:  # the manifest was validated; unreachable for a parsed manifest
            continue
        built = build_metadata(manifest.id, [(name, array.length, array.chunk_len, info)],
                               codec_spec(array.codec))
        for rel, data in built.items():
            docs[rel] = json.loads(data)
    if not manifest.arrays:
        built = build_metadata(manifest.id, [], codec_spec(manifest.codec))
        docs.update({rel: json.loads(data) for rel, data in built.items()})
    return docs


def _describe_difference(got: Any, want: dict[str, Any]) -> str:
    if not isinstance(got, dict):
        return "is not a JSON object"
    codecs = got.get("codecs")
    if isinstance(codecs, list):
        names = {c.get("name") for c in codecs if isinstance(c, dict)}
        foreign = sorted(str(n) for n in names - _OUR_CODECS)
        if foreign:
            return f"names codecs {foreign} that ckptstore never writes (hostile or foreign)"
    keys = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    return f"differs from what the manifest implies in {keys}"


def _rewrite_metadata(directory: Path, manifest: Manifest) -> None:
    """Write the expected zarr.json documents back (atomically) and drop v2 metadata."""
    for rel, doc in _expected_metadata(manifest).items():
        path = directory / rel
        tmp = path.with_name(f".ckpt-tmp-doctor-{os.getpid()}")
        data = json.dumps(doc, indent=2).encode()
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            if name in _V2_METADATA:
                os.unlink(os.path.join(dirpath, name))


# ---------------------------------------------------------------------- the checks
class _Doctor:
    """One doctor run (keeps the report and the catalog snapshot together)."""

    def __init__(self, store: StoreCore, *, fix: bool, deep: bool, grace_s: float,
                 tiers: Iterable[str] | None) -> None:
        self.store = store
        self.fix = fix
        self.deep = deep
        self.grace_s = grace_s
        self.report = DoctorReport(fix=fix)
        self.owner = "doctor:" + lease_owner()
        all_tiers = store_tiers(store)
        wanted = set(tiers) if tiers is not None else set(all_tiers)
        self.tiers: dict[str, Tier] = {n: t for n, t in all_tiers.items() if n in wanted}
        self.host = host()

    # -- bookkeeping ------------------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        self.report.checked[what] = self.report.checked.get(what, 0) + n

    def _find(self, kind: str, subject: str, detail: str, *, tier: str | None = None,
              repair: Any = None) -> Finding:
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

    def _with_lease(self, ckpt_id: str, purpose: str, action: Any) -> Any:
        """Run ``action`` under the flows' lease ``purpose``, so no flow works on it now."""

        def run() -> None:
            if not self.store.catalog.acquire_lease(ckpt_id, purpose, self.owner, _LEASE_TTL_S):
                holder = self.store.catalog.lease_holder(ckpt_id, purpose)
                raise StorageError(f"lease {purpose} is held by {holder}; retry later")
            try:
                action()
            finally:
                self.store.catalog.release_lease(ckpt_id, purpose, self.owner)

        return run

    # -- phase A: rows -----------------------------------------------------------------
    def leases(self) -> None:
        for ckpt_id, purpose, owner in _live_leases(self.store):
            self._count("leases")
            if not owner_is_dead(owner, on_host=self.host):
                continue

            def release(ckpt_id: str = ckpt_id, purpose: str = purpose,
                        owner: str = owner) -> None:
                self.store.catalog.release_lease(ckpt_id, purpose, owner)

            self._find("dead-lease", ckpt_id,
                       f"lease {purpose!r} is held by {owner}, a process that is gone; it "
                       "blocks reruns until it expires", repair=release)

    def pending(self, everything: list[Checkpoint]) -> None:
        for ck in everything:
            if ck.state != CheckpointState.PENDING or not writer_is_dead(
                self.store, ck, older_than_s=DEFAULT_PENDING_GRACE_S
            ):
                continue
            directory = self.store.checkpoint_dir(ck.run, ck.id)

            def fail(ck: Checkpoint = ck, directory: Path = directory) -> None:
                self.store.catalog.fail_checkpoint(ck.id, "writer died; cleaned by doctor")
                if directory.exists():
                    _remove_tree(directory, self.store.hot)

            self._find("dead-pending", ck.id,
                       f"{ck.ref} is PENDING but its writer {ck.writer} is gone", repair=fail)

    def copying(self, everything: list[Checkpoint]) -> None:
        for ck in everything:
            if ck.state != CheckpointState.COMMITTED:
                continue
            for replica in ck.replicas:
                if replica.state != ReplicaState.COPYING or replica.tier not in self.tiers:
                    continue
                purpose = f"archive:{replica.tier}"
                holder = self.store.catalog.lease_holder(ck.id, purpose)
                if holder is not None:
                    continue  # a live copy is under way

                def drop(ck: Checkpoint = ck, tier: str = replica.tier) -> None:
                    self.store.catalog.set_replica(ck.id, tier, state=ReplicaState.DELETED,
                                                   bytes=0)

                self._find("stale-copying", ck.id,
                           f"the {replica.tier} copy of {ck.ref} is COPYING but no flow holds "
                           f"{purpose}: the copy was killed; rerun the archive",
                           tier=replica.tier,
                           repair=self._with_lease(ck.id, purpose, drop))

    def deleting(self, everything: list[Checkpoint]) -> None:
        for ck in everything:
            if ck.state == CheckpointState.DELETING:
                self._find("interrupted-delete", ck.id,
                           f"{ck.ref} is DELETING: a prune was interrupted; `ckpt prune` "
                           "finishes it")
                continue
            for replica in ck.replicas:
                if replica.state == ReplicaState.DELETING:
                    self._find("interrupted-delete", ck.id,
                               f"the {replica.tier} copy of {ck.ref} is DELETING: a prune was "
                               "interrupted; `ckpt prune --tier "
                               f"{replica.tier}` finishes it", tier=replica.tier)

    # -- phase B: replicas the catalog claims ------------------------------------------
    def replicas(self, everything: list[Checkpoint]) -> None:
        for ck in everything:
            if ck.state != CheckpointState.COMMITTED:
                continue
            self._count("checkpoints")
            for replica in ck.replicas:
                tier = self.tiers.get(replica.tier)
                if tier is None or replica.state != ReplicaState.PRESENT:
                    continue
                self._count("replicas")
                self._check_replica(ck, tier)

    def _mark_damaged(self, ck: Checkpoint, tier: str) -> Any:
        def mark() -> None:
            self.store.catalog.set_replica(ck.id, tier, state=ReplicaState.DAMAGED)

        return mark

    def _check_replica(self, ck: Checkpoint, tier: Tier) -> None:
        local = tier.local_dir(ck.run, ck.id)
        hint = ("`ckpt verify --repair` copies it again from another replica"
                if any(r.tier != tier.name and r.state == ReplicaState.PRESENT
                       for r in ck.replicas)
                else "no other copy exists: restore it from a backup")
        try:
            manifest = (read_manifest(local, expected_digest=expected_digest(ck, tier.name))
                        if local is not None else manifest_on(tier, ck, use_cache=False))
        except (CheckpointNotFoundError, IncompleteCheckpointError) as exc:
            self._find("missing-replica", ck.id,
                       f"the catalog says {ck.ref} is PRESENT, but {self._lost(ck, tier, exc)}"
                       f"; {hint}", tier=tier.name, repair=self._mark_damaged(ck, tier.name))
            return
        except IntegrityError as exc:
            self._find("damaged-replica", ck.id, f"{ck.ref}: {exc}; {hint}",
                       tier=tier.name, repair=self._mark_damaged(ck, tier.name))
            return
        except StorageError as exc:
            if not is_not_found(exc):
                # The tier is unreachable: that says nothing about the copy; mark nothing.
                self._find("missing-replica", ck.id, f"{ck.ref}: cannot check the copy: {exc}",
                           tier=tier.name)
                return
            self._find("missing-replica", ck.id,
                       f"{ck.ref}: {self._lost(ck, tier, exc)}; {hint}", tier=tier.name,
                       repair=self._mark_damaged(ck, tier.name))
            return
        if local is not None:
            self._check_local_copy(ck, tier, local, manifest, hint)
        else:
            self._check_remote_copy(ck, tier, manifest, hint)

    def _lost(self, ck: Checkpoint, tier: Tier, exc: Exception) -> str:
        """``exc`` as text, said plainly when the copy has no file left at all."""
        try:
            gone = not tier.list_prefix(tier.prefix_for(ck.run, ck.id))
        except CkptError:
            gone = False
        if gone:
            return (f"the copy is lost: no file of it is left on {tier.name} ({exc}); "
                    "`ckpt prune` deletes such a copy like any other")
        return str(exc)

    def _check_local_copy(self, ck: Checkpoint, tier: Tier, local: Path, manifest: Manifest,
                          hint: str) -> None:
        def locate(ckpt_id: str) -> Path:
            other = self.store.catalog.get_any(ckpt_id)
            found = tier.local_dir(other.run, other.id)
            if found is None:
                raise CheckpointNotFoundError(f"base {ckpt_id} is not on {tier.name}")
            return found

        problems = verify_checkpoint(local, manifest, locate=locate, deep=self.deep)
        if local.is_symlink():  # reads would silently come from the link's target
            problems.insert(0, "the checkpoint directory is a symlink")
        if problems:
            missing = all("missing" in p for p in problems)
            self._find("missing-replica" if missing else "damaged-replica", ck.id,
                       f"{ck.ref}: {'; '.join(problems[:3])}"
                       + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
                       + f"; {hint}",
                       tier=tier.name, repair=self._mark_damaged(ck, tier.name))
            return
        meta = check_zarr_metadata(local, manifest)
        if meta:

            def rewrite(local: Path = local, manifest: Manifest = manifest) -> None:
                _rewrite_metadata(local, manifest)

            self._find("zarr-metadata", ck.id,
                       f"{ck.ref}: {'; '.join(meta[:3])}; our loads never use it, but "
                       "zarr.open_group would: the documents are rewritten from the manifest",
                       tier=tier.name, repair=rewrite)
        for dirpath, _dirs, files in os.walk(local):
            for name in files:
                path = Path(dirpath) / name
                if _is_temp(name) and _older_than(path, self.grace_s):
                    self._find("stray-temp", str(path),
                               "temporary file of a killed write inside a committed copy",
                               tier=tier.name,
                               repair=lambda path=path: path.unlink(missing_ok=True))

    def _check_remote_copy(self, ck: Checkpoint, tier: Tier, manifest: Manifest,
                           hint: str) -> None:
        if self.deep:
            from ckptstore.ops.verify import check_replica

            problems = check_replica(self.store, ck, tier, deep=True)
        else:
            have = set(tier.list_prefix(tier.prefix_for(ck.run, ck.id)))
            self._count("keys", len(have))
            problems = [f"{rel}: missing" for rel in owned_files(manifest)
                        if tier.key_for(ck.run, ck.id, rel) not in have]
        if problems:
            missing = all("missing" in p for p in problems)
            self._find("missing-replica" if missing else "damaged-replica", ck.id,
                       f"{ck.ref}: {'; '.join(problems[:3])}; {hint}", tier=tier.name,
                       repair=self._mark_damaged(ck, tier.name))

    # -- phase C: data the catalog does not (or no longer) own --------------------------
    def hot_dirs(self, by_id: dict[str, Checkpoint]) -> None:
        hot = self.store.hot
        if "hot" not in self.tiers or not hot.is_dir():
            return
        for run_dir in sorted(hot.iterdir()):
            if run_dir.name.startswith(".") or not run_dir.is_dir() or run_dir.is_symlink():
                if _is_temp(run_dir.name) and _older_than(run_dir, self.grace_s):
                    self._find("stray-temp", str(run_dir), "temporary file of a killed write",
                               tier="hot", repair=lambda p=run_dir: p.unlink(missing_ok=True))
                continue
            for ck_dir in sorted(run_dir.iterdir()):
                self._count("directories")
                if not ck_dir.is_dir() or ck_dir.is_symlink():
                    if _is_temp(ck_dir.name) and _older_than(ck_dir, self.grace_s):
                        self._find("stray-temp", str(ck_dir), "temporary file of a killed "
                                   "write", tier="hot",
                                   repair=lambda p=ck_dir: p.unlink(missing_ok=True))
                    continue
                self._hot_dir(ck_dir, by_id.get(ck_dir.name))

    def _hot_dir(self, ck_dir: Path, ck: Checkpoint | None) -> None:
        kind = classify_hot_dir(ck_dir, ck)
        remove = self._remover(ck_dir)
        if kind is HotDir.ORPHAN_COMMITTED:
            self._find("orphan-data", str(ck_dir),
                       "a committed checkpoint directory with no catalog row (from another "
                       "catalog?): import it (`ckpt import-bundle`) or delete it by hand",
                       tier="hot")
        elif kind is HotDir.ORPHAN_UNFINISHED:
            self._find("orphan-data", str(ck_dir),
                       "an unfinished directory with no catalog row", tier="hot",
                       repair=remove if _older_than(ck_dir, self.grace_s) else None)
        elif ck is None or kind in (HotDir.SAVING, HotDir.RECORDED):
            return  # a live save (dead ones were handled above), or the recorded copy
        elif kind is HotDir.LEFTOVER:
            self._find("orphan-data", str(ck_dir),
                       f"left behind by {ck.ref}, which is {ck.state}", tier="hot",
                       repair=remove)
        elif kind is HotDir.UNRECORDED:
            self._find("orphan-data", str(ck_dir),
                       f"a complete-looking copy of {ck.ref} the catalog does not record (a "
                       "restore was killed after its last file): adopted if it verifies, "
                       "removed if not", tier="hot",
                       repair=self._with_lease(ck.id, "restore:hot",
                                               self._adopter(ck, self.tiers["hot"])))
        else:
            why = ("left by an interrupted prune" if ck.state == CheckpointState.DELETING
                   else "a partial copy: a restore was killed")
            self._find("orphan-data", str(ck_dir), f"{why} ({ck.ref})", tier="hot",
                       repair=self._with_lease(ck.id, "restore:hot", remove))

    def _adopter(self, ck: Checkpoint, tier: Tier) -> Any:
        """Record an unrecorded, marked copy as PRESENT if it verifies in full, else drop it.

        Run under the tier's flow lease, so no copy is being written there meanwhile.
        """

        def adopt() -> None:
            from ckptstore.ops.replicas import delete_replica
            from ckptstore.ops.verify import check_replica

            current = self.store.catalog.get_any(ck.id)
            replica = current.replica(tier.name)
            if replica is not None and replica.state == ReplicaState.PRESENT:
                return
            problems = check_replica(self.store, current, tier, deep=True)
            if problems:
                # Not a usable copy: remove it the safe way (marker first, shared chunks kept).
                self.store.catalog.set_replica(ck.id, tier.name, state=ReplicaState.DAMAGED)
                delete_replica(self.store, current, tier.name, actor=self.owner, force=True,
                               keep_referenced=True)
                return
            prefix = tier.prefix_for(ck.run, ck.id)
            size = 0
            local = tier.local_dir(ck.run, ck.id)
            if local is not None:
                size = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
            self.store.catalog.set_replica(ck.id, tier.name, uri=tier.uri_for(ck.run, ck.id),
                                           state=ReplicaState.PRESENT, bytes=size or None,
                                           verified=True)
            self.store.catalog.record_event(
                "adopted", checkpoint_id=ck.id, actor=self.owner,
                detail={"tier": tier.name, "prefix": prefix, "verified": "deep"},
            )

        return adopt

    def _remover(self, ck_dir: Path) -> Any:
        def remove() -> None:
            _remove_tree(ck_dir, self.store.hot)

        return remove

    def tier_keys(self, by_id: dict[str, Checkpoint]) -> None:
        for name, tier in sorted(self.tiers.items()):
            if name == "hot":
                continue
            try:
                keys = tier.list_prefix("")
            except CkptError as exc:
                self._find("missing-replica", tier.url, f"cannot list the tier: {exc}",
                           tier=name)
                continue
            self._count("keys", len(keys))
            groups: dict[tuple[str, str], list[str]] = {}
            for key in keys:
                parts = key.split("/", 2)
                if len(parts) == 3:
                    groups.setdefault((parts[0], parts[1]), []).append(key)
            try:
                needed = {
                    tier.key_for(by_id[owner].run, owner, f"{array}/c/{index}")
                    for owner, array, index in referenced_chunks(self.store, name)
                    if owner in by_id
                }
            except CkptError as exc:
                # Without knowing which chunk files other copies read, nothing may go.
                self._find("orphan-data", tier.url,
                           f"cannot tell which files of {name} other checkpoints still read "
                           f"({exc}); not judging this tier's files", tier=name)
                continue
            for (run, ckpt_id), group in sorted(groups.items()):
                self._tier_group(tier, run, ckpt_id, group, by_id.get(ckpt_id), needed)

    def _tier_group(self, tier: Tier, run: str, ckpt_id: str, keys: list[str],
                    ck: Checkpoint | None, needed: set[str]) -> None:
        marker = f"{run}/{ckpt_id}/{COMMIT_NAME}"
        marked = marker in keys
        prefix = f"{run}/{ckpt_id}/"
        spare = [k for k in keys if k not in needed]
        if not spare:
            return
        replica = ck.replica(tier.name) if ck is not None else None
        if ck is not None and ck.state == CheckpointState.PENDING:
            return
        if replica is not None and replica.state in (
            ReplicaState.PRESENT, ReplicaState.DAMAGED, ReplicaState.DELETING,
            ReplicaState.COPYING,
        ):
            return

        def delete(spare: list[str] = spare, marked: bool = marked) -> None:
            if marked:
                tier.delete(marker)
            tier.delete_keys(k for k in spare if k != marker)

        if ck is None:
            detail = f"{len(spare)} object(s) under {prefix} with no catalog row"
            if marked:
                self._find("orphan-data", prefix, detail + " but with a commit marker (another "
                           "catalog's checkpoint?): delete it by hand if unwanted",
                           tier=tier.name)
            else:
                self._find("orphan-data", prefix, detail + " (an unfinished copy)",
                           tier=tier.name, repair=delete)
            return
        gone = ck.state in (CheckpointState.FAILED, CheckpointState.DELETED)
        purpose = f"archive:{tier.name}"
        if marked and ck.state == CheckpointState.COMMITTED:
            self._find("orphan-data", prefix,
                       f"a marked copy of {ck.ref} the catalog does not record on {tier.name} "
                       "(a copy was killed after its last file): adopted if it verifies, "
                       "removed if not", tier=tier.name,
                       repair=self._with_lease(ck.id, purpose, self._adopter(ck, tier)))
            return
        detail = (f"{len(spare)} object(s) of {ck.ref} left on {tier.name} "
                  f"({'checkpoint ' + ck.state if gone else 'a killed or abandoned copy'})")
        self._find("orphan-data", prefix, detail, tier=tier.name,
                   repair=delete if gone else self._with_lease(ck.id, purpose, delete))


def doctor(
    store: StoreCore,
    *,
    fix: bool = False,
    deep: bool = False,
    tiers: Iterable[str] | None = None,
    grace_s: float = 60.0,
) -> DoctorReport:
    """Reconcile the catalog with storage; with ``fix``, apply the safe repairs.

    Args:
        store: The open store.
        fix: Apply the repairs that cannot lose data (see the module docstring).
        deep: Re-hash every chunk of every copy (remote copies are downloaded); otherwise
            presence and sizes (local) or presence (remote).
        tiers: Only these tiers (default: every configured tier).
        grace_s: Unfinished files and directories younger than this are left alone (a
            writer may still be working on them).

    Returns:
        The :class:`DoctorReport`; ``report.ok`` is True when nothing is wrong any more.

    Raises:
        StorageError: If the catalog cannot be reached.
    """
    run = _Doctor(store, fix=fix, deep=deep, grace_s=grace_s, tiers=tiers)
    run.leases()
    everything = store.catalog.list(state=None)
    run.pending(everything)
    run.copying(everything)
    run.deleting(everything)
    run.replicas(everything)
    # Repairs above changed rows: look again before judging what owns which files.
    everything = store.catalog.list(state=None) if fix else everything
    by_id = {ck.id: ck for ck in everything}
    run.hot_dirs(by_id)
    run.tier_keys(by_id)
    report = run.report
    if fix and report.findings:
        store.catalog.record_event(
            "doctor",
            actor=run.owner,
            detail={"fixed": sum(1 for f in report.findings if f.fixed),
                    "findings": [f"{f.kind} {f.subject}" for f in report.findings[:50]]},
        )
    logger.info("%s", report.render().splitlines()[0])
    return report

