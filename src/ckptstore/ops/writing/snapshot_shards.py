"""Sharded (DTensor) states in snapshots: what slice of each global tensor a rank holds, and
which old ranks' slices a rank of another world size needs at a restart.

A snapshot holds a rank's *local* shard of each DTensor (its bytes are what the slot holds);
its meta records, per DTensor key, the global shape and the shard's offsets and sizes
(:class:`ShardSpec`, from ``DTensor.__create_chunk_list__()``, the call DCP's planner uses
for the same purpose), and the world size the snapshot was written in. At a restart at
another world size each rank computes which old ranks' shards overlap the rows it now owns
(:func:`chunk_rows`, :func:`row_overlaps`: pure) and copies those rows into its shard
(``CheckpointManager.restore_latest``, docs/SNAPSHOTS.md "Sharded states").

Supported: DTensors on a 1-D device mesh with the placement ``Shard(0)`` (what FSDP2 makes of
every parameter and its optimizer state). Anything else (a 2-D mesh, ``Shard(d)`` with
``d > 0``, ``Replicate``, ``Partial``, a 0-dim tensor) is refused with
:class:`~ckptstore.errors.ConfigError`: its bytes would be snapshotted without a correct
record of where they belong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.errors import ConfigError, IntegrityError
from ckptstore.format import FlatState, flatten_state
from ckptstore.format.keys import render_path

__all__ = [
    "ShardSpec",
    "chunk_rows",
    "dtensor_spec",
    "dtensor_templates",
    "flatten_sharded",
    "is_dtensor",
    "row_overlaps",
    "specs_from_meta",
]


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's local shard sits in its global tensor.

    Attributes:
        global_shape: The global tensor's shape.
        offsets: The shard's first index along every dimension.
        sizes: The shard's shape (the local tensor's).
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def to_json(self) -> dict[str, list[int]]:
        """The form recorded in a snapshot's meta."""
        return {"global": list(self.global_shape), "offsets": list(self.offsets),
                "sizes": list(self.sizes)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ShardSpec:
        """Parse :meth:`to_json`'s form.

        Raises:
            IntegrityError: If it is malformed.
        """
        try:
            return cls(tuple(int(x) for x in raw["global"]),
                       tuple(int(x) for x in raw["offsets"]),
                       tuple(int(x) for x in raw["sizes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"malformed shard record in a snapshot: {raw!r}") from exc


def chunk_rows(dim0: int, parts: int) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each of ``parts`` shards of ``dim0`` rows, as ``Shard(0)``
    splits them (like ``torch.chunk``: shards of ``ceil(dim0 / parts)`` rows, the last ones
    smaller or empty; an empty shard starts at ``dim0``, as DTensor reports it).

    Raises:
        ValueError: For ``parts < 1`` or ``dim0 < 0``.
    """
    if parts < 1 or dim0 < 0:
        raise ValueError(f"cannot split {dim0} rows into {parts} shards")
    size = -(-dim0 // parts)
    out = []
    for index in range(parts):
        start = min(index * size, dim0)
        out.append((start, max(0, min(size, dim0 - start))))
    return out


def row_overlaps(old: Sequence[tuple[int, int]], start: int,
                 rows: int) -> list[tuple[int, int, int, int]]:
    """Which old shards hold rows ``[start, start + rows)`` of a tensor, and where.

    Args:
        old: ``(first row, rows)`` of every old rank's shard, in old rank order.
        start: The first global row of the new shard.
        rows: Its number of rows.

    Returns:
        ``(old rank, row in the old shard, row in the new shard, rows)`` for every
        non-empty overlap, in old rank order; together they cover the new shard exactly
        when the old shards cover the tensor.
    """
    out = []
    for index, (old_start, old_rows) in enumerate(old):
        lo, hi = max(start, old_start), min(start + rows, old_start + old_rows)
        if hi > lo:
            out.append((index, lo - old_start, lo - start, hi - lo))
    return out


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a DTensor (without importing torch.distributed when unavailable)."""
    if not isinstance(obj, torch.Tensor) or type(obj) in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed has no DTensors
        return False
    return isinstance(obj, DTensor)


def dtensor_spec(tensor: Any, where: str = "") -> ShardSpec:
    """The :class:`ShardSpec` of a DTensor sharded ``Shard(0)`` over a 1-D mesh.

    Args:
        tensor: The DTensor.
        where: Its key path, for messages.

    Raises:
        ConfigError: For any other layout (not built: it would be restored wrongly).
    """
    from torch.distributed.tensor import Shard

    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    if mesh.ndim != 1 or placements != (Shard(0),) or tensor.dim() == 0:
        raise ConfigError(
            f"DTensor at {render_path(where) if where else '?'} has placements {placements} "
            f"on a {mesh.ndim}-D mesh: snapshots reshard only DTensors sharded Shard(0) over "
            "a 1-D device mesh (as FSDP2 shards them); give the snapshot a full or local "
            "tensor there (e.g. .full_tensor()) or use the DCP layout (docs/SNAPSHOTS.md)")
    chunks = tensor.__create_chunk_list__()
    if len(chunks) != 1:  # one chunk per rank for a 1-D Shard(0) layout
        raise ConfigError(f"DTensor at {where!r} reports {len(chunks)} local chunks, not 1")
    return ShardSpec(tuple(int(d) for d in tensor.shape),
                     tuple(int(d) for d in chunks[0].offsets),
                     tuple(int(d) for d in chunks[0].sizes))


def flatten_sharded(state: Any) -> tuple[FlatState, dict[str, ShardSpec]]:
    """Flatten ``state`` with every DTensor replaced by its local shard.

    Returns:
        The flat state (the local shards as its tensors) and, per tensor key that was a
        DTensor, its :class:`ShardSpec`. No DTensor: an empty dict.

    Raises:
        ConfigError: For a DTensor of a layout that is not supported (:func:`dtensor_spec`).
        UnsafeObjectError: As :func:`~ckptstore.format.flatten_state`.
    """
    flat, found = _flatten_local(state)
    return flat, {key: spec for key, (_dt, spec) in found.items()}


def dtensor_templates(state: Any) -> dict[str, tuple[Any, ShardSpec]]:
    """Every DTensor of ``state`` by its tensor key, with its :class:`ShardSpec` (the live
    shards a resharding restart fills in place).

    Raises:
        ConfigError: For a DTensor of a layout that is not supported.
        UnsafeObjectError: As :func:`~ckptstore.format.flatten_state`.
    """
    return _flatten_local(state)[1]


def _flatten_local(state: Any) -> tuple[FlatState, dict[str, tuple[Any, ShardSpec]]]:
    """One walk of ``state``: every DTensor stored as its local shard, and found by its key."""
    found: dict[str, tuple[Any, ShardSpec]] = {}

    def local(tensor: torch.Tensor, key: str) -> torch.Tensor:
        if not is_dtensor(tensor):
            return tensor  # refused by the flattener, as any other subclass
        found[key] = (tensor, dtensor_spec(tensor, key))
        # detach(): the flattener copies bytes only; the local tensor shares the shard's memory.
        return tensor.to_local().detach()  # type: ignore[attr-defined,no-any-return]

    flat = flatten_state(state, subclass=local)
    # A DTensor met twice (tied) is stored once, under its first key.
    return flat, {key: found[key] for key in flat.tensors if key in found}


def specs_from_meta(info: Mapping[str, Any]) -> dict[str, ShardSpec]:
    """The shard records of a snapshot's meta (empty for a snapshot of no DTensor).

    Raises:
        IntegrityError: If they are malformed.
    """
    raw = info.get("shards") or {}
    if not isinstance(raw, dict):
        raise IntegrityError("malformed shard records in a snapshot's meta")
    return {str(k): ShardSpec.from_json(v) for k, v in raw.items()}
