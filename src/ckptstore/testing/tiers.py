"""Contract tests every :class:`~ckptstore.storage.base.Tier` backend must pass.

Subclass :class:`BackendTests` once per backend and provide a ``tier`` fixture::

    class TestLocalTier(BackendTests):
        @pytest.fixture
        def tier(self, tmp_path):
            return LocalTier(tmp_path / "tier", name="hot")

Each test uses its own ``<run>/<id>/`` prefix, so a fixture may share one bucket between tests.
"""

from __future__ import annotations

import errno
import threading
import uuid
from pathlib import Path

import pytest

from ckptstore.errors import ConflictError, InvalidNameError, StorageError
from ckptstore.storage.base import COMMIT_NAME, Tier

__all__ = ["BackendTests"]


def _new_prefix(tier: Tier) -> tuple[str, str, str]:
    run, ckpt_id = "run-contract", uuid.uuid4().hex
    return run, ckpt_id, tier.prefix_for(run, ckpt_id)


class BackendTests:
    """The behaviour every tier backend guarantees (write-once, marker order, errors)."""

    @pytest.fixture
    def tier(self) -> Tier:
        """The tier under test; subclasses override this fixture."""
        raise NotImplementedError("subclasses provide a 'tier' fixture")

    def test_put_get_bytes_roundtrip(self, tier: Tier) -> None:
        run, ckpt_id, _ = _new_prefix(tier)
        key = tier.key_for(run, ckpt_id, "float32/c/0")
        payload = bytes(range(256)) * 17
        assert tier.put_bytes(key, payload) == len(payload)
        assert tier.get_bytes(key) == payload
        assert tier.exists(key)
        assert tier.size(key) == len(payload)

    def test_empty_object(self, tier: Tier) -> None:
        run, ckpt_id, _ = _new_prefix(tier)
        key = tier.key_for(run, ckpt_id, "empty")
        tier.put_bytes(key, b"")
        assert tier.get_bytes(key) == b""
        assert tier.size(key) == 0

    def test_put_file_get_file(self, tier: Tier, tmp_path: Path) -> None:
        run, ckpt_id, _ = _new_prefix(tier)
        src = tmp_path / "src.bin"
        src.write_bytes(b"x" * 10_000 + b"y")
        key = tier.key_for(run, ckpt_id, "manifest.json")
        assert tier.put_file(src, key) == 10_001
        out = tmp_path / "sub" / "out.bin"
        out.parent.mkdir()
        out.write_bytes(b"old contents are replaced")
        assert tier.get_file(key, out) == 10_001
        assert out.read_bytes() == src.read_bytes()
        assert [p.name for p in out.parent.iterdir()] == ["out.bin"]  # no temp file left

    def test_write_once(self, tier: Tier, tmp_path: Path) -> None:
        run, ckpt_id, _ = _new_prefix(tier)
        key = tier.key_for(run, ckpt_id, "float32/c/1")
        tier.put_bytes(key, b"first")
        with pytest.raises(ConflictError, match="already exists"):
            tier.put_bytes(key, b"second")
        other = tmp_path / "other"
        other.write_bytes(b"third")
        with pytest.raises(ConflictError):
            tier.put_file(other, key)
        assert tier.get_bytes(key) == b"first"

    def test_concurrent_writers_one_wins(self, tier: Tier) -> None:
        run, ckpt_id, _ = _new_prefix(tier)
        key = tier.key_for(run, ckpt_id, "COMMITTED")
        outcomes: list[str] = []
        lock = threading.Lock()

        def write(n: int) -> None:
            try:
                tier.put_bytes(key, f"writer-{n}".encode())
                result = "won"
            except ConflictError:
                result = "lost"
            with lock:
                outcomes.append(result)

        threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(outcomes) == ["lost", "lost", "lost", "won"]
        assert tier.get_bytes(key).startswith(b"writer-")

    def test_missing_key(self, tier: Tier, tmp_path: Path) -> None:
        run, ckpt_id, _ = _new_prefix(tier)
        key = tier.key_for(run, ckpt_id, "nope")
        assert not tier.exists(key)
        assert tier.delete(key) in (False, True)  # S3 cannot tell; it must not fail
        with pytest.raises(StorageError) as info:
            tier.get_bytes(key)
        assert info.value.errno == errno.ENOENT
        assert "nope" in str(info.value)
        with pytest.raises(StorageError):
            tier.get_file(key, tmp_path / "x")
        with pytest.raises(StorageError):
            tier.size(key)

    def test_list_prefix_is_exact_and_sorted(self, tier: Tier) -> None:
        run, ckpt_id, prefix = _new_prefix(tier)
        neighbour = ckpt_id + "0"  # shares the string prefix, not the directory
        for rel in ("b/c/1", "a/zarr.json", "b/c/0", "manifest.json"):
            tier.put_bytes(tier.key_for(run, ckpt_id, rel), rel.encode())
        tier.put_bytes(tier.key_for(run, neighbour, "x"), b"x")
        assert tier.list_prefix(prefix) == [
            prefix + "a/zarr.json", prefix + "b/c/0", prefix + "b/c/1", prefix + "manifest.json"
        ]
        assert tier.list_prefix(prefix + "b/") == [prefix + "b/c/0", prefix + "b/c/1"]
        assert tier.list_prefix(tier.prefix_for(run, uuid.uuid4().hex)) == []

    def test_listing_sees_writes_of_another_instance(self, tier: Tier, tier_twin: Tier) -> None:
        run, ckpt_id, prefix = _new_prefix(tier)
        assert tier.list_prefix(prefix) == []  # primes any listing cache
        tier_twin.put_bytes(tier_twin.key_for(run, ckpt_id, "f"), b"1")
        assert tier.list_prefix(prefix) == [prefix + "f"]
        assert tier.exists(prefix + "f")

    @pytest.fixture
    def tier_twin(self, tier: Tier) -> Tier:
        """A second, independent instance on the same location (override per backend)."""
        return tier

    def test_delete_prefix_removes_marker_first(self, tier: Tier) -> None:
        run, ckpt_id, prefix = _new_prefix(tier)
        for rel in ("float32/c/0", "float32/zarr.json", "manifest.json", COMMIT_NAME):
            tier.put_bytes(tier.key_for(run, ckpt_id, rel), b"data")
        deleted: list[str] = []
        original = tier.delete

        def spy(key: str) -> bool:
            deleted.append(key)
            return original(key)

        tier.delete = spy  # type: ignore[method-assign]
        try:
            assert tier.delete_prefix(prefix) == 4
        finally:
            del tier.delete
        assert deleted[0] == prefix + COMMIT_NAME
        assert tier.list_prefix(prefix) == []
        assert tier.delete_prefix(prefix) == 0

    def test_delete_prefix_refuses_root(self, tier: Tier) -> None:
        with pytest.raises(InvalidNameError):
            tier.delete_prefix("")
        with pytest.raises(InvalidNameError):
            tier.delete_prefix("run-contract")

    @pytest.mark.parametrize(
        "bad", ["../x", "/abs", "a//b", "a/./b", "a/../b", "a\\b", "a\x00b", "", "a/"]
    )
    def test_bad_keys_refused(self, tier: Tier, bad: str) -> None:
        with pytest.raises(InvalidNameError):
            tier.put_bytes(bad, b"x")
        with pytest.raises(InvalidNameError):
            tier.get_bytes(bad)

    @pytest.mark.parametrize(("run", "ckpt_id"), [("../etc", "abc"), ("run", "../x"),
                                                  ("run", "a/b"), ("a b", "abc")])
    def test_bad_names_refused(self, tier: Tier, run: str, ckpt_id: str) -> None:
        with pytest.raises(InvalidNameError):
            tier.key_for(run, ckpt_id, "f")

    def test_url_and_uri(self, tier: Tier) -> None:
        run, ckpt_id, _ = _new_prefix(tier)
        uri = tier.uri_for(run, ckpt_id)
        assert uri.endswith(f"{run}/{ckpt_id}")
        assert uri.startswith(tier.url.rstrip("/"))

    def test_abort_multipart_uploads_noop_when_none(self, tier: Tier) -> None:
        _, _, prefix = _new_prefix(tier)
        assert tier.abort_multipart_uploads(prefix) == 0
