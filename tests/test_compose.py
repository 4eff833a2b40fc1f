"""docker-compose.yml cannot run here; keep it well-formed and on the code's config keys."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ckptstore.config import CONFIG_ENV, ENV_ENTRY_VARS, ENV_VARS, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_and_keys() -> None:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = data["services"]
    assert {"postgres", "minio", "prefect-server", "prefect-worker"} <= set(services)
    for name in ("postgres", "minio", "prefect-server"):
        assert "healthcheck" in services[name], name
    env = services["prefect-worker"]["environment"]
    ckpt_keys = {k for k in env if k.startswith("CKPT_")}
    unknown = ckpt_keys - set(ENV_VARS.values()) - set(ENV_ENTRY_VARS) - {CONFIG_ENV}
    assert not unknown, f"compose uses config keys the code does not read: {unknown}"
    assert "AWS_SECRET_ACCESS_KEY" in env  # credentials come from the environment only


def test_compose_worker_serves_a_work_pool() -> None:
    """The worker registers the flows on a process pool, then polls that same pool."""
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    worker = data["services"]["prefect-worker"]
    command = " ".join(worker["command"].split())
    registered = re.search(r"ckpt serve --pool (\S+)", command)
    polled = re.search(r"prefect worker start --pool (\S+) --type process", command)
    assert registered and polled, command
    assert registered.group(1) == polled.group(1)
    assert command.index("ckpt serve --pool") < command.index("prefect worker start")
    assert worker["environment"]["PREFECT_API_URL"].startswith("http://prefect-server:")


def test_example_config_parses() -> None:
    settings = load_settings(ROOT / "ckptstore.example.toml")
    assert settings.codec == "lz4"
    assert settings.keep_best == ("val_loss", "min", 3)
    assert settings.schedules["archive"] == "*/10 * * * *"
