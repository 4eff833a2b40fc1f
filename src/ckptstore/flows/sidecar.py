"""One process beside the training process that runs its embedded flows, with Prefect in it.

Running flows on a thread of the training process costs the training loop: Prefect's import
and every flow run hold the interpreter lock the training thread needs (a loop of small steps
ran 1.5x slower while it archived). In a process that has not imported Prefect itself, the
embedded runner (:mod:`ckptstore.flows.embedded`) therefore keeps Prefect out of it and
starts this module's :func:`main` once in a new Python: it imports Prefect, warms its
client once (which starts Prefect's temporary server, once), and runs the flows it is sent.

Protocol, one JSON object per line: the sidecar writes ``{"ready": true}`` once warm; then,
for each ``{"flow": name, "params": {...}}`` read from stdin, one ``{"ok": true, "result":
...}`` or ``{"ok": false, "error": "Type: message"}`` on stdout. It exits when stdin closes
(the training process closed its runner or died), stopping the temporary server with it.
Its Prefect lines go to the store's log file (the runner points its stderr there), and to
the console when the training process logs at INFO (``--verbose``: argument ``--verbose``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, TextIO

from ckptstore.flows.registry import get_flow
from ckptstore.observability.prefect_env import (
    apply_prefect_defaults,
    console_verbose,
    flow_log_path,
    prefect_env,
    root_logging_kept,
    route_prefect_logs,
)

__all__ = ["FlowProcessError", "Sidecar", "flow_settings", "main", "serve", "warm_up_prefect"]

logger = logging.getLogger(__name__)

#: How long a closed sidecar gets to finish its flow and stop Prefect's temporary server.
_STOP_S = 30.0


class FlowProcessError(Exception):
    """A flow failed in the sidecar (the message is its ``"Type: message"``), or the sidecar
    itself is gone."""


def warm_up_prefect() -> None:
    """Make Prefect's first client call (which starts its temporary server) now, once.

    Doing it once, on one thread, avoids the race two threads hit when both make their
    first flow call.
    """
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.hello()


def flow_settings() -> contextlib.AbstractContextManager[Any]:
    """Prefect settings for embedded flow runs: no heartbeats against the temporary server.

    A heartbeat tells a server that a flow run's process is alive. The temporary server
    lives and dies with the process that started it, so nobody reads them; and each run
    would wait up to a second at its end for the heartbeat thread (prefect/flow_engine.py).
    With a server configured (a Prefect profile, or the settings of a process that uses
    Prefect itself) they stay.
    """
    try:
        from prefect.settings import (
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
            get_current_settings,
            temporary_settings,
        )
    except ImportError:
        return contextlib.nullcontext()
    if get_current_settings().api.url:
        return contextlib.nullcontext()
    return temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


class Sidecar:
    """The training process's side: start the sidecar, send it flows, stop it.

    Used from the embedded runner's one thread only.

    Args:
        store_root: The store whose log file receives the sidecar's output.
    """

    def __init__(self, store_root: str | None) -> None:
        """Start the sidecar process; returns at once."""
        self.store_root = store_root
        self.ready = False
        verbose = console_verbose()
        # Not ``-m``: the package imports this module first, which runpy warns about.
        cmd = [sys.executable, "-c",
               "from ckptstore.flows.sidecar import main; raise SystemExit(main())"]
        if store_root is not None:
            cmd += ["--store-root", store_root]
        if verbose:
            cmd.append("--verbose")
        stderr: IO[bytes] | int | None = None  # verbose: the training process's console
        if not verbose:
            stderr = subprocess.DEVNULL
            if store_root is not None:
                log = flow_log_path(store_root)
                try:
                    log.parent.mkdir(parents=True, exist_ok=True)
                    stderr = log.open("ab")
                except OSError as exc:  # a read-only store still trains
                    logger.warning("cannot write the flow log %s: %s", log, exc)
        try:
            # Its own session: Ctrl-C in the terminal stops training, which then closes the
            # sidecar's stdin; the sidecar ends after the flow it runs.
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                env=prefect_env(), text=True, start_new_session=True,
            )
        finally:
            if hasattr(stderr, "close"):
                stderr.close()  # type: ignore[union-attr]

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            where = f"; see {flow_log_path(self.store_root)}" if self.store_root else ""
            raise FlowProcessError(f"the flow process exited with status {code}{where}")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def wait_ready(self) -> None:
        """Wait until the sidecar has warmed Prefect (or failed to and moved on)."""
        if not self.ready:
            self._line()
            self.ready = True

    def run(self, flow: str, params: dict[str, Any]) -> Any:
        """Run one flow in the sidecar and return its result.

        Raises:
            FlowProcessError: If the flow failed, or the sidecar is gone.
        """
        assert self.proc.stdin is not None
        self.wait_ready()
        try:
            self.proc.stdin.write(json.dumps({"flow": flow, "params": params}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise FlowProcessError(f"the flow process is gone: {exc}") from exc
        reply = self._line()
        if not reply.get("ok"):
            raise FlowProcessError(str(reply.get("error")))
        return reply.get("result")

    @property
    def alive(self) -> bool:
        """Whether the sidecar still runs."""
        return self.proc.poll() is None

    def close(self, timeout: float = _STOP_S) -> None:
        """Close its stdin (it stops after its flow and stops its server), then wait."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """Stop the sidecar and what it started (Prefect's temporary server) now."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(5)
                return
            except subprocess.TimeoutExpired:
                continue


def serve(requests: TextIO, replies: TextIO) -> None:
    """Answer flow requests from ``requests`` on ``replies`` until ``requests`` ends."""
    try:
        warm_up_prefect()
    except Exception as exc:  # a cold Prefect is slower, not broken: the first flow retries
        logger.warning("could not warm up the Prefect client: %s: %s", type(exc).__name__, exc)
    _reply(replies, {"ready": True})
    with flow_settings():
        for line in requests:
            if not line.strip():
                continue
            request = json.loads(line)
            try:
                result = get_flow(request["flow"])(**request["params"])
                reply: dict[str, Any] = {"ok": True, "result": result}
                text = json.dumps(reply, default=str)
            except Exception as exc:  # reported to the runner, which logs it once
                text = json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            replies.write(text + "\n")
            replies.flush()


def _reply(replies: TextIO, doc: dict[str, Any]) -> None:
    replies.write(json.dumps(doc) + "\n")
    replies.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the sidecar process (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store-root", default=None)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    apply_prefect_defaults()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # The replies own stdout: anything else printed there would break the protocol.
    replies, sys.stdout = sys.stdout, sys.stderr
    with root_logging_kept():
        import prefect.main  # noqa: F401
    if args.store_root is not None:
        route_prefect_logs(flow_log_path(Path(args.store_root)))
    try:
        serve(sys.stdin, replies)
    except (BrokenPipeError, KeyboardInterrupt):  # the training process is gone
        return 0
    return 0

