"""PyTorch Lightning adapter: a ``CheckpointIO`` plugin that saves into the store, and a
callback that records metrics with each save.

Usage::

    store = CheckpointStore.open("./ckpt")
    io = CkptStoreIO(store, run="mnist-a", async_save=True)
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(save_top_k=2, ...),
                                               CkptStoreCallback()])
    trainer.fit(model, ckpt_path="mnist-a@latest")     # resume from a store reference

How Lightning's file paths map to the store:

* ``save_checkpoint(ckpt, path)`` saves the checkpoint dict as a new version of ``run`` at
  ``ckpt["global_step"]`` and points an alias named after the path (:func:`alias_for_path`)
  at it. An aliased checkpoint is never pruned, so the alias is how "Lightning still keeps
  this file" is recorded. A small JSON pointer file is written at ``path`` (``stubs=True``)
  so Lightning's own file logic (``ckpt_path="last"``, ``ModelCheckpoint`` bookkeeping) keeps
  working; it holds the checkpoint id, never tensors.
* ``remove_checkpoint(path)`` (``ModelCheckpoint`` dropping a checkpoint out of its top-k)
  removes that alias and the pointer file, and nothing else: **the store's retention decides
  when the data goes** (``keep_last``, ``keep_best``, pins, other aliases). Removing from
  Lightning's point of view means "Lightning no longer needs it", not "delete it".
* ``load_checkpoint(path)`` accepts a pointer file, a path this plugin saved (via its alias),
  any store reference (``run@latest``, ``run@v3``, ``run@best:val_loss``, an alias, a uuid),
  or a plain ``torch.save`` ``.ckpt`` file (loaded weights-only).

With ``async_save=True`` the training loop blocks only while the state is staged in host
memory. Removals are ordered behind the pending save of the same path (Lightning calls
``remove_checkpoint`` synchronously, which with Lightning's own ``AsyncCheckpointIO`` can
delete a checkpoint still being written): a removal of a path whose save has not committed
yet runs right after that save's commit, on the save thread. Use ``async_save`` rather than
wrapping this plugin in ``AsyncCheckpointIO``.

Snapshots (``snapshot_interval=N``, docs/SNAPSHOTS.md)::

    io = CkptStoreIO(store, run="mnist-a", snapshot_interval=1)
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(every_n_train_steps=500),
                                               CkptStoreCallback()])
    trainer.fit(model, ckpt_path="mnist-a@latest")   # after a crash: the newest snapshot wins

The design splits the work as Lightning splits it: the plugin (the ``CheckpointIO``) owns
the :class:`~ckptstore.ops.writing.snapshot.SnapshotWriter` and the resume, because
Lightning hands every checkpoint load to it; the callback says *when*, because only a
callback sees the training loop. :class:`CkptStoreCallback` (required for snapshots) opens
the writer when training starts and, in ``on_train_batch_end`` (after the optimizer step,
where ``ModelCheckpoint(every_n_train_steps=...)`` saves), builds the checkpoint dict
Lightning itself would save (``trainer._checkpoint_connector.dump_checkpoint``: Lightning
2.x has no public call that returns it without writing it) and hands it to the writer
whenever ``trainer.global_step`` reached a new multiple of N (with gradient accumulation
the hook runs once per batch; the step is taken once). A resume from a snapshot is
therefore a resume from the checkpoint ``ModelCheckpoint`` would have saved at that step.
Callbacks that save (``ModelCheckpoint``) run after ours at the same hook, and epoch-end
saves come later still: when Lightning saves a full checkpoint at the step just snapshotted,
the plugin takes the snapshot again from the dict it saves, so the snapshot of a step is
never older than the checkpoint of the same step (a resume prefers the snapshot at an
equal step). The writer is closed (last snapshot committed, thread stopped) when training
ends or fails; its slot files stay for the next process.

``fit(ckpt_path="<run>@latest")`` (this plugin's run) then loads the newest complete
snapshot of the run on this host when its step is at least the newest durable checkpoint's
(:func:`~ckptstore.ops.reading.load.load_latest_snapshot`: a torn, damaged or
other-incarnation snapshot is never used); otherwise the checkpoint, as without snapshots.
Any other reference, and every reference without ``snapshot_interval``, loads as before.
Limits: one process per host and run directory per rank (``$RANK``), as the writer; the
snapshot is a copy of Lightning's dict, so it resumes as exactly as Lightning resumes from
its own mid-epoch checkpoints (weights, optimizer, schedulers, loops and global step are
those of the step; a plain ``DataLoader`` does not resume its position).

Checkpoint contents: ``AttributeDict`` (hyper-parameters) is stored as a plain ``dict``;
anything else that would need pickle is refused with
:class:`~ckptstore.errors.UnsafeObjectError` naming its key (e.g.
``hyper_parameters/transform``).
"""

# ruff: noqa: E402  (the optional imports follow the check that names their extra)
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ckptstore.extras import require

# Before the imports below, so that without the 'lightning' extra the error names it.
require("lightning", "the Lightning integration")

from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO

from ckptstore.durable import replace_file
from ckptstore.errors import CheckpointNotFoundError, CkptError, UnsafeObjectError
from ckptstore.format import FlatState, flatten_state
from ckptstore.names import MAX_NAME_BYTES, validate_metric_name
from ckptstore.ops.reading.load import resume_from_snapshot, snapshot_rank
from ckptstore.ops.writing.async_save import saver_for
from ckptstore.ops.writing.save import save_checkpoint as save_to_store
from ckptstore.ops.writing.snapshot import SnapshotWriter, check_snapshot_options
from ckptstore.save_options import SaveOptions

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ckptstore.records import Checkpoint
    from ckptstore.store import CheckpointStore

__all__ = [
    "HINT_KEY",
    "CkptStoreCallback",
    "CkptStoreIO",
    "alias_for_path",
    "lightning_state",
    "read_pointer",
]

logger = logging.getLogger(__name__)

#: Key :class:`CkptStoreCallback` adds to the checkpoint dict for the plugin (never stored).
HINT_KEY = "_ckptstore"
#: Largest pointer file read back (a real checkpoint is much larger and is not JSON).
_MAX_POINTER_BYTES = 64 * 1024
_UNSAFE_ALIAS_CHARS = re.compile(r"[^A-Za-z0-9._+=,-]")


def alias_for_path(path: str | os.PathLike[str]) -> str:
    """The alias that marks the checkpoint Lightning saved at ``path`` as kept.

    ``lightning-<hash of the absolute path>-<file name>``, cut to the name length limit. The
    hash keeps equal file names in different directories apart.
    """
    absolute = os.path.abspath(os.fspath(path))
    digest = hashlib.sha256(absolute.encode("utf-8")).hexdigest()[:12]
    tail = _UNSAFE_ALIAS_CHARS.sub("_", os.path.basename(absolute)).replace("..", "._")
    name = f"lightning-{digest}-{tail}"
    return name.encode("utf-8")[:MAX_NAME_BYTES].decode("ascii", "ignore")


def lightning_state(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint dict as the store can hold it: ``AttributeDict`` becomes ``dict``.

    The plugin's hint key is dropped. Everything else is kept as is (and refused by the save
    if it needs pickle).
    """

    def clean(obj: Any) -> Any:
        if isinstance(obj, AttributeDict):
            return {k: clean(v) for k, v in obj.items()}
        if type(obj) is dict:
            return {k: clean(v) for k, v in obj.items()}
        if type(obj) is OrderedDict:
            return OrderedDict((k, clean(v)) for k, v in obj.items())
        if type(obj) is list:
            return [clean(v) for v in obj]
        if type(obj) is tuple:
            return tuple(clean(v) for v in obj)
        return obj

    return {k: clean(v) for k, v in checkpoint.items() if k != HINT_KEY}


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The contents of a pointer file this plugin wrote, or None if ``path`` is not one."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(_MAX_POINTER_BYTES + 1)
    except OSError:
        return None
    if len(data) > _MAX_POINTER_BYTES or not data.startswith(b"{"):
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    info = doc.get("ckptstore") if isinstance(doc, dict) else None
    return info if isinstance(info, dict) and isinstance(info.get("id"), str) else None


def _metrics(checkpoint: Mapping[str, Any]) -> dict[str, float]:
    """Numbers to record: the callback's hint, else each ModelCheckpoint's monitored score."""
    out: dict[str, float] = {}
    callbacks = checkpoint.get("callbacks")
    if isinstance(callbacks, Mapping):
        for cb_state in callbacks.values():
            if not isinstance(cb_state, Mapping):
                continue
            monitor, score = cb_state.get("monitor"), cb_state.get("current_score")
            if isinstance(monitor, str) and score is not None:
                _put(out, monitor, score)
    hint = checkpoint.get(HINT_KEY)
    if isinstance(hint, Mapping):
        for name, value in (hint.get("metrics") or {}).items():
            _put(out, name, value)
    return out


def _put(out: dict[str, float], name: Any, value: Any) -> None:
    try:
        number = float(value.item() if isinstance(value, torch.Tensor) else value)
        validate_metric_name(name)
    except (TypeError, ValueError, OverflowError, RuntimeError, CkptError):
        # Not a scalar, an int beyond the float range, or a name the catalog cannot hold.
        return
    if math.isfinite(number):
        out[str(name)] = number


@dataclass
class _Pending:
    """One save not yet committed, and the removals of its path waiting for it."""

    done: bool = False
    deferred: list[str] = field(default_factory=list)
    handle: Any = None  # the SaveHandle; a failed save never commits, so never runs these

    def settled(self) -> bool:
        """True once the save committed or failed (removals need not wait any more)."""
        return self.done or (self.handle is not None and self.handle.done())


class CkptStoreIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves checkpoints into a :class:`CheckpointStore`.

    Attributes:
        store: The store.
        run: The run checkpoints are saved as.
        async_save: Stage and save in the background.
        stubs: Write JSON pointer files at Lightning's paths.
        snapshot_interval: Snapshot every this many global steps (None: no snapshots).
        resumed_step: The step the last snapshot resume loaded (None: none).
        resumed_from: The run's newest checkpoint at that resume (None: there was none).
    """

    def __init__(
        self,
        store: CheckpointStore,
        run: str,
        *,
        async_save: bool = False,
        tags: tuple[str, ...] = ("lightning",),
        codec: str | None = None,
        experiment: str | None = None,
        stubs: bool = True,
        snapshot_interval: int | None = None,
        snapshot_budget_bytes: int | None = None,
    ) -> None:
        """Create the plugin.

        Args:
            store: An open store (the caller closes it).
            run: Run name for the saves.
            async_save: Return from ``save_checkpoint`` once the state is staged in host
                memory; the save commits on a background thread.
            tags: Tags of every saved checkpoint.
            codec: Codec preset (default: the store's).
            experiment: Experiment the run is filed under.
            stubs: Write a pointer file at each path Lightning saves to.
            snapshot_interval: Also snapshot Lightning's checkpoint dict into this host's
                shared memory every N global steps (needs :class:`CkptStoreCallback`;
                docs/SNAPSHOTS.md); ``fit(ckpt_path="<run>@latest")`` then prefers a
                snapshot at least as new as the newest checkpoint. None: no snapshots.
            snapshot_budget_bytes: Most shared memory the two snapshot slots may take; a
                state that does not fit is refused with a ConfigError at the first
                snapshot. None: only the free shared memory bounds them. Needs
                ``snapshot_interval``.

        Raises:
            InvalidNameError: For a bad run name or tag.
            ConfigError: For a ``snapshot_interval`` that is not a positive int, or a
                ``snapshot_budget_bytes`` that is not a positive int or comes without it.
        """
        super().__init__()
        # Checked before the run is created: a typo fails at once and leaves nothing behind.
        check_snapshot_options(snapshot_interval, snapshot_budget_bytes, "global steps")
        self.store = store
        run_info = store.run(run, **({"experiment": experiment} if experiment else {}))
        self.run = run_info.name
        # A snapshot left by an earlier run of the same name (deleted and created again)
        # carries another creation time and is never resumed from.
        self._run_token = run_info.created_at.isoformat()
        self.snapshot_interval = snapshot_interval
        self._snapshot_budget = snapshot_budget_bytes
        self._snapshots: SnapshotWriter | None = None
        self._snapshot_at = 0  # step of the last snapshot taken or resumed (0: none)
        self._snapshot_opened = False  # a CkptStoreCallback opened the writer, or we warned
        self.resumed_step: int | None = None
        self.resumed_from: Checkpoint | None = None
        self.async_save = async_save
        self.stubs = stubs
        self._options = SaveOptions(tags=tuple(tags), codec=codec)
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._handles: list[Any] = []

    # ------------------------------------------------------------------ saving
    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Save Lightning's checkpoint dict as a new version of the run.

        Args:
            checkpoint: What Lightning built (``state_dict``, optimizer states, loops, ...).
            path: Where Lightning would have written the file.
            storage_options: Unused (Lightning passes None).

        Raises:
            UnsafeObjectError: If the checkpoint holds an object that would need pickle.
            CkptError: A failure of an earlier background save (raised once).
        """
        key = os.path.abspath(os.fspath(path))
        state = lightning_state(checkpoint)
        try:
            # The save's one walk of the state; the flattened state is what is saved.
            flat = flatten_state(state)
        except UnsafeObjectError as exc:
            raise UnsafeObjectError(
                f"{exc}. Lightning put this object in the checkpoint: for hyper-parameters "
                "call self.save_hyperparameters(ignore=[...]) or store plain values; for "
                "callback or datamodule state return plain containers from state_dict()"
            ) from exc
        step = int(checkpoint.get("global_step", 0))
        self._refresh_snapshot(checkpoint, step, flat)
        if self.snapshot_interval is not None and not self._snapshot_opened:
            # A save before any writer was opened: no callback is there to open one.
            self._snapshot_opened = True
            logger.warning("CkptStoreIO(snapshot_interval=%s) takes no snapshots without "
                           "CkptStoreCallback() in the Trainer's callbacks",
                           self.snapshot_interval)
        hint = checkpoint.get(HINT_KEY)
        extra = hint.get("tags", ()) if isinstance(hint, Mapping) else ()
        tags = tuple(dict.fromkeys((*self._options.tags, *extra)))
        # Lightning's hparams (``save_hyperparameters``) are the run's config: recorded with
        # its context on the first save and when they change (ops/writing/context.py).
        hparams = checkpoint.get("hyper_parameters")
        options = replace(self._options, metrics=_metrics(checkpoint) or None, tags=tags,
                          config=dict(hparams) if isinstance(hparams, Mapping) else None)
        if not self.async_save:
            ck = save_to_store(self.store, self.run, step, flat, options)
            self._committed(ck, key=key, pending=None)
            return
        pending = _Pending()
        with self._lock:
            # Registered before submitting, so a removal that comes meanwhile waits for it.
            self._pending[key] = pending
        on_commit = functools.partial(self._committed, key=key, pending=pending)
        try:
            # Not under the lock: submit may wait for earlier saves, whose commit callbacks
            # take the lock.
            handle = saver_for(self.store).submit(self.run, step, flat, options,
                                                  on_commit=on_commit)
        except BaseException:
            self._settle(key, pending)
            raise
        with self._lock:
            pending.handle = handle
            self._handles = [h for h in self._handles if not h.done()] + [handle]

    def _committed(self, ck: Checkpoint, *, key: str, pending: _Pending | None) -> None:
        """After a commit: mark the path's checkpoint kept, then run removals queued for it."""
        with self._lock:
            try:
                self.store.alias(ck.id, alias_for_path(key))
                if self.stubs:
                    self._write_pointer(key, ck)
            finally:
                if pending is not None:
                    pending.done = True
                    if self._pending.get(key) is pending:
                        del self._pending[key]
                deferred: list[str] = []
                if pending is not None:
                    deferred, pending.deferred = pending.deferred, []
        for path in deferred:
            self._remove_now(path)
        logger.debug("lightning checkpoint %s is %s", key, ck.ref)

    def _write_pointer(self, key: str, ck: Checkpoint) -> None:
        doc = {"ckptstore": {"id": ck.id, "ref": ck.ref, "run": ck.run, "step": ck.step,
                             "store": str(self.store.settings.root)}}
        path = Path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))

    # ------------------------------------------------------------------ removing
    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Lightning no longer needs ``path``: drop its alias and pointer file.

        The checkpoint itself stays until the store's retention prunes it. If its save is
        still pending, the removal runs right after that save commits.
        """
        key = os.path.abspath(os.fspath(path))
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None and not pending.settled():
                pending.deferred.append(key)
                return
        self._remove_now(key)

    def _settle(self, key: str, pending: _Pending) -> None:
        """A save that will never commit: run the removals that waited for it now."""
        with self._lock:
            pending.done = True
            if self._pending.get(key) is pending:
                del self._pending[key]
            deferred, pending.deferred = pending.deferred, []
        for path in deferred:
            self._remove_now(path)

    def _remove_now(self, key: str) -> None:
        with self._lock:
            with contextlib.suppress(CheckpointNotFoundError):
                self.store.catalog.unalias(alias_for_path(key))
            if read_pointer(key) is not None or not self.stubs:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(key)
        logger.debug("lightning no longer keeps %s", key)

    # ------------------------------------------------------------------ loading
    def resolve(self, path: str | os.PathLike[str]) -> str:
        """The checkpoint id behind a pointer file, a saved path or a store reference.

        Raises:
            CheckpointNotFoundError: If ``path`` is none of these.
        """
        text = os.fspath(path)
        pointer = read_pointer(text)
        if pointer is not None:
            return str(pointer["id"])
        for ref in (alias_for_path(text), text):
            with contextlib.suppress(CheckpointNotFoundError, CkptError):
                return self.store.get(ref).id
        raise CheckpointNotFoundError(
            f"{text!r} is not a checkpoint of this store: not a pointer file, not a path "
            f"this plugin saved, and not a reference such as '{self.run}@latest'; "
            "list checkpoints with `ckpt ls`"
        )

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint dict for Lightning (tensors on CPU; Lightning moves them).

        Args:
            path: A pointer file, a path this plugin saved, a store reference, or a plain
                ``torch.save`` file (loaded weights-only).
            map_location: Ignored: tensors load on CPU.
            weights_only: Ignored: nothing is ever unpickled.

        Raises:
            CheckpointNotFoundError: If ``path`` names no checkpoint.
            UnsafeObjectError: If a plain ``.ckpt`` file needs arbitrary unpickling.
        """
        text = os.fspath(path)
        snapshot = self._load_snapshot(text)
        if snapshot is not None:
            return snapshot
        if os.path.isfile(text) and read_pointer(text) is None:
            from ckptstore.convert.readers import load_pt

            loaded = load_pt(Path(text))
            if not isinstance(loaded, dict):
                raise CheckpointNotFoundError(f"{text} does not hold a Lightning checkpoint dict")
            return loaded
        self.wait()  # a checkpoint saved a moment ago must be committed first
        state = self.store.load(self.resolve(text))
        if not isinstance(state, dict):
            raise CheckpointNotFoundError(f"{text} does not hold a Lightning checkpoint dict")
        return state

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Wait for this plugin's background saves (and the removals queued behind them).

        Raises:
            CkptError: The first background failure not yet reported.
        """
        with self._lock:
            handles, self._handles = self._handles, []
        try:
            if handles:
                saver_for(self.store).wait(handles)
        finally:
            with self._lock:
                failed = [(k, p) for k, p in self._pending.items() if p.settled()]
            for key, pending in failed:
                self._settle(key, pending)

    def teardown(self) -> None:
        """Called by Lightning at the end of ``fit``: wait for pending saves and close the
        snapshot writer.

        Raises:
            CkptError: A background save's failure, or the last snapshot's.
        """
        try:
            self.wait()
        finally:
            self.close_snapshots()

    # ------------------------------------------------------------------ snapshots
    def open_snapshots(self) -> None:
        """Make the snapshot writer, if snapshots are on and none is open (training starts).

        The slot files are created at the first snapshot, not here.

        Raises:
            ConfigError: For a bad budget.
        """
        if self.snapshot_interval is None or self._snapshots is not None:
            return
        self._snapshot_opened = True
        # Two slots: the durable saves stage the state themselves, so no third slot is
        # pinned by a save made from a snapshot.
        self._snapshots = SnapshotWriter(self.store, self.run, slots=2,
                                         budget_bytes=self._snapshot_budget,
                                         rank=snapshot_rank(), run_token=self._run_token)

    def close_snapshots(self) -> None:
        """Wait for the last snapshot's commit and stop the writer's thread (the slot files
        stay: a later process resumes from them).

        Raises:
            CkptError: If the last snapshot failed.
        """
        writer, self._snapshots = self._snapshots, None
        self._snapshot_at = 0  # the next fit may start over from step 0
        if writer is not None:
            writer.close()

    def maybe_snapshot(self, trainer: pl.Trainer) -> bool:
        """Snapshot the trainer's checkpoint dict if its global step is a new multiple of
        ``snapshot_interval`` (called by :class:`CkptStoreCallback` after each batch).

        Returns:
            Whether a snapshot was taken.

        Raises:
            ConfigError: If the slots would not fit the budget or the free shared memory.
            UnsafeObjectError: If the checkpoint holds an object that would need pickle.
            CkptError: The previous snapshot's failure.
        """
        interval, writer = self.snapshot_interval, self._snapshots
        step = int(trainer.global_step)
        if interval is None or writer is None or step <= 0 or step % interval:
            return False
        if step == self._snapshot_at:
            return False  # gradient accumulation: later batches of the same step
        # The dict ModelCheckpoint would save now (Lightning has no public equivalent).
        connector: Any = trainer._checkpoint_connector
        checkpoint = connector.dump_checkpoint(weights_only=False)
        writer.take(step, flatten_state(lightning_state(checkpoint)))
        self._snapshot_at = step
        return True

    def _refresh_snapshot(self, checkpoint: Mapping[str, Any], step: int,
                          flat: FlatState) -> None:
        """Take the snapshot of ``step`` again from a full checkpoint Lightning saves at it.

        Savers run after the snapshot of their step (later callbacks, epoch end), and a
        resume prefers a snapshot at the checkpoint's step: so that snapshot must hold at
        least what the checkpoint holds. A weights-only save is not a resumable state and
        leaves the snapshot as it is.
        """
        writer = self._snapshots
        if writer is None or step <= 0 or step != self._snapshot_at:
            return
        if "optimizer_states" not in checkpoint or "loops" not in checkpoint:
            return
        writer.take(step, flat)

    def _load_snapshot(self, text: str) -> dict[str, Any] | None:
        """The newest snapshot's checkpoint dict, when ``text`` asks for this run's newest
        state and a complete snapshot is at least as new as the newest checkpoint."""
        if self.snapshot_interval is None or text != f"{self.run}@latest":
            return None
        self.wait()  # a checkpoint saved a moment ago counts as the newest
        hit = resume_from_snapshot(self.store, self.run, self._run_token)
        if hit is None:
            return None
        step, state, durable = hit
        if not isinstance(state, dict):
            return None
        self.resumed_step, self.resumed_from = step, durable
        self._snapshot_at = step  # the resumed step is not snapshotted again
        logger.info("resuming %s from its snapshot at step %s", self.run, step)
        return state


def _scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            continue
        _put(out, name, value)
    return out


class CkptStoreCallback(Callback):
    """Records ``trainer.callback_metrics`` with every checkpoint :class:`CkptStoreIO` saves,
    takes the plugin's snapshots (``snapshot_interval``), and waits for its background saves
    and snapshots when training ends or fails.

    Add it next to ``ModelCheckpoint``; it does nothing when the trainer's ``CheckpointIO``
    is not a :class:`CkptStoreIO`.
    """

    def __init__(self, *, tags: tuple[str, ...] = ()) -> None:
        """Create the callback.

        Args:
            tags: Extra tags for every checkpoint saved while it is attached.
        """
        super().__init__()
        self.tags = tuple(tags)

    @staticmethod
    def _io(trainer: pl.Trainer) -> CkptStoreIO | None:
        io = getattr(trainer.strategy, "checkpoint_io", None)
        return io if isinstance(io, CkptStoreIO) else None

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Attach the current metrics for the plugin (it removes them before saving)."""
        if self._io(trainer) is not None:
            checkpoint[HINT_KEY] = {"metrics": _scalar_metrics(trainer.callback_metrics),
                                    "tags": list(self.tags)}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open the plugin's snapshot writer (after the resume: a fit made again reopens it)."""
        io = self._io(trainer)
        if io is not None:
            io.open_snapshots()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """After the optimizer step: the plugin snapshots every ``snapshot_interval`` steps."""
        io = self._io(trainer)
        if io is not None:
            io.maybe_snapshot(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Wait for pending saves so ``fit`` returns with every checkpoint committed, and
        for the last snapshot."""
        io = self._io(trainer)
        if io is not None:
            try:
                io.wait()
            finally:
                io.close_snapshots()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Let pending saves finish; their own failures are logged, not raised over
        ``exception``."""
        io = self._io(trainer)
        if io is not None:
            try:
                io.wait()
            except CkptError:
                logger.exception("a pending checkpoint save failed while training was failing")
            try:
                io.close_snapshots()
            except CkptError:
                logger.exception("the last snapshot failed while training was failing")
