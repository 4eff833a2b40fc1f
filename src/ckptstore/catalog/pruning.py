"""The end of a checkpoint's life: deletion (DELETING → DELETED) and finding dead saves.

Retention and gc flows decide WHAT to delete; these methods make each step a checked state
transition, and refuse to start deleting anything that must be kept (pinned, aliased, or the
base of a live delta checkpoint) whatever a flow decided.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update

from ckptstore.catalog.checkpoints import CheckpointsMixin, transition
from ckptstore.catalog.checks import check_checkpoint_id, check_positive
from ckptstore.catalog.loading import checkpoint_query, load_checkpoints
from ckptstore.catalog.models import AliasRow, CheckpointRow, ReplicaRow, utcnow
from ckptstore.errors import CheckpointNotFoundError, ConflictError, InvalidNameError
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState

__all__ = ["PruningMixin"]

C = CheckpointRow
PENDING = CheckpointState.PENDING
COMMITTED = CheckpointState.COMMITTED


class PruningMixin(CheckpointsMixin):
    """Deletion and gc methods of :class:`~ckptstore.catalog.Catalog`."""

    def mark_deleting(self, ckpt_id: str) -> Checkpoint:
        """Start deleting a checkpoint: COMMITTED or FAILED → DELETING (idempotent).

        Refused while anything still needs the checkpoint, as a last line of defence behind
        the retention policies: a pin, an alias, or a live delta that uses it as its base.

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
            ConflictError: If it is PENDING or DELETED, pinned, aliased, or a live base.
        """
        cid = check_checkpoint_id(ckpt_id)
        with self._write() as s:
            row = s.execute(
                select(C.state, C.pinned).where(C.id == cid).with_for_update(key_share=True)
            ).first()
            if row is None:
                raise CheckpointNotFoundError(f"no checkpoint has id {cid}")
            if row.state == CheckpointState.DELETING:
                return self._load(s, cid)
            if row.state not in (COMMITTED, CheckpointState.FAILED):
                raise ConflictError(
                    f"checkpoint {cid} is {row.state.value}; only COMMITTED or FAILED "
                    "checkpoints can be deleted"
                )
            aliases = list(s.scalars(select(AliasRow.name).where(AliasRow.checkpoint_id == cid)))
            if row.pinned or aliases:
                what = "pinned" if row.pinned else f"aliased as {', '.join(sorted(aliases))}"
                raise ConflictError(
                    f"checkpoint {cid} is {what} and is never pruned; unpin/unalias it first"
                )
            dependents = list(
                s.scalars(
                    select(C.id).where(C.base_id == cid, C.state.in_((PENDING, COMMITTED))).limit(5)
                )
            )
            if dependents:
                raise ConflictError(
                    f"checkpoint {cid} is the base of delta checkpoint(s) {', '.join(dependents)}; "
                    "delete or compact those first"
                )
            s.execute(update(C).where(C.id == cid).values(state=CheckpointState.DELETING))
            return self._load(s, cid)

    def mark_deleted(self, ckpt_id: str) -> Checkpoint:
        """Finish deleting: DELETING → DELETED (idempotent); every replica becomes DELETED.

        The row, its metrics, tags and events stay, so lineage and history remain readable.
        Logs a ``deleted`` event.

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
            ConflictError: If the checkpoint is not DELETING.
        """
        cid = check_checkpoint_id(ckpt_id)
        now = utcnow()
        with self._write() as s:
            if s.scalar(select(C.state).where(C.id == cid)) == CheckpointState.DELETED:
                return self._load(s, cid)
            transition(s, cid, CheckpointState.DELETING, CheckpointState.DELETED)
            s.execute(
                update(ReplicaRow)
                .where(ReplicaRow.checkpoint_id == cid)
                .values(state=ReplicaState.DELETED, updated_at=now)
            )
            ck = self._load(s, cid)
            self._add_event(
                s,
                "deleted",
                checkpoint_id=cid,
                run_id=self._run_id(s, ck.run),
                detail={"step": ck.step, "version": ck.version},
            )
            return ck

    def stale_pending(self, *, older_than_s: float) -> list[Checkpoint]:
        """PENDING checkpoints created more than ``older_than_s`` seconds ago, oldest first.

        These are saves that died or hang; gc marks them FAILED and removes their files.
        """
        age = check_positive(older_than_s, "older_than_s")
        cutoff = utcnow() - timedelta(seconds=age)
        with self._read() as s:
            stmt = (
                checkpoint_query()
                .where(C.state == PENDING, C.created_at < cutoff)
                .order_by(C.created_at, C.id)
            )
            return load_checkpoints(s, stmt)

    def pending_by_writer(self, host: str) -> list[Checkpoint]:
        """PENDING checkpoints written by processes on ``host`` (``writer`` = ``host:pid``).

        gc checks whether each pid is still alive to find saves of dead local processes.
        """
        if not isinstance(host, str) or not host:
            raise InvalidNameError(f"host must be a non-empty string, got {host!r}")
        with self._read() as s:
            stmt = (
                checkpoint_query()
                .where(C.state == PENDING, C.writer.startswith(f"{host}:", autoescape=True))
                .order_by(C.created_at, C.id)
            )
            return load_checkpoints(s, stmt)
