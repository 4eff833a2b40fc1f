"""docker-compose.yml cannot run here; keep it well-formed and on the code's config keys."""

from __future__ import annotations

from pathlib import Path

import yaml

from ckptstore.config import _ENV, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_and_keys() -> None:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = data["services"]
    assert {"postgres", "minio", "prefect-server", "prefect-worker"} <= set(services)
    for name in ("postgres", "minio", "prefect-server"):
        assert "healthcheck" in services[name], name
    env = services["prefect-worker"]["environment"]
    ckpt_keys = {k for k in env if k.startswith("CKPT_")}
    unknown = ckpt_keys - set(_ENV) - {"CKPT_CONFIG"}
    assert not unknown, f"compose uses config keys the code does not read: {unknown}"
    assert "AWS_SECRET_ACCESS_KEY" in env  # credentials come from the environment only


def test_example_config_parses() -> None:
    settings = load_settings(ROOT / "ckptstore.example.toml")
    assert settings.codec == "lz4"
    assert settings.keep_best == ("val_loss", "min", 3)
    assert settings.schedules["archive"] == "*/10 * * * *"
