"""Read plain PyTorch checkpoints safely: ``.pt``/``.bin``, safetensors, Hugging Face and DCP.

Nothing here executes pickled code: ``.pt``/``.bin`` files are loaded with
``torch.load(weights_only=True)`` passed explicitly, which torch honours even when
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` is set; safetensors files hold no pickle at all; DCP
folders go through :mod:`ckptstore.convert.dcp_read`.
"""

from __future__ import annotations

import json
import logging
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptstore.convert.dcp_read import is_dcp_dir, read_dcp
from ckptstore.convert.safetensors import HF_INDEX_NAME
from ckptstore.errors import (
    IntegrityError,
    InvalidNameError,
    StorageError,
    UnsafeObjectError,
    UsageError,
)
from ckptstore.extras import require
from ckptstore.format.flatten import unflatten_state
from ckptstore.format.tree import validate_tree

__all__ = [
    "CONFIG_NAME",
    "FORMATS",
    "METADATA_KEY",
    "PT_SUFFIXES",
    "Source",
    "detect_format",
    "is_hf_dir",
    "load_pt",
    "read_hf",
    "read_safetensors",
    "read_source",
]

logger = logging.getLogger(__name__)

#: Formats understood by export, import and directory conversion.
FORMATS = ("pt", "safetensors", "hf", "dcp")
PT_SUFFIXES = (".pt", ".pth", ".bin")
#: ``__metadata__`` key holding ckptstore's JSON skeleton of the full state.
METADATA_KEY = "ckptstore"
CONFIG_NAME = "config.json"
_HF_INDEXES = (HF_INDEX_NAME, "pytorch_model.bin.index.json")
_MAX_CONFIG_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Source:
    """What an input file or folder holds.

    Attributes:
        state: The state, tensors on CPU.
        fmt: The format it was read as.
        config: A Hugging Face ``config.json`` found next to the weights, else None.
    """

    state: Any
    fmt: str
    config: dict[str, Any] | None = None


def detect_format(path: Path) -> str:
    """Guess the format of ``path`` from its name and contents.

    ``.pt``/``.pth``/``.bin`` → ``pt``; ``.safetensors`` → ``safetensors``; a folder with
    ``.metadata`` → ``dcp``; a folder with ``*.safetensors``, ``pytorch_model*.bin`` or a
    weight index → ``hf``.

    Raises:
        InvalidNameError: If the path matches none of them.
        StorageError: If it does not exist.
    """
    if not path.exists():
        raise StorageError(f"{path} does not exist; check the path")
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in PT_SUFFIXES:
            return "pt"
        if suffix == ".safetensors":
            return "safetensors"
    elif is_dcp_dir(path):
        return "dcp"
    elif is_hf_dir(path):
        return "hf"
    raise InvalidNameError(
        f"cannot tell the format of {path}: expected a .pt/.pth/.bin or .safetensors file, a "
        "DCP folder (with .metadata) or a folder of .safetensors files; pass the format "
        "explicitly (fmt= / --format)"
    )


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face style weights folder."""
    if not path.is_dir():
        return False
    if any((path / index).is_file() for index in _HF_INDEXES):
        return True
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def load_pt(path: Path) -> Any:
    """Load a ``torch.save`` file without unpickling arbitrary objects.

    Zip-format files are memory-mapped, so the tensors stay file-backed until used.

    Raises:
        UnsafeObjectError: If the file needs classes outside torch's weights-only allowlist
            (this is also how a malicious pickle is refused: nothing of it runs).
        IntegrityError: If the file is not a readable torch file.
        StorageError: If it cannot be read.
    """
    mmap = zipfile.is_zipfile(path)
    try:
        # weights_only=True passed explicitly: torch then ignores
        # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD, which only overrides an unset argument.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise UnsafeObjectError(
            f"refusing to load {path}: it needs arbitrary unpickling, which ckptstore never "
            f"does ({_unpickling_reason(exc)}). "
            "Re-save it from a trusted environment with only tensors and plain containers, "
            "e.g. torch.save(model.state_dict(), path)"
        ) from exc
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc}") from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise IntegrityError(
            f"{path} is not a readable PyTorch file ({exc}); check that it is complete"
        ) from exc


def _unpickling_reason(exc: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only error that names the refused global."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "global" in line:
            return line
    return lines[0] if lines else "weights-only load failed"


def _safe_open(path: Path) -> Any:
    safe_open = require("safetensors", "reading safetensors files").safe_open
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc}") from exc
    except Exception as exc:  # safetensors raises its own SafetensorError for bad headers
        raise IntegrityError(f"{path} is not a valid safetensors file: {exc}") from exc


def read_safetensors(path: Path) -> Any:
    """Read a safetensors file (tensor by tensor, without buffering the whole file).

    A file exported by ckptstore carries the state's skeleton in ``__metadata__`` and comes
    back as the original nested state; any other file comes back as a flat
    ``{name: tensor}`` dict.

    Raises:
        IntegrityError: If the file or its embedded skeleton is malformed.
        StorageError: If it cannot be read.
    """
    with _safe_open(path) as handle:
        tensors = {name: handle.get_tensor(name) for name in _data_order(handle)}
        metadata = handle.metadata() or {}
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return tensors
    try:
        doc = json.loads(raw)
        tree = doc["tree"]
        validate_tree(tree, {k: str(t.dtype).removeprefix("torch.") for k, t in tensors.items()})
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(
            f"{path}: the embedded ckptstore skeleton is malformed ({exc}); the file was "
            "altered after export"
        ) from exc
    return unflatten_state(tree, tensors)


def read_hf(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Read a Hugging Face style folder: every weight shard plus ``config.json``.

    Shards are ``*.safetensors`` (preferred) or ``pytorch_model*.bin`` (loaded weights-only),
    listed by their index when there is one.

    Returns:
        The weights (flat ``{name: tensor}``, in shard order) and the config, or None.

    Raises:
        IntegrityError: If the index names files outside the folder or a tensor twice.
        UnsafeObjectError: If a ``.bin`` shard needs arbitrary unpickling.
        StorageError: If a file cannot be read.
    """
    index = next((path / i for i in _HF_INDEXES if (path / i).is_file()), None)
    if index is not None:
        doc = _read_json(index)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise IntegrityError(f"{index} has no weight_map; the folder is damaged")
        # Shard names sort in shard order (model-00001-of-...), which is the model's order.
        files = sorted(set(weight_map.values()), key=str)
        for name in files:
            if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
                raise IntegrityError(
                    f"{index} points at {name!r}, outside the model folder; refusing to read it"
                )
    else:
        files = sorted(p.name for p in path.glob("*.safetensors")) or sorted(
            p.name for p in path.glob("pytorch_model*.bin")
        )
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        shard = path / name
        part = _flat_safetensors(shard) if shard.suffix == ".safetensors" else load_pt(shard)
        if not isinstance(part, dict):
            raise IntegrityError(f"{shard} does not hold a dict of tensors")
        for key, tensor in part.items():
            if key in weights:
                raise IntegrityError(f"tensor {key!r} appears in two shards of {path}")
            weights[key] = tensor
    config_path = path / CONFIG_NAME
    config = _read_json(config_path) if config_path.is_file() else None
    if config is not None and not isinstance(config, dict):
        raise IntegrityError(f"{config_path} is not a JSON object")
    return weights, config


def _flat_safetensors(path: Path) -> dict[str, torch.Tensor]:
    with _safe_open(path) as handle:
        return {name: handle.get_tensor(name) for name in _data_order(handle)}


def _data_order(handle: Any) -> list[str]:
    """Tensor names in file order (``keys()`` is sorted by name), where supported."""
    offset_keys = getattr(handle, "offset_keys", None)
    return list(offset_keys() if callable(offset_keys) else handle.keys())


def _read_json(path: Path) -> Any:
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise IntegrityError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes")
        return json.loads(path.read_bytes())
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise IntegrityError(f"{path} is not valid JSON: {exc}") from exc


def read_source(path: Path, fmt: str | None = None) -> Source:
    """Read any supported input; ``fmt`` None means :func:`detect_format`.

    A Hugging Face folder (or a single file read as ``hf``) comes back as its flat
    ``{name: tensor}`` weights, with its ``config.json`` in :attr:`Source.config`.

    Raises:
        InvalidNameError: For an unknown ``fmt``.
        UnsafeObjectError, IntegrityError, StorageError: From the readers.
    """
    fmt = fmt or detect_format(path)
    if fmt == "pt":
        return Source(load_pt(path), fmt)
    if fmt == "safetensors":
        if path.is_dir():
            fmt = "hf"
        else:
            return Source(read_safetensors(path), fmt)
    if fmt == "hf":
        if not path.is_dir():
            return Source(_flat_safetensors(path), fmt)
        weights, config = read_hf(path)
        return Source(weights, fmt, config)
    if fmt == "dcp":
        if not is_dcp_dir(path):
            raise StorageError(f"{path} is not a DCP folder (no .metadata inside)")
        return Source(read_dcp(path), fmt)
    raise UsageError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
