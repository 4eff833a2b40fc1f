"""Hugging Face ``Trainer`` that writes each checkpoint once, straight into the store.

:class:`~ckptstore.integrations.hf.CkptStoreCallback` lets the ``Trainer`` write its
``checkpoint-N`` folder and then copies that folder into the store, so every checkpoint is
written twice. :class:`CkptStoreTrainer` replaces the ``Trainer``'s checkpoint writing
instead: the weights, optimizer, scheduler, gradient scaler, RNG states and ``TrainerState``
go from memory into one store checkpoint per save step, and ``output_dir`` gets no
``checkpoint-N`` folder at all.

Usage::

    store = CheckpointStore.open("./ckpt")
    trainer = CkptStoreTrainer(model=model, args=args, train_dataset=ds,
                               store=store, run="bert-a")
    trainer.train()
    # after a crash or preemption, in a new process:
    trainer.train(resume_from_checkpoint="bert-a@latest")   # or True: latest of the run

What one checkpoint holds (step = ``state.global_step``; the same layout the callback
ingests, so :func:`~ckptstore.integrations.hf.materialize_hf_checkpoint` writes either kind
back as a ``checkpoint-N`` folder, and either kind resumes this trainer):

====================  ==============================================================
``model``             ``model.state_dict()`` (tied weights stored once)
``config``            the model config as ``config.json`` holds it (JSON)
``optimizer``         ``optimizer.state_dict()``
``scheduler``         ``lr_scheduler.state_dict()``
``scaler``            the gradient scaler's ``state_dict()`` under mixed precision
``rng_state``         ``{"rng_state.pth": {"python", "numpy", "cpu", "cuda"}}``: the
                      generators the ``Trainer`` itself saves, as tuples and arrays
                      (Python's state vector as one int64 array)
``trainer_state``     ``dataclasses.asdict(state)`` exactly as ``trainer_state.json``
``training_args``     ``args.to_json_string()`` as JSON (for the record; never read back)
``hf``                layout version, weights file name, folder name, writer
====================  ==============================================================

``save_only_model=True`` leaves out optimizer, scheduler, scaler and RNG states, as the
``Trainer`` does. The tokenizer / processor is not part of a checkpoint (it does not change
during training); save it once with ``processing_class.save_pretrained(...)``.

Nothing is pickled, either way: the store keeps tensors and typed JSON, and a resume reads
them back with ``store.load`` (no ``torch.load``, so not even weights-only unpickling runs).

Mapping of the ``Trainer``'s options:

* **metrics**: each checkpoint records the newest value of every number in
  ``state.log_history`` up to its step (``loss``, ``learning_rate``, ``eval_loss``...), as
  the callback does; the logged training ``loss`` also goes into the run's metric history
  (:mod:`ckptstore.ops.upkeep.history`), one catalog write per save.
* **after the commit**, off the training path (on a background thread of the trainer, or
  on the store's save thread with ``async_save``): the best-model alias, retention and the
  loss history below. The training loop waits for the durable commit only;
  ``train`` returns after all of it is done.
* **save_total_limit** is applied by the store's retention on the hot tier after each commit:
  the newest ``save_total_limit`` checkpoints stay, the best one counted among them as the
  ``Trainer`` counts it (with ``save_total_limit=1`` and a best that is not the newest, both
  stay, as in the ``Trainer``). With warm/cold tiers configured, older checkpoints leave the
  hot tier once archived instead of being deleted.
* **load_best_model_at_end / metric_for_best_model**: the best checkpoint gets the alias
  ``best_alias`` (default ``<run>.best``), which protects it from retention as the
  ``Trainer`` protects its best folder; ``state.best_model_checkpoint`` holds the store
  reference ``<run>@<step>``; at the end the weights are loaded from the store.
* **resume**: ``train(resume_from_checkpoint=...)`` accepts a store reference (``"run@latest"``,
  ``"run@v3"``, an alias, an id) or ``True`` (the newest checkpoint of this trainer's run); a
  path to an existing directory still resumes from that folder the usual way. The
  ``Trainer`` reads ``TrainerState`` from a file path only, so the resume hands it a
  temporary directory holding nothing but that JSON (a few kB, removed after ``train``);
  everything else is loaded from the store in memory. The first save after a resume
  records the resumed checkpoint as its parent (lineage).
* **snapshots** (``snapshot_interval=N``): every N optimizer steps the same state a save
  holds is also copied into this host's shared memory (a
  :class:`~ckptstore.ops.writing.snapshot.SnapshotWriter`: no catalog row, no disk I/O;
  docs/SNAPSHOTS.md), after the step's logging, evaluation and save, where the ``Trainer``
  would save. ``train(resume_from_checkpoint=True)`` (or ``"<run>@latest"``) then resumes
  from the newest complete snapshot when its step is at least the newest checkpoint's, so a
  killed process loses at most one snapshot interval; the ``save_steps`` saves go on as
  before (staged on their own, not written from a snapshot). The writer is closed when
  ``train`` returns or raises; its slot files stay for the next process.

Limits: one process only (``world_size == 1``); DeepSpeed, FSDP and ``push_to_hub`` need
the ``Trainer``'s own folders: use :class:`~ckptstore.integrations.hf.CkptStoreCallback`
there.

One class and its helpers: each override mirrors one of the ``Trainer``'s checkpoint
methods, and they only make sense together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_pt_utils import set_rng_state_for_device
from transformers.trainer_utils import SaveStrategy

from ckptstore.errors import CheckpointNotFoundError, CkptError, ConfigError, StorageError
from ckptstore.format import as_flat
from ckptstore.integrations.hf import (
    _FORMAT,
    _PREFIX,
    _TRAINER_STATE,
    _WEIGHTS,
    metrics_from_log_history,
    python_rng_state,
)
from ckptstore.names import validate_name
from ckptstore.ops.reading.load import resume_from_snapshot, snapshot_rank
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.ops.upkeep.history import MetricHistory
from ckptstore.ops.writing.async_save import SaveHandle, save_async
from ckptstore.ops.writing.save import save_checkpoint
from ckptstore.ops.writing.snapshot import SnapshotWriter, check_snapshot_options
from ckptstore.retention import RetentionPolicy
from ckptstore.save_options import SaveOptions

if TYPE_CHECKING:
    from ckptstore.records import Checkpoint
    from ckptstore.store import CheckpointStore

__all__ = ["CkptStoreTrainer"]

logger = logging.getLogger(__name__)

#: Key of the single-process RNG states, named after the file the Trainer writes.
_RNG_FILE = "rng_state.pth"
#: What the ``hf`` entry names as the writer (the callback's ingests have none).
_WRITER = "CkptStoreTrainer"


@dataclass
class _Resume:
    """A resume in progress: what it resumes from (a checkpoint's reference, or a snapshot
    named by its step), the loaded state and the stand-in folder."""

    label: str
    state: dict[str, Any]
    folder: str
    best_model_checkpoint: str | None


class CkptStoreTrainer(Trainer):  # type: ignore[misc]
    """A ``transformers.Trainer`` whose checkpoints go straight into a store, once.

    See the module docstring for the layout, the option mapping and the limits. Every
    ``Trainer`` argument works as usual; ``store`` and ``run`` are keyword-only additions.

    Attributes:
        store: The store checkpoints go to (the caller closes it).
        run: The run the checkpoints are saved as.
        saved: The committed checkpoints of this trainer, in commit order.
        resumed_from: The store checkpoint the last ``train`` resumed from, if any (after a
            resume from a snapshot: the run's newest checkpoint, the next save's parent).
        resumed_step: The step the last ``train`` resumed at (None: it started fresh).
        best_alias: The alias that marks the best checkpoint.
        snapshot_interval: Snapshot every this many optimizer steps (None: no snapshots).
    """

    def __init__(
        self,
        *args: Any,
        store: CheckpointStore,
        run: str,
        tags: Sequence[str] = ("hf",),
        codec: str | None = None,
        experiment: str | None = None,
        best_alias: str | None = None,
        async_save: bool = False,
        record_history: bool = True,
        snapshot_interval: int | None = None,
        snapshot_budget_bytes: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Create the trainer.

        Args:
            *args: Positional ``Trainer`` arguments (``model``, ``args``, ...).
            store: An open store.
            run: Run name (created in the catalog if new).
            tags: Tags of every checkpoint.
            codec: Codec preset (default: the store's).
            experiment: Experiment the run is filed under.
            best_alias: Alias of the best checkpoint (default ``<run>.best``).
            async_save: Return from a save once the state is staged in host memory and
                write it on a background thread (the store's async saver); ``train``
                waits for the last save before it returns.
            record_history: Record the logged training loss in the run's metric history.
            snapshot_interval: Also snapshot the training state into this host's shared
                memory every N optimizer steps (docs/SNAPSHOTS.md);
                ``train(resume_from_checkpoint=True)`` then prefers a snapshot at least as
                new as the newest checkpoint. None: no snapshots.
            snapshot_budget_bytes: Most shared memory the two snapshot slots may take (each
                the state's size); a state that does not fit is refused with a ConfigError
                at the first snapshot. None: only the free space of the shared-memory file
                system bounds them. Needs ``snapshot_interval``.
            **kwargs: Keyword ``Trainer`` arguments.

        Raises:
            ConfigError: For more than one process, DeepSpeed, FSDP or ``push_to_hub``, a
                ``snapshot_interval`` that is not a positive int, or a
                ``snapshot_budget_bytes`` that is not a positive int or comes without it.
            InvalidNameError: For a bad run name, tag or alias.
        """
        # Checked before the Trainer is built: a typo fails at once, not after the setup.
        check_snapshot_options(snapshot_interval, snapshot_budget_bytes, "optimizer steps")
        super().__init__(*args, **kwargs)
        if self.args.world_size > 1:
            raise ConfigError(
                f"CkptStoreTrainer saves from one process; this run has world_size="
                f"{self.args.world_size}. Use CkptStoreCallback (ckptstore.integrations.hf) "
                "or store.dcp_writer for multi-process training"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ConfigError(
                "CkptStoreTrainer does not support DeepSpeed or FSDP (their checkpoints are "
                "written by those engines); use CkptStoreCallback"
            )
        if self.args.push_to_hub:
            raise ConfigError(
                "push_to_hub uploads the Trainer's checkpoint folders, which CkptStoreTrainer "
                "does not write; use CkptStoreCallback, or push the final model yourself"
            )
        self.store = store
        run_info = store.run(run, **({"experiment": experiment} if experiment else {}))
        self.run = run_info.name
        # A snapshot left by an earlier run of the same name (deleted and created again)
        # carries another creation time and is never resumed from.
        self._run_token = run_info.created_at.isoformat()
        self.best_alias = validate_name(best_alias or f"{self.run}.best", "alias")
        self.saved: list[Checkpoint] = []
        self.resumed_from: Checkpoint | None = None
        self.resumed_step: int | None = None
        self._options = SaveOptions(tags=tuple(tags), codec=codec)
        self._async = async_save
        self._pending: list[SaveHandle] = []
        self._chores: ThreadPoolExecutor | None = None
        self._chores_pending: list[Future[None]] = []
        self._parent_pending: str | None = None
        self._resume: _Resume | None = None
        self._lock = threading.Lock()
        self._history = MetricHistory(store, self.run) if record_history else None
        self._history_seen = 0
        self.snapshot_interval = snapshot_interval
        self._snapshot_budget = snapshot_budget_bytes
        self._snapshot_at = 0  # the step of the last snapshot taken (0: none yet)
        self._save_calls = 0  # _save_checkpoint calls, to see whether a step saved
        # Made here so that a bad budget fails at once (the writer checks it); slot files
        # are only created by the first snapshot. Closed when train ends, made again by the
        # next train.
        self._snapshots: SnapshotWriter | None = (
            self._snapshot_writer() if snapshot_interval is not None else None)

    # ------------------------------------------------------------------ training
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``, resuming from a store reference as well as from a folder.

        Args:
            resume_from_checkpoint: A store reference (``"run@latest"``, ``"run@v2"``, an
                alias, an id), True for the newest checkpoint of this trainer's run, a path
                to an existing ``checkpoint-N`` folder, or None/False to start fresh.
            trial: As for ``Trainer.train``.
            ignore_keys_for_eval: As for ``Trainer.train``.
            **kwargs: Passed on to ``Trainer.train``.

        Returns:
            The ``Trainer``'s ``TrainOutput``.

        Raises:
            CheckpointNotFoundError: If the reference does not resolve, or True was passed
                and the run has no checkpoint (nor, with ``snapshot_interval``, a snapshot)
                yet.
            InvalidNameError: If the string is neither a directory nor a valid reference.
            CkptError: If the checkpoint was not saved from a ``Trainer``, or a background
                save failed.
            StorageError: If the trainer state cannot be handed to the ``Trainer``.
            ConfigError: If the snapshots would not fit ``snapshot_budget_bytes`` or the free
                shared memory.
        """
        self._snapshot_at = 0
        resume = self._open_snapshot_resume(resume_from_checkpoint)
        if resume is None:
            ck = self._store_checkpoint(resume_from_checkpoint)
            if ck is None:
                return self._train_and_wait(resume_from_checkpoint, trial, ignore_keys_for_eval,
                                            kwargs)
            resume = self._open_resume(ck)
        self._resume = resume
        try:
            return self._train_and_wait(self._resume.folder, trial, ignore_keys_for_eval,
                                        kwargs)
        finally:
            shutil.rmtree(self._resume.folder, ignore_errors=True)
            self._resume = None

    def _train_and_wait(self, resume: Any, trial: Any, ignore: list[str] | None,
                        kwargs: dict[str, Any]) -> Any:
        if self.snapshot_interval is not None and self._snapshots is None:
            self._snapshots = self._snapshot_writer()  # the previous train closed its writer
        try:
            out = super().train(resume_from_checkpoint=resume, trial=trial,
                                ignore_keys_for_eval=ignore, **kwargs)
        except BaseException:
            # Do not hide the training loop's own error behind a background save's failure.
            try:
                self.wait()
            except CkptError:
                logger.exception("a pending save failed while training was failing")
            try:
                self._close_snapshots()
            except CkptError:
                logger.exception("the last snapshot failed while training was failing")
            raise
        finally:
            self._stop_chores()
        try:
            self.wait()
        finally:
            self._close_snapshots()
        return out

    def _snapshot_writer(self) -> SnapshotWriter:
        # Two slots: the durable saves stage the state themselves, so no third slot is
        # pinned by a save made from a snapshot.
        return SnapshotWriter(self.store, self.run, slots=2, budget_bytes=self._snapshot_budget,
                              rank=snapshot_rank(), run_token=self._run_token)

    def _close_snapshots(self) -> None:
        """Wait for the last snapshot's commit and stop the writer's thread (the slot files
        stay: a later process resumes from them).

        Raises:
            CkptError: If the last snapshot failed.
        """
        writer, self._snapshots = self._snapshots, None
        if writer is not None:
            writer.close()

    def _stop_chores(self) -> None:
        """Let the housekeeping thread finish and end it (a later save starts a new one)."""
        with self._lock:
            chores, self._chores = self._chores, None
        if chores is not None:
            chores.shutdown(wait=True)

    def _store_checkpoint(self, value: str | bool | None) -> Checkpoint | None:
        """The store checkpoint ``value`` names, or None for "not a store resume"."""
        if value is None or value is False:
            return None
        if value is True:
            try:
                return self.store.latest(self.run)
            except CheckpointNotFoundError as exc:
                raise CheckpointNotFoundError(
                    f"resume_from_checkpoint=True: run {self.run!r} has no checkpoint in the "
                    "store yet; start without resume_from_checkpoint"
                ) from exc
        if isinstance(value, str | os.PathLike) and os.path.isdir(value):
            return None  # a checkpoint-N folder: the Trainer's own resume
        return self.store.get(str(value))

    def _open_snapshot_resume(self, value: str | bool | None) -> _Resume | None:
        """The resume from this host's newest snapshot, when ``value`` asks for the run's
        newest state and a complete snapshot is at least as new as its newest checkpoint."""
        if self.snapshot_interval is None or not (
            value is True or (isinstance(value, str) and value == f"{self.run}@latest")
        ):
            return None
        hit = resume_from_snapshot(self.store, self.run, self._run_token)
        if hit is None:
            return None
        step, state, durable = hit
        return self._prepare_resume(state, f"the snapshot of {self.run} at step {step}", step,
                                    parent=durable)

    def _open_resume(self, ck: Checkpoint) -> _Resume:
        return self._prepare_resume(self.store.load(ck.id), ck.ref, ck.step, parent=ck)

    def _prepare_resume(self, state: Any, label: str, step: int,
                        parent: Checkpoint | None) -> _Resume:
        """Check a loaded state, write its ``TrainerState`` for the ``Trainer`` to read and
        set the lineage (``parent``: the checkpoint the next save continues)."""
        if not isinstance(state, dict) or "model" not in state or "trainer_state" not in state:
            raise CkptError(
                f"{label} was not saved by a Hugging Face Trainer (no 'model' and "
                "'trainer_state' entries); load it with store.load and copy what you need"
            )
        trainer_state = dict(state["trainer_state"])
        best = trainer_state.get("best_model_checkpoint")
        if isinstance(best, str) and not os.path.isdir(best):
            # A store reference: the Trainer would drop it as a missing folder (with a
            # warning); it is put back after the Trainer has read the state.
            trainer_state["best_model_checkpoint"] = None
        else:
            best = None
        folder = ""
        try:
            folder = tempfile.mkdtemp(prefix=f"ckpt-resume-{step}-")
            Path(folder, _TRAINER_STATE).write_text(
                json.dumps(trainer_state, indent=2, sort_keys=True) + "\n", encoding="utf-8"
            )
        except OSError as exc:
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
            raise StorageError(
                f"cannot write the trainer state of {label} for the Trainer to read: {exc}; "
                "check the temporary directory (TMPDIR) has space"
            ) from exc
        self.resumed_from = parent
        self.resumed_step = step
        self._parent_pending = parent.id if parent is not None else None
        self._history_seen = len(trainer_state.get("log_history") or ())
        # A snapshot (no parent, or the run's own newest checkpoint) is always of this run.
        if self._history is not None and (parent is None or parent.run == self.run):
            try:
                # The curve shows the path the run took: values logged after the resumed
                # step belong to the abandoned attempt.
                self._history.rewind(step)
            except CkptError:
                logger.exception("could not rewind the loss history of %s", self.run)
        # The resumed step's snapshot is the one just read: not taken again.
        self._snapshot_at = step
        logger.info("resuming %s from %s (step %s)", self.run, label, step)
        return _Resume(label, state, folder, best)

    def _resuming(self, checkpoint: str | None) -> _Resume | None:
        resume = self._resume
        if resume is not None and checkpoint == resume.folder:
            return resume
        return None

    # ------------------------------------------------------------------ resume hooks
    def _init_training_state(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._init_training_state(*args, **kwargs)
        resume = self._resume
        if resume is not None and resume.best_model_checkpoint is not None:
            try:
                self.store.get(resume.best_model_checkpoint)
            except CkptError:
                logger.warning("the best checkpoint %s recorded in the resumed state is gone",
                               resume.best_model_checkpoint)
            else:
                self.state.best_model_checkpoint = resume.best_model_checkpoint
        return out

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        resume = self._resuming(resume_from_checkpoint)
        if resume is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        target: Any = self.model if model is None else model
        # strict=False and the warnings helper, as the Trainer loads its own folder: tied
        # weights a safetensors file left out are re-tied there. Popped: the loaded copy
        # would otherwise stay in memory for the whole training run.
        result = target.load_state_dict(resume.state.pop("model"), False)
        self._issue_warnings_after_load(result)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        resume = self._resuming(checkpoint)
        if resume is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        state = resume.state
        # Like the Trainer: both or neither (a save_only_model checkpoint has neither).
        if "optimizer" in state and "scheduler" in state:
            optimizer: Any = self.optimizer
            scheduler: Any = self.lr_scheduler
            optimizer.load_state_dict(state.pop("optimizer"))
            scheduler.load_state_dict(state.pop("scheduler"))

    def _load_scaler(self, checkpoint: str | None) -> None:
        resume = self._resuming(checkpoint)
        if resume is None:
            super()._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and "scaler" in resume.state:
            scaler.load_state_dict(resume.state.pop("scaler"))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        resume = self._resuming(checkpoint)
        if resume is None:
            super()._load_rng_state(checkpoint)
            return
        rng = (resume.state.get("rng_state") or {}).get(_RNG_FILE)
        if rng is None:
            logger.info("%s holds no RNG state; the resume is not bit-exact", resume.label)
            return
        random.setstate(python_rng_state(rng["python"]))
        np.random.set_state(rng["numpy"])
        torch.random.set_rng_state(rng["cpu"])
        if torch.cuda.is_available():
            # The Trainer's own helper: it logs instead of failing when the device differs.
            set_device_rng: Any = set_rng_state_for_device
            set_device_rng("CUDA", torch.cuda, rng, False)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or os.path.isdir(best):
            super()._load_best_model()
            return
        self.wait()  # an async save of the best checkpoint may still be running
        logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        weights = self.store.load(best, keys=["model/*"])["model"]
        model: Any = self.model
        result = model.load_state_dict(weights, False)
        self._issue_warnings_after_load(result)

    # ------------------------------------------------------------------ snapshots
    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The ``Trainer``'s log / evaluate / save of a step, then the step's snapshot.

        After them, so that a snapshot holds what a save at this step would (the step's
        logged loss, evaluation, best metric). The call at the end of an epoch repeats the
        step's; it snapshots again only if it logged or saved something.
        """
        logged, saves = len(self.state.log_history), self._save_calls
        super()._maybe_log_save_evaluate(*args, **kwargs)
        interval = self.snapshot_interval
        step = int(self.state.global_step)
        if self._snapshots is None or interval is None or step <= 0 or step % interval:
            return
        if step == self._snapshot_at and (
            len(self.state.log_history) == logged and self._save_calls == saves
        ):
            return
        self._take_snapshot(step)

    def _take_snapshot(self, step: int) -> None:
        """Copy the state a checkpoint at ``step`` would hold into the next snapshot slot.

        Returns once the tensors are copied (the next optimizer step may change them); the
        checksum and commit word follow on the writer's thread, so a crash loses at most
        this step's snapshot (docs/SNAPSHOTS.md).
        """
        assert self._snapshots is not None
        if self.hp_search_backend is None:
            # As a save does: the FLOPs counted so far go into the state (the sum is the
            # same however often this runs).
            self.store_flos()
        self._snapshots.take(step, as_flat(self._checkpoint_content(step)))
        self._snapshot_at = step

    # ------------------------------------------------------------------ saving
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Save this step's training state as one store checkpoint (no folder)."""
        self._save_calls += 1
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        step = int(self.state.global_step)
        best_step = self.state.best_global_step
        strategies = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        if self.args.save_strategy in strategies and best_step:
            # The Trainer names the best folder only once it exists; here: the step being
            # saved, or an earlier checkpoint of the run that is still in the store.
            best_ref = f"{self.run}@{int(best_step)}"
            if best_step == step or self._exists(best_ref):
                self.state.best_model_checkpoint = best_ref
        content = self._checkpoint_content(step)
        metrics = metrics_from_log_history(self.state.log_history, step) or None
        parent, self._parent_pending = self._parent_pending, None
        # The TrainingArguments are the run's config, recorded with its context.
        options = dataclasses.replace(self._options, metrics=metrics, parent=parent,
                                      config=self.args)
        best = self.state.best_model_checkpoint if best_step else None
        try:
            if self._async:
                handle = save_async(self.store, self.run, step, content, options,
                                    on_commit=lambda ck: self._after_commit(ck, best))
                with self._lock:
                    self._pending = [h for h in self._pending if not h.done()] + [handle]
            else:
                self._after_commit(save_checkpoint(self.store, self.run, step, content, options),
                                   best)
        except BaseException:
            self._parent_pending = parent  # the next save still records the lineage
            raise
        self._record_history()

    def _checkpoint_content(self, step: int) -> dict[str, Any]:
        """The state of one checkpoint, in the layout of the module docstring."""
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        content: dict[str, Any] = {
            "hf": {"format": _FORMAT, "weights": _WEIGHTS, "folder": f"{_PREFIX}-{step}",
                   "writer": _WRITER},
            "model": unwrapped.state_dict(),
        }
        config = getattr(unwrapped, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            content["config"] = json.loads(config.to_json_string())
        if not self.args.save_only_model:
            optimizer: Any = self.optimizer
            scheduler: Any = self.lr_scheduler
            content["optimizer"] = optimizer.state_dict()
            content["scheduler"] = scheduler.state_dict()
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                content["scaler"] = scaler.state_dict()
            content["rng_state"] = {_RNG_FILE: _rng_states()}
        # The Trainer records the stateful callbacks just before writing its state file.
        # (TrainerState turns its list into a name → state dict in __post_init__.)
        stateful: Any = self.state.stateful_callbacks
        for cb in [c for c in [*self.callback_handler.callbacks, self.control]
                   if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(stateful[name], list):
                stateful[name].append(cb.state())
            else:
                stateful[name] = cb.state()
        # Through JSON, as save_to_json writes it: the resumed TrainerState is then the one
        # load_from_json would build from the Trainer's own file.
        content["trainer_state"] = json.loads(
            json.dumps(dataclasses.asdict(self.state), sort_keys=True)
        )
        args: Any = self.args
        try:
            content["training_args"] = json.loads(args.to_json_string())
        except (TypeError, ValueError):
            logger.debug("training arguments are not JSON-serialisable; not recorded")
        return content

    def _exists(self, ref: str) -> bool:
        try:
            self.store.get(ref)
        except CkptError:
            return False
        return True

    def _after_commit(self, ck: Checkpoint, best: str | None) -> None:
        """Record the commit; the housekeeping after it does not hold up training.

        With ``async_save`` this already runs on the store's background save thread; a
        synchronous save hands it to the trainer's own background thread, so the training
        loop waits for the durable commit only, not for the pruning of older checkpoints.
        """
        self.saved.append(ck)
        logger.info("saved %s at step %s", ck.ref, ck.step)
        if self._async:
            self._housekeeping(ck, best)
            return
        with self._lock:
            if self._chores is None:
                self._chores = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hf-chores")
            self._chores_pending = [f for f in self._chores_pending if not f.done()]
            self._chores_pending.append(self._chores.submit(self._housekeeping, ck, best))

    def _housekeeping(self, ck: Checkpoint, best: str | None) -> None:
        """Alias the best checkpoint, apply ``save_total_limit``, write the loss history;
        each part isolated (the checkpoint is committed whatever happens here)."""
        if best is not None:
            try:
                self.store.alias(ck.id if best == f"{self.run}@{ck.step}" else best,
                                 self.best_alias)
            except CkptError:
                logger.exception("could not alias the best checkpoint %s as %s", best,
                                 self.best_alias)
        limit = self.args.save_total_limit
        if limit:
            # The Trainer's limit counts the best checkpoint; retention's keep_last counts
            # only unprotected ones (the alias protects the best), hence one less with a best.
            keep = int(limit) - (1 if best is not None else 0)
            try:
                apply_retention(self.store, run=self.run, tier="hot",
                                policy=RetentionPolicy(keep_last=keep))
            except Exception:
                # Retention runs again after the next save.
                logger.exception("retention of %s after %s failed", self.run, ck.ref)
        self._flush_history()

    def _flush_history(self) -> None:
        if self._history is None:
            return
        try:
            self._history.flush()
        except CkptError:
            logger.exception("could not record the loss history of %s", self.run)

    def _record_history(self) -> None:
        """Buffer the training losses logged since the last save (written after the commit)."""
        history = self._history
        if history is None:
            return
        entries = self.state.log_history[self._history_seen:]
        self._history_seen = len(self.state.log_history)
        for entry in entries:
            step, loss = entry.get("step"), entry.get("loss")
            if isinstance(step, int) and isinstance(loss, int | float):
                history.add(step, float(loss))

    # ------------------------------------------------------------------ waiting
    def wait(self) -> list[Checkpoint]:
        """Wait for background saves and the housekeeping after them (retention, alias,
        loss history); return the checkpoints committed so far.

        Raises:
            CkptError: The first background save failure not yet reported.
        """
        with self._lock:
            pending, self._pending = self._pending, []
            chores, self._chores_pending = self._chores_pending, []
        errors: list[BaseException] = []
        for handle in pending:
            try:
                handle.result()
            except BaseException as exc:
                errors.append(exc)
        for chore in chores:
            chore.result()  # _housekeeping logs its own failures
        self._record_history()
        self._flush_history()
        if errors:
            raise errors[0]
        return list(self.saved)


def _rng_states() -> dict[str, Any]:
    """The generators ``Trainer._save_rng_state`` saves in a single process.

    Python's Mersenne Twister state (625 ints) is kept as one int64 array instead of a tuple
    of 625 numbers: one tensor to store instead of 625 tree entries. Resuming and
    ``materialize_hf_checkpoint`` turn it back into the tuple ``random.setstate`` wants.
    """
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {
        "python": (version, np.asarray(internal, dtype=np.int64), gauss),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state()
    return states
