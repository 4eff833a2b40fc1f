"""Structured logs: one JSON object per line, switched on with ``CKPT_LOG_JSON=1``.

Every record becomes ``{"ts", "level", "logger", "msg", ...}``; records that carry structured
fields (the per-operation records of :class:`~ckptstore.observability.Metrics` put them in
``record.ckpt``) have those fields merged in, so a log shipper can index ``op``, ``seconds``,
``bytes_stored``... without parsing the message.

Example:
    >>> import os; os.environ["CKPT_LOG_JSON"] = "1"                 # doctest: +SKIP
    >>> configure_logging()                                          # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import IO, Any

from ckptstore.redact import scrub

__all__ = [
    "FIELDS_ATTR",
    "JsonFormatter",
    "configure_logging",
    "json_logging_requested",
]

logger = logging.getLogger(__name__)

#: Attribute of a LogRecord holding a dict of structured fields (set with ``extra=``).
FIELDS_ATTR = "ckpt"

_TRUE = frozenset({"1", "true", "yes", "on"})
_HANDLER_MARK = "_ckpt_json_handler"
_LEVEL_MARK = "_ckpt_json_sets_level"


def json_logging_requested() -> bool:
    """Whether ``CKPT_LOG_JSON`` asks for JSON log lines (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get("CKPT_LOG_JSON", "").strip().lower() in _TRUE


def _plain(value: Any) -> Any:
    """``value`` as JSON data, every string scrubbed of credentials."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    return scrub(str(value))


class JsonFormatter(logging.Formatter):
    """Format a record as one line of JSON (UTF-8, no embedded newlines)."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record``.

        Args:
            record: The log record.

        Returns:
            A single-line JSON object with ``ts`` (ISO 8601, UTC), ``level``, ``logger``,
            ``msg``, the structured fields if any, and ``exc`` when an exception is attached;
            every string scrubbed of credentials (:func:`ckptstore.redact.scrub`).
        """
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            # A message may quote a driver's or a backend's text (and a traceback its
            # exception chain): neither may carry a credential into a log shipper.
            "msg": scrub(record.getMessage()),
        }
        fields = getattr(record, FIELDS_ATTR, None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                # Structured fields never overwrite the envelope: a field named "msg" would
                # otherwise silently replace the message.
                doc.setdefault(str(key), _plain(value))
        if record.exc_info:
            doc["exc"] = scrub(self.formatException(record.exc_info))
        return json.dumps(doc, ensure_ascii=False, allow_nan=False, default=str)


def configure_logging(
    *,
    json_lines: bool | None = None,
    level: int = logging.INFO,
    stream: IO[str] | None = None,
    logger_name: str = "ckptstore",
) -> logging.Handler | None:
    """Send ckptstore's logs to ``stream`` as JSON lines (idempotent).

    Args:
        json_lines: Force JSON on or off; None follows ``CKPT_LOG_JSON``.
        level: Level of the handler, and of the ``ckptstore`` logger unless one is set
            (called again, the handler and the level it set take the new level).
        stream: Where lines go (default ``sys.stderr``).
        logger_name: The logger to attach to (default: the package logger).

    Returns:
        The installed handler (or the one already installed), or None when JSON logging is
        off.
    """
    enabled = json_logging_requested() if json_lines is None else json_lines
    if not enabled:
        return None
    target = logging.getLogger(logger_name)
    for handler in target.handlers:
        if getattr(handler, _HANDLER_MARK, False):
            # Called again with another level (``ckpt --verbose`` given after the command
            # name reconfigures what the root options configured): the new level holds.
            handler.setLevel(level)
            if getattr(handler, _LEVEL_MARK, False):
                target.setLevel(level)
            return handler
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.setLevel(level)
    setattr(handler, _HANDLER_MARK, True)
    target.addHandler(handler)
    if target.level == logging.NOTSET:
        # Without this the root logger's WARNING default would drop the per-operation INFO
        # records; a level someone set on purpose is kept.
        target.setLevel(level)
        setattr(handler, _LEVEL_MARK, True)
    # Lines must not appear twice (once as JSON, once through a plain root handler).
    target.propagate = False
    logger.debug("JSON log lines enabled on logger %s", logger_name)
    return handler
