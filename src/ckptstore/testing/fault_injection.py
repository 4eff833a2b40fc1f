"""Fault injection for the reliability suite: a throttling S3 proxy, process killers, damage.

Every helper injects a real fault into real components (no mocks of our own code). The
named kill points that shipped code passes through are :mod:`ckptstore.faultpoints`; this
module is only for tests and benchmarks.

* :class:`FaultyProxy`: a loopback HTTP proxy in front of an S3 endpoint (moto) that answers
  ``503 SlowDown`` for a configurable share of requests, can apply a request and still answer
  503 (the client retries something that already happened), truncates or corrupts response
  bodies (short reads, bit rot in transit), and can black out (every connection dropped, as
  if the server died) after N uploads.
* :func:`kill_after` / :func:`sigkill`: SIGKILL a process at a seeded random moment.
* :func:`flip_bit`, :func:`truncate_file`, :func:`short_reads`: damage on the local disk and
  short reads from the kernel.
* :func:`mount_tmpfs`: a tiny tmpfs for disk-full tests (needs root).

Example:
    >>> with MotoS3() as s3, FaultyProxy(s3.endpoint_url, slowdown=0.3, seed=1) as proxy:
    ...     options = {**s3.storage_options, "endpoint_url": proxy.endpoint_url}
    ...     ...  # archive through the proxy; proxy.counts["slowdown"] faults were injected
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import random
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ckptstore.errors import StorageError

__all__ = [
    "FaultRates",
    "FaultyProxy",
    "flip_bit",
    "kill_after",
    "mount_tmpfs",
    "short_reads",
    "sigkill",
    "truncate_file",
]

logger = logging.getLogger(__name__)

# Hop-by-hop headers are about one connection; a proxy never forwards them.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>ckpt-fault-injection</RequestId></Error>"
)
_MAX_BODY = 256 * 1024 * 1024  # bounds what one proxied request may make us buffer


@dataclass
class FaultRates:
    """Share of requests (0..1) that get each fault.

    Attributes:
        slowdown: Answered ``503 SlowDown`` without reaching the server.
        slowdown_after_apply: Forwarded (the server applies it), then answered 503 anyway.
        truncate_get: GET responses cut to half their body (the connection then closes).
        corrupt_get: GET responses with one bit flipped in the body.
        deny: Answered ``403 AccessDenied`` with the request's Authorization header echoed
            in the message (like servers that leak what they were sent into error text).
        methods: HTTP methods the two 503 faults apply to.
    """

    slowdown: float = 0.0
    slowdown_after_apply: float = 0.0
    truncate_get: float = 0.0
    corrupt_get: float = 0.0
    deny: float = 0.0
    methods: tuple[str, ...] = ("PUT", "POST")


class FaultyProxy:
    """A loopback HTTP proxy that injects S3 faults (see the module docstring).

    Faults are drawn from a seeded generator, one draw per request, so a run is reproducible
    up to thread scheduling. :attr:`counts` counts requests and injected faults by kind
    (``requests``, ``uploads``, ``slowdown``, ``slowdown_after_apply``, ``truncated``,
    ``corrupted``, ``denied``, ``dropped``).

    Args:
        upstream: The real endpoint, ``http://127.0.0.1:<port>``.
        seed: Seed of the fault generator.
        **rates: Initial :class:`FaultRates` fields.
    """

    def __init__(self, upstream: str, *, seed: int = 0, **rates: Any) -> None:
        """Configure the proxy; it listens from ``__enter__`` (or :meth:`start`) on."""
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self._upstream = (parts.hostname, parts.port or 80)
        self._rates = FaultRates(**rates)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self._blackout_after: int | None = None
        self._blacked_out = False
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._local = threading.local()
        self.endpoint_url = ""
        #: Called with the running count of uploads (PUT/POST) as each one arrives, before
        #: it is forwarded: a test hook to kill the real server at an exact moment.
        self.on_upload: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ control
    def set_rates(self, **rates: Any) -> None:
        """Replace the fault rates (unnamed ones become 0)."""
        with self._lock:
            self._rates = FaultRates(**rates)

    def blackout_after(self, uploads: int) -> None:
        """Drop every connection (no response) once ``uploads`` more PUT/POST requests came.

        Models the S3 server dying mid-upload; :meth:`end_blackout` brings it back.
        """
        with self._lock:
            self._blackout_after = self.counts["uploads"] + uploads
            self._blacked_out = False

    def end_blackout(self) -> None:
        """Serve requests again after a blackout."""
        with self._lock:
            self._blackout_after = None
            self._blacked_out = False

    @property
    def blacked_out(self) -> bool:
        """Whether the proxy is currently dropping every request."""
        with self._lock:
            return self._blacked_out

    def start(self) -> None:
        """Start listening on 127.0.0.1 (a free port)."""
        if self._server is not None:
            return
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self.endpoint_url = f"http://127.0.0.1:{server.server_address[1]}"
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05},
            name="ckpt-faulty-proxy", daemon=True,
        )
        self._thread.start()
        logger.debug("fault proxy %s -> %s:%s", self.endpoint_url, *self._upstream)

    def stop(self) -> None:
        """Stop listening (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> FaultyProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _decide(self, method: str) -> str:
        """Pick this request's fault: '', 'drop', 'slowdown', 'after_apply', 'truncate', ..."""
        hook = self.on_upload
        if hook is not None and method in ("PUT", "POST"):
            with self._lock:
                uploads = self.counts["uploads"] + 1
            hook(uploads)
        with self._lock:
            self.counts["requests"] += 1
            if method in ("PUT", "POST"):
                self.counts["uploads"] += 1
            if self._blackout_after is not None and self.counts["uploads"] > self._blackout_after:
                self._blacked_out = True
            if self._blacked_out:
                self.counts["dropped"] += 1
                return "drop"
            rates, draw = self._rates, self._rng.random()
            if draw < rates.deny:
                self.counts["denied"] += 1
                return "deny"
            draw -= rates.deny
            if method in rates.methods:
                if draw < rates.slowdown:
                    self.counts["slowdown"] += 1
                    return "slowdown"
                if draw < rates.slowdown + rates.slowdown_after_apply:
                    self.counts["slowdown_after_apply"] += 1
                    return "after_apply"
            if method == "GET":
                if draw < rates.truncate_get:
                    return "truncate"
                if draw < rates.truncate_get + rates.corrupt_get:
                    return "corrupt"
            return ""

    def _count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def _forward(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        for attempt in range(2):
            if conn is None:
                conn = http.client.HTTPConnection(*self._upstream, timeout=60)
                self._local.conn = conn
            try:
                conn.request(method, path, body=body or None, headers=headers)
                response = conn.getresponse()
                data = response.read()
                return response.status, response.reason, response.getheaders(), data
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = None
                self._local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover


class _ProxyHandler(BaseHTTPRequestHandler):
    """One client connection of :class:`FaultyProxy` (HTTP/1.1, keep-alive)."""

    owner: FaultyProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("proxy: %s", format % args)

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is not None:
            size = int(length)
            if size > _MAX_BODY:
                raise ValueError(f"request body of {size} bytes is over the proxy's limit")
            return self.rfile.read(size)
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            total = 0
            while True:
                line = self.rfile.readline(1024)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                total += size
                if total > _MAX_BODY:
                    raise ValueError("chunked request body is over the proxy's limit")
                parts.append(self.rfile.read(size))
                self.rfile.readline(1024)
        return b""

    def _drop(self) -> None:
        # No response at all, and the socket goes away: what a crashed server looks like.
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _reply(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes,
               *, head: bool = False, length: int | None = None) -> None:
        self.send_response(status, reason)
        sent_length = False
        for name, value in headers:
            lower = name.lower()
            if lower in _HOP_BY_HOP:
                continue
            if lower == "content-length":
                if head:
                    self.send_header(name, value)
                    sent_length = True
                continue
            self.send_header(name, value)
        if not head and not sent_length:
            self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _handle(self) -> None:
        owner = self.owner
        method = self.command
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self._drop()
            return
        fault = owner._decide(method)
        if fault == "drop":
            self._drop()
            return
        if fault == "slowdown":
            self._reply(503, "Slow Down", [("Content-Type", "application/xml")], _SLOWDOWN_BODY)
            return
        if fault == "deny":
            echoed = _xml_escape(self.headers.get("Authorization", ""))
            body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
                    b"<Message>Access Denied for " + echoed.encode() + b"</Message>"
                    b"<RequestId>ckpt-fault-injection</RequestId></Error>")
            self._reply(403, "Forbidden", [("Content-Type", "application/xml")], body)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body:
            headers["Content-Length"] = str(len(body))
        try:
            status, reason, out_headers, data = owner._forward(method, self.path, headers, body)
        except (OSError, http.client.HTTPException):
            self._drop()
            return
        if fault == "after_apply":
            self._reply(503, "Slow Down", [("Content-Type", "application/xml")], _SLOWDOWN_BODY)
            return
        if fault == "truncate" and status == 200 and len(data) > 1:
            owner._count("truncated")
            # Promise the whole body, send half, hang up: a short read on the client side.
            self._reply(status, reason, out_headers, data[: len(data) // 2], length=len(data))
            self.wfile.flush()
            self._drop()
            return
        if fault == "corrupt" and status == 200 and data:
            owner._count("corrupted")
            damaged = bytearray(data)
            damaged[len(damaged) // 2] ^= 0x10
            data = bytes(damaged)
        self._reply(status, reason, out_headers, data, head=(method == "HEAD"))

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


def _xml_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ---------------------------------------------------------------------- processes
def sigkill(pid: int) -> bool:
    """SIGKILL process ``pid``; False if it was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def kill_after(
    pid: int,
    delay_s: float,
    *,
    alive: Callable[[], bool] | None = None,
) -> threading.Thread:
    """SIGKILL ``pid`` after ``delay_s`` seconds unless it has finished by then.

    Args:
        pid: The process to kill (one this test started).
        delay_s: Seconds to wait (draw it from a seeded generator to make runs repeatable).
        alive: Returns False once the process finished on its own (then nothing is sent, so
            a recycled pid is never hit).

    Returns:
        The (daemon) timer thread; join it to know the kill has been sent.
    """

    def run() -> None:
        deadline = time.monotonic() + delay_s
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                return
            time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))
        if alive is None or alive():
            sigkill(pid)

    thread = threading.Thread(target=run, name=f"ckpt-kill-{pid}", daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------- local damage
def flip_bit(path: Path, *, offset: int | None = None, bit: int = 0, seed: int = 0) -> int:
    """Flip one bit of a file in place; return the byte offset that was changed.

    Args:
        path: The file.
        offset: Byte to damage (default: a seeded random byte).
        bit: Which bit of that byte (0-7).
        seed: Seed for the random offset.
    """
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty; there is no bit to flip")
    where = offset if offset is not None else random.Random(seed).randrange(size)
    with open(path, "r+b") as fh:
        fh.seek(where)
        byte = fh.read(1)[0]
        fh.seek(where)
        fh.write(bytes([byte ^ (1 << bit)]))
    return where


def truncate_file(path: Path, size: int) -> None:
    """Cut a file to ``size`` bytes (negative: that many bytes shorter)."""
    current = path.stat().st_size
    os.truncate(path, size if size >= 0 else max(0, current + size))


@contextlib.contextmanager
def short_reads(max_bytes: int = 7) -> Iterator[Counter[str]]:
    """Make ``os.pread``/``os.preadv``/``os.read`` return at most ``max_bytes`` per call.

    POSIX allows any read to return fewer bytes than asked; code that assumes otherwise
    returns garbage. Inside the block every read is short, in this process (all threads).

    Yields:
        A counter of the short reads served, by function name.
    """
    counter: Counter[str] = Counter()
    real_pread, real_preadv, real_read = os.pread, os.preadv, os.read

    def pread(fd: int, n: int, offset: int) -> bytes:
        if n > max_bytes:
            counter["pread"] += 1
        return real_pread(fd, min(n, max_bytes), offset)

    def read(fd: int, n: int) -> bytes:
        if n > max_bytes:
            counter["read"] += 1
        return real_read(fd, min(n, max_bytes))

    def preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        if not views:
            return 0
        first = views[0]
        if len(first) == 0:
            return real_preadv(fd, views[:1], offset, *flags)
        counter["preadv"] += 1
        return real_preadv(fd, [first[: max(1, min(len(first), max_bytes))]], offset, *flags)

    os.pread, os.preadv, os.read = pread, preadv, read  # type: ignore[assignment]
    try:
        yield counter
    finally:
        os.pread, os.preadv, os.read = real_pread, real_preadv, real_read  # type: ignore[assignment]


@contextlib.contextmanager
def mount_tmpfs(path: Path, size: str = "4m") -> Iterator[Path]:
    """Mount a tmpfs of ``size`` on ``path`` (created if needed); unmount afterwards.

    Raises:
        StorageError: If the mount fails (not root, no mount namespace); tests skip then.
    """
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", f"ckpt-{uuid.uuid4().hex[:8]}", str(path)],
        capture_output=True, text=True, check=False, timeout=30,
    )
    if proc.returncode != 0:
        raise StorageError(
            f"cannot mount a {size} tmpfs on {path}: {proc.stderr.strip() or proc.returncode}; "
            "run as root (or skip the disk-full tests)"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True, timeout=30)
