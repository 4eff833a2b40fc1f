"""Reading a DCP checkpoint without a process group: full loads.

:func:`load_full` returns full (unsharded) CPU tensors, nested as DCP's flatten mapping
says (the index and the file checks: :mod:`ckptstore.format.dcp.verify`). Chunk reads go through
:mod:`ckptstore.format.dcp.chunks` (verified), box geometry through
:mod:`ckptstore.format.dcp.boxes`.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ckptstore.errors import InvalidNameError, UnsafeObjectError
from ckptstore.format.dcp.boxes import dtype_of, stored_boxes
from ckptstore.format.dcp.chunks import ChunkSource, load_blob
from ckptstore.format.dcp.layout import DcpIndex
from ckptstore.format.dcp.requests import Request, run_requests
from ckptstore.format.dcp.verify import index_of
from ckptstore.format.keys import escape_component, key_matches
from ckptstore.format.manifest import Manifest

__all__ = ["load_full"]

logger = logging.getLogger(__name__)


def _key_of(index: DcpIndex, fqn: str) -> str:
    parts = (index.planner_data or {}).get(fqn)
    if not parts:
        return escape_component(fqn)
    return "/".join(escape_component(p) for p in parts)


def _set_path(root: dict[str, Any], parts: Sequence[str | int], value: Any) -> None:
    node: Any = root
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        nxt = None if last else parts[depth + 1]
        if isinstance(node, list):
            assert isinstance(part, int)
            while len(node) <= part:
                node.append(None)
            if last:
                node[part] = value
            else:
                if node[part] is None:
                    node[part] = [] if isinstance(nxt, int) else {}
                node = node[part]
        else:
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, [] if isinstance(nxt, int) else {})


def _safe_load(fqn: str, data: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeObjectError(
            f"non-tensor item {fqn!r} needs arbitrary unpickling, which ckptstore refuses "
            f"when loading without a DCP planner: {str(exc).splitlines()[0]}; load it with "
            "dcp.load and a planner you trust, or save plain values (numbers, str, lists, dicts)"
        ) from exc


def load_full(
    directory: Path,
    manifest: Manifest,
    *,
    keys: Sequence[str] | None = None,
    threads: int = 2,
    source: ChunkSource | None = None,
) -> dict[str, Any]:
    """Load a DCP checkpoint into full (unsharded) CPU tensors, without a process group.

    The nesting comes back from DCP's flatten mapping: dict keys as strings (DCP records
    every dict key as a string, so an optimizer's ``state[0]`` becomes ``"0"``), list
    positions as lists. Non-tensor items are read with ``torch.load(weights_only=True)``,
    never with arbitrary unpickling.

    Args:
        directory: The checkpoint directory.
        manifest: Its verified manifest.
        keys: fnmatch patterns over ``/``-joined key paths (``"model/*"``) or DCP fqns
            (``"model.layer.weight"``); only matching items are read.
        threads: Reader threads.
        source: Where the chunks come from (default: ``directory``); a checkpoint saved
            across hosts reads each host's part from wherever a copy of it is.

    Returns:
        The nested state (a flat ``{fqn: value}`` dict if DCP recorded no mapping).

    Raises:
        IntegrityError: On a damaged or missing chunk.
        InvalidNameError: If a key pattern matches nothing.
        UnsafeObjectError: If a non-tensor item would need arbitrary unpickling.
    """
    index = index_of(manifest)
    if source is None:
        source = ChunkSource(directory, manifest.id, index)
    names = list(index.tensors) + list(index.blobs)
    if keys is not None:
        patterns = [keys] if isinstance(keys, str) else list(keys)
        chosen = [
            f for f in names if key_matches(_key_of(index, f), patterns) or key_matches(f, patterns)
        ]
        missing = [
            p for p in patterns
            if not any(key_matches(_key_of(index, f), [p]) or key_matches(f, [p]) for f in names)
        ]
        if missing:
            some = ", ".join(_key_of(index, f) for f in names[:8])
            raise InvalidNameError(
                f"key patterns {missing} match nothing in checkpoint {manifest.id}; "
                f"keys look like: {some or '(none)'}"
            )
        names = chosen
    boxes = stored_boxes(index)
    values: dict[str, Any] = {}
    requests: list[Request] = []
    for fqn in names:
        item = index.tensors.get(fqn)
        if item is None:
            continue
        out = torch.empty(item.shape, dtype=dtype_of(item.dtype))
        values[fqn] = out
        for box in boxes[fqn]:
            view = out[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]
            requests.append(Request(box, tuple(0 for _ in box.sizes), box.sizes, view))
    run_requests(source, requests, threads)
    for fqn in names:
        blob = index.blobs.get(fqn)
        if blob is not None:
            values[fqn] = _safe_load(fqn, load_blob(source, blob))
    if index.planner_data is None:
        return values
    root: dict[str, Any] = {}
    for fqn in sorted(values, key=lambda f: _key_of(index, f)):
        _set_path(root, index.planner_data.get(fqn) or (fqn,), values[fqn])
    return root
