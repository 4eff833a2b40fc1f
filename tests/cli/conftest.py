"""Fixtures of the CLI suite: small real stores, and ``ckpt`` run in-process like a user."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import Ckpt, FilledStore, Result, make_filled_store

from ckptstore.cli.app import main


@pytest.fixture
def ckpt(capsys: pytest.CaptureFixture[str]) -> Ckpt:
    """Run ``ckpt ARGS...`` in this process; returns its exit code, stdout and stderr."""

    def run(*args: object) -> Result:
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


@pytest.fixture(scope="session")
def catalog_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty catalog already at the newest schema (copying it skips the migration, which
    costs seconds on a loaded machine).

    Only migrated, never opened as a store: a store records its hot tier in its catalog, and
    a copy of that catalog would belong to the template's hot tier, not the test's.
    """
    from ckptstore.catalog import migrate

    path = tmp_path_factory.mktemp("catalog-template") / "catalog.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def filled(tmp_path: Path, catalog_template: Path) -> FilledStore:
    """A fresh store with a few runs (see :func:`cli_support.make_filled_store`)."""
    return make_filled_store(tmp_path, catalog_template)
