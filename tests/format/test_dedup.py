"""Chunk dedup against a base checkpoint: shared chunks hard-linked, or read through locate."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.errors import MissingBaseError
from ckptstore.format import (
    BaseRef,
    Manifest,
    chunk_files,
    read_checkpoint,
    verify_checkpoint,
)
from ckptstore.format.constants import ZARR_JSON
from ckptstore.format.zarrmeta import ref_document

CHUNK = 64 * 1024  # one tensor per chunk below


def _as_reference_copy(directory: Path, manifest: Manifest) -> None:
    """Remove the hard-linked shared chunks: the state of a copy that only references them
    (an object-store copy, or a hot tier where links were impossible)."""
    for array in manifest.arrays.values():
        shared = [c for c in array.chunks if c.src is not None]
        for chunk in shared:
            (directory / array.chunk_path(chunk.i)).unlink()
        if shared:
            rel = f"{array.name}/{ZARR_JSON}"
            data = ref_document(manifest, array.name, (directory / rel).read_bytes())
            (directory / rel).write_bytes(data)


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    a = {f"t{i}": torch.randn(CHUNK // 4) for i in range(8)}
    b = {k: (v + 1 if i % 2 == 0 else v.clone()) for i, (k, v) in enumerate(a.items())}
    return a, b


@pytest.mark.parametrize("codec", ["none", "lz4"])
def test_unchanged_chunks_are_referenced_not_written(save: Any, codec: str) -> None:
    a, b = _states()
    dir_a, man_a = save(a, name="a", codec=codec, chunk_bytes=CHUNK)
    dir_b, man_b = save(b, name="b", codec=codec, chunk_bytes=CHUNK, base=BaseRef(man_a, dir_a))
    assert man_b.kind == "delta" and man_b.base_id == man_a.id
    assert man_b.referenced_checkpoints() == {man_a.id}
    assert 0.4 < man_b.stored_bytes / man_a.stored_bytes < 0.6
    assert man_b.logical_bytes == man_a.logical_bytes
    written = [f for f in chunk_files(man_b) if "/c/" in f]
    assert len(written) == 4
    assert all((dir_b / f).is_file() for f in chunk_files(man_b))
    # The shared chunks are hard links to a's files: b is complete on its own.
    shared = [(a.chunk_path(c.i)) for a in man_b.arrays.values() for c in a.chunks if c.src]
    assert len(shared) == 4
    assert all((dir_b / rel).stat().st_ino == (dir_a / rel).stat().st_ino for rel in shared)
    out = read_checkpoint(dir_b, man_b)
    assert all(torch.equal(out[key], tensor) for key, tensor in b.items())
    assert verify_checkpoint(dir_b, man_b) == []

    _as_reference_copy(dir_b, man_b)
    locations = {man_a.id: dir_a}
    out = read_checkpoint(dir_b, man_b, locate=locations.__getitem__)
    for key, tensor in b.items():
        assert torch.equal(out[key], tensor)
    assert verify_checkpoint(dir_b, man_b, locate=locations.__getitem__) == []


def test_chains_point_at_the_physical_owner(save: Any) -> None:
    a, b = _states()
    dir_a, man_a = save(a, name="a", chunk_bytes=CHUNK)
    dir_b, man_b = save(b, name="b", chunk_bytes=CHUNK, base=BaseRef(man_a, dir_a))
    c = {k: v.clone() for k, v in b.items()}
    dir_c, man_c = save(c, name="c", chunk_bytes=CHUNK, base=BaseRef(man_b, dir_b))
    assert man_c.stored_bytes == 0
    assert man_c.referenced_checkpoints() == {man_a.id, man_b.id}
    _as_reference_copy(dir_c, man_c)
    locations = {man_a.id: dir_a, man_b.id: dir_b}
    out = read_checkpoint(dir_c, man_c, locate=locations.__getitem__)
    assert all(torch.equal(out[k], v) for k, v in c.items())


def test_delta_without_its_base_raises_missing_base(save: Any, tmp_path: Path) -> None:
    a, b = _states()
    dir_a, man_a = save(a, name="a", chunk_bytes=CHUNK)
    dir_b, man_b = save(b, name="b", chunk_bytes=CHUNK, base=BaseRef(man_a, dir_a))
    shutil.rmtree(dir_a / "float32")
    # Its shared chunks are hard links: b loads without its base.
    assert torch.equal(read_checkpoint(dir_b, man_b)["t1"], b["t1"])
    _as_reference_copy(dir_b, man_b)
    with pytest.raises(MissingBaseError, match=man_a.id):
        read_checkpoint(dir_b, man_b)

    def broken(ckpt_id: str) -> Path:
        raise LookupError(f"no such checkpoint {ckpt_id}")

    with pytest.raises(MissingBaseError, match=man_a.id):
        read_checkpoint(dir_b, man_b, locate=broken)
    problems = verify_checkpoint(dir_b, man_b)
    assert len(problems) == 4 and all(man_a.id in p for p in problems)

    shutil.rmtree(dir_a)
    with pytest.raises(MissingBaseError, match=man_a.id):
        read_checkpoint(dir_b, man_b, locate=lambda _: dir_a)
    # Keys whose chunks live in b itself still load without the base.
    out = read_checkpoint(dir_b, man_b, keys=["t0", "t2"])
    assert torch.equal(out["t0"], b["t0"])


def test_a_deleted_base_chunk_is_a_missing_base(save: Any) -> None:
    a, b = _states()
    dir_a, man_a = save(a, name="a", chunk_bytes=CHUNK)
    dir_b, man_b = save(b, name="b", chunk_bytes=CHUNK, base=BaseRef(man_a, dir_a))
    _as_reference_copy(dir_b, man_b)
    (dir_a / "float32" / "c" / "1").unlink()
    with pytest.raises(MissingBaseError, match=man_a.id):
        read_checkpoint(dir_b, man_b, locate=lambda _: dir_a)


def test_no_dedup_across_codecs_or_chunk_sizes(save: Any) -> None:
    a, _ = _states()
    dir_a, man_a = save(a, name="a", codec="none", chunk_bytes=CHUNK)
    _, man_b = save(a, name="b", codec="lz4", chunk_bytes=CHUNK, base=BaseRef(man_a, dir_a))
    assert man_b.kind == "full" and man_b.base_id is None and not man_b.referenced_checkpoints()
    _, man_c = save(a, name="c", codec="none", chunk_bytes=CHUNK // 2, base=BaseRef(man_a, dir_a))
    assert man_c.kind == "full"


def test_own_id_cannot_be_the_base(save: Any, tmp_path: Path) -> None:
    from ckptstore.errors import InvalidNameError
    from ckptstore.format import write_checkpoint

    a, _ = _states()
    dir_a, man_a = save(a, name="a")
    with pytest.raises(InvalidNameError):
        write_checkpoint(
            tmp_path / "x", a, ckpt_id=man_a.id, run="r", step=0, base=BaseRef(man_a, dir_a)
        )
    assert uuid.UUID(man_a.id)
