"""Serving a Prometheus registry: a ``/metrics`` HTTP endpoint or a node_exporter textfile.

:class:`~ckptstore.observability.metrics.Metrics` records; this module only exposes what it
recorded. Both functions import ``prometheus_client`` when called, so importing this module
costs nothing without it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import StorageError

__all__ = ["MetricsServer", "serve_registry", "write_registry_textfile"]

logger = logging.getLogger(__name__)

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class MetricsServer:
    """A running ``/metrics`` HTTP endpoint; stop it with :meth:`close`."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def serve_registry(registry: Any, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` at ``/metrics`` over HTTP in a daemon thread.

    Args:
        registry: A ``prometheus_client.CollectorRegistry``.
        port: TCP port; 0 picks a free one (read it from the result).
        addr: Address to bind. The default keeps it on this machine; pass ``0.0.0.0``
            deliberately to let a Prometheus server elsewhere scrape it.

    Returns:
        The running :class:`MetricsServer`.

    Raises:
        StorageError: If the port cannot be bound.
    """
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise StorageError(
            exc.errno or 0,
            f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}; "
            "pick another port (or 0 for any free one)",
        ) from exc
    handle = MetricsServer(addr, int(server.server_port), server, thread)
    if addr not in _LOOPBACK:
        logger.warning("metrics endpoint %s is reachable from other machines", handle.url)
    logger.info("serving metrics on %s", handle.url)
    return handle


def write_registry_textfile(registry: Any, path: str | os.PathLike[str]) -> None:
    """Write ``registry`` for node_exporter's textfile collector (atomic rename).

    Args:
        registry: A ``prometheus_client.CollectorRegistry``.
        path: Target file, conventionally ``<collector dir>/ckptstore.prom``.

    Raises:
        StorageError: If the file cannot be written.
    """
    from prometheus_client import write_to_textfile

    try:
        write_to_textfile(os.fspath(path), registry)
    except OSError as exc:
        raise StorageError(
            exc.errno or 0,
            f"cannot write metrics textfile {path}: {exc.strerror or exc}; "
            "check the directory exists and is writable",
        ) from exc
