"""A bundle carries the run context its checkpoint was saved under (commit, command, config,
the patch and the package lock), so the importing store can say how to reproduce it; a
context altered on the way is refused before anything is written."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.capture import blob_digest, context_digest
from ckptstore.errors import IntegrityError
from ckptstore.ops.sharing.bundle import BUNDLE_HEADER, export_bundle, import_bundle
from ckptstore.store import CheckpointStore

PATCH = b"diff --git a/train.py b/train.py\n+lr = 0.25\n"
LOCK = b"numpy==2.3.0\ntorch==2.13.0\n"


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[CheckpointStore, CheckpointStore, Path]]:
    a = CheckpointStore.open(tmp_path / "a")
    b = CheckpointStore.open(tmp_path / "b")
    ck = a.save("ctx", 1, {"w": torch.arange(12, dtype=torch.float32)})
    doc = {"code": {"commit": "0123abc", "dirty": True, "patch": blob_digest(PATCH)},
           "environment": {"lock": blob_digest(LOCK), "python": "3.11"},
           "command": {"argv": ["train.py", "--lr", "0.25"]},
           "config": {"lr": 0.25, "layers": 4}, "data_version": "shards-v3"}
    a.catalog.record_context("ctx", ck.version, doc, context_digest(doc),
                             {blob_digest(PATCH): PATCH, blob_digest(LOCK): LOCK})
    bundle = export_bundle(a, ck.id, tmp_path / "ctx.tar")
    try:
        yield a, b, bundle
    finally:
        a.close()
        b.close()


def test_the_context_travels_in_the_bundle(
        stores: tuple[CheckpointStore, CheckpointStore, Path]) -> None:
    a, b, bundle = stores
    ck = import_bundle(b, bundle)
    here, there = a.catalog.context_of(a.get(ck.id)), b.catalog.context_of(b.get(ck.id))
    assert here is not None and there is not None
    assert there.digest == here.digest and there.document == here.document
    assert b.catalog.context_blob(blob_digest(PATCH)) == PATCH
    assert b.catalog.context_blob(blob_digest(LOCK)) == LOCK
    run = next(r for r in b.runs() if r.name == "ctx")
    # The run's columns are filled as a save fills them: listings and --where see them.
    assert run.config == {"lr": 0.25, "layers": 4}
    assert run.code_version == "git:0123abc+dirty" and run.data_version == "shards-v3"
    assert [c.id for c in b.list(where="config.lr==0.25")] == [ck.id]
    assert b.show(ck.id)["reproduction"]["context"]["commit"] == "0123abc"


def _rewrite_header(bundle: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    with tarfile.open(bundle) as tar:
        members = [(info, tar.extractfile(info).read())  # type: ignore[union-attr]
                   for info in tar.getmembers()]
    header = json.loads(members[0][1])
    assert members[0][0].name == BUNDLE_HEADER
    edit(header)
    members[0] = (members[0][0], json.dumps(header).encode())
    out = bundle.with_name("edited.tar")
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def _other_config(header: dict[str, Any]) -> None:
    header["context"]["document"]["config"]["lr"] = 1.0  # digest left as it was


def _other_blob(header: dict[str, Any]) -> None:
    header["context"]["blobs"][blob_digest(LOCK)] = base64.b64encode(b"torch==1.0\n").decode()


def _not_base64(header: dict[str, Any]) -> None:
    header["context"]["blobs"][blob_digest(LOCK)] = "%%%"


def _malformed(header: dict[str, Any]) -> None:
    header["context"] = "trust me"


@pytest.mark.parametrize("edit", [_other_config, _other_blob, _not_base64, _malformed],
                         ids=["document", "blob", "not-base64", "malformed"])
def test_an_altered_context_is_refused_and_nothing_is_written(
        stores: tuple[CheckpointStore, CheckpointStore, Path],
        edit: Callable[[dict[str, Any]], None]) -> None:
    _, b, bundle = stores
    with pytest.raises(IntegrityError, match="context"):
        import_bundle(b, _rewrite_header(bundle, edit))
    assert b.list() == [] and not any((b.hot / "ctx").glob("*"))
