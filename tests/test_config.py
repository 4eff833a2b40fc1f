"""Configuration precedence and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore.config import load_settings
from ckptstore.errors import ConfigError


def test_defaults(tmp_path: Path) -> None:
    s = load_settings(root=tmp_path)
    assert s.codec == "auto"
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
     "keep_last = -1", 'hot = "gs://bucket/x"', "this is not toml", "replicas = 3",
     "[sync]\nruns = 'a'", "[sync]\nmode = 'avg'", "[sync]\nbest = 3", "[sync]\nevery = 1"],
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


# ---------------------------------------------------------------------- keys, env, discovery
EXAMPLE = Path(__file__).resolve().parents[1] / "ckptstore.example.toml"

# A valid environment value of every setting, and what it resolves to.
ENV_SAMPLES: dict[str, tuple[str, object]] = {
    "root": ("store", None),
    "catalog_url": ("sqlite:////tmp/x/catalog.db", "sqlite:////tmp/x/catalog.db"),
    "hot": ("/tmp/x/hot", "/tmp/x/hot"),
    "warm": ("s3://bucket/warm", "s3://bucket/warm"),
    "cold": ("s3://bucket/cold", "s3://bucket/cold"),
    "cold_storage_class": ("STANDARD_IA", "STANDARD_IA"),
    "cold_restore_tier": ("Bulk", "Bulk"),
    "cold_restore_days": ("2", 2),
    "storage_options": ('{"endpoint_url": "http://127.0.0.1:9000"}',
                        {"endpoint_url": "http://127.0.0.1:9000"}),
    "codec": ("zstd-1", "zstd-1"),
    "archive_codec": ("zstd-3", "zstd-3"),
    "chunk_bytes": ("65536", 65536),
    "threads": ("3", 3),
    "keep_last": ("4", 4),
    "keep_every": ("100", 100),
    "keep_best": ("val_loss:max:2", ("val_loss", "max", 2)),
    "max_age_days": ("7.5", 7.5),
    "save_interval": ("500", 500),
    "cold_after_days": ("3", 3.0),
    "schedules": ('{"gc": "every 30s"}', {"gc": "every 30s"}),
    "staging_budget_bytes": ("1048576", 1048576),
    "memory_tier_bytes": ("0", 0),
    "memory_tier_dir": ("/tmp/x/shm", "/tmp/x/shm"),
    "delta": ('{"quantize": 8}', {"quantize": 8}),
    "keyframe_every": ("5", 5),
    "delta_cache_bytes": ("0", 0),
    "replicas": ("2", 2),
    "host_timeout_s": ("45", 45.0),
    "sync": ('{"runs": ["a"], "best": "loss"}', {"runs": ["a"], "best": "loss"}),
    "decrypt_key": ("/tmp/x/me.key", "/tmp/x/me.key"),
    # Relative to the current directory (the test's), where the keys are made below.
    "encrypt_to": ("keys/a.pub, keys/b.pub", ("keys/a.pub", "keys/b.pub")),
    "capture": ("0", False),
    "capture_env": ("SLURM_JOB_ID, RUN_TAG", ("SLURM_JOB_ID", "RUN_TAG")),
}


def _settings_fields() -> list[str]:
    import dataclasses

    from ckptstore.config import Settings

    return [f.name for f in dataclasses.fields(Settings) if f.name != "source"]


def test_every_setting_is_documented_and_has_an_env_var(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import re

    from ckptstore.config import ENV_VARS, resolve_settings

    example = EXAMPLE.read_text(encoding="utf-8")
    missing_doc, missing_env = [], []
    for name in _settings_fields():
        documented = re.search(rf"(?m)^\s*#?\s*{name}\s*=", example) or re.search(
            rf"(?m)^\[{name}\]", example)
        if not documented:
            missing_doc.append(name)
        env = ENV_VARS.get(name)
        if env is None or not env.startswith("CKPT_") or env not in example:
            missing_env.append(name)
    assert not missing_doc, f"keys missing from ckptstore.example.toml: {missing_doc}"
    assert not missing_env, f"settings without a documented CKPT_* variable: {missing_env}"
    assert set(ENV_SAMPLES) == set(_settings_fields())  # this test covers every setting
    monkeypatch.chdir(tmp_path)
    _encryption_keys(tmp_path / "keys", "a", "b")
    for name, (text, expected) in ENV_SAMPLES.items():
        monkeypatch.setenv(ENV_VARS[name], text)
        resolved = resolve_settings()
        value = getattr(resolved.settings, name)
        if name == "root":
            assert value == tmp_path / "store"
        else:
            assert value == expected, name
        assert resolved.origins[name].kind == "env", name
        monkeypatch.delenv(ENV_VARS[name])


@pytest.mark.parametrize(("var", "text"), [
    ("CKPT_KEEP_BEST", "val_loss:3"), ("CKPT_KEEP_BEST", "val_loss:avg:3"),
    ("CKPT_KEEP_EVERY", "-1"), ("CKPT_MAX_AGE_DAYS", "soon"), ("CKPT_MAX_AGE_DAYS", "nan"),
    ("CKPT_STORAGE_OPTIONS", "endpoint_url=x"), ("CKPT_SCHEDULES", "[1, 2]"),
    ("CKPT_DELTA", "{bad json"), ("CKPT_SYNC", '{"runs": "a"}'),
])
def test_bad_env_values_name_their_variable(monkeypatch: pytest.MonkeyPatch, var: str,
                                            text: str) -> None:
    monkeypatch.setenv(var, text)
    with pytest.raises(ConfigError, match=var):
        load_settings()


def _encryption_keys(directory: Path, *names: str) -> None:
    from ckptstore.ops.sharing.crypt import generate_encryption_keypair

    for name in names:
        generate_encryption_keypair(directory, name)


def test_the_example_config_is_valid_with_every_key_uncommented(tmp_path: Path) -> None:
    import re

    text = re.sub(r"(?m)^# (\w+ = )", r"\1", EXAMPLE.read_text(encoding="utf-8"))
    cfg = tmp_path / "all.toml"
    cfg.write_text(text, encoding="utf-8")
    # encrypt_to names keys/ops.pub next to the config: missing, it is refused by name.
    with pytest.raises(ConfigError, match=r"tiers\.encrypt_to: .*keys/ops\.pub"):
        load_settings(cfg)
    _encryption_keys(tmp_path / "keys", "ops")
    # Every key at once puts encrypt_to beside an S3 cold tier in GLACIER: sealed copies
    # there are thawed like plain ones (ops/tiering/thaw.py).
    s = load_settings(cfg)
    assert s.cold_storage_class == "GLACIER"
    assert s.encrypt_to == (str(tmp_path / "keys" / "ops.pub"),)
    assert s.catalog_url and s.cold_after_days == 30 and s.max_age_days == 30
    assert s.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}


def test_config_discovery_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstore.config import resolve_settings

    monkeypatch.chdir(tmp_path)
    assert resolve_settings().config is None and load_settings().codec == "auto"
    (tmp_path / "ckptstore.toml").write_text('codec = "zstd-1"\n')
    found = resolve_settings()
    assert found.config == tmp_path / "ckptstore.toml"
    assert found.config_found_by == "./ckptstore.toml"
    assert found.settings.codec == "zstd-1" and found.origins["codec"].kind == "file"
    other = tmp_path / "other.toml"
    other.write_text('codec = "zstd-3"\n')
    monkeypatch.setenv("CKPT_CONFIG", str(other))
    assert load_settings().codec == "zstd-3"  # $CKPT_CONFIG beats ./ckptstore.toml
    explicit = tmp_path / "explicit.toml"
    explicit.write_text('codec = "none"\n')
    resolved = resolve_settings(explicit)
    assert resolved.settings.codec == "none" and resolved.config_found_by == "argument"
    monkeypatch.setenv("CKPT_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(ConfigError, match="CKPT_CONFIG"):
        load_settings()


def test_ckpt_config_shows_sources_and_never_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from ckptstore.cli.app import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckptstore.toml").write_text(
        'catalog_url = "postgresql+psycopg://ckpt:s3cr3t-pw@db:5432/ckpt?sslpassword=pw2x"\n'
        'save_dir = "hot"\n'
        '[storage_options]\nendpoint_url = "http://minio:9000"\nsecret = "AKIAsecretvalue"\n'
        '[retention]\nkeep_last = 2\n'
    )
    monkeypatch.setenv("CKPT_THREADS", "3")
    monkeypatch.setenv("CKPT_WARM", "s3://user:warm-pw@bucket/warm")
    assert main(["config", "--json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)
    rows = doc["settings"]
    assert doc["config"] == {"path": str(tmp_path / "ckptstore.toml"),
                             "found_by": "./ckptstore.toml"}
    assert rows["keep_last"] == {"value": 2, "from": "file",
                                 "detail": str(tmp_path / "ckptstore.toml")}
    assert rows["threads"]["from"] == "env" and rows["threads"]["value"] == 3
    assert rows["codec"] == {"value": "auto", "from": "default", "detail": ""}
    assert rows["hot"]["value"] == str(tmp_path / "hot")
    assert rows["root"]["value"] == str(tmp_path / "hot" / ".ckptstore")
    assert rows["root"]["from"] == "default"
    assert rows["storage_options"]["value"]["secret"] == "***"
    assert set(rows) == set(_settings_fields())
    assert main(["--store", str(tmp_path / "explicit"), "config", "--json"]) == 0
    root = json.loads(capsys.readouterr().out)["settings"]["root"]
    assert root == {"value": str(tmp_path / "explicit"), "from": "argument", "detail": ""}
    assert main(["config"]) == 0
    text = capsys.readouterr().out
    assert "config file:" in text and "env ($CKPT_THREADS)" in text
    for leaked in ("s3cr3t-pw", "pw2x", "AKIAsecretvalue", "warm-pw"):
        assert leaked not in out and leaked not in text
    assert "***" in text


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
