"""Run contexts: what made a run's checkpoints, and the blobs the contexts name.

A context document (:mod:`ckptstore.capture`) is recorded for a run at a version: on the
run's first save, and on a later save whose context differs from the run's newest (another
commit, config or environment). A checkpoint's context is the newest one recorded at or
before its version. Blobs (the uncommitted change, the lock of installed distributions)
are stored once per digest and checked against it on every read.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Mapping
from typing import Any

import blake3
from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptstore.catalog.core import CatalogCore, runs_hint
from ckptstore.catalog.models import ContextBlobRow, RunContextRow, RunRow, utcnow
from ckptstore.errors import CheckpointNotFoundError, IntegrityError, InvalidNameError
from ckptstore.names import validate_name
from ckptstore.records import Checkpoint, RunContext

__all__ = ["ContextsMixin"]

# Digest prefix of every blob (the same content address as capture.blob_digest).
_B3 = "b3:"


def _check_blob(digest: str, data: bytes) -> None:
    if not isinstance(digest, str) or not digest.startswith(_B3):
        raise InvalidNameError(f"blob digest must be 'b3:<hex>', not {digest!r}")
    if _B3 + blake3.blake3(data).hexdigest() != digest:
        raise IntegrityError(
            f"context blob {digest} does not match its content (blake3 "
            f"{_B3 + blake3.blake3(data).hexdigest()}); the catalog row is damaged"
        )


class ContextsMixin(CatalogCore):
    """Run-context methods of :class:`~ckptstore.catalog.Catalog`."""

    def record_context(
        self,
        run: str,
        from_version: int,
        document: Mapping[str, Any],
        digest: str,
        blobs: Mapping[str, bytes] | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        code_version: str | None = None,
        data_version: str | None = None,
    ) -> bool:
        """Record ``document`` as the run's context from ``from_version`` on, if it is new.

        The blobs are stored first (each checked against its digest; one already stored is
        kept), then the row, unless the run's newest context has the same ``digest``. The
        run's ``config``, ``code_version`` and ``data_version`` columns are filled where
        they are still empty, so listings and ``--where config.*`` see them.

        Returns:
            Whether a new context row was written.

        Raises:
            CheckpointNotFoundError: If the run does not exist.
            IntegrityError: If a blob does not match its digest.
            InvalidNameError: If the document is not JSON.
        """
        validate_name(run)
        try:
            doc = json.loads(json.dumps(dict(document), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise InvalidNameError(f"run context is not JSON: {exc}") from exc
        for key, data in (blobs or {}).items():
            _check_blob(key, data)
        with self._write() as s:
            run_id = self._context_run_id(s, run)
            newest = s.scalar(
                select(RunContextRow.digest)
                .where(RunContextRow.run_id == run_id)
                .order_by(RunContextRow.from_version.desc(), RunContextRow.id.desc())
                .limit(1)
            )
            if newest == digest:
                return False
            for key, data in (blobs or {}).items():
                s.execute(
                    self._insert(ContextBlobRow)
                    .values(digest=key, size=len(data), data=data, created_at=utcnow())
                    .on_conflict_do_nothing(index_elements=["digest"])
                )
            s.add(RunContextRow(run_id=run_id, from_version=int(from_version), digest=digest,
                                document=doc, created_at=utcnow()))
            row = s.get_one(RunRow, run_id)
            if config is not None and row.config is None:
                row.config = json.loads(json.dumps(dict(config), allow_nan=False))
            if code_version is not None and row.code_version is None:
                row.code_version = code_version[:200]
            if data_version is not None and row.data_version is None:
                row.data_version = data_version[:200]
            return True

    def run_contexts(self, run: str) -> builtins.list[RunContext]:
        """Every context recorded for a run, oldest first."""
        validate_name(run)
        with self._read() as s:
            run_id = self._context_run_id(s, run)
            rows = s.scalars(
                select(RunContextRow)
                .where(RunContextRow.run_id == run_id)
                .order_by(RunContextRow.from_version, RunContextRow.id)
            ).all()
            return [self._context(run, r) for r in rows]

    def context_of(self, ck: Checkpoint) -> RunContext | None:
        """The context a checkpoint was saved under; None for one saved before contexts."""
        with self._read() as s:
            run_id = self._context_run_id(s, ck.run)
            row = s.scalars(
                select(RunContextRow)
                .where(RunContextRow.run_id == run_id,
                       RunContextRow.from_version <= ck.version)
                .order_by(RunContextRow.from_version.desc(), RunContextRow.id.desc())
                .limit(1)
            ).first()
            return self._context(ck.run, row) if row is not None else None

    def context_blob(self, digest: str) -> bytes:
        """A blob a context names, checked against its digest.

        Raises:
            CheckpointNotFoundError: If no such blob is stored.
            IntegrityError: If the stored bytes do not match the digest.
        """
        if not isinstance(digest, str) or not digest.startswith(_B3):
            raise InvalidNameError(f"blob digest must be 'b3:<hex>', not {digest!r}")
        with self._read() as s:
            data = s.scalar(select(ContextBlobRow.data).where(ContextBlobRow.digest == digest))
        if data is None:
            raise CheckpointNotFoundError(f"no context blob {digest} in the catalog")
        data = bytes(data)
        _check_blob(digest, data)
        return data

    @staticmethod
    def _context_run_id(session: Session, run: str) -> int:
        run_id = session.scalar(select(RunRow.id).where(RunRow.name == run))
        if run_id is None:
            raise CheckpointNotFoundError(f"run {run!r} does not exist; {runs_hint(session)}")
        return int(run_id)

    @staticmethod
    def _context(run: str, row: RunContextRow) -> RunContext:
        return RunContext(run=run, from_version=row.from_version, digest=row.digest,
                          document=dict(row.document), created_at=row.created_at)
