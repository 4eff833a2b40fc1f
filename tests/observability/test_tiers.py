"""Tier health: reachability, free space, contents, throughput probes, ``ckpt tiers``."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore.observability.tiers import (
    PROBE_PREFIX,
    REQUIRED_BYTES_PER_S,
    probe_tier,
    scan_tier,
    tier_status,
)
from ckptstore.storage import LocalTier, S3Tier, build_tiers
from ckptstore.testing.s3 import FAKE_SECRET_ACCESS_KEY, MotoS3


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_local_tier_status_matches_catalog_and_disk(filled_store: CheckpointStore) -> None:
    tiers = build_tiers(filled_store.settings)
    status = tier_status(tiers["hot"], filled_store.usage())
    files = _files(filled_store.hot)
    assert status.reachable and status.error is None and status.role == "hot"
    assert status.backend == "local" and status.url == str(filled_store.hot)
    assert status.free_bytes is not None and status.free_bytes > 0
    assert status.objects == len(files)
    assert status.listed_bytes == sum(p.stat().st_size for p in files)
    assert status.catalog_checkpoints == 3
    assert status.catalog_bytes == sum(r.bytes for r in filled_store.usage())
    assert status.probe is None
    assert json.loads(json.dumps(status.to_dict()))["name"] == "hot"


def test_local_probe_measures_and_cleans_up(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "hot", name="hot")
    (tmp_path / "hot").mkdir()
    result = probe_tier(tier, size_bytes=4 * 2**20)
    assert result.size_bytes == 4 * 2**20
    assert result.write_bytes_per_s > 0 and result.read_bytes_per_s is not None
    assert result.required_bytes_per_s == REQUIRED_BYTES_PER_S["hot"]
    slow = min(result.write_bytes_per_s, result.read_bytes_per_s) < 1e9
    assert result.ok is not slow
    assert (result.verdict == "ok") is result.ok
    if not result.ok:
        assert "slow for the hot role" in result.verdict and "1000 MB/s needed" in result.verdict
    assert list((tmp_path / "hot").iterdir()) == []  # blob and probe folder are gone
    assert scan_tier(tier) == (0, 0)


def test_missing_hot_directory_is_reported(tmp_path: Path) -> None:
    status = tier_status(LocalTier(tmp_path / "nowhere", name="hot"))
    assert not status.reachable and "does not exist yet" in (status.error or "")


def test_s3_tier_listing_probe_and_outage(s3: MotoS3) -> None:
    prefix = uuid.uuid4().hex[:10]
    tier = S3Tier(s3.url(f"{prefix}/warm"), s3.storage_options, name="warm")
    tier.put_bytes("run/0001/a", b"x" * 100)
    tier.put_bytes("run/0001/b", b"y" * 23)
    status = tier_status(tier, probe=True, probe_bytes=2**20)
    assert status.reachable, status.error
    assert (status.objects, status.listed_bytes) == (2, 123)
    assert status.backend == "s3" and status.role == "archive" and status.free_bytes is None
    assert status.probe is not None and status.probe.read_bytes_per_s is not None
    assert status.probe.required_bytes_per_s == 1e8
    assert not s3.keys(f"{prefix}/warm/{PROBE_PREFIX}")  # the probe blob was deleted
    missing = S3Tier(f"s3://no-such-bucket-{prefix}/x", s3.storage_options, name="cold")
    down = tier_status(missing)
    assert not down.reachable and "does not exist" in (down.error or "")
    assert FAKE_SECRET_ACCESS_KEY not in (down.error or "")
    s3.stop()
    try:
        gone = tier_status(S3Tier(s3.url(prefix), s3.storage_options, name="warm"))
        assert not gone.reachable and gone.error
    finally:
        s3.start()


def test_glacier_probe_skips_the_read(s3: MotoS3) -> None:
    tier = S3Tier(s3.url(uuid.uuid4().hex[:10]), s3.storage_options,
                  storage_class="GLACIER", name="cold")
    result = probe_tier(tier, size_bytes=2**20)
    assert result.read_bytes_per_s is None and result.write_bytes_per_s > 0


def test_ckpt_tiers_command(
    filled_store: CheckpointStore,
    ckpt_cli: Callable[..., int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = str(filled_store.settings.root)
    assert ckpt_cli("--store", root, "tiers", "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["hot"]
    assert rows[0]["reachable"] and rows[0]["catalog_checkpoints"] == 3 and rows[0]["objects"]
    assert ckpt_cli("--store", root, "tiers", "--probe", "--probe-mib", "2") == 0
    out = capsys.readouterr().out
    assert "hot" in out and "MB/s" in out and ("ok" in out or "slow" in out)
    assert ckpt_cli("--store", root, "tiers", "--probe-mib", "0") == 2  # bad usage
    assert "--probe-mib" in capsys.readouterr().err


def test_ckpt_tiers_fails_when_a_tier_is_down(
    tmp_path: Path, s3: MotoS3, ckpt_cli: Callable[..., int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "ckpt.toml"
    config.write_text(
        f'root = "{tmp_path / "store"}"\n[tiers]\nwarm = "s3://absent-{uuid.uuid4().hex[:8]}/w"\n'
        f'[storage_options]\nendpoint_url = "{s3.endpoint_url}"\n'
    )
    assert ckpt_cli("init", "--config", str(config)) == 0
    capsys.readouterr()
    assert ckpt_cli("--config", str(config), "tiers") == 1
    captured = capsys.readouterr()
    assert "NO" in captured.out and "does not exist" in captured.err
