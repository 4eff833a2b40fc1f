"""docker-compose.yml cannot run here (no container engine): check what can be checked by reading.

The compose file and scripts/stack/ are one deployment: every ckptstore service runs one of
those scripts, with environment variables the code actually reads (CKPT_* config keys) or the
standard ones of the services. tests/deploy/test_stack.py runs the same scripts for real.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptstore import identity
from ckptstore.config import CONFIG_ENV, ENV_ENTRY_VARS, ENV_VARS, load_settings

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "scripts" / "stack"
#: Where the Dockerfile puts scripts/stack in the image (WORKDIR /app).
IMAGE_APP = "/app/"

#: Variables of the services themselves that a ckptstore service may set or a stack script
#: may read: Prefect's client and server settings, the AWS credential chain.
SERVICE_VARS = frozenset({
    "PREFECT_API_URL",
    "PREFECT_SERVER_API_HOST",
    "PREFECT_SERVER_API_PORT",
    "PREFECT_API_DATABASE_CONNECTION_URL",
    "PREFECT_SERVER_ANALYTICS_ENABLED",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
})
#: Variables of the third-party images, by image name.
IMAGE_VARS = {
    "postgres": frozenset({"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"}),
    "quay.io/minio/minio": frozenset({"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}),
}
SCRIPTS = {"db-upgrade.sh", "make-bucket.py", "prefect-server.sh", "agent.sh", "ui.sh",
           "trainer.sh"}


def known_config_keys() -> set[str]:
    """The CKPT_* variables ckptstore reads: the ones load_settings maps onto Settings fields
    (src/ckptstore/config.py), the config file's path (CKPT_CONFIG, read there too), the
    node name (src/ckptstore/identity.py) and the JSON-log switch
    (src/ckptstore/observability/jsonlog.py)."""
    return {*ENV_VARS.values(), *ENV_ENTRY_VARS, CONFIG_ENV, identity.HOST_ENV, "CKPT_LOG_JSON"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _ours(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run the ckptstore image (built from the Dockerfile)."""
    return {name: svc for name, svc in compose["services"].items() if "build" in svc}


def test_services_of_the_topology(compose: dict[str, Any]) -> None:
    services = set(compose["services"])
    assert {"postgres", "minio", "make-bucket", "db-upgrade", "prefect-server",
            "agent-node-a", "agent-node-b", "trainer", "ui"} <= services
    assert set(_ours(compose)) == services - {"postgres", "minio", "ui-proxy"}


def test_ckptstore_services_run_the_stack_scripts(compose: dict[str, Any]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^COPY scripts/stack/ /app/scripts/stack/$", dockerfile, re.M)
    assert re.search(r"^WORKDIR /app$", dockerfile, re.M)
    used = set()
    for name, svc in _ours(compose).items():
        assert "entrypoint" not in svc, f"{name}: the command is the entry point"
        command = svc.get("command")
        assert isinstance(command, list) and command, f"{name}: command must be a list"
        assert command[0].startswith(IMAGE_APP + "scripts/stack/"), (name, command)
        script = ROOT / command[0][len(IMAGE_APP):]
        assert script.name in SCRIPTS and script.is_file(), (name, command[0])
        assert script.stat().st_mode & 0o111, f"{script} is not executable"
        used.add(script.name)
    assert used == SCRIPTS, f"scripts no service runs: {SCRIPTS - used}"


def test_environment_is_config_keys_or_service_variables(compose: dict[str, Any]) -> None:
    allowed = known_config_keys() | SERVICE_VARS
    for name, svc in compose["services"].items():
        env = set(_env(svc))
        if "build" in svc:
            unknown = env - allowed
            assert not unknown, f"{name} sets variables the code does not read: {unknown}"
            ckpt_config_path = _env(svc).get("CKPT_CONFIG")
            if ckpt_config_path is not None:
                targets = {c["target"] for c in svc.get("configs", [])}
                assert ckpt_config_path in targets, f"{name}: CKPT_CONFIG names no mounted file"
        else:
            image = svc["image"].rsplit(":", 1)[0]
            assert env <= IMAGE_VARS.get(image, frozenset()), (name, env)


def test_stack_scripts_read_only_known_variables() -> None:
    allowed = known_config_keys() | SERVICE_VARS
    # Files only: a __pycache__ appears beside the .py scripts wherever Python may cache them.
    for script in sorted(p for p in STACK.iterdir() if p.is_file()):
        text = script.read_text()
        if script.suffix == ".sh":
            local = set(re.findall(r"^\s*([A-Za-z_]\w*)=", text, re.M))
            read = set(re.findall(r"\$\{?([A-Za-z_]\w*)", text)) - local
        elif script.suffix == ".py":
            read = set(re.findall(r"environ(?:\.get\(|\[)\s*['\"](\w+)", text))
            read |= set(re.findall(r"getenv\(\s*['\"](\w+)", text))
        else:
            continue
        assert read <= allowed, f"{script.name} reads {read - allowed}"


def test_images_are_pinned(compose: dict[str, Any]) -> None:
    version = importlib.metadata.version("ckptstore")
    for name, svc in compose["services"].items():
        image = svc.get("image")
        assert image, f"{name}: no image"
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag and tag not in ("", "latest"), f"{name}: {image} unpinned"
        if "build" in svc:
            assert image == f"ckptstore:{version}", f"{name}: tag the image with the version"
        else:
            assert re.search(r"\d", tag), f"{name}: {image} is not a release tag"


def test_healthchecks_use_tools_the_images_have(compose: dict[str, Any]) -> None:
    # None of the images has curl or wget: postgres has pg_isready, MinIO has mc, ours python.
    for name, svc in compose["services"].items():
        test = svc.get("healthcheck", {}).get("test", [])
        text = " ".join(test) if isinstance(test, list) else str(test)
        assert not re.search(r"\b(curl|wget)\b", text), f"{name}: {text}"


def test_no_bind_mounts(compose: dict[str, Any]) -> None:
    """Only named volumes; files reach containers through `configs` (read-only, no source
    tree: the image carries the installed package)."""
    named = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":", 1)[0]
            assert source in named, f"{name}: {volume} is not a named volume"
    for name, cfg in (compose.get("configs") or {}).items():
        path = ROOT / cfg["file"]
        assert path.is_file() and path.suffix in (".toml", ".sql"), (name, cfg)


def test_dependencies(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            condition = spec.get("condition", "service_started")
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health"
            elif condition == "service_completed_successfully":
                assert services[dep].get("restart", "no") == "no", f"{dep} is not one-shot"
        if name in _ours(compose) and name != "db-upgrade":
            assert deps.get("db-upgrade", {}).get("condition") == (
                "service_completed_successfully"), f"{name} must wait for db-upgrade"


def test_ports_are_published_on_loopback(compose: dict[str, Any]) -> None:
    published = set()
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"
            published.add(name)
    assert {"postgres", "minio", "prefect-server", "ui"} <= published


def test_agents_are_nodes_of_one_pool(compose: dict[str, Any]) -> None:
    """Two nodes with their own CKPT_HOST on one pool; each runs `ckpt agent` on the pool (it
    registers the flows, then polls its own queue and, on the shared hot volume, the default
    one)."""
    agents = {n: s for n, s in compose["services"].items() if n.startswith("agent-")}
    assert len(agents) == 2
    hosts = {_env(s)["CKPT_HOST"] for s in agents.values()}
    assert len(hosts) == 2
    assert len({tuple(s["command"]) for s in agents.values()}) == 1
    for svc in agents.values():
        assert _env(svc)["PREFECT_API_URL"].startswith("http://prefect-server:")
        assert "hot:/data/hot" in svc["volumes"] and _env(svc)["CKPT_HOT"] == "/data/hot"
    trainer = compose["services"]["trainer"]
    assert "hot:/data/hot" in trainer["volumes"] and _env(trainer)["CKPT_HOST"] in hosts
    script = (STACK / "agent.sh").read_text()
    # One shared hot volume: the agents must serve the default queue too.
    assert re.search(r'^exec ckpt agent --pool "\$pool" --shared-hot$', script, re.M), script


def test_interpolated_variables_are_documented(compose: dict[str, Any]) -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    docs = (ROOT / "docs" / "DEPLOYMENT.md").read_text()
    for var in sorted(set(re.findall(r"(?<!\$)\$\{(\w+)", text))):
        assert var in docs, f"{var} is not documented in docs/DEPLOYMENT.md"


def test_example_config_parses() -> None:
    settings = load_settings(ROOT / "ckptstore.example.toml")
    assert settings.codec == "auto"
    assert settings.keep_best == ("val_loss", "min", 3)
    assert settings.schedules["archive"] == "*/10 * * * *"


def test_stack_config_parses() -> None:
    settings = load_settings(STACK / "ckptstore.toml")
    # MinIO refuses GLACIER; the cold tier must write a class it stores.
    assert settings.cold_storage_class in ("STANDARD", "REDUCED_REDUNDANCY")
    assert {"archive", "retention"} <= set(settings.schedules)
    assert settings.catalog_url is None and settings.warm is None  # locations: CKPT_* only
