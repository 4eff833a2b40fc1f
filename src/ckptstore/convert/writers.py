"""Write plain PyTorch checkpoints atomically: ``torch.save`` files, safetensors, HF folders.

Every writer produces its output under a temporary name next to the destination
(:func:`staged_output`) and renames it into place, so a crash never leaves a half-written
file under the final name. The safetensors writers take ``(name, tensor)`` pairs one at a
time and never hold more than the current tensor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ckptstore.convert.heap import trim_heap
from ckptstore.convert.readers import CONFIG_NAME
from ckptstore.convert.safetensors import (
    HF_INDEX_NAME,
    SafetensorsFileWriter,
    TensorSpec,
    hf_index,
    hf_shard_names,
    plan_shards,
)
from ckptstore.durable import fsync_dir, fsync_fd, write_new_file
from ckptstore.errors import CkptError, ConflictError, StorageError

__all__ = ["staged_output", "write_hf", "write_pt", "write_safetensors"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def staged_output(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary path next to ``out``; rename it to ``out`` when the block succeeds.

    The temporary path does not exist yet: the block creates a file or a folder there. On
    failure it is removed and ``out`` is untouched.

    Raises:
        ConflictError: If ``out`` exists and ``overwrite`` is False.
        StorageError: If the rename fails.
    """
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ConflictError(
            f"{out} already exists; pass overwrite=True (--overwrite) or choose another path"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create {out.parent}: {exc.strerror}") from exc
    tag = uuid.uuid4().hex[:8]
    tmp = out.parent / f".{out.name}.tmp-{tag}"
    try:
        yield tmp
        _replace(tmp, out, out.parent / f".{out.name}.old-{tag}")
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(out.parent)


def _replace(tmp: Path, out: Path, old: Path) -> None:
    try:
        if out.is_dir() and not out.is_symlink():
            # rename() cannot replace a non-empty folder: move the old one aside first.
            out.rename(old)
            try:
                tmp.rename(out)
            except OSError:
                old.rename(out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as exc:
        raise StorageError(f"cannot move the output into place at {out}: {exc.strerror}") from exc


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def write_pt(state: Any, path: Path) -> None:
    """``torch.save`` ``state`` to ``path`` and fsync it.

    Raises:
        StorageError: If writing fails.
    """
    try:
        with path.open("xb") as fh:
            torch.save(state, fh)
            fh.flush()
            fsync_fd(fh.fileno(), path)
    except StorageError:
        raise
    except OSError as exc:
        raise StorageError(f"writing {path} failed: {exc}; check free space") from exc


def write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    items: Iterable[tuple[str, torch.Tensor]],
    *,
    metadata: Mapping[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write one safetensors file, tensor by tensor, from ``(name, tensor)`` pairs.

    Pairs whose name is not in ``specs`` are skipped (callers filter by keys that way).

    Returns:
        The file size in bytes.
    """
    with SafetensorsFileWriter(path, specs, metadata) as writer:
        wanted = {spec.name for spec in specs}
        for name, tensor in items:
            written = writer.write(name, tensor) if name in wanted else 0
            # Drop the reference before the reader allocates the next tensor.
            del tensor
            trim_heap(written)
            if progress is not None and written:
                progress(written)
        return writer.nbytes


def write_hf(
    folder: Path,
    specs: Sequence[TensorSpec],
    items: Iterable[tuple[str, torch.Tensor]],
    *,
    shard_bytes: int,
    config: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write a Hugging Face style folder: shards (+ index when sharded) and ``config.json``.

    Every shard is open at once and each tensor is written into its shard as it arrives.

    Returns:
        The files written.

    Raises:
        CkptError: If a dtype is not representable or names collide.
        StorageError: If writing fails.
    """
    shards = plan_shards(specs, shard_bytes)
    names = hf_shard_names(len(shards))
    try:
        folder.mkdir()
    except OSError as exc:
        raise StorageError(f"cannot create {folder}: {exc.strerror}") from exc
    where = {spec.name: i for i, shard in enumerate(shards) for spec in shard}
    with contextlib.ExitStack() as stack:
        writers = [
            stack.enter_context(
                SafetensorsFileWriter(folder / name, shard, metadata={"format": "pt"})
            )
            for shard, name in zip(shards, names, strict=True)
        ]
        for name, tensor in items:
            shard_no = where.get(name)
            written = writers[shard_no].write(name, tensor) if shard_no is not None else 0
            # Drop the reference before the reader allocates the next tensor.
            del tensor
            trim_heap(written)
            if progress is not None and written:
                progress(written)
    files = [folder / name for name in names]
    if len(shards) > 1:
        files.append(_write_json(folder / HF_INDEX_NAME, hf_index(shards, names)))
    if config is not None:
        files.append(_write_json(folder / CONFIG_NAME, dict(config)))
    return files


def _write_json(path: Path, doc: Any) -> Path:
    try:
        text = json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise CkptError(f"cannot write {path.name}: the value is not plain JSON ({exc})") from exc
    write_new_file(path, text.encode("utf-8"))
    return path
