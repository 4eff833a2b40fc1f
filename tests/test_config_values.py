"""Every setting is checked when the settings are resolved: a bad value fails there, naming
the key, the value, where it came from (file or variable) and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore.config import SCHEDULABLE_FLOWS, load_settings
from ckptstore.cronspec import check_schedule
from ckptstore.errors import ConfigError
from ckptstore.store import CheckpointStore

# (file text, key as written, what the message says is allowed)
BAD_FILE_VALUES = [
    ("[tiers]\nwarm = 5", "tiers.warm", "local path, a file:// URL or an s3://bucket"),
    ('[tiers]\ncold = "gs://bucket/x"', "tiers.cold", "unsupported scheme 'gs://'"),
    ('[tiers]\nwarm = "s3:///prefix"', "tiers.warm", "names no bucket"),
    ('[tiers]\nhot = ""', "tiers.hot", "local path"),
    ('[schedules]\narchive = "every ten minutes"', "schedules",
     "neither a cron expression nor an interval"),
    ('[schedules]\ngc = "61 * * * *"', "schedules", "minute field's 61 is outside 0-59"),
    ('[schedules]\nrestore = "@daily"', "schedules", "cannot be served (that flow"),
    ('[schedules]\nverify = 3', "schedules", "cron expression"),
    ('chunk_bytes = "8MB"', "chunk_bytes", "non-negative integer"),
    ('staging_budget_bytes = -1', "staging_budget_bytes", "non-negative integer"),
    ('[tiers]\ncold_storage_class = "GLACIAL"', "tiers.cold_storage_class", "DEEP_ARCHIVE"),
    ('[tiers]\ncold_restore_tier = "Fast"', "tiers.cold_restore_tier", "Expedited"),
    ('catalog_url = "mysql://db/ckpt"', "catalog_url", "postgresql+psycopg://"),
    ('catalog_url = 7', "catalog_url", "sqlite:///"),
    ('root = 5', "root", "directory path"),
    ('memory_tier_dir = "s3://b/x"', "memory_tier_dir", "local directory path"),
    ('[retention]\nkeep_best = "val_loss"', "retention.keep_best", '"min" or "max"'),
    ('[retention]\nkeep_best = [3, "min", 3]', "retention.keep_best", "metric"),
]


@pytest.mark.parametrize(("text", "key", "allowed"), BAD_FILE_VALUES,
                         ids=[t for t, _, _ in BAD_FILE_VALUES])
def test_bad_file_values_fail_at_resolution(tmp_path: Path, text: str, key: str,
                                            allowed: str) -> None:
    cfg = tmp_path / "ckptstore.toml"
    cfg.write_text(f'root = "{tmp_path / "store"}"\n' * ("root" not in text) + text + "\n")
    for resolve in (lambda: load_settings(cfg), lambda: CheckpointStore.open(config=cfg)):
        with pytest.raises(ConfigError) as caught:
            resolve()
        message = str(caught.value)
        assert message.startswith(f"{cfg}: invalid value for {key}: "), message
        assert allowed in message, message
    assert not (tmp_path / "store").exists() and not (tmp_path / "5").exists()


def test_bad_env_values_name_the_variable(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPT_WARM", "ftp://host/x")
    with pytest.raises(ConfigError, match=r"^\$CKPT_WARM: invalid value for warm: "
                                          r"'ftp://host/x' \(unsupported scheme"):
        load_settings()
    monkeypatch.delenv("CKPT_WARM")
    monkeypatch.setenv("CKPT_SCHEDULES", '{"archive": "every ten minutes"}')
    with pytest.raises(ConfigError, match=r"^\$CKPT_SCHEDULES: invalid value for schedules"):
        load_settings()


def test_a_bad_config_is_a_usage_free_failure_of_ckpt_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from ckptstore.cli.app import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckptstore.toml").write_text("[tiers]\nwarm = 5\n")
    assert main(["config"]) == 1
    err = capsys.readouterr().err
    assert "invalid value for tiers.warm: 5" in err and not (tmp_path / "5").exists()


def test_good_values_still_pass(tmp_path: Path) -> None:
    cfg = tmp_path / "ok.toml"
    cfg.write_text(
        '[tiers]\nhot = "file:///tmp/hot"\nwarm = "s3://bucket/ckpt"\ncold = "cold"\n'
        'cold_storage_class = "STANDARD_IA"\n'
        '[schedules]\narchive = "*/10 * * * *"\nretention = "0 * * * *"\nverify = "0 3 * * 0"\n'
        'gc = "30 3 * * *"\nsync = "@every 1h"\ndemote = "@daily"\n'
    )
    settings = load_settings(cfg)
    assert settings.warm == "s3://bucket/ckpt" and settings.cold == str(tmp_path / "cold")
    assert settings.schedules["sync"] == "@every 1h"


def test_schedulable_flows_match_the_flows_package() -> None:
    from ckptstore.flows.embedded import _UNSCHEDULABLE
    from ckptstore.flows.registry import FLOWS

    assert set(SCHEDULABLE_FLOWS) == set(FLOWS) - _UNSCHEDULABLE


@pytest.mark.parametrize("text", [
    "*/10 * * * *", "0 3 * * 0", "@daily", "0 0 1 jan mon", "0 0 L * *", "1-5/2 * * * * 30",
    "0 0 * * 7", "5,10-20/5 * * * *", "61 * * * *", "* * * *", "0 0 32 * *", "a b c d e",
    "*/0 * * * *", "@often", "0 0 * * 8",
])
def test_cron_check_agrees_with_croniter(text: str) -> None:
    croniter = pytest.importorskip("croniter")
    try:
        check_schedule(text)
        ours = True
    except ValueError:
        ours = False
    assert ours == croniter.croniter.is_valid(text)
