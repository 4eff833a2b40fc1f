"""Parts of parted checkpoints, the hosts that hold them, and the manifests they share.

A distributed save across hosts without a shared filesystem leaves one part of the hot copy on
each host (the files its ranks wrote); archiving uploads each host's part from that host. The
catalog is the one place that knows where every part is: one ``replica_parts`` row per
(checkpoint, tier, part host, stored-on host), a few per host and save, never one per chunk.

The tier's aggregate replica row (``replicas``) stays what every other operation reads:
:meth:`PartsMixin.set_part` keeps it consistent with the parts in the same transaction, and a
copy becomes PRESENT only through :meth:`PartsMixin.commit_parted` (the save) or
:meth:`PartsMixin.complete_parts` (the last part is in and the copy's marker is written), so
a partial copy is never mistaken for a complete one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from ckptstore.catalog.checkpoints import CheckpointsMixin, transition
from ckptstore.catalog.checks import check_checkpoint_id, check_replica_state, check_tier
from ckptstore.catalog.models import (
    CheckpointManifestRow,
    CheckpointRow,
    HostRow,
    ReplicaPartRow,
    ReplicaRow,
    utcnow,
)
from ckptstore.errors import CheckpointNotFoundError, IncompleteCheckpointError, InvalidNameError
from ckptstore.records import (
    TIER_ORDER,
    Checkpoint,
    CheckpointState,
    HostInfo,
    PartSpec,
    Replica,
    ReplicaPart,
    ReplicaState,
)

__all__ = ["SHARED", "PartsMixin", "check_host"]

logger = logging.getLogger("ckptstore.catalog")

C = CheckpointRow
P = ReplicaPartRow
R = ReplicaRow

#: ``stored_on`` of a part on a tier every host reaches (S3): primary keys cannot be NULL.
SHARED = ""

_HOST_LEN = 255
# Best copy of a part first: a part is as good as its best copy.
_RANK = {
    ReplicaState.PRESENT: 4,
    ReplicaState.COPYING: 3,
    ReplicaState.DAMAGED: 2,
    ReplicaState.DELETING: 1,
    ReplicaState.DELETED: 0,
}


def check_host(value: object, what: str = "host") -> str:
    """A host name as recorded in the catalog: 1-255 printable characters, no ``/``.

    Raises:
        InvalidNameError: Otherwise.
    """
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= _HOST_LEN
        or not value.isprintable()
        or "/" in value
        or value != value.strip()
    ):
        raise InvalidNameError(
            f"{what} must be 1-{_HOST_LEN} printable characters without '/' or surrounding "
            f"spaces, got {value!r}; set CKPT_HOST to a plain host name"
        )
    return value


def _stored(value: str | None) -> str:
    return SHARED if value is None else check_host(value, "stored_on host")


def _part(row: Any) -> ReplicaPart:
    return ReplicaPart(
        tier=row.tier,
        part=row.part_host,
        stored_on=row.stored_on or None,
        state=row.state,
        bytes=row.bytes,
        files=row.files,
        verified_at=row.verified_at,
    )


def _tier_key(tier: str) -> tuple[int, str]:
    return (TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER), tier)


class PartsMixin(CheckpointsMixin):
    """Part, host and shared-manifest methods of :class:`~ckptstore.catalog.Catalog`."""

    # ------------------------------------------------------------------ the save
    def commit_parted(
        self,
        ckpt_id: str,
        *,
        manifest: bytes,
        manifest_digest: str,
        logical_bytes: int,
        stored_bytes: int,
        parts: Sequence[PartSpec],
        shared: bool = False,
        uri: str = "",
    ) -> Checkpoint:
        """Commit a parted save: its row, its manifest, one hot part per host, one event.

        One transaction: the checkpoint becomes COMMITTED, its hot copy PRESENT (verified)
        and each host's part PRESENT on that host (or on the shared hot tier), together or
        not at all. The hosts are recorded as seen (role ``saver``).

        Args:
            ckpt_id: The PENDING checkpoint.
            manifest: The manifest bytes (any host materialises its part's copy from them).
            manifest_digest: Their digest.
            logical_bytes: Bytes of the state before encoding.
            stored_bytes: Bytes of every chunk file.
            parts: What each host's ranks wrote.
            shared: The hot tier is one object store every host reaches (``hot =
                "s3://..."``): the parts are stored on no host in particular.
            uri: Where the hot copy lives (recorded on the aggregate replica).

        Returns:
            The COMMITTED checkpoint.

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
            ConflictError: If it is not PENDING (gc marked it FAILED meanwhile).
            InvalidNameError: For an empty part list, a bad host name or a duplicate host.
        """
        cid = check_checkpoint_id(ckpt_id)
        if not parts:
            raise InvalidNameError("a parted commit needs at least one part")
        hosts = [check_host(p.host) for p in parts]
        if len(set(hosts)) != len(hosts):
            raise InvalidNameError(f"parts name a host twice: {sorted(hosts)}")
        if not isinstance(manifest, bytes | bytearray) or not manifest:
            raise InvalidNameError("the manifest bytes are empty")
        if not isinstance(manifest_digest, str) or not 0 < len(manifest_digest) <= 128:
            raise InvalidNameError("manifest_digest must be a non-empty string of <= 128 chars")
        now = utcnow()
        with self._write() as s:
            transition(
                s, cid, CheckpointState.PENDING, CheckpointState.COMMITTED,
                committed_at=now, manifest_digest=manifest_digest,
                logical_bytes=int(logical_bytes), stored_bytes=int(stored_bytes),
                part_hosts=sorted(hosts),
            )
            s.add(CheckpointManifestRow(
                checkpoint_id=cid, digest=manifest_digest, data=bytes(manifest),
                parts={p.host: sorted(int(r) for r in p.ranks) for p in parts},
            ))
            s.execute(self._insert(ReplicaPartRow), [
                {"checkpoint_id": cid, "tier": "hot", "part_host": p.host,
                 "stored_on": SHARED if shared else p.host, "state": ReplicaState.PRESENT,
                 "bytes": int(p.bytes), "files": int(p.files), "verified_at": now,
                 "updated_at": now}
                for p in parts
            ])
            stmt = self._insert(ReplicaRow).values(
                checkpoint_id=cid, tier="hot", uri=uri, state=ReplicaState.PRESENT,
                bytes=int(stored_bytes), verified_at=now, updated_at=now,
            )
            s.execute(stmt.on_conflict_do_update(
                index_elements=["checkpoint_id", "tier"],
                set_={k: stmt.excluded[k] for k in ("uri", "state", "bytes", "verified_at",
                                                     "updated_at")},
            ))
            self._seen(s, hosts, "saver", now)
            ck = self._load(s, cid)
            self._add_event(
                s, "saved", checkpoint_id=cid, run_id=self._run_id(s, ck.run),
                detail={"step": ck.step, "version": ck.version, "stored_bytes": stored_bytes,
                        "tier": "hot", "hosts": sorted(hosts), "shared": shared},
            )
            return ck

    # ------------------------------------------------------------------ parts
    def set_part(
        self,
        ckpt_id: str,
        tier: str,
        part: str,
        *,
        stored_on: str | None,
        state: ReplicaState | str,
        bytes: int | None = None,
        files: int | None = None,
        verified: bool = False,
        uri: str | None = None,
    ) -> Replica | None:
        """Record one copy of one host's part, and bring the tier's aggregate replica along.

        The aggregate never becomes PRESENT here (a copy is complete only once its marker is
        written: :meth:`complete_parts`). It becomes COPYING while parts arrive, DAMAGED when
        a complete copy loses the last copy of a part, DELETED once every part of a copy
        being deleted is gone.

        Args:
            ckpt_id: The checkpoint (any state).
            tier: Tier name.
            part: The host whose ranks wrote the part.
            stored_on: The host whose disk holds this copy; None on a shared tier (S3).
            state: New state of this copy.
            bytes: Its size (None keeps the stored value, 0 on creation).
            files: Its file count (likewise).
            verified: Set ``verified_at`` to now.
            uri: Recorded on the aggregate replica when this begins a new copy (there is
                none, or it is DELETED); a copy under way keeps the URI it began with.

        Returns:
            The tier's aggregate replica after the change (None if there is none).

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
            InvalidNameError: If the checkpoint is not parted or has no such part, or a
                value is invalid.
        """
        cid = check_checkpoint_id(ckpt_id)
        tier = check_tier(tier)
        part = check_host(part, "part host")
        where = _stored(stored_on)
        new_state = check_replica_state(state)
        for value, what in ((bytes, "bytes"), (files, "files")):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise InvalidNameError(f"part {what} must be a non-negative int, got {value!r}")
        now = utcnow()
        with self._write() as s:
            hosts = self._hosts_locked(s, cid)
            if part not in hosts:
                raise InvalidNameError(
                    f"checkpoint {cid} has no part of host {part!r}; its parts: "
                    f"{', '.join(hosts) or 'none (it is not a parted checkpoint)'}"
                )
            values: dict[str, Any] = {
                "checkpoint_id": cid, "tier": tier, "part_host": part, "stored_on": where,
                "state": new_state, "bytes": bytes or 0, "files": files or 0,
                "verified_at": now if verified else None, "updated_at": now,
            }
            stmt = self._insert(ReplicaPartRow).values(**values)
            changes: dict[str, Any] = {"state": stmt.excluded.state,
                                       "updated_at": stmt.excluded.updated_at}
            if bytes is not None:
                changes["bytes"] = stmt.excluded.bytes
            if files is not None:
                changes["files"] = stmt.excluded.files
            if verified:
                changes["verified_at"] = stmt.excluded.verified_at
            s.execute(stmt.on_conflict_do_update(
                index_elements=["checkpoint_id", "tier", "part_host", "stored_on"],
                set_=changes,
            ))
            return self._aggregate(s, cid, tier, hosts, now, uri)

    def complete_parts(self, ckpt_id: str, tier: str, *, uri: str | None = None) -> Replica:
        """Make a tier's copy PRESENT (verified) once every part is PRESENT there.

        Call it after the copy's marker was written: from then on the copy is used like any
        complete copy.

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
            IncompleteCheckpointError: If some part has no PRESENT copy on the tier (naming
                them).
        """
        cid = check_checkpoint_id(ckpt_id)
        tier = check_tier(tier)
        now = utcnow()
        with self._write() as s:
            hosts = self._hosts_locked(s, cid)
            best = self._best(s, cid, tier)
            missing = [h for h in hosts if best.get(h, (None, 0))[0] != ReplicaState.PRESENT]
            if not hosts or missing:
                raise IncompleteCheckpointError(
                    f"the {tier} copy of checkpoint {cid} is incomplete: no part of "
                    f"{', '.join(missing) or 'any host'} is there yet; archive it from those "
                    "hosts (`ckpt archive` there, or their agents)"
                )
            size = sum(best[h][1] for h in hosts)
            stmt = self._insert(ReplicaRow).values(
                checkpoint_id=cid, tier=tier, uri=uri or "", state=ReplicaState.PRESENT,
                bytes=size, verified_at=now, updated_at=now,
            )
            changes = {k: stmt.excluded[k] for k in ("state", "bytes", "verified_at",
                                                      "updated_at")}
            if uri is not None:
                changes["uri"] = stmt.excluded.uri
            s.execute(stmt.on_conflict_do_update(index_elements=["checkpoint_id", "tier"],
                                                 set_=changes))
            return self._replica(s, cid, tier)

    def parts(self, ckpt_id: str, tier: str | None = None) -> list[ReplicaPart]:
        """Every recorded copy of every part of a checkpoint (fastest tier first).

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
        """
        cid = check_checkpoint_id(ckpt_id)
        with self._read() as s:
            if s.scalar(select(C.id).where(C.id == cid)) is None:
                raise CheckpointNotFoundError(f"no checkpoint has id {cid}")
            stmt = select(P).where(P.checkpoint_id == cid)
            if tier is not None:
                stmt = stmt.where(P.tier == check_tier(tier))
            rows = [_part(r) for r in s.scalars(stmt)]
        return sorted(rows, key=lambda p: (_tier_key(p.tier), p.part, p.stored_on or ""))

    def parts_on(
        self,
        host: str | None,
        *,
        tier: str = "hot",
        states: Iterable[ReplicaState] | None = None,
    ) -> list[tuple[str, ReplicaPart]]:
        """The part copies one host's disk holds (None: those on shared tiers), by checkpoint.

        What a host's agent works through: the parts it can upload, prune or serve.

        Returns:
            ``(checkpoint id, part)`` pairs, oldest update first.
        """
        where = _stored(host)
        stmt = select(P).where(P.stored_on == where, P.tier == check_tier(tier))
        if states is not None:
            stmt = stmt.where(P.state.in_([check_replica_state(x) for x in states]))
        with self._read() as s:
            rows = list(s.scalars(stmt.order_by(P.updated_at, P.checkpoint_id)))
            return [(r.checkpoint_id, _part(r)) for r in rows]

    def part_ranks(self, ckpt_id: str) -> dict[str, list[int]]:
        """Which ranks wrote each host's part: ``{host: [ranks]}`` ({} if not parted)."""
        cid = check_checkpoint_id(ckpt_id)
        with self._read() as s:
            parts = s.scalar(select(CheckpointManifestRow.parts)
                             .where(CheckpointManifestRow.checkpoint_id == cid))
        return {str(h): [int(r) for r in ranks] for h, ranks in (parts or {}).items()}

    def manifest_bytes(self, ckpt_id: str) -> tuple[str, bytes]:
        """The catalogued manifest of a parted checkpoint: ``(digest, bytes)``.

        The caller checks the bytes against the digest before using them.

        Raises:
            CheckpointNotFoundError: If the checkpoint has no catalogued manifest.
        """
        cid = check_checkpoint_id(ckpt_id)
        with self._read() as s:
            row = s.execute(
                select(CheckpointManifestRow.digest, CheckpointManifestRow.data)
                .where(CheckpointManifestRow.checkpoint_id == cid)
            ).one_or_none()
        if row is None:
            raise CheckpointNotFoundError(
                f"checkpoint {cid} has no manifest in the catalog (only distributed saves "
                "across hosts or to object storage record one)"
            )
        return str(row.digest), bytes(row.data)

    def forget_parts(self, ckpt_id: str, tier: str) -> int:
        """Drop the DELETED part rows of one tier of a checkpoint; return how many."""
        cid = check_checkpoint_id(ckpt_id)
        with self._write() as s:
            result = s.execute(delete(P).where(
                P.checkpoint_id == cid, P.tier == check_tier(tier),
                P.state == ReplicaState.DELETED,
            ))
            return int(getattr(result, "rowcount", 0) or 0)

    def part_usage(self) -> list[tuple[str, str, str | None, int, int]]:
        """PRESENT part copies by tier, part host and stored-on host (None: shared tier):
        ``(tier, part, stored_on, checkpoints, bytes)`` rows, for ``ckpt tiers --hosts``."""
        stmt = (
            select(P.tier, P.part_host, P.stored_on, func.count(), func.sum(P.bytes))
            .where(P.state == ReplicaState.PRESENT)
            .group_by(P.tier, P.part_host, P.stored_on)
        )
        with self._read() as s:
            rows = s.execute(stmt).all()
        out = [(str(t), str(h), (str(o) or None), int(n), int(b or 0)) for t, h, o, n, b in rows]
        return sorted(out, key=lambda r: (_tier_key(r[0]), r[1], r[2] or ""))

    # ------------------------------------------------------------------ hosts
    def heartbeat(self, host: str, role: str = "agent", *, at: datetime | None = None) -> None:
        """Record that ``host`` is alive (agents every few seconds, savers at each commit)."""
        name = check_host(host)
        if not isinstance(role, str) or len(role) > 32:
            raise InvalidNameError(f"host role must be a string of <= 32 chars, got {role!r}")
        when = at or utcnow()
        with self._write() as s:
            self._seen(s, [name], role, when)

    def hosts(self) -> list[HostInfo]:
        """Every host the catalog has heard from, by name."""
        with self._read() as s:
            rows = s.scalars(select(HostRow).order_by(HostRow.name))
            return [HostInfo(r.name, r.first_seen, r.last_seen, r.role) for r in rows]

    # ------------------------------------------------------------------ helpers
    def _seen(self, s: Session, hosts: Sequence[str], role: str, when: datetime) -> None:
        stmt = self._insert(HostRow).values(
            [{"name": h, "first_seen": when, "last_seen": when, "role": role} for h in hosts]
        )
        s.execute(stmt.on_conflict_do_update(
            index_elements=["name"],
            set_={"last_seen": stmt.excluded.last_seen, "role": stmt.excluded.role},
        ))

    @staticmethod
    def _hosts_locked(s: Session, cid: str) -> list[str]:
        # The checkpoint row is the lock that serialises aggregate updates from many hosts
        # (PostgreSQL; SQLite's write transactions are exclusive anyway).
        row = s.execute(select(C.part_hosts).where(C.id == cid).with_for_update()).one_or_none()
        if row is None:
            raise CheckpointNotFoundError(f"no checkpoint has id {cid}")
        return [str(h) for h in (row.part_hosts or [])]

    @staticmethod
    def _best(s: Session, cid: str, tier: str) -> dict[str, tuple[ReplicaState, int]]:
        best: dict[str, tuple[ReplicaState, int]] = {}
        rows = s.execute(select(P.part_host, P.state, P.bytes)
                         .where(P.checkpoint_id == cid, P.tier == tier))
        for host, state, size in rows:
            if host not in best or _RANK[state] > _RANK[best[host][0]]:
                best[host] = (state, int(size))
        return best

    def _aggregate(self, s: Session, cid: str, tier: str, hosts: Sequence[str],
                   now: datetime, uri: str | None) -> Replica | None:
        best = self._best(s, cid, tier)
        states = [best[h][0] if h in best else ReplicaState.DELETED for h in hosts]
        complete = all(x == ReplicaState.PRESENT for x in states)
        live = any(x in (ReplicaState.PRESENT, ReplicaState.COPYING) for x in states)
        current = s.scalar(select(R.state).where(R.checkpoint_id == cid, R.tier == tier))
        new: ReplicaState | None
        if current == ReplicaState.DELETING:
            gone = all(x == ReplicaState.DELETED for x in states)
            new = ReplicaState.DELETED if gone else ReplicaState.DELETING
        elif current in (ReplicaState.PRESENT, ReplicaState.DAMAGED):
            new = ReplicaState.PRESENT if complete else ReplicaState.DAMAGED
        elif live:
            new = ReplicaState.COPYING
        else:
            new = ReplicaState.DELETED if current is not None else None
        if new is None:
            return None
        size = sum(best[h][1] for h in hosts if best.get(h, (None, 0))[0]
                   == ReplicaState.PRESENT)
        values: dict[str, Any] = {"checkpoint_id": cid, "tier": tier, "uri": uri or "",
                                  "state": new, "bytes": size, "updated_at": now}
        stmt = self._insert(ReplicaRow).values(**values)
        changes = {k: stmt.excluded[k] for k in ("state", "bytes", "updated_at")}
        if uri is not None and current in (None, ReplicaState.DELETED):
            # Only a new copy takes the URI: the hosts uploading parts of one copy agree on
            # where it lives through this row (a sealed copy's random prefix is chosen by
            # whichever host begins it, and the others read it back from here).
            changes["uri"] = stmt.excluded.uri
        s.execute(stmt.on_conflict_do_update(index_elements=["checkpoint_id", "tier"],
                                             set_=changes))
        return self._replica(s, cid, tier)

    @staticmethod
    def _replica(s: Session, cid: str, tier: str) -> Replica:
        row = s.execute(
            select(R.tier, R.uri, R.state, R.bytes, R.verified_at, R.manifest_digest)
            .where(R.checkpoint_id == cid, R.tier == tier)
        ).one()
        return Replica(tier=row.tier, uri=row.uri, state=row.state, bytes=row.bytes,
                       verified_at=row.verified_at, manifest_digest=row.manifest_digest)

