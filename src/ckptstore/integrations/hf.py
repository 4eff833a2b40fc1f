"""Hugging Face transformers adapter: ingest each ``checkpoint-N`` folder the ``Trainer``
writes into the store, and write one back for ``resume_from_checkpoint``.

This path writes every checkpoint twice (the folder, then the store). To write it once,
straight into the store, use :class:`ckptstore.integrations.hf_trainer.CkptStoreTrainer`
(a ``Trainer`` subclass; same checkpoint layout, resumes from ``"run@latest"``). The callback
remains for what that subclass does not cover: several processes, DeepSpeed, FSDP and
``push_to_hub``, which need the ``Trainer``'s own folders.

Usage::

    store = CheckpointStore.open("./ckpt")
    trainer = Trainer(..., callbacks=[CkptStoreCallback(store, run="bert-a", archive=True)])
    trainer.train()
    # later, anywhere the store is reachable:
    path = materialize_hf_checkpoint(store, "bert-a@latest", "out/")
    trainer.train(resume_from_checkpoint=path)

What one ingested checkpoint holds (one store checkpoint per folder, step = global step):

====================  ==============================================================
``model``             the weights, ``{name: tensor}`` (``model.safetensors``, shards, or
                      ``pytorch_model*.bin`` loaded weights-only)
``config``            ``config.json`` (JSON)
``optimizer``         ``optimizer.pt`` (``torch.load(weights_only=True)``)
``scheduler``         ``scheduler.pt`` (weights-only)
``scaler``            ``scaler.pt`` when mixed precision wrote one (weights-only)
``rng_state``         ``rng_state*.pth`` by file name (weights-only, numpy RNG arrays
                      allowed as the Trainer itself allows them)
``trainer_state``     ``trainer_state.json`` (JSON: global step, log history, best metric)
``files``             every other file (tokenizer, ``training_args.bin``, ...), its bytes
                      verbatim as a uint8 tensor: stored, never unpickled
``hf``                how to write the folder back (weights file name, ingest version)
====================  ==============================================================

Metrics recorded with the checkpoint: the newest value of each number in
``state.log_history`` up to that step (``loss``, ``learning_rate``, ``eval_loss``, ...).
"""

# ruff: noqa: E402  (the optional imports follow the check that names their extra)
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptstore.extras import require

# Before the imports below, so that without the 'hf' extra the error names it.
require("transformers", "the Hugging Face integration")

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ckptstore.convert.readers import CONFIG_NAME, load_pt, read_hf
from ckptstore.errors import CkptError, ConflictError, StorageError, UnsafeObjectError
from ckptstore.names import validate_metric_name
from ckptstore.ops.writing.save import save_checkpoint
from ckptstore.save_options import SaveOptions

if TYPE_CHECKING:
    from ckptstore.records import Checkpoint
    from ckptstore.store import CheckpointStore

__all__ = [
    "CkptStoreCallback",
    "materialize_hf_checkpoint",
    "metrics_from_log_history",
    "python_rng_state",
    "read_trainer_folder",
]

logger = logging.getLogger(__name__)

_PREFIX = "checkpoint"
_WEIGHTS = "model.safetensors"
_TRAINER_STATE = "trainer_state.json"
_TORCH_FILES = {"optimizer.pt": "optimizer", "scheduler.pt": "scheduler", "scaler.pt": "scaler"}
_WEIGHT_SUFFIXES = (".safetensors",)
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_FORMAT = 1


def _load_rng(path: Path) -> Any:
    """Load an ``rng_state*.pth`` weights-only, allowing numpy's RNG arrays (as the Trainer's
    own loader does) and nothing else."""
    np_core = getattr(np, "_core", None) or np.core
    allowed = [np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        return load_pt(path)


def _is_weights(name: str) -> bool:
    return (
        name.endswith(_WEIGHT_SUFFIXES)
        or name in _WEIGHT_INDEXES
        or (name.startswith("pytorch_model") and name.endswith(".bin"))
    )


def read_trainer_folder(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``checkpoint-N`` folder into one state, without unpickling anything unsafe.

    Args:
        folder: The folder the Trainer wrote.

    Returns:
        The state described in the module docstring.

    Raises:
        UnsafeObjectError: If a torch file needs arbitrary unpickling.
        IntegrityError: If a file is damaged.
        StorageError: If the folder cannot be read.
    """
    path = Path(folder)
    if not path.is_dir():
        raise StorageError(f"{path} is not a directory; pass the Trainer's checkpoint-N folder")
    weights, config = read_hf(path)
    state: dict[str, Any] = {
        "hf": {"format": _FORMAT, "weights": _WEIGHTS, "folder": path.name},
        "model": weights,
    }
    if config is not None:
        state["config"] = config
    rng: dict[str, Any] = {}
    files: dict[str, torch.Tensor] = {}
    for entry in sorted(path.iterdir(), key=lambda p: p.name):
        name = entry.name
        if not entry.is_file() or name == CONFIG_NAME or _is_weights(name):
            if entry.is_dir():
                logger.warning("%s: sub-directory %s is not ingested", path, name)
            continue
        if name in _TORCH_FILES:
            state[_TORCH_FILES[name]] = load_pt(entry)
        elif name.startswith("rng_state") and name.endswith(".pth"):
            rng[name] = _load_rng(entry)
        elif name == _TRAINER_STATE:
            try:
                state["trainer_state"] = json.loads(entry.read_bytes())
            except ValueError as exc:
                raise StorageError(f"{entry} is not valid JSON: {exc}") from exc
        else:
            # Kept byte for byte (tokenizer files, training_args.bin, ...); never unpickled.
            data = entry.read_bytes()
            files[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else (
                torch.empty(0, dtype=torch.uint8))
    if rng:
        state["rng_state"] = rng
    if files:
        state["files"] = files
    return state


def metrics_from_log_history(log_history: Sequence[Mapping[str, Any]], step: int
                             ) -> dict[str, float]:
    """The newest value of every finite number logged at or before ``step``."""
    out: dict[str, float] = {}
    for entry in reversed(log_history):
        at = entry.get("step")
        if isinstance(at, int) and at > step:
            continue
        for name, value in entry.items():
            if name == "step" or name in out or isinstance(value, bool):
                continue
            if not isinstance(value, int | float):
                continue
            try:
                number = float(value)
            except OverflowError:  # an int beyond the float range
                continue
            if not math.isfinite(number):
                continue
            with contextlib.suppress(CkptError):
                out[validate_metric_name(name)] = number
    return out


def python_rng_state(state: Sequence[Any]) -> tuple[Any, ...]:
    """Python's ``random`` state as ``random.setstate`` takes it.

    A Trainer folder holds ``(version, tuple of 625 ints, gauss_next)``;
    :class:`~ckptstore.integrations.hf_trainer.CkptStoreTrainer` stores the middle part as
    one int64 array. Both come back as the tuple form.
    """
    version, internal, gauss = state
    return (version, tuple(int(x) for x in internal), gauss)


def _untie(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses two names on one storage: give repeated tensors their own copy."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        tensor = tensor.contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen and tensor.numel() else tensor
        seen.add(ptr)
    return out


def materialize_hf_checkpoint(
    store: CheckpointStore,
    ref: str,
    output_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
) -> str:
    """Write an ingested checkpoint back as ``<output_dir>/checkpoint-<step>``.

    The folder is complete before it appears (written under a temporary name, then renamed),
    so ``trainer.train(resume_from_checkpoint=path)`` (or ``resume_from_checkpoint=True``
    with ``output_dir``) resumes from it.

    Args:
        store: The open store.
        ref: Reference of a checkpoint saved by :class:`CkptStoreCallback`.
        output_dir: Parent directory of the folder.
        overwrite: Replace an existing folder of the same name.

    Returns:
        The folder's path.

    Raises:
        CheckpointNotFoundError: If ``ref`` does not resolve.
        ConflictError: If the folder exists and ``overwrite`` is False.
        CkptError: If the checkpoint was not ingested from a Trainer folder.
        StorageError: If writing fails.
    """
    from safetensors.torch import save_file

    ck = store.get(ref)
    state = store.load(ck.id)
    if not isinstance(state, dict) or "hf" not in state or "model" not in state:
        raise CkptError(
            f"{ck.ref} was not ingested from a Hugging Face Trainer folder (no 'hf' and "
            "'model' entries); export plain weights with "
            "`ckpt convert REF --format hf --out DIR` instead"
        )
    parent = Path(output_dir)
    target = parent / f"{_PREFIX}-{ck.step}"
    if target.exists() and not overwrite:
        raise ConflictError(
            f"{target} exists; remove it or pass overwrite=True to replace it"
        )
    tmp = parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        save_file(_untie(state["model"]), str(tmp / _WEIGHTS), metadata={"format": "pt"})
        if "config" in state:
            _write_text(tmp / CONFIG_NAME, json.dumps(state["config"], indent=2, sort_keys=True))
        for name, key in _TORCH_FILES.items():
            if key in state:
                torch.save(state[key], tmp / name)
        for name, rng in (state.get("rng_state") or {}).items():
            if isinstance(rng, dict) and "python" in rng:
                # The Trainer's loader passes it to random.setstate, which wants the tuple.
                rng = {**rng, "python": python_rng_state(rng["python"])}
            torch.save(rng, tmp / _safe_name(name))
        if "trainer_state" in state:
            _write_text(tmp / _TRAINER_STATE,
                        json.dumps(state["trainer_state"], indent=2, sort_keys=True))
        for name, data in (state.get("files") or {}).items():
            (tmp / _safe_name(name)).write_bytes(data.numpy().tobytes())
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError as exc:
        raise StorageError(f"cannot write {target}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    store.catalog.record_event("converted", checkpoint_id=ck.id,
                               detail={"fmt": "hf-trainer", "path": str(target.absolute())})
    logger.info("wrote %s as %s", ck.ref, target)
    return str(target)


def _safe_name(name: str) -> str:
    if Path(name).name != name or name.startswith("."):
        raise UnsafeObjectError(f"refusing to write file name {name!r}: it leaves the folder")
    return name


def _write_text(path: Path, text: str) -> None:
    path.write_text(text + "\n", encoding="utf-8")


class CkptStoreCallback(TrainerCallback):
    """Ingests every ``checkpoint-N`` folder into the store when the Trainer saves it.

    The folder is read during ``on_save`` (the Trainer may rotate it away at its next save);
    with ``async_save`` the store write happens on one background thread, in save order.

    Attributes:
        store: The store.
        run: The run the checkpoints are saved as.
        saved: The committed checkpoints, in save order.
    """

    def __init__(
        self,
        store: CheckpointStore,
        run: str,
        *,
        archive: bool = False,
        async_save: bool = True,
        delete_folder: bool = False,
        tags: Sequence[str] = ("hf",),
        codec: str | None = None,
        experiment: str | None = None,
    ) -> None:
        """Create the callback.

        Args:
            store: An open store (the caller closes it).
            run: Run name.
            archive: Trigger the archive flow after each commit (``store.trigger``).
            async_save: Save in the background (the folder is read in ``on_save``).
            delete_folder: Delete the Trainer's folder once its checkpoint is committed (the
                store becomes the only copy; not with ``load_best_model_at_end``).
            tags: Tags of every checkpoint.
            codec: Codec preset (default: the store's).
            experiment: Experiment the run is filed under.

        Raises:
            InvalidNameError: For a bad run name or tag.
        """
        self.store = store
        self.run = store.run(run, **({"experiment": experiment} if experiment else {})).name
        self.archive = archive
        self.delete_folder = delete_folder
        self.saved: list[Checkpoint] = []
        self._options = SaveOptions(tags=tuple(tags), codec=codec)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hf") if async_save else None
        self._futures: list[Future[Checkpoint]] = []

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Read the folder just written and save it into the store."""
        if not state.is_world_process_zero:
            return
        step = int(state.global_step)
        folder = Path(args.output_dir or ".") / f"{_PREFIX}-{step}"
        if not folder.is_dir():
            logger.warning("the Trainer saved at step %s but %s does not exist; not ingested",
                           step, folder)
            return
        content = read_trainer_folder(folder)
        metrics = metrics_from_log_history(state.log_history, step)
        # The TrainingArguments are the run's config, recorded with its context.
        options = replace(self._options, metrics=metrics or None, config=args)
        if self._pool is None:
            self._save(folder, step, content, options)
        else:
            self._raise_failed()
            self._futures.append(self._pool.submit(self._save, folder, step, content, options))

    def _save(self, folder: Path, step: int, content: dict[str, Any],
              options: SaveOptions) -> Checkpoint:
        ck = save_checkpoint(self.store, self.run, step, content, options)
        self.store.catalog.record_event(
            "imported", checkpoint_id=ck.id,
            detail={"fmt": "hf-trainer", "path": str(folder.absolute())},
        )
        self.saved.append(ck)
        logger.info("ingested %s as %s", folder, ck.ref)
        if self.archive:
            try:
                self.store.trigger("archive", ck)
            except CkptError as exc:
                # e.g. no warm tier: say it once, in one line, rather than at every save.
                logger.warning("checkpoints of run %s are not archived: %s", ck.run, exc)
                self.archive = False
            except Exception:
                # The checkpoint is committed; a flow that cannot start must not fail the
                # ingest (archiving can still run later: `ckpt archive` or its schedule).
                logger.exception("could not trigger archiving of %s", ck.ref)
        if self.delete_folder:
            shutil.rmtree(folder, ignore_errors=True)
        return ck

    def _raise_failed(self) -> None:
        for future in [f for f in self._futures if f.done()]:
            self._futures.remove(future)
            future.result()  # re-raises a failed save, once

    def wait(self) -> list[Checkpoint]:
        """Wait for pending saves; return the checkpoints committed so far.

        Raises:
            CkptError: The first failed save not yet reported.
        """
        futures, self._futures = self._futures, []
        errors: list[BaseException] = []
        for future in futures:
            try:
                future.result()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return list(self.saved)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Wait until every checkpoint of the run is committed."""
        self.wait()

    def close(self) -> None:
        """Wait for pending saves and stop the background thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
