"""Every ``zarr.json`` field that changes what a plain reader returns is under the manifest's
digests: a tampered document makes the copy damaged (``ckpt verify`` exits 1), ``ckpt
doctor`` names it, and a repair restores the exact document, after which plain zarr reads
the saved bytes again.

Our own loader never reads ``zarr.json`` (it decodes from the manifest), so a load stays
exact whatever the document says; plain readers are the ones these checks protect.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from ckptstore import CheckpointStore, ReplicaState
from ckptstore.cli.app import main as ckpt
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.upkeep.doctor import doctor
from ckptstore.ops.upkeep.verify import verify_replicas

Doc = dict[str, Any]


def _codecs(doc: Doc) -> list[Doc]:
    codecs: list[Doc] = doc["codecs"]
    return codecs


def _chunk_shape(doc: Doc) -> list[int]:
    shape: list[int] = doc["chunk_grid"]["configuration"]["chunk_shape"]
    return shape


#: field -> an edit a plain reader would follow (each changes the values it returns).
TAMPER: dict[str, Callable[[Doc], None]] = {
    "data_type": lambda d: d.update(data_type="int32"),
    "shape": lambda d: d.update(shape=[d["shape"][0] // 2]),
    "chunk_shape": lambda d: d["chunk_grid"]["configuration"].update(
        chunk_shape=[max(1, c // 2) for c in _chunk_shape(d)]),
    "chunk_key_encoding": lambda d: d.update(
        chunk_key_encoding={"name": "v2", "configuration": {"separator": "."}}),
    "fill_value": lambda d: d.update(fill_value=1.5),
    "codecs: pickle first": lambda d: _codecs(d).insert(
        0, {"name": "numcodecs.pickle", "configuration": {}}),
    "codecs: byte order": lambda d: next(
        c for c in _codecs(d) if c["name"] == "bytes").update(configuration={"endian": "big"}),
    "codecs: dropped": lambda d: d.update(codecs=[c for c in _codecs(d)
                                                  if c["name"] == "bytes"]),
}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    # 1 MiB of float32 gets an array of its own (docs/FORMAT.md); lz4 puts a codec after
    # the bytes codec, so dropping codecs changes what is decoded.
    return {"big": torch.randn(512, 512, generator=g), "small": torch.arange(10.0)}


def _array_doc(directory: Path) -> Path:
    """The ``zarr.json`` of the array holding ``big``."""
    docs = sorted(p for p in directory.glob("*/zarr.json"))
    assert docs, directory
    return max(docs, key=lambda p: json.loads(p.read_text()).get("shape", [0])[0])


def _plain_read(doc: Path) -> np.ndarray[Any, Any]:
    return np.asarray(zarr.open_array(str(doc.parent), mode="r")[:])


@pytest.mark.parametrize("field", list(TAMPER))
def test_a_tampered_zarr_json_is_damage_found_and_repaired(
    tiered_store: CheckpointStore, field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tiered_store
    state = _state()
    ck = store.save("tamper", 1, state, codec="lz4")
    archive_checkpoints(store, ref=ck.id)
    doc = _array_doc(store.checkpoint_dir("tamper", ck.id))
    original = doc.read_bytes()
    exact = _plain_read(doc)
    edited = json.loads(original)
    TAMPER[field](edited)
    doc.write_text(json.dumps(edited))
    # A plain reader now gets something else, or an error: never the saved values.
    try:
        changed = not np.array_equal(_plain_read(doc), exact)
    except Exception:  # zarr refusing the document is the other outcome
        changed = True
    # fill_value shows only where a chunk file is absent, which a complete copy never has:
    # it is under the digest all the same (a copy missing a chunk would read as 1.5).
    assert changed or field == "fill_value"
    assert torch.equal(store.load(ck.id)["big"], state["big"])  # ours: from the manifest

    findings = doctor(store, tiers=["hot"]).findings
    assert [f.kind for f in findings] == ["zarr-metadata"], [f.detail for f in findings]
    assert doc.parent.name in findings[0].detail

    report = verify_replicas(store, ref=ck.id, tier="hot", repair=False)
    problems = report.damaged[f"{ck.id}@hot"]
    assert any(doc.parent.name in p and "zarr.json" in p for p in problems), problems
    assert store.get(ck.id).replica("hot").state == ReplicaState.DAMAGED  # type: ignore[union-attr]
    capsys.readouterr()
    root = str(store.settings.root)
    assert ckpt(["verify", ck.id, "--tier", "hot", "--no-repair", "--store", root]) == 1
    assert "damaged" in capsys.readouterr().err

    report = verify_replicas(store, ref=ck.id, tier="hot")  # repaired from the S3 copy
    assert report.repaired == [f"{ck.id}@hot"] and report.clean
    assert doc.read_bytes() == original
    assert np.array_equal(_plain_read(doc), exact)
    assert store.get(ck.id).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]


def test_doctor_fix_rewrites_a_tampered_document_without_another_copy(
    store: CheckpointStore,
) -> None:
    state = _state()
    ck = store.save("tamper", 1, state, codec="lz4")
    doc = _array_doc(store.checkpoint_dir("tamper", ck.id))
    original = doc.read_bytes()
    edited = json.loads(original)
    TAMPER["codecs: pickle first"](edited)
    doc.write_text(json.dumps(edited))
    report = doctor(store, fix=True, grace_s=0)
    assert [f.kind for f in report.findings] == ["zarr-metadata"] and report.ok
    assert doc.read_bytes() == original
    assert verify_replicas(store, ref=ck.id).ok == [f"{ck.id}@hot"]
