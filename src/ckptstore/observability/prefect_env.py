"""Prefect in the processes ckptstore starts: telemetry off, its log lines in the store's log file.

A training process that archives through the embedded flow runner (``flows/embedded.py``)
must print only what the user asked for. Left to its defaults, Prefect would send analytics
(from the SDK and from its temporary server, whose failure without network prints ``Failed
to send telemetry``), install its console handler on the root logger when it is imported,
and print a few lines per flow run there.

* :func:`apply_prefect_defaults` puts :data:`PREFECT_DEFAULTS` into ``os.environ`` before
  Prefect is imported (``ckptstore.tasks`` and ``ckptstore.flows`` call it when they are
  imported), so this process and every process it starts (Prefect's temporary server, a
  ``prefect worker`` and its flow runs) inherit them; :func:`prefect_env` does the same for
  the environment of a child process. A setting the user gave, in the environment or in the
  active Prefect profile, is left alone.
* :func:`root_logging_kept` wraps the first import of Prefect so that the root logger keeps
  the handlers it had (none, in a plain training script); :func:`route_prefect_logs` then
  sends the ``prefect`` logger to the store's log file (:func:`flow_log_path`), and to the
  console only when this process logs at INFO (``--verbose`` on a ``ckpt`` command, or a script's
  ``logging.basicConfig(level=logging.INFO)``).

Nothing here imports Prefect.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

from ckptstore.redact import RedactingFormatter

__all__ = [
    "FLOW_LOG_NAME",
    "PREFECT_DEFAULTS",
    "apply_prefect_defaults",
    "console_verbose",
    "flow_log_path",
    "prefect_env",
    "root_logging_kept",
    "route_prefect_logs",
]

logger = logging.getLogger(__name__)

#: Prefect settings every process ckptstore starts gets unless the user set them.
PREFECT_DEFAULTS: dict[str, str] = {
    # The SDK's anonymous usage events (read by prefect/_internal/analytics/enabled.py).
    "DO_NOT_TRACK": "1",
    # The temporary server's start-up report to Prefect (its "telemetry" service).
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # OpenTelemetry spans of flow and task runs, meant for Prefect Cloud.
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
    # A sampling thread per flow-run process reporting CPU and memory as events: costs CPU
    # beside the checkpoint copies, and nobody reads them in embedded mode.
    "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false",
    # The temporary server the embedded runner starts once per process: on a training node
    # whose cores are busy, Prefect's 20 s default can run out, and each flow after a failed
    # start would try to start another one.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}

#: The store's log file for background flows, under ``<root>/logs/``.
FLOW_LOG_NAME = "flows.log"
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(ckpt_run)s%(message)s"
_LOG_BYTES = 10 * 1024 * 1024
_LOG_BACKUPS = 3
_HANDLER_MARK = "_ckpt_flow_log"


class _FlowLogFormatter(RedactingFormatter):
    """Prefect's run records name their run (``flow run 'name': ...``), scrubbed."""

    def format(self, record: logging.LogRecord) -> str:
        """Format ``record``, its flow or task run's name before the message."""
        run = ""
        for attr, what in (("task_run_name", "task run"), ("flow_run_name", "flow run")):
            name = getattr(record, attr, None)
            if name:
                run = f"{what} {name!r}: "
                break
        record.ckpt_run = run
        return super().format(record)


def _profile_settings(env: Mapping[str, str]) -> Mapping[str, object]:
    """The settings of the active Prefect profile (``prefect config set`` writes them)."""
    home = Path(env.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    path = Path(env.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no profiles file, or one Prefect itself would reject
        return {}
    active = env.get("PREFECT_PROFILE") or doc.get("active") or "ephemeral"
    profile = doc.get("profiles", {}).get(str(active), {})
    return profile if isinstance(profile, dict) else {}


def prefect_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) plus each of :data:`PREFECT_DEFAULTS` it lacks.

    A setting present in ``env`` or in the active Prefect profile is kept as the user set it.

    Args:
        env: The environment of the process to start.

    Returns:
        A new environment mapping.
    """
    base = dict(os.environ if env is None else env)
    missing = {k: v for k, v in PREFECT_DEFAULTS.items() if k not in base}
    if missing:
        profile = _profile_settings(base)
        base.update({k: v for k, v in missing.items() if k not in profile})
    return base


def apply_prefect_defaults() -> None:
    """Put :data:`PREFECT_DEFAULTS` into ``os.environ`` where the user set nothing.

    Call it before Prefect is imported: Prefect reads its settings when it loads.
    """
    for key, value in prefect_env().items():
        if key in PREFECT_DEFAULTS:
            os.environ.setdefault(key, value)


def flow_log_path(store_root: str | os.PathLike[str]) -> Path:
    """The log file of a store's background flows: ``<root>/logs/flows.log``."""
    return Path(store_root) / "logs" / FLOW_LOG_NAME


@contextlib.contextmanager
def root_logging_kept() -> Iterator[None]:
    """Undo, on exit, what the block did to the root logger's handlers and level.

    Importing Prefect configures logging and, in a process whose root logger has no
    handler of the user's, installs Prefect's console handler there: from then on every
    library's warning would be printed in Prefect's format. Wrap that import in this.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


def console_verbose() -> bool:
    """Whether this process shows INFO lines on its console (``--verbose``): its root logger
    has a handler and is enabled for INFO."""
    root = logging.getLogger()
    return bool(root.handlers) and root.isEnabledFor(logging.INFO)


def route_prefect_logs(log_file: Path, *, quiet: bool = True) -> None:
    """Send the ``prefect`` logger's records to ``log_file`` (idempotent per file).

    The file rotates (10 MiB, three old files). Lines are scrubbed of credentials. Each
    store's file receives every Prefect line of the process, since Prefect's loggers are
    process-wide.

    Args:
        log_file: The store's flow log (:func:`flow_log_path`).
        quiet: Keep Prefect's records off the console unless this process logs at INFO
            (its root logger has a handler and is enabled for INFO, as with ``--verbose``).
            False leaves their propagation as it is (Prefect was imported by the user).
    """
    target = logging.getLogger("prefect")
    resolved = str(log_file.resolve())
    if not any(getattr(h, _HANDLER_MARK, None) == resolved for h in target.handlers):
        try:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.handlers.RotatingFileHandler(
                resolved, maxBytes=_LOG_BYTES, backupCount=_LOG_BACKUPS, encoding="utf-8",
                delay=True,
            )
        except OSError as exc:  # a read-only store still trains; Prefect's lines are lost
            logger.warning("cannot write the flow log %s: %s", log_file, exc)
        else:
            handler.setFormatter(_FlowLogFormatter(_LOG_FORMAT))
            setattr(handler, _HANDLER_MARK, resolved)
            target.addHandler(handler)
    if quiet:
        target.propagate = console_verbose()
