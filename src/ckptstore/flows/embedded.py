"""Run flows off the training thread: one background worker, warmed once, fed by a queue.

Embedded mode (the default, no Prefect server): :class:`EmbeddedRunner` owns one daemon thread.
The flows run one at a time in one sidecar process (:mod:`ckptstore.flows.sidecar`), which
imports Prefect and warms its client once (starting Prefect's ephemeral server), so that
neither takes the interpreter lock from the training thread; in a process that had imported
Prefect already, the thread itself imports and warms it (doing that once, on one thread,
avoids the race two threads hit when both make their first flow call) and runs the flows. The
thread fires the configured schedules with a timer of its own (Prefect's cron schedules need
a server). ``submit`` only enqueues: it costs microseconds and never imports Prefect.
Prefect's lines go to the store's ``logs/flows.log`` (:mod:`ckptstore.observability.prefect_env`).

Server mode (``PREFECT_API_URL`` set): the same thread calls
``run_deployment(name, parameters, timeout=0, idempotency_key=...)`` for deployments that
``ckpt serve`` serves (see :mod:`ckptstore.flows.deployments`); the served deployments carry
the schedules, so the runner's timer stays off.

Example:
    >>> runner = EmbeddedRunner("./ckpt", schedules={"gc": "every 10 minutes"})  # doctest: +SKIP
    >>> runner.submit("archive", ref=ck.id)                                  # doctest: +SKIP
    >>> runner.close(wait=True)                                              # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, cast

from ckptstore.errors import ConfigError
from ckptstore.flows.registry import FLOWS, get_flow
from ckptstore.flows.schedules import CronSchedule, IntervalSchedule, parse_schedule
from ckptstore.flows.sidecar import FlowProcessError, Sidecar, flow_settings, warm_up_prefect
from ckptstore.identity import host
from ckptstore.observability.prefect_env import (
    flow_log_path,
    root_logging_kept,
    route_prefect_logs,
)

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

__all__ = [
    "DEPLOYMENT_NAME",
    "EmbeddedRunner",
    "JobResult",
    "deployment_name",
    "get_runner",
    "shutdown_runners",
    "trigger_flow",
    "wait_for_flows",
]

logger = logging.getLogger(__name__)

#: Name every flow's deployment gets from ``serve_all``; ``run_deployment`` targets it.
DEPLOYMENT_NAME = "ckptstore"

#: Flows that need parameters nobody can schedule (a ref, an output path).
_UNSCHEDULABLE = frozenset({"restore", "convert", "import", "compact", "merge", "prefetch",
                            "thaw"})

#: Longest the worker sleeps between looks at the schedules (seconds).
_MAX_SLEEP_S = 1.0

Mode = Literal["auto", "embedded", "server"]


def deployment_name(flow_name: str, deployment: str = DEPLOYMENT_NAME) -> str:
    """``<prefect flow name>/<deployment>`` for a short flow name (``ckpt-archive/ckptstore``)."""
    if flow_name not in FLOWS:
        raise ConfigError(f"unknown flow {flow_name!r}; known flows: {', '.join(sorted(FLOWS))}")
    return f"ckpt-{flow_name}/{deployment}"


@dataclass(frozen=True)
class JobResult:
    """The outcome of one flow run started by the runner.

    Attributes:
        flow: Short flow name.
        params: Parameters it ran with.
        ok: True when the flow completed.
        result: Its JSON-able result (a flow-run id in server mode), or None.
        error: ``"Type: message"`` when it failed.
        started_at: When it started.
        seconds: How long it took.
        scheduled: True when the runner's timer started it.
    """

    flow: str
    params: dict[str, Any]
    ok: bool
    result: Any = None
    error: str | None = None
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    seconds: float = 0.0
    scheduled: bool = False


@dataclass(frozen=True)
class _Job:
    flow: str
    params: dict[str, Any]
    key: str | None
    scheduled: bool = False
    work_queue: str | None = None


_STOP = object()


class EmbeddedRunner:
    """One background thread that runs ckptstore flows from a queue and on schedules.

    Lifecycle: construct (parses the schedules, starts nothing) → ``start()`` or the first
    ``submit()`` starts the thread → the thread warms Prefect once, then runs jobs in order
    and fires due schedules → ``close(wait=True)`` runs what is queued and stops it.
    Jobs never raise into the caller: failures are logged and kept in :attr:`results`.

    Args:
        store_root: Store directory passed to every flow (a plain path, never credentials).
        config: Config file passed to every flow.
        schedules: Flow name → cron expression or ``"every N <unit>"`` (embedded mode only).
        mode: ``"embedded"`` runs flows in this process; ``"server"`` calls
            ``run_deployment`` instead; ``"auto"`` picks server when ``PREFECT_API_URL`` is
            set in the environment.
        warm: Warm the Prefect client first thing on the thread.
        history: How many :class:`JobResult` entries to keep.
        deployment: Deployment name used in server mode.
        exit_timeout_s: How long :func:`wait_for_flows` (``CheckpointStore.close()``) waits
            for the queued and running flows. At interpreter exit nothing is waited for:
            flows cannot run once it shuts down, so what is left is reported, one line each.
        isolate: Embedded mode: run the flows in one sidecar process
            (:mod:`ckptstore.flows.sidecar`), so that neither Prefect's import nor its flow
            runs take the interpreter lock from the training thread. Default: yes, unless
            this process had imported Prefect when the runner started (it then runs them on
            its thread, with this process's Prefect settings).

    Raises:
        ConfigError: For an unknown flow name or an invalid schedule.
    """

    def __init__(
        self,
        store_root: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] | None = None,
        *,
        schedules: Mapping[str, str] | None = None,
        mode: Mode = "auto",
        warm: bool = True,
        history: int = 100,
        deployment: str = DEPLOYMENT_NAME,
        exit_timeout_s: float = 600.0,
        isolate: bool | None = None,
    ) -> None:
        """Validate the schedules; nothing starts until :meth:`start` or :meth:`submit`."""
        self.store_root = None if store_root is None else str(store_root)
        self.config = None if config is None else str(config)
        if mode == "auto":
            mode = "server" if os.environ.get("PREFECT_API_URL") else "embedded"
        if mode not in ("embedded", "server"):
            raise ConfigError(f"runner mode must be auto, embedded or server, got {mode!r}")
        self.mode: Mode = mode
        self.deployment = deployment
        self.exit_timeout_s = exit_timeout_s
        self._warm = warm
        self.schedules: dict[str, IntervalSchedule | CronSchedule] = {}
        for name, text in (schedules or {}).items():
            if name not in FLOWS:
                raise ConfigError(
                    f"schedule for unknown flow {name!r}; known flows: {', '.join(sorted(FLOWS))}"
                )
            if name in _UNSCHEDULABLE:
                raise ConfigError(
                    f"flow {name!r} needs a checkpoint or path and cannot be scheduled; remove it "
                    "from [schedules]"
                )
            self.schedules[name] = parse_schedule(text)
        self.results: collections.deque[JobResult] = collections.deque(maxlen=history)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0
        self._queued_keys: set[str] = set()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._abort = threading.Event()
        self._running: _Job | None = None  # the job on the worker thread, for _at_exit
        self._isolate: bool | None = isolate
        self._sidecar: Sidecar | None = None
        self._exiting = False
        self.ready = threading.Event()
        """Set once the worker has warmed Prefect (or failed to and moved on)."""

    # ------------------------------------------------------------------ public API
    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._closed:
            raise ConfigError("this flow runner is closed; create a new EmbeddedRunner")
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._main, name="ckptstore-flows", daemon=True
            )
            self._thread.start()
            # From the start: a flow queued while Prefect still warms up is reported too.
            atexit.register(self._at_exit)

    def submit(self, flow_name: str, /, *, key: str | None = None,
               work_queue: str | None = None, **params: Any) -> bool:
        """Queue a flow run and return at once (no Prefect import, no I/O).

        Args:
            flow_name: Short flow name (``archive``, ``retention``, ``verify``, ``gc``, ...).
            key: Idempotency key: a job whose key is already queued (not yet started) is
                dropped, like ``run_deployment``'s ``idempotency_key`` in server mode.
            work_queue: The host that must run it (server mode: the work queue of that
                host's agent). In embedded mode a job for another host is dropped: that
                host's own processes (or its agent) do its part of the work.
            **params: Flow parameters (plain values); ``store_root``/``config`` default to
                the runner's.

        Returns:
            True when queued, False when dropped as a duplicate or another host's job.

        Raises:
            ConfigError: For an unknown flow or a closed runner.
        """
        if flow_name not in FLOWS:
            raise ConfigError(
                f"unknown flow {flow_name!r}; known flows: {', '.join(sorted(FLOWS))}"
            )
        if self.mode == "embedded" and work_queue is not None and work_queue != host():
            logger.debug("flow %s is for host %s: its own processes or agent run it",
                         flow_name, work_queue)
            return False
        with self._lock:
            self._start_locked()
            if key is not None:
                if key in self._queued_keys:
                    return False
                self._queued_keys.add(key)
            self._outstanding += 1
        self._queue.put(_Job(flow_name, dict(params), key, work_queue=work_queue))
        return True

    def pending(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return self._outstanding

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted job finished.

        Args:
            timeout: Seconds to wait at most (None: no limit).

        Returns:
            True when idle, False on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._outstanding:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self, wait: bool = True, timeout: float | None = None) -> bool:
        """Stop the worker.

        Args:
            wait: Run what is already queued first; False drops queued jobs (the running one
                still finishes: flows are not interrupted half-way).
            timeout: Seconds to wait for the thread (None: no limit).

        Returns:
            True when the thread has stopped (or never started).
        """
        with self._lock:
            if self._closed and self._thread is None:
                return True
            self._closed = True
            thread = self._thread
        if not wait:
            self._abort.set()
        self._queue.put(_STOP)
        if thread is None:
            return True
        thread.join(timeout)
        stopped = not thread.is_alive()
        if stopped:
            atexit.unregister(self._at_exit)
            with self._lock:
                self._thread = None
        else:
            logger.warning("flow runner still busy after %ss; leaving it to finish", timeout)
        return stopped

    def __enter__(self) -> EmbeddedRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(wait=True)

    # ------------------------------------------------------------------ worker thread
    def _main(self) -> None:
        try:
            self._loop()
        except BaseException:  # a bug here must not leave submitters waiting forever
            logger.exception("the flow runner thread crashed; queued flows are dropped")
            with self._lock:
                self._closed = True
            self._drain_dropped()
            raise

    def _loop(self) -> None:
        if self._isolate is None:
            # A process that uses Prefect itself (its settings, its server, its logging) runs
            # our flows beside its own; any other keeps Prefect out (flows/sidecar.py).
            self._isolate = self.mode == "embedded" and "prefect" not in sys.modules
        if self._isolate:
            try:
                self._serve()
            finally:
                if self._sidecar is not None:
                    self._sidecar.close()
                    self._sidecar = None
            return
        self._import_prefect()
        with flow_settings() if self.mode == "embedded" else contextlib.nullcontext():
            self._serve()

    def _serve(self) -> None:
        if self._warm:
            self._warm_up()
        self.ready.set()
        timer_on = self.mode == "embedded" and bool(self.schedules)
        now = datetime.now(UTC)
        due = {name: s.next_after(now) for name, s in self.schedules.items()} if timer_on else {}
        while True:
            wait_s = _MAX_SLEEP_S
            if due:
                soonest = min(due.values())
                wait_s = max(0.0, min(wait_s, (soonest - datetime.now(UTC)).total_seconds()))
            try:
                item = self._queue.get(timeout=wait_s)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._drain_dropped()
                return
            if isinstance(item, _Job):
                if self._abort.is_set():
                    _log_dropped(item)
                    self._finish(item, None)
                else:
                    self._running = item
                    try:
                        result = self._run(item)
                    finally:
                        self._running = None
                    self._finish(item, result)
            now = datetime.now(UTC)
            for name, when in list(due.items()):
                if when <= now and not self._abort.is_set():
                    logger.info("schedule %s fired for flow %s", self.schedules[name].text, name)
                    self.results.append(self._run(_Job(name, {}, None, scheduled=True)))
                    due[name] = self.schedules[name].next_after(datetime.now(UTC))

    def _import_prefect(self) -> None:
        """Import Prefect on this thread, its lines to the store's log file, not the console.

        Done once, before anything else here touches Prefect: its import would otherwise put
        its console handler on the root logger of the training process.
        """
        # prefect.main configures Prefect's logging (``import prefect`` alone defers it). If
        # it is loaded already, the user imported Prefect: their logging stays theirs.
        ours = "prefect.main" not in sys.modules
        try:
            with root_logging_kept() if ours else contextlib.nullcontext():
                import prefect.main  # noqa: F401
        except ImportError:
            return  # the first flow says which extra is missing
        if self.store_root is not None:
            route_prefect_logs(flow_log_path(self.store_root), quiet=ours)

    def _warm_up(self) -> None:
        started = time.perf_counter()
        try:
            if self._isolate:
                self._sidecar_ready().wait_ready()
            else:
                warm_up_prefect()
        except Exception as exc:  # a cold Prefect is slower, not broken: the first flow retries
            if not self._abort.is_set():  # at exit, _at_exit says what is left undone
                logger.warning(
                    "could not warm up the Prefect client: %s: %s", type(exc).__name__, exc
                )
            return
        logger.info("prefect client warmed in %.1fs", time.perf_counter() - started)

    def _sidecar_ready(self) -> Sidecar:
        """The sidecar, started now if it is not running (first use, or it died)."""
        if self._sidecar is None or not self._sidecar.alive:
            self._sidecar = Sidecar(self.store_root)
        return self._sidecar

    def _params(self, job: _Job) -> dict[str, Any]:
        params = dict(job.params)
        if self.store_root is not None:
            params.setdefault("store_root", self.store_root)
        if self.config is not None:
            params.setdefault("config", self.config)
        return params

    def _run(self, job: _Job) -> JobResult:
        params = self._params(job)
        started_at = datetime.now(UTC)
        started = time.perf_counter()
        try:
            if self.mode == "server":
                result: Any = self._run_deployment(job, params)
            elif self._isolate:
                result = self._sidecar_ready().run(job.flow, params)
            else:
                result = get_flow(job.flow)(**params)
        except Exception as exc:  # a failed flow must not kill the worker; keep the error
            # One line: Prefect's own run log already holds the traceback.
            error = str(exc) if isinstance(exc, FlowProcessError) else (
                f"{type(exc).__name__}: {exc}")
            if not self._exiting:  # else _at_exit says, once, that it did not finish
                logger.warning("flow %s failed: %s", job.flow, error)
            return JobResult(
                job.flow, params, False, None, error, started_at,
                time.perf_counter() - started, job.scheduled,
            )
        return JobResult(
            job.flow, params, True, result, None, started_at, time.perf_counter() - started,
            job.scheduled,
        )

    def _run_deployment(self, job: _Job, params: dict[str, Any]) -> str:
        from prefect.deployments import run_deployment

        # Called from sync code, run_deployment returns the FlowRun (not a coroutine).
        flow_run = cast(
            "FlowRun",
            run_deployment(
                deployment_name(job.flow, self.deployment),
                parameters=params,
                timeout=0,
                idempotency_key=job.key,
                as_subflow=False,
                # The host's own queue: only that host's agent (its Prefect worker) runs it.
                work_queue_name=job.work_queue,
            ),
        )
        return str(flow_run.id)

    def _finish(self, job: _Job, result: JobResult | None) -> None:
        if result is not None:
            self.results.append(result)
        with self._idle:
            if job.key is not None:
                self._queued_keys.discard(job.key)
            self._outstanding -= 1
            self._idle.notify_all()

    def _drain_dropped(self) -> None:
        """Account for jobs left behind a STOP (close without wait)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Job):
                _log_dropped(item)
                self._finish(item, None)

    def _at_exit(self) -> None:
        """Say, one line each, which flows the exiting process leaves undone; run none.

        atexit hooks run after threading's shutdown: concurrent.futures refuses new work and
        Prefect cannot restart its log and event workers, so a flow run from here fails, and
        every line it logs ends in "--- Logging error ---" (waiting for the running one only
        prolongs that). Flows finish cleanly only while the program still runs:
        CheckpointStore.close() waits for those it triggered.
        """
        if self._abort.is_set():
            return  # close(wait=False) was asked for: do not hold the interpreter's exit
        if self._closed and self._thread is None:
            return
        with self._lock:
            self._closed = True
        self._abort.set()
        self._drain_dropped()
        running = self._running
        sidecar = self._sidecar
        if sidecar is not None:
            # Nothing a process starts outlives it: an idle sidecar stops (and stops its
            # server) as on close; one still warming up, or running a flow, is stopped now.
            self._exiting = True
            if running is None and sidecar.ready:
                sidecar.close(timeout=10)
            else:
                sidecar.kill()
        if running is not None:
            about = f" for {running.params['ref']}" if "ref" in running.params else ""
            logger.warning(
                "flow %s%s did not finish: the process exited while it ran (close the store "
                "before the process exits to wait for the flows it started)", running.flow, about,
            )
        self._queue.put(_STOP)


def _log_dropped(job: _Job) -> None:
    about = f" for {job.params['ref']}" if "ref" in job.params else ""
    logger.warning(
        "flow %s%s was not run: its runner was closed first (close the store before the "
        "process exits to wait for the flows it started)", job.flow, about,
    )


# ---------------------------------------------------------------------- process-wide runners
_RUNNERS: dict[tuple[str | None, str | None], EmbeddedRunner] = {}
_RUNNERS_LOCK = threading.Lock()


def get_runner(
    store_root: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | None = None,
    *,
    schedules: Mapping[str, str] | None = None,
    mode: Mode = "auto",
) -> EmbeddedRunner:
    """The process-wide runner for a store (created and started on first use).

    Args:
        store_root: Store directory.
        config: Config file.
        schedules: Schedules, used only when the runner is created.
        mode: See :class:`EmbeddedRunner`.

    Returns:
        The runner.
    """
    key = (None if store_root is None else str(store_root), None if config is None else str(config))
    with _RUNNERS_LOCK:
        runner = _RUNNERS.get(key)
        if runner is None or runner._closed:
            runner = EmbeddedRunner(key[0], key[1], schedules=schedules, mode=mode)
            runner.start()
            _RUNNERS[key] = runner
        return runner


def wait_for_flows(
    store_root: str | os.PathLike[str] | None,
    config: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
) -> bool:
    """Wait until the process-wide runner of a store has run every flow submitted to it.

    Args:
        store_root: Store directory.
        config: Config file.
        timeout: Seconds to wait at most (default: the runner's ``exit_timeout_s``).

    Returns:
        True when nothing is left (or there is no runner); False on timeout (logged), or on
        the runner's own thread, which cannot wait for itself.
    """
    key = (None if store_root is None else str(store_root), None if config is None else str(config))
    with _RUNNERS_LOCK:
        runner = _RUNNERS.get(key)
    if runner is None:
        return True
    if threading.current_thread() is runner._thread:
        return False  # a flow closing a store that triggered flows: they run after it
    limit = runner.exit_timeout_s if timeout is None else timeout
    if runner.wait_idle(limit):
        return True
    logger.warning(
        "%d background flow(s) of %s still queued or running after %.0fs; not waiting longer",
        runner.pending(), key[0], limit,
    )
    return False


def shutdown_runners(wait: bool = True, timeout: float | None = None) -> None:
    """Close every process-wide runner.

    Args:
        wait: Run queued flows first.
        timeout: Per runner, seconds to wait.
    """
    with _RUNNERS_LOCK:
        runners = list(_RUNNERS.values())
        _RUNNERS.clear()
    for runner in runners:
        runner.close(wait=wait, timeout=timeout)


def trigger_flow(
    store_root: str | os.PathLike[str] | None,
    flow_name: str,
    params: Mapping[str, Any] | None = None,
    *,
    config: str | os.PathLike[str] | None = None,
    idempotency_key: str | None = None,
) -> None:
    """Start a flow without waiting for it (what ``CheckpointStore.trigger`` calls).

    With ``PREFECT_API_URL`` set, the background thread calls ``run_deployment(...,
    timeout=0)`` for the deployment ``ckpt serve`` serves; otherwise it runs the flow
    in-process (embedded). Either way this call only enqueues.

    Args:
        store_root: Store directory (plain path).
        flow_name: Short flow name.
        params: Flow parameters (plain values; never credentials).
        config: Config file path.
        idempotency_key: e.g. ``f"archive:{ckpt_id}"`` (default derived from ``ref``).

    Raises:
        ConfigError: For an unknown flow.
    """
    params = dict(params or {})
    if idempotency_key is None and "ref" in params:
        idempotency_key = f"{flow_name}:{params['ref']}"
    get_runner(store_root, config).submit(flow_name, key=idempotency_key, **params)

