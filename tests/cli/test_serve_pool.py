"""``ckpt serve --pool``: the paths that need no Prefect server (the real one: test_scaleout)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore.cli.app import main


@pytest.fixture
def no_api_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No PREFECT_API_URL anywhere: not in the environment, not in a settings context."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    # A Prefect test harness started earlier in the session publishes its URL process-wide.
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        yield


@pytest.mark.usefixtures("no_api_url")
def test_pool_without_api_url_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--store", str(tmp_path / "store"), "serve", "--pool", "ckpt"])
    _, err = capsys.readouterr()
    assert code == 1
    assert "PREFECT_API_URL is not set" in err
    assert "prefect server start" in err


@pytest.mark.usefixtures("no_api_url")
def test_empty_pool_name_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--store", str(tmp_path / "store"), "serve", "--pool", " "])
    _, err = capsys.readouterr()
    assert code == 1
    assert "work pool name is empty" in err


def test_serve_help_explains_the_pool(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--help"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "--pool" in out
    assert "prefect worker start" in " ".join(out.split())
