"""Snapshot areas: where each process of a run keeps its snapshots in shared memory.

One row per (run, host, rank), recorded when a process creates its snapshot slots
(:mod:`ckptstore.ops.writing.snapshot`) and never per snapshot: which slot holds the newest
complete snapshot is in the slots' own headers, so snapshotting every step costs the catalog
nothing. The rows tell operators and other hosts which hosts hold a run's snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select

from ckptstore.catalog.core import CatalogCore
from ckptstore.catalog.models import RunRow, SnapshotAreaRow, utcnow
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError
from ckptstore.names import validate_name

__all__ = ["SnapshotArea", "SnapshotsMixin"]

_MAX_URI = 4096


@dataclass(frozen=True)
class SnapshotArea:
    """One process's snapshot slots.

    Attributes:
        run: Run name.
        host: Host whose shared memory holds the slots.
        rank: The process's rank.
        uri: The slot directory (``shm://<host><path>``).
        slots: Number of slots.
        slot_bytes: Bytes of each slot file.
        updated_at: When the slots were last created.
    """

    run: str
    host: str
    rank: int
    uri: str
    slots: int
    slot_bytes: int
    updated_at: datetime


class SnapshotsMixin(CatalogCore):
    """Snapshot-area methods of :class:`~ckptstore.catalog.Catalog`."""

    def record_snapshot_area(self, run: str, host: str, rank: int, uri: str, *,
                             slots: int, slot_bytes: int) -> None:
        """Record (or update) where ``run``'s process ``rank`` on ``host`` keeps snapshots.

        Raises:
            CheckpointNotFoundError: If the run does not exist.
            InvalidNameError: For a bad run name, host, rank, URI or size.
        """
        validate_name(run)
        if not host or len(host) > 255:
            raise InvalidNameError(f"host must be 1-255 characters, got {host!r}")
        for label, value in (("rank", rank), ("slots", slots), ("slot_bytes", slot_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidNameError(f"{label} must be an int >= 0, got {value!r}")
        if not uri or len(uri) > _MAX_URI:
            raise InvalidNameError(f"snapshot uri must be 1-{_MAX_URI} characters")
        now = utcnow()
        with self._write() as s:
            run_id = s.scalar(select(RunRow.id).where(RunRow.name == run))
            if run_id is None:
                raise CheckpointNotFoundError(f"run {run!r} does not exist")
            values = {"uri": uri, "slots": slots, "slot_bytes": slot_bytes, "updated_at": now}
            s.execute(self._insert(SnapshotAreaRow)
                      .values(run_id=run_id, host=host, rank=rank, **values)
                      .on_conflict_do_update(index_elements=["run_id", "host", "rank"],
                                             set_=values))

    def snapshot_areas(self, run: str | None = None) -> list[SnapshotArea]:
        """Snapshot areas, of one run or of all, by run, host and rank."""
        query = (select(RunRow.name, SnapshotAreaRow)
                 .join(RunRow, RunRow.id == SnapshotAreaRow.run_id)
                 .order_by(RunRow.name, SnapshotAreaRow.host, SnapshotAreaRow.rank))
        if run is not None:
            query = query.where(RunRow.name == run)
        with self._read() as s:
            return [
                SnapshotArea(name, row.host, row.rank, row.uri, row.slots, row.slot_bytes,
                             row.updated_at)
                for name, row in s.execute(query).tuples().all()
            ]

    def forget_snapshot_area(self, run: str, host: str, rank: int) -> bool:
        """Remove one area's row; return whether there was one."""
        with self._write() as s:
            run_id = s.scalar(select(RunRow.id).where(RunRow.name == run))
            if run_id is None:
                return False
            result = s.execute(delete(SnapshotAreaRow).where(
                SnapshotAreaRow.run_id == run_id, SnapshotAreaRow.host == host,
                SnapshotAreaRow.rank == rank))
            return bool(getattr(result, "rowcount", 0))
