"""Store-wide invariants, checked after every test that changes a store (and by fault tests).

:func:`check_invariants` returns human-readable violations (empty when the store is sound):

1. every COMMITTED checkpoint has at least one PRESENT replica;
2. every PRESENT replica on a local tier (the hot tier, or a local-path warm/cold tier) reads
   back: the manifest matches the catalog's digest (a re-encoded copy's: the replica's own
   digest, and its original manifest the checkpoint's, describing the same chunks), every
   chunk matches its hashes, and every tensor decodes;
3. every delta's base chain is COMMITTED (no missing or deleted base);
4. no PENDING row belongs to a dead writer on this host;
5. no directory on the hot tier lacks a catalog row, and none belongs to a DELETED checkpoint
   or to a DELETED hot replica, except one holding only chunk files that live checkpoints
   still read (dedup and delta bases are tracked per chunk).

Example:
    >>> assert check_invariants(store) == []  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from ckptstore.core import StoreCore
from ckptstore.errors import CheckpointNotFoundError, CkptError
from ckptstore.format import iter_tensors, verify_checkpoint
from ckptstore.numeric import decimal_or_none
from ckptstore.ops.tiering.reencode import read_copy_manifest
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState, expected_digest

__all__ = ["check_invariants"]

logger = logging.getLogger(__name__)


def check_invariants(store: StoreCore, *, deep: bool = True) -> list[str]:
    """Check the store-wide invariants.

    Args:
        store: The open store.
        deep: Re-hash and decode every local replica (False: manifests only).

    Returns:
        One line per violation; ``[]`` when every invariant holds.
    """
    problems: list[str] = []
    everything = store.catalog.list(state=None)
    by_id = {ck.id: ck for ck in everything}
    for ck in everything:
        if ck.state == CheckpointState.COMMITTED:
            problems.extend(_check_committed(store, ck, by_id, deep=deep))
        elif ck.state == CheckpointState.PENDING and _writer_dead(ck.writer):
            problems.append(f"{ck.ref} ({ck.id}) is PENDING but its writer {ck.writer} is dead")
    problems.extend(_check_hot_dirs(store, by_id))
    for line in problems:
        logger.warning("invariant violated: %s", line)
    return problems


def _check_committed(
    store: StoreCore, ck: Checkpoint, by_id: dict[str, Checkpoint], *, deep: bool
) -> list[str]:
    problems: list[str] = []
    name = f"{ck.ref} ({ck.id})"
    present = [r for r in ck.replicas if r.state == ReplicaState.PRESENT]
    if not present:
        where = ", ".join(f"{r.tier}:{r.state}" for r in ck.replicas) or "none"
        problems.append(f"{name} is COMMITTED but has no PRESENT replica (replicas: {where})")
    base_id, seen = ck.base_id, {ck.id}
    while base_id is not None:
        base = by_id.get(base_id)
        if base is None:
            problems.append(f"{name}: base {base_id} has no catalog row")
            break
        if base.state != CheckpointState.COMMITTED:
            problems.append(f"{name}: base {base.ref} ({base.id}) is {base.state}")
            break
        if base.id in seen:
            problems.append(f"{name}: base chain has a cycle at {base.id}")
            break
        seen.add(base.id)
        base_id = base.base_id
    for replica in present:
        directory = _local_dir(store, ck, replica.tier, replica.uri)
        if directory is None:
            continue  # remote replicas are the verify flow's job
        problems.extend(
            f"{name} on {replica.tier}: {p}"
            for p in _check_local_copy(store, ck, directory, replica.tier, deep=deep)
        )
    return problems


def _check_local_copy(
    store: StoreCore, ck: Checkpoint, directory: Path, tier: str, *, deep: bool
) -> list[str]:
    def locate(ckpt_id: str) -> Path:
        other = store.catalog.get_any(ckpt_id)
        replica = other.replica(tier)
        found = _local_dir(store, other, tier, replica.uri if replica is not None else "")
        if found is None:
            raise CheckpointNotFoundError(f"base {ckpt_id} has no local copy on {tier}")
        return found

    try:
        if ck.manifest_digest is None:
            return ["COMMITTED without a manifest digest"]
        # A re-encoded copy has its own digest and must prove the checkpoint's original.
        manifest = read_copy_manifest(directory, ck.manifest_digest,
                                      expected_digest(ck, tier))
        if not deep:
            return []
        problems = list(verify_checkpoint(directory, manifest, locate=locate, deep=True))
        if not problems:
            # Hashes match; decoding proves the chunks also load (codec, dtype, shape).
            for _key, _tensor in iter_tensors(directory, manifest, locate=locate):
                pass
        return problems
    except CkptError as exc:
        return [f"{type(exc).__name__}: {exc}"]


def _local_dir(store: StoreCore, ck: Checkpoint, tier: str, uri: str) -> Path | None:
    if tier == "hot":
        return store.checkpoint_dir(ck.run, ck.id)
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    if uri and "://" not in uri:
        return Path(uri)
    return None


def _writer_dead(writer: str | None) -> bool:
    if not writer:
        return False
    host, _, pid_text = writer.rpartition(":")
    pid = decimal_or_none(pid_text)
    if host != socket.gethostname() or not pid:
        return False  # another host's process: not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _kept_chunks_only(ck_dir: Path, still: set[tuple[str, str, int]]) -> bool:
    """Whether a directory holds only chunk files that live checkpoints read."""
    for path in ck_dir.rglob("*"):
        if not path.is_file():
            continue
        parts = path.relative_to(ck_dir).parts
        index = decimal_or_none(parts[2]) if len(parts) == 3 and parts[1] == "c" else None
        if index is None:
            return False
        if (ck_dir.name, parts[0], index) not in still:
            return False
    return True


def _check_hot_dirs(store: StoreCore, by_id: dict[str, Checkpoint]) -> list[str]:
    from ckptstore.ops.tiering.replicas import referenced_chunks

    problems: list[str] = []
    if not store.hot.is_dir():
        return problems
    try:
        still = referenced_chunks(store, "hot")
    except CkptError:
        # A live copy whose manifest cannot be read is reported by the replica checks; here it
        # only means no leftover directory can be excused as "chunks still read".
        still = set()
    for run_dir in sorted(store.hot.iterdir()):
        if not run_dir.is_dir() or run_dir.name.startswith("."):
            continue
        for ck_dir in sorted(run_dir.iterdir()):
            if not ck_dir.is_dir() or ck_dir.name.startswith("."):
                continue
            ck = by_id.get(ck_dir.name)
            if ck is None:
                problems.append(f"hot directory {ck_dir} has no catalog row")
            elif ck.state == CheckpointState.DELETED and not _kept_chunks_only(ck_dir, still):
                problems.append(f"hot directory {ck_dir} belongs to DELETED checkpoint {ck.ref}")
            elif (
                (hot := ck.replica("hot")) is not None
                and hot.state == ReplicaState.DELETED
                and not _kept_chunks_only(ck_dir, still)
            ):
                problems.append(f"hot directory {ck_dir} remains after its replica was DELETED")
            elif ck.run != run_dir.name:
                problems.append(f"hot directory {ck_dir} is filed under the wrong run ({ck.run})")
    return problems
