"""`ckpt export` of a default checkpoint: one that reads chunks of an earlier one (an
unchanged tensor deduplicated against it). The bundle carries those chunks and imports
elsewhere bit for bit; `show` says which copies are self-contained and what they read;
`compact` says what it moved."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch
from cli_support import Ckpt

from ckptstore.store import CheckpointStore


def _state(step: int) -> dict[str, torch.Tensor]:
    # The RNG-like tensor never changes: the default (dedup) save of v2 reads v1's chunk.
    return {"w": torch.full((4096,), float(step)), "rng": torch.arange(2048, dtype=torch.int64)}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    with CheckpointStore.open(root) as store:
        store.save("run-a", step=1, state=_state(1))
        store.save("run-a", step=2, state=_state(2))
        store.alias("run-a@v2", "prod")
        store.pin("run-a@v2")
    return root


def test_export_of_a_checkpoint_that_reads_others_chunks(source: Path, tmp_path: Path,
                                                         ckpt: Ckpt) -> None:
    shown = json.loads(ckpt("show", "run-a@v2", "--json", "--store", source).out)
    assert shown["checkpoint"]["kind"] == "full"
    assert shown["copies"] == [{"tier": "hot", "state": "PRESENT", "self_contained": False,
                                "reads": ["run-a@v1"]}]
    text = ckpt("show", "run-a@v2", "--store", source).out
    assert "hot: reads chunks of run-a@v1" in " ".join(text.split())

    bundle = tmp_path / "run-a-v2.tar"
    result = ckpt("export", "run-a@v2", "--out", bundle, "--store", source)
    assert result.code == 0, result.err
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
    assert not any(n.endswith(".tmp") for n in names)
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # scratch gone

    other = tmp_path / "other"
    assert ckpt("init", other).code == 0
    result = ckpt("import-bundle", bundle, "--store", other, "--json")
    assert result.code == 0, result.err
    with CheckpointStore.open(other) as store:
        loaded = store.load("run-a@latest")
        assert set(loaded) == {"w", "rng"}
        assert torch.equal(loaded["w"], _state(2)["w"]) and torch.equal(loaded["rng"],
                                                                       _state(2)["rng"])
    imported = json.loads(ckpt("show", "run-a@latest", "--json", "--store", other).out)
    assert imported["copies"][0]["self_contained"] is True
    assert ckpt("verify", "run-a@latest", "--store", other).code == 0


def test_compact_says_what_it_moved(source: Path, ckpt: Ckpt) -> None:
    result = ckpt("compact", "run-a@v2", "--store", source)
    assert result.code == 0, result.err
    err = " ".join(result.err.split())
    assert "run-a@latest now names run-a@v3 (was run-a@v2)" in err
    assert "alias prod still names run-a@v2" in err
    assert "run-a@v2 stays pinned; run-a@v3 is not" in err
    doc = json.loads(ckpt("compact", "run-a@v2", "--store", source, "--json").out)
    assert doc["ref"] == "run-a@v3"  # already compacted: the same version, @latest stays
    assert not any("@latest" in note for note in doc["notes"])
