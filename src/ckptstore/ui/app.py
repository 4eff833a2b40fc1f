"""The catalog browser: a small read-only FastAPI app rendering server-side HTML.

Pages: ``/`` (runs), ``/runs/<run>`` (with its training curve), ``/compare?run=a&run=b``
(training curves overlaid), ``/checkpoints/<id>``, ``/lineage``, ``/tiers``, and
``/healthz``. Only GET routes exist, so the app cannot change the store; every response
carries a Content-Security-Policy that forbids scripts, so catalog text (run names, tags)
can never run code in the viewer's browser. :func:`serve` binds to loopback only: the app
has no authentication.
"""

# ruff: noqa: E402  (the optional imports follow the check that names their extra)
from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ckptstore.extras import require

# Before the imports below, so that without the 'ui' extra the error names it.
require("fastapi", "the catalog browser (ckpt ui)")
require("uvicorn", "the catalog browser (ckpt ui)")

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response

from ckptstore.catalog import mask_url
from ckptstore.errors import CheckpointNotFoundError, CkptError, InvalidNameError
from ckptstore.ui.render import render
from ckptstore.ui.views import (
    AppLinks,
    checkpoint_view,
    compare_view,
    lineage_view,
    run_view,
    runs_view,
    tiers_view,
)

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = ["CSP", "BackgroundUI", "check_loopback", "create_app", "serve", "start_background"]

logger = logging.getLogger(__name__)

#: No scripts, no remote anything: inline styles and inline SVG only. Forms submit to this
#: app only (the runs list's search: GET, read-only like every route).
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


def create_app(store: CheckpointStore) -> FastAPI:
    """Build the app over an open store (the caller keeps ownership and closes it).

    Args:
        store: An open :class:`~ckptstore.store.CheckpointStore`.

    Returns:
        The FastAPI application.
    """
    app = FastAPI(
        title="ckptstore catalog browser", docs_url=None, redoc_url=None, openapi_url=None
    )
    links = AppLinks()
    label = mask_url(store.settings.resolved_catalog_url)

    def page(fragment: str, title: str, data: dict[str, Any]) -> HTMLResponse:
        html = render(
            "page.html",
            links,
            fragment=fragment,
            title=title,
            page=data,
            store_label=label,
            generated=datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        )
        return HTMLResponse(html)

    @app.middleware("http")
    async def _headers(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Cache-Control"] = "no-store"
        return response

    @app.exception_handler(CkptError)
    async def _ckpt_error(request: Request, exc: CkptError) -> HTMLResponse:
        if isinstance(exc, CheckpointNotFoundError):
            status, heading = 404, "Not found"
        elif isinstance(exc, InvalidNameError):
            status, heading = 400, "Bad request"
        else:
            status, heading = 500, "The catalog could not answer"
            logger.warning("catalog browser: %s failed: %s", request.url.path, exc)
        html = render(
            "error.html",
            links,
            title=heading,
            heading=heading,
            message=str(exc),
            store_label=label,
            generated=datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        )
        return HTMLResponse(html, status_code=status)

    # Plain `def` handlers: FastAPI runs them in its thread pool, so slow catalog queries
    # never block the event loop (the catalog object is thread-safe).
    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> HTMLResponse:
        # Unknown paths get a page like every other, not FastAPI's JSON.
        html = render("error.html", links, title="Not found", heading="Not found",
                      message=f"there is no page at {request.url.path}; start from the runs "
                              "list", store_label=label,
                      generated=datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))
        return HTMLResponse(html, status_code=404)

    @app.get("/", response_class=HTMLResponse)
    def runs_page(q: str = "", sort: str = "name", where: str = "") -> HTMLResponse:
        return page("_runs.html", "Runs", runs_view(store, links, q=q, sort=sort, where=where))

    @app.get("/runs/{name}", response_class=HTMLResponse)
    def run_page(name: str) -> HTMLResponse:
        return page("_run.html", f"Run {name}", run_view(store, name, links))

    @app.get("/compare", response_class=HTMLResponse)
    def compare_page(
        run: list[str] = Query(default=[]),
        metric: str = "loss",
        log: bool = False,
    ) -> HTMLResponse:
        data = compare_view(store, run, links, metric=metric, log=log)
        return page("_compare.html", f"Training curves: {data['metric']}", data)

    @app.get("/checkpoints/{ckpt_id}", response_class=HTMLResponse)
    def checkpoint_page(ckpt_id: str) -> HTMLResponse:
        data = checkpoint_view(store, ckpt_id, links)
        return page("_checkpoint.html", f"Checkpoint {data['ck'].ref}", data)

    @app.get("/lineage", response_class=HTMLResponse)
    def lineage_page() -> HTMLResponse:
        return page("_lineage.html", "Lineage", lineage_view(store, links))

    @app.get("/tiers", response_class=HTMLResponse)
    def tiers_page(scan: bool = False) -> HTMLResponse:
        return page("_tiers.html", "Tiers & usage", tiers_view(store, links, scan=scan))

    @app.get("/healthz", response_class=PlainTextResponse)
    def healthz() -> str:
        return "ok"

    return app


def check_loopback(host: str) -> str:
    """Accept only loopback addresses (the app has no authentication).

    Args:
        host: ``127.0.0.1``, ``::1``, ``localhost`` or another 127.x.y.z address.

    Returns:
        ``host`` unchanged.

    Raises:
        InvalidNameError: For any other address.
    """
    if host == "localhost":
        return host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise InvalidNameError(
            f"the catalog browser binds to loopback only (got --host {host!r}); it has no "
            "authentication. To reach it from another machine use an SSH tunnel: "
            "ssh -L 8787:127.0.0.1:8787 <this host>"
        )
    return host


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on ``host:port`` (binding here gives a clear error and lets
    port 0 work: the chosen port is known before the server starts)."""
    from ckptstore.errors import StorageError

    check_loopback(host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StorageError(
            exc.errno or 0,
            f"cannot bind the catalog browser to {host}:{port}: {exc.strerror or exc}; "
            "pick another --port",
        ) from exc
    return sock


def serve(store: CheckpointStore, *, host: str = "127.0.0.1", port: int = 8787) -> None:
    """Run the browser with uvicorn until interrupted (Ctrl-C).

    Args:
        store: An open store.
        host: Loopback address to bind.
        port: TCP port.

    Raises:
        InvalidNameError: If ``host`` is not a loopback address.
        StorageError: If the port cannot be bound.
    """
    import uvicorn

    sock = _bind(host, port)
    config = uvicorn.Config(create_app(store), log_level="warning", access_log=False)
    logger.info("catalog browser on http://%s:%s/", host, port)
    uvicorn.Server(config).run(sockets=[sock])


class BackgroundUI:
    """The browser running in a daemon thread (for notebooks and tests); see
    :func:`start_background`. Stop it with :meth:`close` or use it as a context manager."""

    def __init__(self, server: Any, thread: threading.Thread, host: str, port: int) -> None:
        self._server = server
        self._thread = thread
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        """Base URL, ending in ``/``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving and wait for the thread (at most ``timeout`` seconds)."""
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundUI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_background(
    store: CheckpointStore,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    startup_timeout: float = 20.0,
) -> BackgroundUI:
    """Start the browser in a daemon thread and return once it accepts connections.

    Args:
        store: An open store (it must stay open while the UI runs).
        host: Loopback address to bind.
        port: TCP port; 0 picks a free one (read it from the result).
        startup_timeout: Most seconds to wait for the server to start.

    Returns:
        The running :class:`BackgroundUI`.

    Raises:
        InvalidNameError: If ``host`` is not a loopback address.
        StorageError: If the port cannot be bound or the server does not start in time.
    """
    import uvicorn

    from ckptstore.errors import StorageError

    sock = _bind(host, port)
    bound_port = int(sock.getsockname()[1])
    config = uvicorn.Config(create_app(store), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="ckpt-ui", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise StorageError(
                0, f"the catalog browser did not start on {host}:{bound_port} within "
                f"{startup_timeout:.0f} s; see the log for uvicorn's error"
            )
        time.sleep(0.02)
    return BackgroundUI(server, thread, host, bound_port)
