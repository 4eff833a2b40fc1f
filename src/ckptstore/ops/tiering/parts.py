"""Checkpoints saved across hosts: their parts, their manifest, and where each part is read.

A distributed save whose ranks span several hosts (each with its own node-local hot tier and
no shared filesystem), or whose hot tier is object storage, is *parted*: every rank writes
its shards to its own host's hot tier in the per-rank layout
(:func:`~ckptstore.format.dcp.layout.rank_array_path`), so every file belongs to one rank and
one host's *part* (the save itself: :mod:`ckptstore.ops.dcp.writer`). The catalog records one
row per part and copy (:class:`~ckptstore.records.ReplicaPart`), the manifest bytes and which
ranks make up each part; no disk every host reaches holds the manifest.

This module is what every operation on such a checkpoint shares (archive, retention, gc,
doctor, load, verify, show), with no process group involved:

* the parts' files (:func:`part_files`, :func:`part_specs`, :func:`rank_hosts`);
* the manifest (:func:`parted_manifest`: from the catalog, checked against the digest) and
  :func:`materialize`, which gives a host's part its ``manifest.json`` and commit marker;
* reading: :class:`PartsSource` reads each chunk from the first copy of its part that has
  it intact, in order: this host's disk (its own part, or a peer's part it keeps), then the
  shared tiers (a hot tier in object storage, warm, cold). A part readable only from an
  archival (GLACIER) copy is thawed first (:mod:`ckptstore.ops.tiering.thaw`). A part that exists
  nowhere raises :class:`~ckptstore.errors.IncompleteCheckpointError` naming the host and
  the tensors;
* this host's parts on disk: :func:`verify_parts_here`, :func:`remove_local_parts`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import blake3

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    StorageError,
)
from ckptstore.format import Manifest
from ckptstore.format.constants import COMMIT_NAME
from ckptstore.format.dcp.chunks import ByteView, ChunkSource
from ckptstore.format.dcp.layout import ArrayInfo, chunk_file, rank_of_file
from ckptstore.format.dcp.verify import verify_dcp
from ckptstore.format.manifest import known_manifest, parse_verified
from ckptstore.identity import host
from ckptstore.records import TIER_ORDER, Checkpoint, PartSpec, ReplicaState
from ckptstore.storage import Tier

__all__ = [
    "PartsSource",
    "gather_parts",
    "of_ranks",
    "materialize",
    "part_files",
    "part_specs",
    "parted_manifest",
    "parts_source",
    "rank_hosts",
    "record_gathered",
    "remove_local_parts",
    "verify_parts_here",
]

logger = logging.getLogger(__name__)


def rank_hosts(parts: Mapping[str, Iterable[int]]) -> dict[int, str]:
    """``{rank: host}`` from the catalog's ``{host: [ranks]}``."""
    return {int(rank): h for h, ranks in parts.items() for rank in ranks}


def part_files(manifest: Manifest, ranks: Iterable[int]) -> list[tuple[str, int]]:
    """``(relative path, size)`` of the files of one part (those its ``ranks`` wrote)."""
    wanted = set(ranks)
    return [(f.path, f.nbytes) for f in manifest.files if rank_of_file(f.path) in wanted]


def part_specs(manifest: Manifest, hosts: tuple[str, ...]) -> list[PartSpec]:
    """What each host's ranks wrote, from the manifest and the host of every rank."""
    by_host: dict[str, list[int]] = {}
    for rank, h in enumerate(hosts):
        by_host.setdefault(h, []).append(rank)
    out = []
    for h, ranks in sorted(by_host.items()):
        files = part_files(manifest, ranks)
        out.append(PartSpec(h, tuple(ranks), len(files), sum(n for _, n in files)))
    return out


# --------------------------------------------------------------------------- the manifest
def parted_manifest(store: StoreCore, ck: Checkpoint) -> tuple[Manifest, bytes]:
    """A parted checkpoint's manifest and its bytes, from the catalog (digest checked).

    Raises:
        CheckpointNotFoundError: If the catalog holds no manifest for it.
        IntegrityError: If the bytes do not hash to the checkpoint's manifest digest.
    """
    digest, data = store.catalog.manifest_bytes(ck.id)
    actual = blake3.blake3(data).hexdigest()
    if actual != digest or (ck.manifest_digest is not None and actual != ck.manifest_digest):
        raise IntegrityError(
            f"the catalogued manifest of {ck.ref} ({ck.id}) has digest {actual}, not "
            f"{ck.manifest_digest}: the catalog row is damaged; restore the catalog from a "
            "backup or load the checkpoint from a complete warm copy"
        )
    cached = known_manifest(actual, ck.id)
    return (cached if cached is not None else parse_verified(data, actual)), data


def _write_shared(directory: Path, manifest: Manifest, data: bytes) -> None:
    """The documents every host's copy of a parted checkpoint shares (idempotent)."""
    # Imported here: the commit module pulls in torch.distributed.checkpoint, most of a
    # second to import, which the processes that only list or prune parts never need.
    from ckptstore.format.dcp.commit import write_shared

    write_shared(directory, manifest, data, exist_ok=True)


def materialize(store: StoreCore, ck: Checkpoint, *, data: bytes | None = None
                ) -> Path | None:
    """Give this host's part of a parted checkpoint its manifest and commit marker.

    DCP runs the commit on the coordinator only, so the other hosts' parts have no
    ``manifest.json`` or ``COMMITTED`` until they get them from the catalog here (at the end
    of ``save_distributed``, or when the host first needs them: load, verify, archive).
    Idempotent; a directory that already holds the marker is left alone.

    Args:
        store: The store.
        ck: The committed checkpoint.
        data: Its manifest bytes when the caller has them (the coordinator; a broadcast):
            checked against the digest like the catalog's.

    Returns:
        This host's directory of the checkpoint, or None when it holds no part here.

    Raises:
        IntegrityError: If the manifest bytes are damaged.
        StorageError: If the files cannot be written.
    """
    if not ck.parted or store.settings.hot_remote is not None:
        return None
    directory = store.checkpoint_dir(ck.run, ck.id)
    if (directory / COMMIT_NAME).is_file():
        return directory
    if not directory.is_dir():
        return None
    with _locked(directory):
        # Another thread or process of this host (the save's background writer, an archive
        # flow) may have finished it while this one waited.
        if (directory / COMMIT_NAME).is_file():
            return directory
        digest = blake3.blake3(data).hexdigest() if data is not None else None
        if data is not None and digest == ck.manifest_digest:
            assert digest is not None
            cached = known_manifest(digest, ck.id)
            manifest = cached if cached is not None else parse_verified(data, digest)
        else:
            manifest, data = parted_manifest(store, ck)
        _write_shared(directory, manifest, data)
    logger.debug("materialised the manifest of %s on %s", ck.ref, host())
    return directory


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on a checkpoint directory, between threads and processes of a host.

    ``flock`` on the directory itself: nothing is added to the checkpoint, and a killed
    holder releases it with its file descriptors.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise StorageError(f"cannot open {directory}: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class _Copy:
    """One place a part can be read from: this host's directory, or a shared tier."""

    name: str
    directory: Path | None = None
    tier: Tier | None = None


class PartsSource(ChunkSource):
    """Reads each chunk of a parted checkpoint from the first intact copy of its part.

    Thread-safe, like :class:`~ckptstore.format.dcp.chunks.ChunkSource`; every chunk passes
    the same checks whichever copy it came from.

    Args:
        ck: The checkpoint.
        manifest: Its verified manifest.
        ranks: ``{rank: part host}``.
        copies: ``{part host: places to read it from, best first}``.
        local: This host's directory of the checkpoint.
    """

    def __init__(self, ck: Checkpoint, manifest: Manifest, ranks: Mapping[int, str],
                 copies: Mapping[str, list[_Copy]], local: Path) -> None:
        assert manifest.dcp is not None
        super().__init__(local, manifest.id, manifest.dcp)
        self.ck = ck
        self.ranks = dict(ranks)
        self.copies = {h: list(c) for h, c in copies.items()}
        self._dirs = {
            c.directory: ChunkSource(c.directory, manifest.id, manifest.dcp)
            for cs in self.copies.values() for c in cs if c.directory is not None
        }
        # Chunk files other ranks fetched for this one (ops/dcp/share.py), by relative path.
        self._received: dict[str, bytes | ByteView] = {}
        self._failed: set[str] = set()

    @property
    def remote(self) -> bool:
        """Whether some part is read from a tier over the network."""
        return any(c.tier is not None for cs in self.copies.values() for c in cs)

    def missing(self) -> dict[str, list[str]]:
        """``{part host: tensors and items stored in it}`` for parts with no copy anywhere."""
        index = self.index
        gone = {h for h in set(self.ranks.values()) if not self.copies.get(h)}
        if not gone:
            return {}
        out: dict[str, list[str]] = {h: [] for h in sorted(gone)}
        for fqn, item in index.tensors.items():
            for piece in item.pieces:
                owner = self._owner(piece.array)
                if owner in gone and fqn not in out[owner]:
                    out[owner].append(fqn)
        for fqn, blob in index.blobs.items():
            owner = self._owner(blob.array)
            if owner in gone:
                out[owner].append(fqn)
        return out

    def _owner(self, array: str) -> str | None:
        rank = rank_of_file(array + "/")
        return None if rank is None else self.ranks.get(rank)

    def _copies_of(self, rel: str) -> tuple[str | None, list[_Copy]]:
        rank = rank_of_file(rel)
        owner = self.ranks.get(rank) if rank is not None else None
        return owner, (self.copies.get(owner, []) if owner is not None else [])

    def parts_on_disk(self) -> set[str]:
        """The part hosts whose best copy is on this host's disk (its own, a peer's kept)."""
        return {h for h, cs in self.copies.items() if cs and cs[0].directory is not None}

    def parts_reached(self) -> set[str]:
        """The part hosts with some copy this host can read (on its disk or a shared tier)."""
        return {h for h, cs in self.copies.items() if cs}

    def part_of(self, rel: str) -> str | None:
        """The host whose part holds chunk file ``rel`` (None: not a rank's file)."""
        return self._copies_of(rel)[0]

    def is_remote(self, rel: str) -> bool:
        """Whether chunk file ``rel`` would be read over the network here: no disk of this
        host holds its part."""
        _, copies = self._copies_of(rel)
        return not copies or copies[0].directory is None

    def fetch(self, rel: str) -> bytes:
        """The bytes of chunk file ``rel`` from the first copy of its part that has it, for
        another rank (:mod:`ckptstore.ops.dcp.share`). Unchecked here: the rank that uses
        them checks them (:meth:`accept`) and reads its own copies if they fail.

        Raises:
            StorageError: If no copy could be read.
        """
        owner, copies = self._copies_of(rel)
        problems: list[str] = []
        for copy in copies:
            try:
                if copy.directory is not None:
                    return (copy.directory / rel).read_bytes()
                assert copy.tier is not None
                return copy.tier.get_bytes(copy.tier.key_for(self.ck.run, self.ck.id, rel))
            except (OSError, StorageError) as exc:
                problems.append(f"{copy.name}: {str(exc).splitlines()[0]}")
        raise StorageError(
            f"checkpoint {self.ck.ref} ({self.ck.id}): chunk {rel} of the part of host "
            f"{owner} could not be read from any copy ({'; '.join(problems) or 'none'})"
        )

    def receive(self, frames: Mapping[str, bytes | ByteView], failed: Iterable[str] = ()
                ) -> None:
        """Keep chunk files another rank fetched; :meth:`read` uses them first.

        Args:
            frames: ``{chunk file: its bytes}``.
            failed: Chunk files another rank was to fetch for this one and could not (what
                it sent in their place, if kept, is dropped).
        """
        self._received.update(frames)
        for rel in failed:
            self._received.pop(rel, None)
            self._failed.add(rel)

    def forget_received(self) -> None:
        """Drop the received chunk files (after the read that needed them)."""
        self._received.clear()
        self._failed.clear()

    def read(self, array: ArrayInfo, key: str, dest: ByteView) -> None:
        """Fill ``dest`` with chunk ``key`` from the first copy of its part that has it intact.

        Raises:
            IncompleteCheckpointError: If no copy of the part exists (naming the host and
                the tensors stored there).
            IntegrityError: If every copy of the chunk is missing or damaged.
        """
        rel = chunk_file(array.path, key)
        frame = self._received.get(rel)
        if frame is not None:
            try:
                self.accept(array, key, frame, dest)
                return
            except IntegrityError as exc:  # damaged on the way: read it from our copies
                logger.warning("chunk %s of %s from another rank failed its checks (%s); "
                               "reading it from this host's copies", rel, self.ck.ref, exc)
        owner, copies = self._copies_of(rel)
        if not copies and rel in self._failed:
            raise IntegrityError(
                f"checkpoint {self.ck.ref} ({self.ck.id}): chunk {rel} of the part of host "
                f"{owner} could not be fetched by the rank it was assigned to (its log says "
                "why) and this host reaches no copy of it; run `ckpt verify "
                f"{self.ck.ref}` where copies of that part are kept, or load an earlier "
                "checkpoint"
            )
        if not copies:
            raise self._nowhere(owner, array)
        problems: list[str] = []
        for copy in copies:
            try:
                if copy.directory is not None:
                    self._dirs[copy.directory].read(array, key, dest)
                else:
                    assert copy.tier is not None
                    data = copy.tier.get_bytes(copy.tier.key_for(self.ck.run, self.ck.id, rel))
                    self.accept(array, key, data, dest)
                return
            except (IntegrityError, StorageError) as exc:
                problems.append(f"{copy.name}: {str(exc).splitlines()[0]}")
                logger.debug("chunk %s of %s not usable from %s: %s", rel, self.ck.ref,
                             copy.name, exc)
        raise IntegrityError(
            f"checkpoint {self.ck.ref} ({self.ck.id}): chunk {rel} of the part of host "
            f"{owner} is missing or damaged in every copy ({'; '.join(problems)}); run "
            f"`ckpt verify {self.ck.ref}` or load an earlier checkpoint"
        )

    def _nowhere(self, owner: str | None, array: ArrayInfo) -> IncompleteCheckpointError:
        owners = sorted(
            {fqn for fqn, item in self.index.tensors.items()
             if any(p.array == array.path for p in item.pieces)}
            | {fqn for fqn, blob in self.index.blobs.items() if blob.array == array.path}
        )
        ranks = sorted(r for r, h in self.ranks.items() if h == owner)
        shown = ", ".join(owners[:5]) + (f" (+{len(owners) - 5} more)" if len(owners) > 5 else "")
        return IncompleteCheckpointError(
            f"checkpoint {self.ck.ref} ({self.ck.id}): the part of host {owner} (ranks "
            f"{', '.join(map(str, ranks)) or '?'}) exists on no tier this host can read, so "
            f"{shown or array.path} cannot be loaded; bring host {owner} back, or archive its "
            "part to the warm tier before it is lost (`ckpt archive` on that host)"
        )


def _part_copies(store: StoreCore, ck: Checkpoint, hosts: Iterable[str]) -> dict[str, list[_Copy]]:
    """Where each part can be read from on this host, best first."""
    me = host()
    local = store.checkpoint_dir(ck.run, ck.id)
    tiers = store.tiers
    rows = store.catalog.parts(ck.id)
    copies: dict[str, list[_Copy]] = {}
    # Every tier but a node-local hot one is the same for all hosts (object storage, or a
    # path every node mounts), and the catalog records copies on it per tier, not per host.
    shared = sorted(
        (t for t in tiers.values() if t.name != "hot" or store.settings.hot_remote is not None),
        key=lambda t: TIER_ORDER.index(t.name) if t.name in TIER_ORDER else len(TIER_ORDER),
    )
    # A replacement node under the lost one's name starts with an empty disk, while the
    # catalog still lists the lost disk's parts: with no directory here, those parts are
    # remote (their reads are shared among the ranks) rather than read, and missed, here.
    on_disk = store.settings.hot_remote is None and local.is_dir()
    for part in hosts:
        found: list[_Copy] = []
        here = any(r.tier == "hot" and r.part == part and r.stored_on == me
                   and r.state in (ReplicaState.PRESENT, ReplicaState.DAMAGED) for r in rows)
        if (here or part == me) and on_disk:
            # Own part or a peer's kept here; a file that is gone falls through to the tiers.
            found.append(_Copy(f"hot on {me}", directory=local))
        for tier in shared:
            aggregate = ck.replica(tier.name)
            if aggregate is not None and aggregate.sealed:
                # Sealed (an encrypted tier): ciphertext objects, not the part's files;
                # read only whole, with a key (parts_source's ``unseal``).
                continue
            whole = aggregate is not None and aggregate.state == ReplicaState.PRESENT
            row = any(r.tier == tier.name and r.part == part and r.stored_on is None
                      and r.state == ReplicaState.PRESENT for r in rows)
            if (whole or row) and tier.readable:
                found.append(_Copy(tier.name, tier=tier))
        copies[part] = found
    return copies


#: ``thaw(store, ck)``: a readable view of ``ck``'s archival copy once thawed, None without
#: one; raises ThawPendingError while thawing (:func:`ckptstore.ops.tiering.thaw.thawed_source`,
#: which callers pass in: it reads manifests through ``ops/tiering/replicas.py``, above this
#: module).
ThawHook = Callable[[StoreCore, Checkpoint], Tier | None]


#: ``unseal(store, ck)``: decrypt a sealed (encrypted tier) copy of ``ck`` onto this host's
#: disk, recording every part as kept here; False when there is none
#: (:func:`ckptstore.ops.tiering.restore.unseal_parts_here`, passed in by callers: it sits
#: above this module).
UnsealHook = Callable[[StoreCore, Checkpoint], bool]


def parts_source(store: StoreCore, ck: Checkpoint, *, thaw: ThawHook | None = None,
                 unseal: UnsealHook | None = None) -> tuple[Manifest, PartsSource]:
    """The manifest of a parted checkpoint and a source reading each part from its best copy.

    Args:
        store: The open store.
        ck: The checkpoint.
        thaw: Called when some part is readable nowhere, for the archival copy.
        unseal: Called first when some part is readable nowhere: a sealed copy restored
            onto this host's disk makes every part readable here.

    Raises:
        CheckpointNotFoundError: If the catalog holds no manifest for it.
        IntegrityError: If the catalogued manifest is damaged.
        ThawPendingError: If a part is readable only from an archival (GLACIER) copy that
            is not thawed yet (its thaw is requested and recorded).
    """
    if not ck.parted:
        raise CheckpointNotFoundError(f"{ck.ref} ({ck.id}) is not a checkpoint saved in parts")
    manifest, _ = parted_manifest(store, ck)
    ranks = rank_hosts(store.catalog.part_ranks(ck.id))
    copies = _part_copies(store, ck, sorted(set(ranks.values())))
    lacking = [h for h, found in copies.items() if not found]
    if lacking and unseal is not None and unseal(store, ck):
        ck = store.catalog.get_any(ck.id)
        copies = _part_copies(store, ck, sorted(set(ranks.values())))
        lacking = [h for h, found in copies.items() if not found]
    if lacking:
        # Some part is readable nowhere, but the archival (GLACIER) copy holds every part:
        # asks S3 to restore it and raises ThawPendingError until all objects are readable.
        # A parted checkpoint is then read in place from the thawed objects (no part is
        # gathered first), so its thaw is done once they are readable.
        thawed = thaw(store, ck) if thaw is not None else None
        if thawed is not None:
            for part in lacking:
                copies[part].append(_Copy(f"{thawed.name} (thawed)", tier=thawed))
            store.catalog.finish_thaw(ck.id, thawed.name)
    return manifest, PartsSource(ck, manifest, ranks, copies,
                                 store.checkpoint_dir(ck.run, ck.id))


def verify_parts_here(store: StoreCore, ck: Checkpoint, *, deep: bool = True) -> list[str]:
    """Check the parts of a parted checkpoint this host's disk holds; record what was found.

    Each part copy the catalog lists on this host becomes PRESENT (verified now) when every
    file of it is intact, DAMAGED otherwise.

    Returns:
        One line per problem; empty when intact (or when this host holds no part).
    """
    me = host()
    mine = [p for p in store.catalog.parts(ck.id, "hot") if p.stored_on == me
            and p.state in (ReplicaState.PRESENT, ReplicaState.DAMAGED)]
    if not mine:
        return []
    directory = materialize(store, ck)
    if directory is None:
        problems = [f"{store.checkpoint_dir(ck.run, ck.id)}: missing"]
        for p in mine:
            store.catalog.set_part(ck.id, "hot", p.part, stored_on=me,
                                   state=ReplicaState.DAMAGED)
        return problems
    manifest, _ = parted_manifest(store, ck)
    ranks = store.catalog.part_ranks(ck.id)
    problems = []
    for p in mine:
        wanted = set(ranks.get(p.part, []))
        found = verify_dcp(directory, manifest, deep=deep, include=of_ranks(wanted))
        problems += [f"part of {p.part}: {line}" for line in found]
        store.catalog.set_part(ck.id, "hot", p.part, stored_on=me,
                               state=ReplicaState.DAMAGED if found else ReplicaState.PRESENT,
                               verified=not found)
    return problems


def of_ranks(ranks: set[int]) -> Callable[[str], bool]:
    """Accepts the relative paths of the files those ranks wrote (``verify_dcp(include=)``)."""
    return lambda rel: rank_of_file(rel) in ranks


def remove_local_parts(store: StoreCore, ck: Checkpoint, *, parts: Iterable[str] | None = None
                       ) -> int:
    """Delete the part copies of ``ck`` this host's disk holds (all, or only ``parts``).

    Each copy is marked DELETING and its files removed; when none is left on this host the
    directory goes too (marker first, so it never looks committed); only then are the copies
    marked DELETED, so a DELETED copy (and the aggregate replica the last one turns DELETED)
    never has files left on disk.

    Returns:
        Number of files deleted.

    Raises:
        StorageError: If a file cannot be removed (the copy stays DELETING; rerun).
    """
    me = host()
    wanted = None if parts is None else set(parts)
    live = [p for p in store.catalog.parts(ck.id, "hot") if p.stored_on == me
            and p.state != ReplicaState.DELETED]
    rows = [p for p in live if wanted is None or p.part in wanted]
    keeps_others = len(rows) < len(live)
    directory = store.checkpoint_dir(ck.run, ck.id)
    ranks = store.catalog.part_ranks(ck.id)
    deleted = 0
    for row in rows:
        store.catalog.set_part(ck.id, "hot", row.part, stored_on=me,
                               state=ReplicaState.DELETING)
        mine = set(ranks.get(row.part, []))
        (directory / COMMIT_NAME).unlink(missing_ok=True)
        for path in sorted(directory.rglob("*")) if directory.is_dir() else []:
            rel = str(path.relative_to(directory))
            if path.is_file() and rank_of_file(rel) in mine:
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise StorageError(
                        f"cannot delete {path}: {exc.strerror or exc}; check permissions "
                        "and rerun `ckpt gc` (the part stays DELETING until then)"
                    ) from exc
                deleted += 1
    if not keeps_others and directory.exists():
        (directory / COMMIT_NAME).unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
    for row in rows:
        store.catalog.set_part(ck.id, "hot", row.part, stored_on=me,
                               state=ReplicaState.DELETED, bytes=0, files=0)
    logger.info("removed %d files of %s's parts on %s", deleted, ck.ref, me)
    return deleted


def gather_parts(store: StoreCore, ck: Checkpoint, directory: Path, *,
                 record: bool, thaw: ThawHook | None = None) -> int:
    """Copy every part of ``ck`` into ``directory`` from its best copy, then verify it whole.

    What ``ckpt restore`` does with a checkpoint saved across hosts: the result is one
    complete directory. With ``record`` (``directory`` is this host's hot directory of the
    checkpoint) each part copied is recorded as kept on this host.

    Returns:
        Bytes copied.

    Raises:
        IncompleteCheckpointError: If a part has no copy this host can read.
        IntegrityError: If the result fails verification.
    """
    manifest, data = parted_manifest(store, ck)
    ranks = store.catalog.part_ranks(ck.id)
    _, source = parts_source(store, ck, thaw=thaw)
    missing = source.missing()
    if missing:
        raise IncompleteCheckpointError(
            f"checkpoint {ck.ref} ({ck.id}) cannot be restored here: the parts of "
            f"{', '.join(missing)} exist on no tier this host can read; bring those hosts back "
            "or archive their parts from them first"
        )
    directory.mkdir(parents=True, exist_ok=True)  # only now: nothing is made for a refusal
    me = host()
    local = store.checkpoint_dir(ck.run, ck.id)
    kept = {p.part for p in store.catalog.parts(ck.id, "hot")
            if p.stored_on == me and p.state == ReplicaState.PRESENT}
    total = 0
    for part, part_ranks in sorted(ranks.items()):
        files = part_files(manifest, part_ranks)
        copies = source.copies.get(part, [])
        if record and part not in kept:
            store.catalog.set_part(ck.id, "hot", part, stored_on=me, state=ReplicaState.COPYING)
        for rel, size in files:
            target = directory / rel
            if target.is_file() and target.stat().st_size == size and directory == local:
                continue  # this host's own part (verified below with the rest)
            problems = []
            for copy in copies:
                try:
                    if copy.directory is not None:
                        blob = (copy.directory / rel).read_bytes()
                    else:
                        assert copy.tier is not None
                        blob = copy.tier.get_bytes(copy.tier.key_for(ck.run, ck.id, rel))
                    break
                except (OSError, StorageError) as exc:
                    problems.append(f"{copy.name}: {exc}")
            else:
                raise IntegrityError(
                    f"{rel} of the part of {part} of {ck.ref} is in no copy "
                    f"({'; '.join(problems)}); run `ckpt verify {ck.ref}`"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            target.write_bytes(blob)
            total += len(blob)
    _write_shared(directory, manifest, data)
    problems = verify_dcp(directory, manifest, deep=True)
    if problems:
        raise IntegrityError(
            f"the copy of {ck.ref} gathered in {directory} fails verification: "
            + "; ".join(problems[:5])
        )
    if record:
        record_gathered(store, ck, manifest, directory)
    return total


def record_gathered(store: StoreCore, ck: Checkpoint, manifest: Manifest,
                    directory: Path) -> None:
    """Record every part of ``ck`` as kept on this host, whose hot ``directory`` now holds
    all of them (verified), and the hot copy as whole again."""
    me = host()
    ranks = store.catalog.part_ranks(ck.id)
    sizes = {p.host: p for p in part_specs(manifest, _hosts_by_rank(ranks))}
    for part in ranks:
        spec = sizes[part]
        store.catalog.set_part(ck.id, "hot", part, stored_on=me, state=ReplicaState.PRESENT,
                               bytes=spec.bytes, files=spec.files, verified=True)
    # Every part is on this host's disk now: the hot copy is whole again.
    store.catalog.complete_parts(ck.id, "hot", uri=str(directory))


def _hosts_by_rank(ranks: Mapping[str, Iterable[int]]) -> tuple[str, ...]:
    by_rank = rank_hosts(ranks)
    return tuple(by_rank[r] for r in sorted(by_rank))
