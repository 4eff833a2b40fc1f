"""Runs and experiments: get-or-create, lookup, listing."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from ckptstore.catalog.checks import check_json
from ckptstore.catalog.core import CatalogCore, runs_hint
from ckptstore.catalog.models import CheckpointRow, ExperimentRow, RunRow, utcnow
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError
from ckptstore.names import validate_name
from ckptstore.records import CheckpointState, RunInfo

__all__ = ["RUN_STATUSES", "RunsMixin"]

#: What a run's ``status`` may be.
RUN_STATUSES = ("active", "closed")

logger = logging.getLogger("ckptstore.catalog")


class RunsMixin(CatalogCore):
    """Run and experiment methods of :class:`~ckptstore.catalog.Catalog`."""

    def ensure_run(
        self,
        name: str,
        *,
        experiment: str | None = None,
        config: Mapping[str, Any] | None = None,
        code_version: str | None = None,
        data_version: str | None = None,
        host: str | None = None,
    ) -> RunInfo:
        """Get or create a run; fields the existing run lacks (None) are filled in.

        Safe under concurrency: processes creating the same run at once end up with one row
        and no error. Fields the run already has are never overwritten.

        Args:
            name: Run name (see :func:`ckptstore.names.validate_name`).
            experiment: Experiment to file the run under (created if needed).
            config: JSON-serialisable training configuration.
            code_version: Code version, e.g. the git commit.
            data_version: Data set version.
            host: Host the run trains on.

        Returns:
            The run.

        Raises:
            InvalidNameError: If a name is invalid or the config is not JSON-serialisable.

        Example:
            >>> catalog.ensure_run("resnet-a", experiment="resnet", code_version="1f3c2e")
            ... # doctest: +SKIP
        """
        validate_name(name)
        if experiment is not None:
            validate_name(experiment, "experiment name")
        fields: dict[str, Any] = {
            "config": check_json(config, "run config") if config is not None else None,
            "code_version": code_version,
            "data_version": data_version,
            "host": host,
        }
        with self._write() as s:
            run_id = self._get_or_create_run(s, name, experiment=experiment, **fields)
            row = s.get_one(RunRow, run_id)
            if experiment is not None and row.experiment_id is None:
                row.experiment_id = self._get_or_create_experiment(s, experiment)
            for key, value in fields.items():
                if value is not None and getattr(row, key) is None:
                    setattr(row, key, value)
            s.flush()
            return self._run_infos(s, RunRow.id == run_id)[0]

    def set_run_status(self, name: str, status: str) -> None:
        """Mark a run ``active`` (training) or ``closed`` (its manager was closed).

        Raises:
            CheckpointNotFoundError: If there is no such run.
            InvalidNameError: For another status.
        """
        validate_name(name)
        if status not in RUN_STATUSES:
            raise InvalidNameError(f"run status must be one of {', '.join(RUN_STATUSES)}, "
                                   f"not {status!r}")
        with self._write() as s:
            row = s.scalar(select(RunRow).where(RunRow.name == name))
            if row is None:
                raise CheckpointNotFoundError(f"run {name!r} does not exist; {runs_hint(s)}")
            row.status = status

    def get_run(self, name: str) -> RunInfo:
        """Look up a run by name.

        Raises:
            CheckpointNotFoundError: If there is no such run; the message lists the runs.
        """
        validate_name(name)
        with self._read() as s:
            found = self._run_infos(s, RunRow.name == name)
            if not found:
                raise CheckpointNotFoundError(f"run {name!r} does not exist; {runs_hint(s)}")
            return found[0]

    def runs(self) -> list[RunInfo]:
        """All runs by name, each with ``checkpoints`` = its number of COMMITTED checkpoints."""
        with self._read() as s:
            return self._run_infos(s, None)

    # ------------------------------------------------------------------ helpers
    def _get_or_create_experiment(self, session: Session, name: str) -> int:
        stmt = select(ExperimentRow.id).where(ExperimentRow.name == name)
        exp_id = session.scalar(stmt)
        if exp_id is None:
            # ON CONFLICT DO NOTHING instead of catching IntegrityError: a concurrent creator
            # makes our insert a no-op (PostgreSQL waits for its commit first), and the
            # re-read below then sees its row; the transaction is never aborted.
            session.execute(
                self._insert(ExperimentRow)
                .values(name=name, created_at=utcnow())
                .on_conflict_do_nothing(index_elements=["name"])
            )
            exp_id = session.scalar(stmt)
            assert exp_id is not None
        return exp_id

    def _get_or_create_run(
        self, session: Session, name: str, *, experiment: str | None = None, **fields: Any
    ) -> int:
        stmt = select(RunRow.id).where(RunRow.name == name)
        run_id = session.scalar(stmt)
        if run_id is not None:
            return run_id
        exp_id = self._get_or_create_experiment(session, experiment) if experiment else None
        session.execute(
            self._insert(RunRow)
            .values(
                name=name,
                experiment_id=exp_id,
                status="active",
                created_at=utcnow(),
                **{k: v for k, v in fields.items() if v is not None},
            )
            .on_conflict_do_nothing(index_elements=["name"])
        )
        run_id = session.scalar(stmt)
        assert run_id is not None
        logger.debug("run %s ready (id %s)", name, run_id)
        return run_id

    @staticmethod
    def _run_infos(session: Session, where: ColumnElement[bool] | None) -> list[RunInfo]:
        committed = (
            select(func.count())
            .where(
                CheckpointRow.run_id == RunRow.id,
                CheckpointRow.state == CheckpointState.COMMITTED,
            )
            .correlate(RunRow)
            .scalar_subquery()
        )
        stmt = (
            select(
                RunRow.name,
                RunRow.created_at,
                ExperimentRow.name.label("experiment"),
                RunRow.config,
                RunRow.code_version,
                RunRow.data_version,
                RunRow.host,
                RunRow.status,
                committed.label("committed"),
            )
            .outerjoin(ExperimentRow, RunRow.experiment_id == ExperimentRow.id)
            .order_by(RunRow.name)
        )
        if where is not None:
            stmt = stmt.where(where)
        return [
            RunInfo(
                name=r.name,
                created_at=r.created_at,
                experiment=r.experiment,
                config=dict(r.config or {}),
                code_version=r.code_version,
                data_version=r.data_version,
                host=r.host,
                status=r.status,
                checkpoints=r.committed,
            )
            for r in session.execute(stmt)
        ]
