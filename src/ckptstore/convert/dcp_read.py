"""Read ``torch.distributed.checkpoint`` (DCP) folders without running pickled code.

Reading: stock DCP unpickles ``.metadata`` with plain ``pickle`` and non-tensor items with
``torch.load(weights_only=False)``, so a hostile folder runs code on load. Here ``.metadata``
goes through an unpickler that only builds DCP's own metadata records, torch dtypes/sizes
and paths, and non-tensor items are loaded with ``weights_only=True``. Tensor items already
use ``weights_only=True`` in torch.

Writing lives in :mod:`ckptstore.convert.dcp_write`.
"""

from __future__ import annotations

import importlib
import io
import itertools
import logging
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ckptstore.errors import CkptError, IntegrityError, StorageError, UnsafeObjectError

__all__ = [
    "DCP_METADATA_NAME",
    "SafeFileSystemReader",
    "is_dcp_dir",
    "read_dcp",
    "read_dcp_metadata",
    "unwrap_dcp_error",
]

logger = logging.getLogger(__name__)

DCP_METADATA_NAME = ".metadata"

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
    }
)
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


def is_dcp_dir(path: Path) -> bool:
    """Whether ``path`` is a DCP checkpoint folder (it holds ``.metadata``)."""
    return path.is_dir() and (path / DCP_METADATA_NAME).is_file()


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata records, torch dtypes/layouts/sizes and paths."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, _TORCH_VALUE_TYPES) or value is torch.Size:
                return value
        elif module == _METADATA_MODULE:
            value = getattr(importlib.import_module(module), name, None)
            if isinstance(value, type) and value.__module__ == module:
                return value
        elif (module, name) in _ALLOWED_GLOBALS:
            return getattr(importlib.import_module(module), name)
        raise UnsafeObjectError(
            f"DCP metadata wants to build {module}.{name}, which is not a DCP metadata type; "
            "refusing to unpickle it. Only import DCP folders written by torch.distributed."
            "checkpoint, and re-save suspicious ones from a trusted environment"
        )


def read_dcp_metadata(path: Path) -> Metadata:
    """Read a DCP folder's ``.metadata`` with the restricted unpickler.

    Raises:
        UnsafeObjectError: If the metadata references anything but DCP metadata types.
        IntegrityError: If it is not DCP metadata.
        StorageError: If it cannot be read.
    """
    meta_path = path / DCP_METADATA_NAME
    try:
        with meta_path.open("rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except CkptError:  # UnsafeObjectError is a TypeError: keep it from the branch below
        raise
    except OSError as exc:
        raise StorageError(f"cannot read {meta_path}: {exc.strerror}") from exc
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise IntegrityError(
            f"{meta_path} is not a readable DCP metadata file ({exc}); the folder is damaged"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise IntegrityError(
            f"{meta_path} holds a {type(metadata).__name__}, not DCP Metadata; the folder is "
            "damaged or not a DCP checkpoint"
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose ``.metadata`` is read with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata`` without executing pickled code."""
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor items with ``weights_only=True`` into a flat target dict."""

    def __init__(self, target: dict[str, Any]) -> None:
        super().__init__(flatten_state_dict=False)
        self._target = target

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeObjectError(
                f"DCP item {fqn!r} needs arbitrary unpickling, which ckptstore refuses: "
                f"{str(exc).splitlines()[0]}; store plain values (numbers, str, lists, dicts) "
                "in the checkpoint instead"
            ) from exc
        self._target[fqn] = obj


def read_dcp(path: Path) -> Any:
    """Load a whole DCP folder into a nested state, without a process group.

    The nesting is rebuilt from DCP's flatten mapping: string path parts become dict keys and
    integer parts list positions. DCP records every dict key as a string, so an int key such
    as an optimizer's ``state[0]`` comes back as ``"0"``.

    Args:
        path: The DCP folder.

    Returns:
        A dict of the checkpoint's top-level keys.

    Raises:
        UnsafeObjectError: If metadata or an item would need arbitrary unpickling.
        IntegrityError: If the folder is damaged.
        StorageError: If files cannot be read.
    """
    metadata = read_dcp_metadata(path)
    flat: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            flat[fqn] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        else:
            flat[fqn] = None  # placeholder: the value arrives through load_bytes
    # dcp.load writes its own copy of the top-level values back into `flat` when it
    # finishes, so non-tensor values are collected in a dict of their own.
    loaded: dict[str, Any] = {}
    try:
        dcp_load(
            flat,
            storage_reader=SafeFileSystemReader(str(path)),
            planner=_SafeLoadPlanner(loaded),
            no_dist=True,
        )
    except CkptError:
        raise
    except OSError as exc:
        raise StorageError(f"reading DCP folder {path} failed: {exc}") from exc
    except (CheckpointException, RuntimeError, ValueError) as exc:
        raise unwrap_dcp_error(exc, f"DCP folder {path} could not be loaded") from exc
    flat.update(loaded)
    mapping = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    root: dict[str, Any] = {}
    for fqn, value in flat.items():
        parts = mapping.get(fqn) or (fqn,)
        _set_path(root, tuple(parts), value)
    return root


def unwrap_dcp_error(exc: BaseException, what: str) -> CkptError:
    """DCP wraps failures in CheckpointException; surface the first inner error."""
    inner: BaseException = exc
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, Mapping):
        for failure in failures.values():
            candidate = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(candidate, BaseException):
                inner = candidate
                break
    if isinstance(inner, CkptError):
        return inner
    if isinstance(inner, OSError):
        return StorageError(f"{what}: {inner}")
    return IntegrityError(
        f"{what}: {type(inner).__name__}: {inner}; the folder may be damaged or not a DCP "
        "checkpoint"
    )


def _set_path(root: dict[str, Any], parts: Sequence[str | int], value: Any) -> None:
    node: Any = root
    for part, nxt in itertools.pairwise(parts):
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            assert isinstance(part, int)
            while len(node) <= part:
                node.append(None)
            if node[part] is None:
                node[part] = empty
            node = node[part]
        else:
            node = node.setdefault(part, empty)
    last = parts[-1]
    if isinstance(node, list):
        assert isinstance(last, int)
        while len(node) <= last:
            node.append(None)
        node[last] = value
    else:
        node[last] = value
