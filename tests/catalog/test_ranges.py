"""Integers and floats are checked against the catalog's column ranges where they enter.

``checkpoints.step`` and byte counts are BIGINT (signed 64-bit), ``checkpoints.version`` is
INTEGER (signed 32-bit), metrics are double precision. A value outside those ranges used to
escape as ``OverflowError`` (SQLite's driver, ``float()``) or ``sqlalchemy.exc.DataError``
(PostgreSQL), differently on each backend; now it is an :class:`InvalidNameError` on both,
raised before anything is written. A reference naming a step or version no column can hold is
malformed the same way (``run@<step>`` is a step, and that is not one).
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.app import main
from ckptstore.errors import CheckpointNotFoundError, IntegrityError, InvalidNameError
from ckptstore.refs import Ref

HUGE = 10**400
MAX_STEP = 2**63 - 1  # checkpoints.step: BIGINT
MAX_VERSION = 2**31 - 1  # checkpoints.version: INTEGER


@pytest.fixture
def store(tmp_path: Path, catalog_url: str) -> Iterator[CheckpointStore]:
    with CheckpointStore.open(tmp_path / "s", catalog_url=catalog_url) as opened:
        opened.save("h", 1, {"w": torch.zeros(4)}, metrics={"loss": 1.0})
        yield opened


def _rows(store: CheckpointStore) -> tuple[int, int, int]:
    return (len(store.list(state=None)), len(store.runs()),
            sum(1 for p in store.hot.rglob("*") if p.is_dir()))


@pytest.mark.parametrize("ref", [
    "h@99999999999999999999",             # beyond BIGINT (and beyond uint64)
    f"h@{MAX_STEP + 1}",                   # 2**63
    f"h@v{MAX_VERSION + 1}",               # 2**31: beyond the INTEGER version column
    "h@v99999999999999999999",
    "h@" + "9" * 5000,                     # more digits than int() converts
])
def test_refs_beyond_the_columns_are_invalid(store: CheckpointStore, ref: str) -> None:
    with pytest.raises(InvalidNameError, match="out of range"):
        store.get(ref)
    with pytest.raises(InvalidNameError):
        store.catalog.lineage(ref)


def test_refs_at_the_limits_are_just_not_found(store: CheckpointStore) -> None:
    for ref in (f"h@{MAX_STEP}", f"h@v{MAX_VERSION}"):
        with pytest.raises(CheckpointNotFoundError):
            store.get(ref)
    for ref in (Ref(kind="step", text="h@?", run="h", step=MAX_STEP + 1),
                Ref(kind="version", text="h@?", run="h", version=MAX_VERSION + 1)):
        with pytest.raises(InvalidNameError):
            store.catalog.get(ref)  # a Ref built by hand is checked before binding too


@pytest.mark.parametrize("kwargs", [
    {"step": 2**63},
    {"step": HUGE},
    {"step": 1, "metrics": {"loss": HUGE}},
    {"step": 1, "metrics": {"loss": -HUGE}},
])
def test_save_refuses_values_beyond_the_columns(store: CheckpointStore,
                                                kwargs: dict[str, object]) -> None:
    before = _rows(store)
    with pytest.raises(InvalidNameError):
        store.save("h2", state={"w": torch.ones(2)}, experiment="exp", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidNameError):
        store.save_async("h2", state={"w": torch.ones(2)}, **kwargs)  # type: ignore[arg-type]
    store.wait()
    assert _rows(store) == before  # nothing written: no run, no row, no directory


def test_queries_refuse_values_beyond_the_columns(store: CheckpointStore) -> None:
    assert len(store.list(limit=MAX_STEP)) == 1
    for kwargs in ({"limit": 10**20}, {"limit": HUGE}, {"step_range": (0, 2**63)},
                   {"step_range": (-(2**70), None)}, {"metrics": {"loss": ("<", HUGE)}}):
        with pytest.raises(InvalidNameError):
            store.list(**kwargs)
    with pytest.raises(InvalidNameError):
        store.events(limit=10**20)


def test_catalog_writes_refuse_values_beyond_the_columns(store: CheckpointStore) -> None:
    cat = store.catalog
    ck = cat.begin_checkpoint("h", 5)
    for kwargs in ({"logical_bytes": 2**63, "stored_bytes": 1},
                   {"logical_bytes": 1, "stored_bytes": HUGE},
                   {"logical_bytes": 1, "stored_bytes": 1, "error_bound": HUGE}):
        with pytest.raises(InvalidNameError):
            cat.commit_checkpoint(ck.id, manifest_digest="ab" * 32, **kwargs)  # type: ignore[arg-type]
    assert cat.get_any(ck.id).state.name == "PENDING"
    with pytest.raises(InvalidNameError):
        cat.set_replica(ck.id, "hot", state="PRESENT", bytes=2**63)
    with pytest.raises(InvalidNameError):
        cat.acquire_lease(ck.id, "test", "me", HUGE)
    with pytest.raises(InvalidNameError):
        cat.begin_checkpoint("h", 6, error_bound=HUGE, lossy=True)


def test_bundle_header_numbers_beyond_the_columns_are_refused(
    store: CheckpointStore, tmp_path: Path
) -> None:
    from ckptstore.ops.sharing.bundle import BUNDLE_HEADER, export_bundle, import_bundle

    good = export_bundle(store, "h@latest", tmp_path / "good.tar")
    hostile = tmp_path / "metric.tar"
    with tarfile.open(good) as src, tarfile.open(hostile, "w", format=tarfile.PAX_FORMAT) as out:
        for info in src.getmembers():
            handle = src.extractfile(info)
            data = handle.read() if handle is not None else b""
            if info.name == BUNDLE_HEADER:
                header = json.loads(data)
                header["metrics"] = {"loss": HUGE}  # a 401-digit JSON number
                data = json.dumps(header).encode()
                info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    with CheckpointStore.open(tmp_path / "other") as other:
        with pytest.raises(IntegrityError, match="loss"):
            import_bundle(other, hostile)
        assert other.list(state=None) == []


def test_cli_prints_one_line_for_out_of_range_refs(
    store: CheckpointStore, catalog_url: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CKPT_CATALOG_URL", catalog_url)
    root = str(store.settings.root)
    for ref in ("h@99999999999999999999", f"h@v{MAX_VERSION + 1}"):
        code = main(["--store", root, "show", ref])
        err = capsys.readouterr().err
        assert code == 2, err  # a malformed reference is bad usage
        assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
        assert "out of range" in err, err
    code = main(["--store", root, "ls", "--limit", "99999999999999999999"])
    err = capsys.readouterr().err
    assert code == 2 and "at most" in err and "Traceback" not in err, err  # a usage error
    assert main(["--store", root, "show", f"h@{MAX_STEP}"]) == 1
    assert "has no step" in capsys.readouterr().err
