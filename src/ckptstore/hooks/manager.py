"""CheckpointManager: the training-loop side of the store.

It decides when to save (save policies), saves asynchronously (the loop blocks only while the
state is staged to host memory), resumes from the newest checkpoint, and after each commit
pins, prunes the run's hot tier, runs the user's ``on_commit`` hooks and triggers the archive
flow, all on the background save thread. On SIGTERM (preemption) it makes a final save at the
next ``step()`` and exits once that save is committed.

One class, kept whole: the ordering between its parts (staging, the background commit, pins,
pruning, hooks, SIGTERM) is what it is for.

Example:
    >>> store = CheckpointStore.open("./ckpt")                        # doctest: +SKIP
    >>> mgr = CheckpointManager(store, "run-a", save_interval=100, keep_last=3)  # doctest: +SKIP
    >>> with mgr:                                                     # doctest: +SKIP
    ...     state = mgr.restore_latest()
    ...     start = state["step"] + 1 if state else 0
    ...     for step in range(start, 10_000):
    ...         loss = train_step()
    ...         mgr.step(step, lambda: {"model": model.state_dict(),
    ...                                 "optim": opt.state_dict(), "step": step},
    ...                  metrics={"loss": loss})
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from ckptstore.capture import safe_config
from ckptstore.errors import CheckpointNotFoundError, CkptError, ConfigError
from ckptstore.format import FlatState, as_flat
from ckptstore.hooks.policies import AnyOf, EveryNSeconds, EveryNSteps, OnDemand, SavePolicy
from ckptstore.hooks.ranks import RankRestart, Ring, join_ring, leave_ring
from ckptstore.ops.reading.load import load_latest_snapshot, snapshot_rank
from ckptstore.ops.reading.reproduce import RESUME_ENV
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.ops.upkeep.history import DEFAULT_HISTORY_POINTS, MetricHistory
from ckptstore.ops.writing.async_save import SaveHandle, saver_for
from ckptstore.ops.writing.save import save_checkpoint
from ckptstore.ops.writing.snapshot import SnapshotWriter
from ckptstore.ops.writing.snapshot_peer import (
    SnapshotReplicaServer,
    SnapshotReplicator,
    parse_address,
    pull_replica,
)
from ckptstore.ops.writing.snapshot_shards import flatten_sharded
from ckptstore.ops.writing.snapshot_world import current_world
from ckptstore.retention import RetentionPolicy
from ckptstore.save_options import SaveOptions

if TYPE_CHECKING:
    from ckptstore.observability.serving import MetricsServer
    from ckptstore.observability.tensorboard import TensorBoardSink
    from ckptstore.ops.reading.progressive import ProgressiveLoad
    from ckptstore.records import Checkpoint
    from ckptstore.store import CheckpointStore

__all__ = ["CheckpointManager", "PruneFn", "StateFn"]

logger = logging.getLogger(__name__)

#: Builds the training state; called only when a save is due.
StateFn = Callable[[], Any]
#: Applies the manager's retention to one run's hot tier: ``prune_fn(store, run)``.
PruneFn = Callable[["CheckpointStore", str], None]

#: Exit status after a preemption save, as if SIGTERM had killed the process (128 + 15).
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


def _default_prune(
    store: CheckpointStore,
    run: str,
    *,
    keep_last: int | None,
    keep_best: tuple[str, str, int] | None,
) -> None:
    """Apply keep_last/keep_best to the run's hot tier with the retention engine."""
    apply_retention(
        store, run=run, tier="hot", policy=RetentionPolicy(keep_last=keep_last, keep_best=keep_best)
    )


class CheckpointManager:
    """Save a training run on a schedule, resume it, and survive preemption.

    Lifecycle: create → :meth:`restore_latest` (optional) → :meth:`step` every training step
    (and :meth:`save_now` for extra saves) → :meth:`close` (or use it as a context manager).
    The store stays open; the caller closes it.

    Attributes:
        store: The store saves go to.
        run: The run name.
        policy: The save policy (steps and/or seconds, plus on-demand requests).
        resumed_from: The checkpoint :meth:`restore_latest` loaded, if any.
        last_checkpoint: The most recently committed checkpoint of this manager.
        metrics_server: The Prometheus endpoint started for ``metrics_port`` (None otherwise);
            stopped by :meth:`close`.
        tensorboard: The TensorBoard sink started for ``tensorboard_dir`` (None otherwise);
            flushed and closed by :meth:`close`.
        history: The run's metric-history recorder (None with ``history=False``); a
            :class:`~ckptstore.hooks.LossMonitor` given this manager records through it.
    """

    def __init__(
        self,
        store: CheckpointStore,
        run: str,
        *,
        save_interval: int | None = None,
        save_every_seconds: float | None = None,
        keep_last: int | None = None,
        keep_best: tuple[str, str, int] | None = None,
        async_save: bool = True,
        archive: bool = False,
        on_commit: Callable[[Checkpoint], None]
        | Sequence[Callable[[Checkpoint], None]]
        | None = None,
        handle_sigterm: bool = True,
        experiment: str | None = None,
        config: Any = None,
        data_version: str | None = None,
        prune_fn: PruneFn | None = None,
        policy: SavePolicy | None = None,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
        tensorboard_dir: str | os.PathLike[str] | None = None,
        history: bool = True,
        history_points: int = DEFAULT_HISTORY_POINTS,
        snapshot_interval: int | None = None,
        snapshot_budget_bytes: int | None = None,
        snapshot_async: bool = False,
        optimizer: Any | None = None,
        replicas: int = 1,
        peer: str | None = None,
        replica_host: str | None = None,
        replicated: bool = False,
        distributed: bool | None = None,
    ) -> None:
        """Attach a manager to ``run`` of ``store``.

        Args:
            store: An open store.
            run: Run name (created in the catalog if new).
            save_interval: Save every N steps (default the store's ``save_interval``).
            save_every_seconds: Also save when this many seconds passed since the last save.
            keep_last: Keep the newest N checkpoints of the run on the hot tier
                (default the store's ``keep_last``).
            keep_best: ``(metric, "min"|"max", N)``: also keep the best N
                (default the store's ``keep_best``).
            async_save: Stage and save in the background (True) or save in the step (False).
            archive: Trigger the archive flow after each commit (never waited for).
            on_commit: Callables run with each committed checkpoint (background thread when
                ``async_save``); their errors are logged.
            handle_sigterm: On SIGTERM, save at the next :meth:`step` and exit with status
                143 once it is committed (main thread only).
            experiment: Experiment the run is filed under.
            config: Run configuration recorded with the run's context (for reproduction;
                JSON-safe, secrets masked: :func:`ckptstore.capture.safe_config`).
            data_version: The data set's version, recorded with the context.
            prune_fn: Retention hook ``prune_fn(store, run)``; default applies
                ``keep_last``/``keep_best`` through ``ckptstore.ops.tiering.retention``.
            policy: A custom save policy; replaces ``save_interval``/``save_every_seconds``.
            metrics_port: Serve the store's Prometheus series at
                ``http://<metrics_addr>:<port>/metrics`` while the manager is open (0 picks a
                free port; read it from :attr:`metrics_server`). Needs ``ckptstore[metrics]``.
            metrics_addr: Address the endpoint binds; the default keeps it on this machine.
            tensorboard_dir: Write every save's timings and sizes to a TensorBoard event file
                there (``ckpt/save/seconds``, ``ckpt/save/blocked_seconds``, ... per step)
                while the manager is open. Needs ``ckptstore[tensorboard]``.
            history: Record the ``metrics`` passed to :meth:`step` at every step as the run's
                metric history (the training curve ``ckpt ui`` plots), written to the
                catalog in batches after each save and on close (see
                :mod:`ckptstore.ops.upkeep.history`).
            history_points: The most points the catalog keeps per metric of the run (older
                stretches are merged, min and max kept).
            snapshot_interval: Also snapshot the state into this host's shared memory every
                N steps (no catalog row, no disk I/O; see docs/SNAPSHOTS.md); each durable
                save is then written from the newest snapshot. :meth:`restore_latest`
                prefers a snapshot newer than the newest checkpoint.
            snapshot_budget_bytes: Most shared memory the snapshot slots may take (2 slots,
                3 with durable saves, each the state's size); a state that does not fit is
                refused with a ConfigError at the first snapshot. None: only the free space
                of the shared-memory file system bounds them. With ``replicas=2`` the
                neighbour's replica (2 slots) counts too.
            snapshot_async: :meth:`step` starts the snapshot's copy and returns without
                waiting for it: CUDA tensors are copied on a side stream into pinned
                buffers, CPU tensors on a background thread, and the checksum and commit
                follow there. The forward and backward of the next step overlap the copy;
                nothing may change the state in place before :meth:`wait_snapshot` (which
                ``optimizer``'s pre-step hook calls; see docs/SNAPSHOTS.md "Devices").
            optimizer: A ``torch.optim.Optimizer`` (with ``snapshot_async``): its
                ``step()`` first waits until the pending snapshot's copy is out of the
                state (:meth:`guard`), so a loop whose only in-place change of the state is
                that optimizer's step needs no explicit wait.
            replicas: 2 also sends every snapshot to a neighbour node's memory
                (asynchronously; :mod:`ckptstore.ops.writing.snapshot_peer`), and
                :meth:`restore_latest` pulls it back when this host has none.
            peer: The neighbour's replica server, ``"host:port"`` (it runs a
                :class:`~ckptstore.ops.writing.snapshot_peer.SnapshotReplicaServer`).
                Without it, ``replicas=2`` needs a ``torch.distributed`` job of at least
                two nodes: local rank 0 of every node runs its node's server, the ranks
                exchange the addresses through the process group (every rank must create
                its manager, a collective), and node ``k`` sends to node
                ``(k + 1) % nnodes`` (:mod:`ckptstore.ops.writing.snapshot_world`).
            replica_host: The address this node's replica server binds and is reached at
                (without ``peer``; default this machine's host name).
            replicated: Every rank's state is the same (data parallel, as DDP keeps it): a
                restart of a multi-rank job, at this world size or another, resumes every
                rank from the newest snapshot of any rank. Without it each rank resumes its
                own rank's state, so every rank of the new world must have one.
            distributed: Whether every rank of the process group runs a manager of this
                run and calls :meth:`restore_latest` (collectives: the step to resume is
                agreed by all of them). None: when a process group of more than one rank
                is initialised. False: this rank on its own (a job that snapshots from one
                rank only; ``replicas=2`` then needs ``peer``). True: a process group is
                required.

        Raises:
            ConfigError: For a non-positive interval or count, a bad ``keep_best``, a
                metrics endpoint / TensorBoard directory whose extra is not installed, or
                ``replicas=2`` without ``peer`` outside a job of several nodes.
            StorageError: If ``metrics_port`` is already in use, or (on every rank) a
                node's replica server cannot listen.
            InvalidNameError: For a bad run name.
        """
        settings = store.settings
        self.store = store
        self.run = run
        self._async = async_save
        self._archive = archive
        self._hooks: tuple[Callable[[Checkpoint], None], ...] = (
            () if on_commit is None
            else (on_commit,) if callable(on_commit)
            else tuple(on_commit)
        )
        save_interval = save_interval if save_interval is not None else settings.save_interval
        self.keep_last = keep_last if keep_last is not None else settings.keep_last
        self.keep_best = _check_keep_best(
            keep_best if keep_best is not None else settings.keep_best
        )
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"keep_last must be at least 1, got {self.keep_last!r}")
        self._on_demand = OnDemand()
        if policy is None:
            parts: list[SavePolicy] = []
            if save_interval is not None:
                parts.append(EveryNSteps(save_interval))
            if save_every_seconds is not None:
                parts.append(EveryNSeconds(save_every_seconds))
            policy = AnyOf(*parts)
        self.policy: SavePolicy = AnyOf(policy, self._on_demand)
        if prune_fn is None and (self.keep_last is not None or self.keep_best is not None):
            prune_fn = functools.partial(
                _default_prune, keep_last=self.keep_last, keep_best=self.keep_best
            )
        self._prune = prune_fn
        self.resumed_from: Checkpoint | None = None
        self.last_checkpoint: Checkpoint | None = None
        self._parent_pending: str | None = None
        self._last_state_fn: StateFn | None = None
        self._handles: list[SaveHandle] = []
        self._handles_lock = threading.Lock()
        self._preempted = False
        self._previous_handler: Any = None
        self._installed = False
        self._closed = False
        fields: dict[str, Any] = {}
        if experiment is not None:
            fields["experiment"] = experiment
        if config is not None:
            fields["config"] = safe_config(config)
        if data_version is not None:
            fields["data_version"] = str(data_version)
        self._config, self._data_version = config, data_version
        run_info = store.run(run, **fields)
        self._run_token = run_info.created_at.isoformat()
        store.catalog.set_run_status(run, "active")  # again, for a resumed run
        self.resumed_step: int | None = None
        self.snapshots: SnapshotWriter | None = None
        self._snapshot_policy: EveryNSteps | None = None
        self._overlap = False
        self.replicator: SnapshotReplicator | None = None
        #: This node's replica server, when this rank runs it (``replicas=2`` without peer).
        self.replica_server: SnapshotReplicaServer | None = None
        self._peer: tuple[str, int] | None = None
        self._ring: Ring | None = None  # replicas=2 in a job: ops/hooks/ranks.py
        self._failing = False
        if not isinstance(replicated, bool):
            raise ConfigError(f"replicated must be True or False, got {replicated!r}")
        self._replicated = replicated
        if distributed not in (None, True, False):
            raise ConfigError(f"distributed must be None, True or False, got {distributed!r}")
        if distributed is None:
            import torch.distributed as dist

            distributed = (dist.is_available() and dist.is_initialized()
                           and dist.get_world_size() > 1)
        elif distributed and current_world() is None:
            raise ConfigError("distributed=True needs an initialised torch.distributed "
                              "process group (init_process_group() before the manager)")
        self._collective = distributed
        # Checked before the ring is joined: a bad option must not leave a server running.
        if not isinstance(snapshot_async, bool):
            raise ConfigError(f"snapshot_async must be True or False, got {snapshot_async!r}")
        if snapshot_async and snapshot_interval is None:
            raise ConfigError("snapshot_async=True needs snapshot_interval: it is how the "
                              "snapshots are copied")
        if optimizer is not None and not snapshot_async:
            raise ConfigError("optimizer= guards the asynchronous snapshot copy: pass "
                              "snapshot_async=True with it (or call guard(optimizer))")
        if optimizer is not None and not callable(
                getattr(optimizer, "register_step_pre_hook", None)):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        self._snapshot_async = snapshot_async
        if replicas not in (1, 2) or isinstance(replicas, bool):
            raise ConfigError(f"replicas must be 1 or 2, got {replicas!r}")
        if replicas == 2:
            if snapshot_interval is None:
                raise ConfigError(
                    "replicas=2 needs snapshot_interval: the replicas are of the snapshots")
            if peer is not None:
                self._peer = parse_address(peer)
            elif not self._collective:
                current_world()  # under torchrun without a process group: it says so
                raise ConfigError(
                    "replicas=2 needs peer='host:port' (a neighbour's snapshot replica server) "
                    "or a torch.distributed job of several nodes (an initialised process "
                    "group, distributed not False), whose neighbours are found by themselves")
            else:
                self._ring = join_ring(store, replica_host)
                self.replica_server, self._peer = self._ring.server, self._ring.peer
        if snapshot_interval is not None:
            self._snapshot_policy = EveryNSteps(snapshot_interval)
            durable = (save_interval is not None or save_every_seconds is not None
                       or policy is not None)
            rank = self._ring.world.rank if self._ring is not None else snapshot_rank()
            if self._peer is not None:
                self.replicator = SnapshotReplicator(self._peer, run, rank)
            self.snapshots = SnapshotWriter(
                store, run, slots=3 if durable else 2, budget_bytes=snapshot_budget_bytes,
                rank=rank, run_token=self._run_token,
                peer_slots=2 if self._peer is not None else 0,
                on_commit=self.replicator.offer if self.replicator is not None else None,
                async_copy=snapshot_async,
            )
            # With snapshot_async, step() does not wait for the copy even without an
            # optimizer to guard: the caller then calls wait_snapshot() before changing it.
            self._overlap = snapshot_async
            if optimizer is not None:
                self.guard(optimizer)
        self.history = (
            MetricHistory(store, run, max_points=history_points) if history else None
        )
        self.metrics_server: MetricsServer | None = None
        self.tensorboard: TensorBoardSink | None = None
        self._start_observability(metrics_port, metrics_addr, tensorboard_dir)
        if handle_sigterm:
            self._install_sigterm()

    # ------------------------------------------------------------------ peers
    def _distributed(self) -> bool:
        """Whether the ranks of a process group must agree on the step to resume."""
        return self._collective

    # ------------------------------------------------------------------ observability
    def _start_observability(
        self,
        port: int | None,
        addr: str,
        tensorboard_dir: str | os.PathLike[str] | None,
    ) -> None:
        """Start the endpoint and the sink; on any failure nothing stays running."""
        metrics = self.store.metrics
        try:
            if port is not None:
                if metrics.prom is None:
                    raise ConfigError(
                        f"metrics_port={port} needs prometheus_client: "
                        "pip install 'ckptstore[metrics]'"
                    )
                self.metrics_server = metrics.serve_metrics(port, addr)
            if tensorboard_dir is not None:
                # TensorBoardSink raises ConfigError naming ckptstore[tensorboard] without it.
                self.tensorboard = metrics.attach_tensorboard(tensorboard_dir)
        except BaseException:
            self._stop_observability()
            raise

    def _stop_observability(self) -> None:
        server, self.metrics_server = self.metrics_server, None
        if server is not None:
            self.store.metrics.stop_server(server)
        sink, self.tensorboard = self.tensorboard, None
        if sink is not None:
            self.store.metrics.detach_tensorboard(sink)

    # ------------------------------------------------------------------ resume
    def restore_latest(
        self,
        into: Any | None = None,
        *,
        priority: Sequence[str | Sequence[str]] | None = None,
        on_group: Callable[[int, Any], None] | None = None,
    ) -> Any | None:
        """Load the newest committed checkpoint of the run.

        The next save records it as its parent (lineage: resumed-from), and the step policy
        continues from its step. When ``CKPT_RESUME`` names a checkpoint (what a
        ``ckpt reproduce`` recipe sets), that checkpoint is loaded instead, whatever is newer
        in memory or in the catalog: the recipe resumes the exact state it recorded.

        Args:
            into: A state of the same structure to fill in place (fastest; no allocations).
                In a multi-rank job, DTensors in it (``Shard(d)`` and ``Replicate`` on any
                device mesh) make the restart reshard: their local shards are filled from
                the old ranks' snapshots, at whatever world size wrote them
                (docs/SNAPSHOTS.md).
            priority: Load progressively, group by group in this order (fnmatch patterns
                such as ``["model/*"]``; everything else last); see
                :func:`ckptstore.ops.reading.progressive.load_progressive`.
            on_group: With ``priority``: called on this thread as ``on_group(index, part)``
                as soon as each group is loaded, before the rest is waited for.

        Returns:
            The state, or None when the run has no committed checkpoint yet.

        Raises:
            CheckpointNotFoundError: If the newest checkpoint has no copy on any tier, or
                ``CKPT_RESUME`` names no checkpoint of this store.
            IntegrityError: If it is damaged.
        """
        self.wait()
        latest, pinned = self._resume_target()
        if priority is None and not pinned:
            # A complete snapshot in this host's memory at or after the newest checkpoint
            # (a restart after a crash) is the newer state; a torn one is never read.
            durable_step = latest.step if latest is not None else None
            if self._distributed():
                # Several ranks: all resume at one step or none does (from a snapshot).
                hit = RankRestart(
                    self.store, self.run, run_token=self._run_token,
                    replicated=self._replicated,
                    node_server=self._ring.node_server if self._ring is not None else None,
                ).restore(durable_step, into, self.snapshots)
            else:
                hit = load_latest_snapshot(self.store, self.run, durable_step, into=into,
                                           run_token=self._run_token)
            if hit is None and self._peer is not None and not self._distributed():
                # A replacement node: the neighbour holds this rank's newest snapshot.
                pulled = pull_replica(self.store, self.run, snapshot_rank(), self._peer)
                if pulled is not None:
                    hit = load_latest_snapshot(self.store, self.run, durable_step, into=into,
                                               run_token=self._run_token)
            if hit is not None:
                self._resumed_snapshot(hit[0], latest)
                return hit[1]
        if latest is None:
            logger.info("run %s has no checkpoint yet: starting fresh", self.run)
            return None
        ck = latest
        if priority is None:
            state = self.store.load(ck.id, into=into)
        else:
            from ckptstore.ops.reading.progressive import load_progressive

            with load_progressive(self.store, ck.id, priority, into=into) as progressive:
                for index, part in progressive:
                    if on_group is not None:
                        on_group(index, part)
                state = progressive.result()
        self._resumed(ck)
        return state

    def restore_latest_progressive(
        self,
        priority: Sequence[str | Sequence[str]],
        into: Any | None = None,
    ) -> ProgressiveLoad | None:
        """Start loading the newest checkpoint group by group; return without waiting.

        Args:
            priority: Groups in load order (fnmatch patterns; everything else last).
            into: A state of the same structure to fill in place.

        Returns:
            The :class:`~ckptstore.ops.reading.progressive.ProgressiveLoad` (``wait(i)`` for a
            group, ``result()`` for the whole state), or None when the run has no
            checkpoint yet.
        """
        from ckptstore.ops.reading.progressive import load_progressive

        self.wait()
        ck, _ = self._resume_target()
        if ck is None:
            logger.info("run %s has no checkpoint yet: starting fresh", self.run)
            return None
        progressive = load_progressive(self.store, ck.id, priority, into=into)
        self._resumed(ck)
        return progressive

    def _resume_target(self) -> tuple[Checkpoint | None, bool]:
        """The checkpoint to resume from (None: the run has none yet), and whether
        ``CKPT_RESUME`` chose it.

        Raises:
            CheckpointNotFoundError: If ``CKPT_RESUME`` names no checkpoint of this store.
        """
        pinned = os.environ.get(RESUME_ENV, "").strip()
        if not pinned:
            try:
                return self.store.latest(self.run), False
            except CheckpointNotFoundError:
                return None, False
        try:
            ck = self.store.get(pinned)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{RESUME_ENV}={pinned!r} names no checkpoint of this store ({exc}); restore "
                f"it first (ckpt restore {pinned}) or unset {RESUME_ENV} to resume from the "
                "run's newest checkpoint") from exc
        logger.info("%s names %s: resuming from it", RESUME_ENV, ck.ref)
        return ck, True

    def _resumed(self, ck: Checkpoint) -> None:
        if self.history is not None:
            try:
                # The curve shows the path the run took: what was logged after the resumed
                # step belongs to the abandoned attempt.
                self.history.rewind(ck.step)
            except CkptError:
                logger.exception("could not rewind the metric history of %s", self.run)
        self.resumed_from = ck
        self.resumed_step = ck.step
        self._parent_pending = ck.id
        now = time.monotonic()
        self.policy.saved(ck.step, now)
        if self._snapshot_policy is not None:
            self._snapshot_policy.saved(ck.step, now)
        logger.info("resumed %s from %s (step %s)", self.run, ck.ref, ck.step)

    def _resumed_snapshot(self, step: int, durable: Checkpoint | None) -> None:
        if self.history is not None:
            try:
                self.history.rewind(step)
            except CkptError:
                logger.exception("could not rewind the metric history of %s", self.run)
        # Lineage: the snapshot continues the newest durable checkpoint's line.
        self.resumed_from = durable
        self.resumed_step = step
        self._parent_pending = durable.id if durable is not None else None
        now = time.monotonic()
        self.policy.saved(step, now)
        if self._snapshot_policy is not None:
            self._snapshot_policy.saved(step, now)
        logger.info("resumed %s from its snapshot at step %s", self.run, step)

    # ------------------------------------------------------------------ saving
    def step(
        self,
        step: int,
        state_fn: StateFn,
        metrics: Mapping[str, Any] | None = None,
    ) -> SaveHandle | Checkpoint | None:
        """Save if the policy says a save is due at ``step``.

        Args:
            step: The training step just finished.
            state_fn: Builds the state to save; called only when a save is due.
            metrics: Numbers recorded with the checkpoint (non-finite values are dropped).

        Returns:
            A :class:`SaveHandle` (async), the committed :class:`Checkpoint` (sync), or None
            when no save was due.

        Raises:
            CkptError: An earlier background save's failure (raised once).
            SystemExit: With status 143 after the preemption save, when SIGTERM was received.
        """
        self._check_open()
        if self._snapshot_async:
            # The previous step's snapshot has overlapped this step's compute; it is
            # committed (or its failure raised) before anything else happens.
            self.wait_snapshot()
        self._last_state_fn = state_fn
        if metrics and self.history is not None:
            self.history.add_many(step, metrics)
        if self._preempted:
            self._save_and_exit(step, state_fn, metrics)
        if self.snapshots is not None:
            return self._snapshot_step(step, state_fn, metrics)
        if not self.policy.should_save(step, time.monotonic()):
            return None
        return self._save(step, state_fn, metrics, tags=(), pin=False)

    def guard(self, optimizer: Any) -> None:
        """Let snapshots overlap the next step: the copy runs while it computes.

        Registers a pre-step hook on ``optimizer`` that waits for the pending snapshot's
        copy, so :meth:`step` returns before the tensors are copied. Only correct when
        every change to the saved state happens in that optimizer's ``step()`` (no
        BatchNorm running statistics, no in-place edits of the weights elsewhere).

        Args:
            optimizer: A ``torch.optim.Optimizer`` updating the saved state.

        Raises:
            ConfigError: If the manager takes no snapshots.
        """
        if self.snapshots is None:
            raise ConfigError("guard() needs snapshot_interval: the manager takes no snapshots")
        snapshots = self.snapshots
        optimizer.register_step_pre_hook(lambda *_args: snapshots.wait_copied())
        self._overlap = True

    def wait_snapshot(self) -> None:
        """Block until the pending snapshot is copied and committed (header written last).

        With ``snapshot_async=True`` call it before anything changes the state in place
        when no ``optimizer`` was given (the optimizer's pre-step hook waits otherwise).
        It is also called at the start of :meth:`step`, by :meth:`restore_latest`,
        :meth:`close`, :meth:`wait` and durable saves. No-op without a pending snapshot.

        Raises:
            SnapshotError: If the pending snapshot's copy or commit failed (its slot stays
                invisible; raised once).
        """
        if self.snapshots is not None:
            self.snapshots.flush()

    def _snapshot_step(
        self, step: int, state_fn: StateFn, metrics: Mapping[str, Any] | None
    ) -> SaveHandle | Checkpoint | None:
        """Snapshot when due; when a durable save is due, write it from the snapshot."""
        assert self.snapshots is not None and self._snapshot_policy is not None
        now = time.monotonic()
        save_due = self.policy.should_save(step, now)
        if not (save_due or self._snapshot_policy.should_save(step, now)):
            return None
        if self.replicator is not None:
            # The neighbour acknowledges the previous snapshot before this one is taken: a
            # node loss then costs at most one snapshot interval (docs/SNAPSHOTS.md).
            self.snapshots.flush()
            self.replicator.wait_sent()
        flat, extra = _snapshot_flat(state_fn())
        if extra is not None and save_due:
            raise ConfigError(
                "a durable save of a sharded (DTensor) state is not made from its snapshots "
                "(each rank's would hold its own shard only): use snapshot_interval without "
                "save_interval for it, and the DCP layout for durable saves (docs/SNAPSHOTS.md)")
        self.snapshots.take(step, flat, overlap=self._overlap and not save_due,
                            extra_meta=extra)
        self._snapshot_policy.saved(step, now)
        if not save_due:
            return None
        view = self.snapshots.persist_view()
        if view is None:  # no complete snapshot of ours (cannot happen after a take)
            return self._save(step, state_fn, metrics, tags=(), pin=False)
        options = SaveOptions(metrics=_finite_metrics(metrics), parent=self._parent_pending)
        after = functools.partial(self._after_commit, pin=False)
        result: SaveHandle | Checkpoint
        if self._async:
            handle = saver_for(self.store).submit_staged(
                self.run, view.step, view.flat, options, release=view.release, on_commit=after)
            with self._handles_lock:
                self._handles = [h for h in self._handles if not h.done()]
                self._handles.append(handle)
            result = handle
        else:
            try:
                ck = save_checkpoint(self.store, self.run, view.step, view.flat, options)
            finally:
                view.release()
            after(ck)
            result = ck
        self._parent_pending = None
        self.policy.saved(step, now)
        return result

    def save_now(
        self,
        step: int,
        state_fn: StateFn | None = None,
        metrics: Mapping[str, Any] | None = None,
        tags: Sequence[str] = (),
        pin: bool = False,
    ) -> SaveHandle | Checkpoint:
        """Save now, whatever the policy says.

        Args:
            step: The training step.
            state_fn: Builds the state (default: the one last passed to :meth:`step`).
            metrics: Numbers recorded with the checkpoint (non-finite values are dropped).
            tags: Labels for the checkpoint.
            pin: Protect it from retention once committed.

        Returns:
            A :class:`SaveHandle` (async) or the committed :class:`Checkpoint` (sync).

        Raises:
            ConfigError: If no ``state_fn`` is given and :meth:`step` was never called.
            CkptError: An earlier background save's failure (raised once).
        """
        self._check_open()
        state_fn = state_fn or self._last_state_fn
        if state_fn is None:
            raise ConfigError(
                "save_now needs a state_fn: pass one, or call step() with one first"
            )
        return self._save(step, state_fn, metrics, tags=tuple(tags), pin=pin)

    def request_save(self) -> None:
        """Ask for a save at the next :meth:`step` (safe from signal handlers and threads)."""
        self._on_demand.request()

    @property
    def preempted(self) -> bool:
        """Whether SIGTERM was received."""
        return self._preempted

    def _save(
        self,
        step: int,
        state_fn: StateFn,
        metrics: Mapping[str, Any] | None,
        *,
        tags: tuple[str, ...],
        pin: bool,
    ) -> SaveHandle | Checkpoint:
        if self._snapshot_async:
            # A pending copy's failure is reported before a durable save starts.
            self.wait_snapshot()
        state = state_fn()
        now = time.monotonic()
        options = SaveOptions(metrics=_finite_metrics(metrics), tags=tags,
                              parent=self._parent_pending, config=self._config,
                              data_version=self._data_version)
        after = functools.partial(self._after_commit, pin=pin)
        result: SaveHandle | Checkpoint
        if self._async:
            handle = saver_for(self.store).submit(self.run, step, state, options,
                                                  on_commit=after)
            with self._handles_lock:
                self._handles = [h for h in self._handles if not h.done()]
                self._handles.append(handle)
            result = handle
        else:
            ck = save_checkpoint(self.store, self.run, step, state, options)
            after(ck)
            result = ck
        # Only after a successful submit: a refused save leaves the policy due.
        self._parent_pending = None
        self.policy.saved(step, now)
        return result

    def _after_commit(self, ck: Checkpoint, *, pin: bool) -> None:
        """Post-commit work; each part is isolated so one failure does not skip the rest."""
        self.last_checkpoint = ck
        if pin:
            try:
                self.store.pin(ck.id)
            except CkptError:
                logger.exception("could not pin %s; retention may prune it", ck.ref)
        if self._prune is not None:
            try:
                self._prune(self.store, self.run)
            except Exception:
                logger.exception("pruning the hot tier of %s after %s failed", self.run, ck.ref)
        if self.history is not None:
            try:
                self.history.flush()
            except CkptError:
                logger.exception("could not record the metric history of %s", self.run)
        for hook in self._hooks:
            try:
                hook(ck)
            except Exception:
                logger.exception("on_commit hook %r failed for %s", hook, ck.ref)
        if self._archive:
            try:
                self.store.trigger("archive", ck)
            except CkptError as exc:
                # e.g. no warm tier: say it once, in one line, rather than at every commit.
                logger.warning("checkpoints of run %s are not archived: %s", self.run, exc)
                self._archive = False
            except Exception:
                logger.exception("could not trigger archiving of %s", ck.ref)

    # ------------------------------------------------------------------ waiting
    def wait(self) -> None:
        """Wait until this manager's pending saves are committed (or failed).

        Raises:
            CkptError: The first failure of this manager's saves not yet reported.
        """
        self.wait_snapshot()
        with self._handles_lock:
            handles, self._handles = self._handles, []
        if handles:
            saver_for(self.store).wait(handles)

    def close(self) -> None:
        """Wait for pending saves, stop the metrics endpoint and TensorBoard sink the manager
        started, and restore the SIGTERM handler; the store stays open.

        Raises:
            CkptError: The first failure of this manager's saves not yet reported.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self.snapshots is not None:
                self.snapshots.close()
            if self.replicator is not None:
                self.replicator.close()
            if self._ring is not None:
                leave_ring(self._ring, failing=self._failing)
            self._uninstall_sigterm()
            # After the wait: the last saves' timings still reach the endpoint and the file.
            self._stop_observability()
            if self.history is not None:
                self.history.close()
            try:  # the UI shows the run closed, not active
                self.store.catalog.set_run_status(self.run, "closed")
            except CkptError as exc:
                logger.warning("could not mark run %s closed: %s", self.run, exc)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None or issubclass(exc_type, SystemExit):
            self.close()
            return
        # Do not hide the loop's own exception behind a save failure.
        self._failing = True  # the other ranks may never reach close(): no barrier
        try:
            self.close()
        except CkptError:
            logger.exception("a pending save failed while the training loop was failing")

    def _check_open(self) -> None:
        if self._closed:
            raise CkptError(f"the checkpoint manager of {self.run} is closed; create a new one")

    # ------------------------------------------------------------------ preemption
    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.debug("not on the main thread: SIGTERM is not handled by the manager")
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            # The program chose to ignore SIGTERM; preemption handling must not undo that.
            return
        self._previous_handler = previous
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _uninstall_sigterm(self) -> None:
        if not self._installed:
            return
        self._installed = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Runs between two bytecodes of the main thread: set flags only, save in step().
        if self._preempted:
            logger.warning("SIGTERM again: still waiting for the next step to save")
            return
        self._preempted = True
        self._on_demand.request()
        logger.warning("SIGTERM received: %s saves at its next step, then exits", self.run)

    def _save_and_exit(
        self, step: int, state_fn: StateFn, metrics: Mapping[str, Any] | None
    ) -> None:
        for attempt in range(2):
            try:
                self._save(step, state_fn, metrics, tags=("preempted",), pin=False)
                self.wait()
                break
            except CkptError:
                # The error may be an earlier save's failure surfacing now; one retry makes
                # the preemption save itself.
                if attempt:
                    raise
                logger.exception("a save failed during preemption; saving again")
        logger.warning("preemption save of %s at step %s committed; exiting", self.run, step)
        previous = self._previous_handler
        self.close()
        if callable(previous) and previous not in (signal.default_int_handler,):
            previous(signal.SIGTERM, None)
        raise SystemExit(PREEMPTED_EXIT_CODE)


def _snapshot_flat(state: Any) -> tuple[FlatState, dict[str, Any] | None]:
    """The state flattened for a snapshot, and for a sharded one the meta that places each
    shard (the world size and every DTensor's :class:`ShardSpec`); None when it has none.

    DTensors exist only with an initialised process group: without one the walk is skipped.
    """
    import torch.distributed as dist

    if isinstance(state, FlatState) or not (dist.is_available() and dist.is_initialized()):
        return as_flat(state), None
    flat, specs = flatten_sharded(state)
    if not specs:
        return flat, None
    return flat, {"world": dist.get_world_size(),
                  "shards": {key: spec.to_json() for key, spec in specs.items()}}


def _finite_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float] | None:
    """Plain floats; non-finite values are dropped (with a warning) instead of failing a save."""
    if not metrics:
        return None
    out: dict[str, float] = {}
    for name, value in metrics.items():
        try:
            number = float(value)
        except OverflowError:  # an int beyond the float range: as good as infinite
            number = math.inf
        if math.isfinite(number):
            out[name] = number
        else:
            logger.warning("metric %s=%s is not finite: not recorded", name, number)
    return out


def _check_keep_best(value: tuple[str, str, int] | None) -> tuple[str, str, int] | None:
    if value is None:
        return None
    try:
        metric, mode, count = value
    except (TypeError, ValueError):
        raise ConfigError(
            f"keep_best must be (metric, 'min'|'max', N), got {value!r}"
        ) from None
    if mode not in ("min", "max") or not isinstance(count, int) or count < 1:
        raise ConfigError(f"keep_best must be (metric, 'min'|'max', N>=1), got {value!r}")
    return (str(metric), mode, count)
