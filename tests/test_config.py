"""Configuration precedence and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore.config import load_settings
from ckptstore.errors import ConfigError


def test_defaults(tmp_path: Path) -> None:
    s = load_settings(root=tmp_path)
    assert s.codec == "lz4"
    assert s.resolved_catalog_url.startswith("sqlite:///")
    assert s.hot_path == (tmp_path / "hot").resolve()


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('codec = "zstd-1"\nthreads = 3\n[retention]\nkeep_last = 4\n')
    assert load_settings(cfg).codec == "zstd-1"
    monkeypatch.setenv("CKPT_CODEC", "none")
    assert load_settings(cfg).codec == "none"  # env beats file
    assert load_settings(cfg, codec="zstd-3").codec == "zstd-3"  # argument beats env
    assert load_settings(cfg).keep_last == 4
    monkeypatch.setenv("CKPT_CONFIG", str(cfg))
    assert load_settings().threads == 3


def test_deepspeed_style_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "deepspeed-style.toml"
    cfg.write_text(
        'save_dir = "hotdir"\narchive_dir = "s3://b/p"\nkeep_last = 2\nsave_interval = 500\n'
        '[compression_config]\ntype = "diff"\nthreshold = 1e-4\nquantize = 8\n'
    )
    s = load_settings(cfg)
    assert s.warm == "s3://b/p"
    assert s.hot_path.name == "hotdir"
    assert (s.keep_last, s.save_interval) == (2, 500)


@pytest.mark.parametrize(
    "text",
    ['codec = "gzip"', "threads = 0", 'unknown_key = 1', "[tiers]\nlukewarm = 'x'",
     "keep_last = -1", 'hot = "gs://bucket/x"', "this is not toml", "replicas = 3"],
)
def test_bad_config(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError):
        load_settings(cfg).hot_path  # noqa: B018 - the hot path is validated lazily


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_delta_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(root=tmp_path).delta == "dedup"
    assert load_settings(root=tmp_path).keyframe_every == 10
    cfg = tmp_path / "deepspeed-style.toml"
    cfg.write_text('[compression_config]\ntype = "diff"\nthreshold = 1e-4\nquantize = 8\n')
    assert load_settings(cfg).delta == {"type": "diff", "threshold": 1e-4, "quantize": 8}
    cfg.write_text('delta = "xor"\nkeyframe_every = 4\n[compression_config]\ntype = "diff"\n')
    s = load_settings(cfg)
    assert (s.delta, s.keyframe_every) == ("xor", 4)  # an explicit delta wins
    monkeypatch.setenv("CKPT_DELTA", "false")
    assert load_settings(cfg).delta is False
    assert load_settings(cfg, delta={"quantize": 4}).delta == {"quantize": 4}
    for bad in ('delta = "zip"', "keyframe_every = 0", "[delta]\nquantize = 3"):
        cfg.write_text(bad)
        with pytest.raises(ConfigError):
            load_settings(cfg)


def test_hot_tier_in_object_storage_and_replicas(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes without local disk: hot may be an s3:// URL (distributed saves upload there);
    the local hot path is then scratch space under the root."""
    cfg = tmp_path / "ckpt.toml"
    cfg.write_text(f'root = "{tmp_path / "r"}"\nreplicas = 2\n[tiers]\nhot = "s3://b/hot"\n')
    settings = load_settings(cfg)
    assert settings.hot_remote == "s3://b/hot"
    assert settings.hot_path == (tmp_path / "r" / "hot").resolve()
    assert settings.tier_urls()["hot"] == "s3://b/hot"
    assert settings.replicas == 2 and settings.host_timeout_s == 600.0
    monkeypatch.setenv("CKPT_REPLICAS", "1")
    monkeypatch.setenv("CKPT_HOST_TIMEOUT_S", "45")
    settings = load_settings(cfg)
    assert (settings.replicas, settings.host_timeout_s) == (1, 45.0)
    assert load_settings(root=tmp_path).hot_remote is None
