"""Convert plain checkpoint files without a store: ``ckpt convert --input-dir D --output-dir O``.

Each source (a ``.pt``/``.pth``/``.bin`` or ``.safetensors`` file, a DCP folder, a Hugging
Face folder) is read whole with the safe readers of :mod:`ckptstore.convert.readers`,
then written as ``pt``, safetensors (with the state's skeleton, so nesting survives) or an
hf folder. Unlike a store export this holds one source's state in memory at a time
(``.pt`` inputs are memory-mapped).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptstore.convert.dcp_read import is_dcp_dir
from ckptstore.convert.readers import (
    FORMATS,
    METADATA_KEY,
    PT_SUFFIXES,
    is_hf_dir,
    read_source,
)
from ckptstore.convert.safetensors import HF_INDEX_NAME, TensorSpec, hf_name_map
from ckptstore.convert.writers import staged_output, write_hf, write_pt, write_safetensors
from ckptstore.errors import InvalidNameError, UsageError
from ckptstore.format.flatten import flatten_state

__all__ = ["DIRECTORY_FORMATS", "check_format", "convert_directory"]

logger = logging.getLogger(__name__)

#: Output formats of :func:`convert_directory` (``pytorch`` is an alias of ``pt``).
DIRECTORY_FORMATS = ("pytorch", "pt", "safetensors", "hf")
_DEFAULT_SHARD_BYTES = 5 * 2**30
_SUFFIX = {"pt": ".pt", "safetensors": ".safetensors", "hf": ""}
_INDEXES = (HF_INDEX_NAME, "pytorch_model.bin.index.json")


def check_format(fmt: str, allowed: Sequence[str] = FORMATS) -> str:
    """Normalise a format name (``pytorch`` → ``pt``).

    Raises:
        InvalidNameError: If it is not one of ``allowed``.
    """
    name = "pt" if fmt == "pytorch" else fmt
    if name not in allowed:
        raise UsageError(f"unknown format {fmt!r}; use one of {', '.join(allowed)}")
    return name


def convert_directory(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    fmt: str,
    *,
    overwrite: bool = False,
    shard_bytes: int = _DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Convert plain checkpoint files without a store (``ckpt convert --input-dir ...``).

    Sources: ``input_dir`` itself when it is a DCP or Hugging Face folder; otherwise every
    ``.pt``/``.pth``/``.bin``/``.safetensors`` file in it and every DCP or Hugging Face
    sub-folder. Each source becomes ``output_dir/<source name>.pt``,
    ``output_dir/<source name>.safetensors`` or the folder ``output_dir/<source name>/``
    (``hf``).

    Args:
        input_dir: Folder to convert.
        output_dir: Folder for the outputs (created).
        fmt: ``pytorch`` (or ``pt``), ``safetensors`` or ``hf``.
        overwrite: Replace existing outputs.
        shard_bytes: Largest shard for ``hf``.

    Returns:
        The outputs written, in source order.

    Raises:
        InvalidNameError: For an unknown format, or when nothing convertible is found.
        ConflictError: If an output exists and ``overwrite`` is False.
        UnsafeObjectError: If an input needs arbitrary unpickling.
    """
    target = check_format(fmt, DIRECTORY_FORMATS)
    src_dir, dst_dir = Path(input_dir), Path(output_dir)
    sources = _directory_sources(src_dir)
    if not sources:
        raise InvalidNameError(
            f"{src_dir} holds no .pt/.pth/.bin/.safetensors files, DCP folders or Hugging "
            "Face folders; point --input-dir at one of those"
        )
    outputs = []
    for source_path in sources:
        name = source_path.stem if source_path.is_file() else source_path.name
        out = dst_dir / f"{name}{_SUFFIX[target]}"
        source = read_source(source_path)
        _write_state(source.state, target, out, overwrite, shard_bytes, source.config)
        logger.info("converted %s -> %s", source_path, out)
        outputs.append(out)
    return outputs


def _directory_sources(src_dir: Path) -> list[Path]:
    # A folder holding one sharded model is one source, not one per shard.
    if is_dcp_dir(src_dir) or any((src_dir / i).is_file() for i in _INDEXES):
        return [src_dir]
    if not src_dir.is_dir():
        raise InvalidNameError(f"{src_dir} is not a folder; pass a folder to --input-dir")
    found = []
    for child in sorted(src_dir.iterdir()):
        if child.name.startswith("."):
            continue
        is_file = child.is_file() and child.suffix.lower() in (*PT_SUFFIXES, ".safetensors")
        if is_file or is_dcp_dir(child) or is_hf_dir(child):
            found.append(child)
    return found


def _write_state(
    state: Any,
    fmt: str,
    out: Path,
    overwrite: bool,
    shard_bytes: int,
    config: dict[str, Any] | None,
) -> None:
    """Write an in-memory state as pt, safetensors (with skeleton) or hf."""
    with staged_output(out, overwrite=overwrite) as tmp:
        if fmt == "pt":
            write_pt(state, tmp)
            return
        flat = flatten_state(state)
        if fmt == "safetensors":
            doc = {"version": 1, "tree": flat.tree}
            specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in flat.tensors.items()]
            write_safetensors(
                tmp,
                specs,
                flat.tensors.items(),
                metadata={"format": "pt", METADATA_KEY: json.dumps(doc)},
            )
            return
        names = hf_name_map(list(flat.tensors))
        specs = [
            TensorSpec(names[k], flat.tensors[k].dtype, tuple(flat.tensors[k].shape))
            for k in names
        ]
        write_hf(
            tmp,
            specs,
            ((names[k], flat.tensors[k]) for k in names),
            shard_bytes=shard_bytes,
            config=config,
        )
