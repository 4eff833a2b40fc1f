"""LocalTier: the contract, plus local-only behaviour (symlinks, temp files, free space)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptstore.errors import InvalidNameError, StorageError
from ckptstore.storage import LocalTier, build_tiers, tier_from_url
from ckptstore.storage.s3 import S3Tier
from ckptstore.testing.tiers import BackendTests


class TestLocalTier(BackendTests):
    @pytest.fixture
    def tier(self, tmp_path: Path) -> LocalTier:
        return LocalTier(tmp_path / "tier", name="hot")

    @pytest.fixture
    def tier_twin(self, tier: LocalTier) -> LocalTier:
        return LocalTier(tier.root, name="hot")


def test_local_dir_and_file_url(tmp_path: Path) -> None:
    tier = LocalTier(f"file://{tmp_path}/t", name="warm")
    assert tier.url == str(tmp_path / "t")
    assert tier.local_dir("run", "abc") == tmp_path / "t" / "run" / "abc"
    assert tier.uri_for("run", "abc") == str(tmp_path / "t" / "run" / "abc")
    assert tier.free_bytes() > 0


def test_symlink_escape_refused(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "tier")
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "tier").mkdir()
    os.symlink(outside, tmp_path / "tier" / "run")
    with pytest.raises(InvalidNameError, match="outside"):
        tier.put_bytes("run/abc/f", b"x")
    assert list(outside.iterdir()) == []


def test_symlinked_file_refused(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "tier")
    target = tmp_path / "secret"
    target.write_bytes(b"secret")
    (tmp_path / "tier" / "run" / "abc").mkdir(parents=True)
    os.symlink(target, tmp_path / "tier" / "run" / "abc" / "f")
    with pytest.raises(InvalidNameError, match="symlink"):
        tier.get_bytes("run/abc/f")


def test_no_temp_files_left_and_temp_files_ignored(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "tier")
    tier.put_bytes("run/abc/f", b"x")
    (tmp_path / "tier" / "run" / "abc" / ".ckpt-tmp-dead").write_bytes(b"partial")
    assert tier.list_prefix("run/abc/") == ["run/abc/f"]
    assert tier.delete_prefix("run/abc/") == 1
    assert not (tmp_path / "tier" / "run" / "abc").exists()


def test_permission_error_is_storage_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    root = tmp_path / "tier"
    (root / "run").mkdir(parents=True)
    (root / "run").chmod(0o500)
    try:
        with pytest.raises(StorageError, match="permission denied") as info:
            LocalTier(root).put_bytes("run/abc/f", b"x")
        assert isinstance(info.value.__cause__, PermissionError)
    finally:
        (root / "run").chmod(0o700)


def test_factory(tmp_path: Path) -> None:
    from ckptstore.config import Settings

    settings = Settings(root=tmp_path, warm=str(tmp_path / "warm"),
                        cold="s3://bucket/cold", storage_options={"endpoint_url": "http://x"})
    tiers = build_tiers(settings)
    assert set(tiers) == {"hot", "warm", "cold"}
    assert isinstance(tiers["hot"], LocalTier)
    assert tiers["hot"].url == str(settings.hot_path)
    assert isinstance(tiers["warm"], LocalTier)
    cold = tiers["cold"]
    assert isinstance(cold, S3Tier)
    assert cold.storage_class == "GLACIER"
    assert not cold.readable
    assert cold.url == "s3://bucket/cold"
    from ckptstore.errors import ConfigError

    with pytest.raises(ConfigError, match="unsupported"):
        tier_from_url("warm", "gs://b/p")
