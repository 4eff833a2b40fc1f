"""Streaming writer for the safetensors format and the Hugging Face sharded-folder layout.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape, ``[begin, end)`` byte range of the data section, plus an optional
``__metadata__`` string map) padded with spaces, then the raw little-endian tensor bytes.
Because every shape and dtype is known before any data is read (from a manifest), the header
is written first and each tensor is then written at its own offset the moment it arrives, in
any order. Only one tensor is ever held in memory, which the ``safetensors`` library's
``save_file`` (it takes the whole dict) cannot offer.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from ckptstore.durable import fsync_fd
from ckptstore.errors import CkptError, IntegrityError, StorageError

__all__ = [
    "HF_INDEX_NAME",
    "HF_SINGLE_NAME",
    "SAFETENSORS_DTYPES",
    "SafetensorsFileWriter",
    "TensorSpec",
    "hf_index",
    "hf_name_map",
    "hf_shard_names",
    "plan_shards",
    "safetensors_dtype",
]

logger = logging.getLogger(__name__)

#: Torch dtype -> safetensors dtype string, limited to what ``safetensors.torch`` can load.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        SAFETENSORS_DTYPES[_dt] = _code

HF_SINGLE_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"

# Alignment of the data section, as the reference implementation pads its headers.
_ALIGN = 8
# Linux writes at most ~2 GiB per call; larger buffers go in slices.
_MAX_WRITE = 1 << 30


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, dtype and shape of one tensor to be written.

    Attributes:
        name: Tensor name in the file.
        dtype: Torch dtype.
        shape: Shape.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of the raw data in bytes."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def safetensors_dtype(dtype: torch.dtype, name: str) -> str:
    """Return the safetensors dtype code of ``dtype``.

    Raises:
        CkptError: If safetensors cannot represent it (complex128, complex32, float4, ...).
    """
    code = SAFETENSORS_DTYPES.get(dtype)
    if code is None:
        raise CkptError(
            f"tensor {name!r} has dtype {dtype}, which safetensors cannot store; export this "
            "checkpoint as 'pt' or 'dcp' instead, or select other keys"
        )
    return code


def plan_shards(specs: Sequence[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most ``shard_bytes`` of data.

    A tensor larger than ``shard_bytes`` gets a shard of its own (tensors are never split).

    Raises:
        ValueError: If ``shard_bytes`` is not positive.
    """
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def hf_shard_names(count: int) -> list[str]:
    """File names of ``count`` shards in the Hugging Face convention."""
    if count == 1:
        return [HF_SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def hf_name_map(keys: Sequence[str]) -> dict[str, str]:
    """Map ckptstore tensor keys to ``state_dict``-style weight names.

    Only the ``model`` subtree is kept when there is one, its prefix stripped
    (``model/encoder.weight`` → ``encoder.weight``); otherwise every key is kept with its
    parts joined by ``.`` (``net/0/weight`` → ``net.0.weight``). Escaped ``/`` and ``%``
    inside parts are restored.
    """
    under_model = [k for k in keys if k.startswith("model/")]
    chosen, skip = (under_model, 1) if under_model else (list(keys), 0)
    return {k: ".".join(_unescape(c) for c in k.split("/")[skip:]) for k in chosen}


def _unescape(component: str) -> str:
    return component.replace("%2F", "/").replace("%25", "%")


def hf_index(shards: Sequence[Sequence[TensorSpec]], names: Sequence[str]) -> dict[str, object]:
    """The ``model.safetensors.index.json`` document for a sharded folder."""
    weight_map = {spec.name: fname for shard, fname in zip(shards, names, strict=True)
                  for spec in shard}
    total = sum(spec.nbytes for shard in shards for spec in shard)
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


class SafetensorsFileWriter:
    """Write one safetensors file tensor by tensor, in any order.

    Lifecycle: construct (creates the file exclusively, writes the header and sizes the file)
    → :meth:`write` once per spec → :meth:`close` (checks completeness, fsyncs). On error call
    :meth:`abort` (or leave the ``with`` block by an exception); the caller removes the file.

    Args:
        path: File to create; must not exist.
        specs: Every tensor the file will hold, in data order.
        metadata: The ``__metadata__`` string map (e.g. ``{"format": "pt"}``).

    Raises:
        CkptError: If a dtype has no safetensors equivalent or names repeat.
        StorageError: If the file cannot be created or written.
    """

    def __init__(
        self,
        path: Path,
        specs: Sequence[TensorSpec],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.path = path
        self._slots: dict[str, tuple[TensorSpec, int]] = {}
        self._written: set[str] = set()
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for spec in specs:
            if spec.name in self._slots or spec.name == "__metadata__":
                raise CkptError(
                    f"tensor name {spec.name!r} appears twice (or is reserved) in {path.name}; "
                    "rename the key before exporting"
                )
            header[spec.name] = {
                "dtype": safetensors_dtype(spec.dtype, spec.name),
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            self._slots[spec.name] = (spec, offset)
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % _ALIGN)
        self._data_start = 8 + len(raw)
        self._size = self._data_start + offset
        try:
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise StorageError(
                f"cannot create {path}: {exc.strerror}; check the directory"
            ) from exc
        try:
            self._pwrite(len(raw).to_bytes(8, "little") + raw, 0)
            # Size the file now so a short write anywhere shows up as a hole, not a truncation.
            os.ftruncate(self._fd, self._size)
        except BaseException:
            self.abort()
            raise

    @property
    def nbytes(self) -> int:
        """Final size of the file."""
        return self._size

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write the data of tensor ``name``; return the number of data bytes written.

        Raises:
            IntegrityError: If ``name`` is unknown, already written, or its dtype/shape differ
                from the spec.
            StorageError: If the write fails.
        """
        slot = self._slots.get(name)
        if slot is None or name in self._written:
            raise IntegrityError(
                f"tensor {name!r} is not expected in {self.path.name} (unknown or written twice)"
            )
        spec, offset = slot
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise IntegrityError(
                f"tensor {name!r} is {tensor.dtype}{tuple(tensor.shape)} but the manifest says "
                f"{spec.dtype}{spec.shape}; verify the checkpoint (`ckpt verify`)"
            )
        if spec.nbytes:
            self._pwrite(_tensor_bytes(tensor), self._data_start + offset)
        self._written.add(name)
        return spec.nbytes

    def close(self) -> None:
        """Check that every tensor was written, fsync and close the file.

        Raises:
            IntegrityError: If some tensors were never written.
            StorageError: If fsync fails.
        """
        missing = [n for n in self._slots if n not in self._written]
        if missing:
            self.abort()
            raise IntegrityError(
                f"{len(missing)} tensors were never produced for {self.path.name} "
                f"(first: {missing[0]!r}); the checkpoint may be damaged: run `ckpt verify`"
            )
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            fsync_fd(fd, self.path)
        finally:
            os.close(fd)

    def abort(self) -> None:
        """Close the file without checks (the caller deletes it)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> SafetensorsFileWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _pwrite(self, data: memoryview | bytes, offset: int) -> None:
        if self._fd is None:
            raise StorageError(f"{self.path} is already closed; this is a bug in the caller")
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd, view[done : done + _MAX_WRITE], offset + done)
        except OSError as exc:
            raise StorageError(
                f"writing {self.path} failed: {exc.strerror}; check free space and permissions"
            ) from exc


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a tensor, without a copy when it is already contiguous."""
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise CkptError("exporting safetensors needs a little-endian machine")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    # A uint8 view keeps every dtype (bf16, float8, bool) out of numpy's dtype table.
    return flat.view(torch.uint8).numpy().data
