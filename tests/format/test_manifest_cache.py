"""The digest-keyed cache of parsed manifests: hits skip parsing, never checking."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptstore.errors import IntegrityError
from ckptstore.format import read_manifest, write_checkpoint
from ckptstore.format.manifest import Manifest, manifest_digest, parse_verified

CKPT_ID = "0b7c2f8e-6f0a-4f43-9d6e-0c1f5d2b7a11"


def _write(path: Path) -> Manifest:
    return write_checkpoint(path, {"w": torch.arange(10.0), "step": 3}, ckpt_id=CKPT_ID,
                            run="r", step=3)


def test_a_written_manifest_is_served_parsed_and_equal(tmp_path: Path) -> None:
    written = _write(tmp_path / "c")
    first = read_manifest(tmp_path / "c", expected_digest=written.digest)
    assert first is written  # the writer's own parse, no second one
    assert first == Manifest.from_json((tmp_path / "c" / "manifest.json").read_bytes())


def test_damage_is_still_caught_on_a_cached_manifest(tmp_path: Path) -> None:
    written = _write(tmp_path / "c")
    read_manifest(tmp_path / "c")
    path = tmp_path / "c" / "manifest.json"
    data = bytearray(path.read_bytes())
    data[data.index(b'"run"') + 1] ^= 0x20  # "run" -> "Run": other bytes, other digest
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="modified or damaged"):
        read_manifest(tmp_path / "c")
    # The marker names the damaged bytes' digest now: the catalog's still differs.
    (tmp_path / "c" / "COMMITTED").write_text(manifest_digest(bytes(data)) + "\n")
    with pytest.raises(IntegrityError, match="was expected"):
        read_manifest(tmp_path / "c", expected_digest=written.digest)


def test_invalid_bytes_are_not_cached(tmp_path: Path) -> None:
    data = b'{"format_version": 1}'
    for _ in range(2):
        with pytest.raises(IntegrityError):
            parse_verified(data, manifest_digest(data))


def test_a_known_digest_is_served_without_a_read(tmp_path: Path) -> None:
    from ckptstore.format.manifest import known_manifest

    written = _write(tmp_path / "c")
    assert known_manifest(written.digest) is written
    assert known_manifest(written.digest, CKPT_ID) is written
    # A catalog row naming another checkpoint's digest must lead to a read, not this one.
    assert known_manifest(written.digest, "11111111-1111-4111-8111-111111111111") is None
    assert known_manifest("0" * 64) is None and known_manifest(None) is None
