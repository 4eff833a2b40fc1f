"""The checkpoint life cycle up to COMMITTED: PENDING → COMMITTED, or FAILED.

Deletion (COMMITTED → DELETING → DELETED) lives in :mod:`ckptstore.catalog.pruning`.

Version allocation is the one read-modify-write that must never race: ``version`` is
``max(version of the run) + 1`` and has to be unique and gap-free with several processes
saving into the same run. On SQLite the write transaction starts with ``BEGIN IMMEDIATE``, so
writers are serialised before they read the maximum. On PostgreSQL the run row is locked
(``SELECT ... FOR NO KEY UPDATE``) before the maximum is read; under READ COMMITTED that read
then sees every version committed by the previous lock holder.

State changes are conditional ``UPDATE ... WHERE state = <expected>`` statements, so two
processes flipping the same row cannot both succeed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, cast

from sqlalchemy import CursorResult, func, insert, null, select, update
from sqlalchemy.orm import Session

from ckptstore.catalog.checks import (
    check_checkpoint_id,
    check_count,
    check_finite,
    check_metrics,
    check_step,
    check_tags,
    check_tier,
)
from ckptstore.catalog.core import default_writer
from ckptstore.catalog.loading import load_by_id
from ckptstore.catalog.models import (
    CheckpointMetricRow,
    CheckpointRow,
    CheckpointTagRow,
    ReplicaRow,
    utcnow,
)
from ckptstore.catalog.resolve import resolve_any
from ckptstore.catalog.runs import RunsMixin
from ckptstore.errors import (
    CheckpointNotFoundError,
    ConflictError,
    IncompleteCheckpointError,
    InvalidNameError,
)
from ckptstore.names import validate_name
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState

__all__ = ["CheckpointsMixin", "transition"]

logger = logging.getLogger("ckptstore.catalog")

C = CheckpointRow
PENDING = CheckpointState.PENDING
COMMITTED = CheckpointState.COMMITTED
KINDS = ("full", "delta")


def _check_bytes(value: object, what: str) -> int:
    # BigInteger columns (models.py): larger values fail only in the driver.
    return check_count(value, what)


def _check_short_text(value: object, what: str, max_len: int) -> str:
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise InvalidNameError(f"{what} must be a non-empty string of at most {max_len} chars")
    return value


class CheckpointsMixin(RunsMixin):
    """Checkpoint life-cycle methods of :class:`~ckptstore.catalog.Catalog`."""

    def begin_checkpoint(
        self,
        run: str,
        step: int,
        *,
        ckpt_id: str | None = None,
        metrics: Mapping[str, float] | None = None,
        tags: Iterable[str] = (),
        parent_id: str | None = None,
        kind: str = "full",
        base_id: str | None = None,
        codec: str = "none",
        lossy: bool = False,
        error_bound: float | None = None,
        writer: str | None = None,
        tier: str = "hot",
        uri: str = "",
    ) -> Checkpoint:
        """Register a checkpoint that is about to be written (state PENDING).

        Allocates the run's next version atomically (unique and gap-free under concurrent
        writers on both backends), creates the run if needed, and records a COPYING replica
        on ``tier``. Nothing lists, loads or uses a PENDING checkpoint as a base until
        :meth:`commit_checkpoint`.

        Args:
            run: Run name (created if it does not exist).
            step: Training step (saving a step again makes a new version).
            ckpt_id: Id to use (a uuid); a fresh uuid4 by default.
            metrics: Metric values at save time; finite numbers only.
            tags: Tags for filtering.
            parent_id: Checkpoint this one was resumed or fine-tuned from (any run).
            kind: ``"full"`` or ``"delta"``.
            base_id: Base of a delta checkpoint; must be COMMITTED.
            codec: Codec preset name.
            lossy: Whether any stored value is approximate.
            error_bound: Largest absolute error of a lossy checkpoint.
            writer: ``host:pid`` of the saving process; this process by default.
            tier: Tier the checkpoint is written to.
            uri: Where on that tier, if already known.

        Returns:
            The PENDING checkpoint with its version.

        Raises:
            InvalidNameError: If a name, tag, metric or value is invalid.
            CheckpointNotFoundError: If ``parent_id`` or ``base_id`` does not exist.
            IncompleteCheckpointError: If the parent or base was never committed.
            ConflictError: If ``ckpt_id`` is already taken.
        """
        validate_name(run)
        step = check_step(step)
        cid = check_checkpoint_id(ckpt_id) if ckpt_id is not None else str(uuid.uuid4())
        values = check_metrics(metrics)
        tag_list = check_tags(tags)
        if kind not in KINDS:
            raise InvalidNameError(
                f"checkpoint kind must be one of {', '.join(KINDS)}, not {kind!r}"
            )
        if kind == "delta" and base_id is None:
            raise InvalidNameError("a delta checkpoint needs base_id (the checkpoint it extends)")
        parent = check_checkpoint_id(parent_id) if parent_id is not None else None
        base = check_checkpoint_id(base_id) if base_id is not None else None
        codec = _check_short_text(codec, "codec", 64)
        bound = None if error_bound is None else check_finite(error_bound, "error_bound")
        tier = check_tier(tier)
        writer = _check_short_text(writer or default_writer(), "writer", 300)
        now = utcnow()
        with self._write() as s:
            run_id = self._get_or_create_run(s, run)
            self._run_id(s, run, lock=True)
            self._check_link(s, parent, "parent", committed_only=False)
            self._check_link(s, base, "base", committed_only=True)
            if s.scalar(select(C.id).where(C.id == cid)) is not None:
                raise ConflictError(f"checkpoint id {cid} is already taken; omit ckpt_id")
            version = (s.scalar(select(func.max(C.version)).where(C.run_id == run_id)) or 0) + 1
            s.execute(
                insert(CheckpointRow).values(
                    id=cid,
                    run_id=run_id,
                    step=step,
                    version=version,
                    state=PENDING,
                    kind=kind,
                    base_id=base,
                    parent_id=parent,
                    metrics=values,
                    tags=sorted(tag_list),
                    codec=codec,
                    lossy=bool(lossy),
                    error_bound=bound,
                    writer=writer,
                    created_at=now,
                )
            )
            if tag_list:
                s.execute(
                    insert(CheckpointTagRow),
                    [
                        {
                            "checkpoint_id": cid,
                            "tag": t,
                            "run_id": run_id,
                            "step": step,
                            "version": version,
                        }
                        for t in tag_list
                    ],
                )
            if values:
                s.execute(
                    insert(CheckpointMetricRow),
                    [
                        {"checkpoint_id": cid, "name": k, "run_id": run_id, "value": v}
                        for k, v in values.items()
                    ],
                )
            s.execute(
                insert(ReplicaRow).values(
                    checkpoint_id=cid,
                    tier=tier,
                    uri=str(uri),
                    state=ReplicaState.COPYING,
                    bytes=0,
                    updated_at=now,
                )
            )
            logger.debug("began checkpoint %s: %s step %s v%s", cid, run, step, version)
            return self._load(s, cid)

    def commit_checkpoint(
        self,
        ckpt_id: str,
        *,
        manifest_digest: str,
        logical_bytes: int,
        stored_bytes: int,
        tier: str = "hot",
        replica_bytes: int | None = None,
        uri: str | None = None,
        lossy: bool | None = None,
        error_bound: float | None = None,
        lossy_scope: Iterable[str] | None = None,
    ) -> Checkpoint:
        """Flip a PENDING checkpoint to COMMITTED once its files are durable.

        The replica on ``tier`` becomes PRESENT and verified now; a ``saved`` event is logged.

        Args:
            ckpt_id: The checkpoint id from :meth:`begin_checkpoint`.
            manifest_digest: Digest of the written manifest.
            logical_bytes: Bytes of the state before encoding.
            stored_bytes: Bytes written.
            tier: Tier holding the written copy.
            replica_bytes: Bytes of that copy; ``stored_bytes`` by default.
            uri: Where the copy lives, if not given at :meth:`begin_checkpoint`.
            lossy: Whether the written checkpoint holds approximate values (None: as begun).
            error_bound: Its measured largest absolute error (None: as begun); it is only
                known once the chunks are written.
            lossy_scope: Key patterns of the tensors stored approximately (None: as begun).

        Returns:
            The COMMITTED checkpoint.

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
            ConflictError: If the checkpoint is not PENDING (already committed, or marked
                FAILED by gc because its writer looked dead).
        """
        cid = check_checkpoint_id(ckpt_id)
        digest = _check_short_text(manifest_digest, "manifest_digest", 128)
        logical = _check_bytes(logical_bytes, "logical_bytes")
        stored = _check_bytes(stored_bytes, "stored_bytes")
        copy_bytes = (
            stored if replica_bytes is None else _check_bytes(replica_bytes, "replica_bytes")
        )
        tier = check_tier(tier)
        extra: dict[str, Any] = {}
        if lossy is not None:
            extra["lossy"] = bool(lossy)
        if error_bound is not None:
            extra["error_bound"] = check_finite(error_bound, "error_bound")
        if lossy_scope is not None:
            extra["lossy_scope"] = [
                _check_short_text(p, "lossy_scope pattern", 300) for p in lossy_scope
            ]
        now = utcnow()
        with self._write() as s:
            transition(
                s,
                cid,
                PENDING,
                COMMITTED,
                committed_at=now,
                manifest_digest=digest,
                logical_bytes=logical,
                stored_bytes=stored,
                **extra,
            )
            values: dict[str, Any] = {
                "checkpoint_id": cid,
                "tier": tier,
                "uri": uri or "",
                "state": ReplicaState.PRESENT,
                "bytes": copy_bytes,
                "verified_at": now,
                "updated_at": now,
            }
            stmt = self._insert(ReplicaRow).values(**values)
            changes: dict[str, Any] = {
                k: stmt.excluded[k] for k in ("state", "bytes", "verified_at", "updated_at")
            }
            # The copy just written holds the checkpoint's own manifest (NULL digest).
            changes["manifest_digest"] = null()
            if uri is not None:
                changes["uri"] = stmt.excluded.uri
            s.execute(
                stmt.on_conflict_do_update(index_elements=["checkpoint_id", "tier"], set_=changes)
            )
            ck = self._load(s, cid)
            self._add_event(
                s,
                "saved",
                checkpoint_id=cid,
                run_id=self._run_id(s, ck.run),
                detail={
                    "step": ck.step,
                    "version": ck.version,
                    "stored_bytes": stored,
                    "tier": tier,
                },
            )
            return ck

    def fail_checkpoint(self, ckpt_id: str, reason: str) -> None:
        """Mark a PENDING checkpoint FAILED (its save died); logs a ``save_failed`` event.

        Idempotent for an already FAILED checkpoint.

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
            ConflictError: If the checkpoint is COMMITTED or being deleted.
        """
        cid = check_checkpoint_id(ckpt_id)
        with self._write() as s:
            state = s.scalar(select(C.state).where(C.id == cid))
            if state == CheckpointState.FAILED:
                return
            transition(s, cid, PENDING, CheckpointState.FAILED)
            run_id = s.scalar(select(C.run_id).where(C.id == cid))
            self._add_event(
                s, "save_failed", checkpoint_id=cid, run_id=run_id, detail={"reason": str(reason)}
            )
        logger.info("checkpoint %s marked FAILED: %s", cid, reason)

    def get_any(self, ckpt_id: str) -> Checkpoint:
        """The checkpoint with this id, in any state (for gc and flows).

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
        """
        cid = check_checkpoint_id(ckpt_id)
        with self._read() as s:
            return resolve_any(s, cid)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _load(session: Session, cid: str) -> Checkpoint:
        ck = load_by_id(session, cid)
        if ck is None:
            raise CheckpointNotFoundError(f"no checkpoint has id {cid}")
        return ck

    @staticmethod
    def _check_link(session: Session, cid: str | None, what: str, *, committed_only: bool) -> None:
        if cid is None:
            return
        state = session.scalar(select(C.state).where(C.id == cid))
        if state is None:
            raise CheckpointNotFoundError(f"{what} checkpoint {cid} does not exist")
        if state in (PENDING, CheckpointState.FAILED):
            raise IncompleteCheckpointError(
                f"{what} checkpoint {cid} was never committed (state {state.value})"
            )
        if committed_only and state != COMMITTED:
            raise CheckpointNotFoundError(
                f"{what} checkpoint {cid} was pruned (state {state.value}); pick a kept one"
            )


def transition(
    session: Session,
    cid: str,
    expected: CheckpointState,
    new: CheckpointState,
    **values: Any,
) -> None:
    """``UPDATE ... SET state = new WHERE id = cid AND state = expected``, or explain."""
    result = cast(
        "CursorResult[Any]",
        session.execute(
            update(C)
            .where(C.id == cid, C.state == expected)
            .values(state=new, **values)
            .execution_options(synchronize_session=False)
        ),
    )
    if result.rowcount == 1:
        return
    state = session.scalar(select(C.state).where(C.id == cid))
    if state is None:
        raise CheckpointNotFoundError(f"no checkpoint has id {cid}")
    hint = ""
    if expected == PENDING and state == CheckpointState.FAILED:
        hint = "; gc marked it FAILED (its writer looked dead): save again"
    elif expected == PENDING and state == COMMITTED:
        hint = "; it was already committed"
    raise ConflictError(
        f"checkpoint {cid} is {state.value}, not {expected.value}: cannot make it {new.value}{hint}"
    )
