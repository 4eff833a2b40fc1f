"""Sharded (DTensor) states in snapshots: what box of each global tensor a rank holds, and
which old ranks' boxes a rank of another world size needs at a restart.

A snapshot holds a rank's *local* shard of each DTensor (its bytes are what the slot holds);
its meta records, per DTensor key, the global shape, the shard's offsets and sizes, and the
layout they come from: the device mesh's shape, the rank at each of its positions and the
placement along each mesh dimension (:class:`ShardSpec`, :class:`MeshLayout`). At a restart
at another world size each rank computes every old rank's box from the recorded layout
(:func:`shard_boxes`, pure), which of them overlap the box it now owns
(:func:`box_overlaps`), and copies those regions into its shard
(``CheckpointManager.restore_latest``, docs/SNAPSHOTS.md "Sharded states").

Supported: DTensors whose placements are ``Shard(d)`` (any dimension) and ``Replicate`` on a
device mesh of any number of dimensions: FSDP2's ``Shard(0)`` over one dimension, tensor
parallelism's ``Shard(1)``, and both over a 2-D mesh. When writing, the box
:func:`shard_boxes` gives this rank is compared with DTensor's own
(``DTensor.__create_chunk_list__()``, the call DCP's planner uses); a layout whose boxes
would be recorded wrongly (``Partial``, whose values are not a slice; a strided shard) is
refused with :class:`~ckptstore.errors.ConfigError`: its bytes would be snapshotted without
a correct record of where they belong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.errors import ConfigError, IntegrityError
from ckptstore.format import FlatState, flatten_state
from ckptstore.format.keys import render_path

__all__ = [
    "Box",
    "MeshLayout",
    "ShardSpec",
    "box_overlaps",
    "chunk_rows",
    "dtensor_spec",
    "dtensor_templates",
    "flatten_sharded",
    "is_dtensor",
    "shard_boxes",
    "specs_from_meta",
]

#: ``(offsets, sizes)``: where a shard sits in its global tensor, one entry per dimension.
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class MeshLayout:
    """How a DTensor is spread over ranks.

    Attributes:
        shape: The device mesh's shape.
        ranks: The rank at each position of the mesh, in row-major order.
        placements: Per mesh dimension, the tensor dimension it shards (``Shard(d)``), or
            None where the tensor is replicated along it (``Replicate``).
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: tuple[int | None, ...]

    @classmethod
    def one_d(cls, world: int) -> MeshLayout:
        """``Shard(0)`` over ranks ``0 .. world - 1``: the layout of a snapshot whose meta
        records none (written before layouts were recorded)."""
        return cls((world,), tuple(range(world)), (0,))

    def to_json(self) -> dict[str, list[Any]]:
        """The form recorded in a snapshot's meta."""
        return {"mesh": list(self.shape), "ranks": list(self.ranks),
                "placements": list(self.placements)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> MeshLayout:
        """Parse :meth:`to_json`'s form.

        Raises:
            IntegrityError: If it is malformed or inconsistent.
        """
        try:
            layout = cls(tuple(int(x) for x in raw["mesh"]),
                         tuple(int(x) for x in raw["ranks"]),
                         tuple(None if p is None else int(p) for p in raw["placements"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"malformed mesh layout in a snapshot: {raw!r}") from exc
        if (len(layout.placements) != len(layout.shape)
                or math.prod(layout.shape) != len(layout.ranks)
                or len(set(layout.ranks)) != len(layout.ranks)):
            raise IntegrityError(f"inconsistent mesh layout in a snapshot: {raw!r}")
        return layout


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
    layout: MeshLayout | None = None

    @property
    def box(self) -> Box:
        """``(offsets, sizes)``."""
        return self.offsets, self.sizes

    def to_json(self) -> dict[str, Any]:
        """The form recorded in a snapshot's meta."""
        raw: dict[str, Any] = {"global": list(self.global_shape),
                               "offsets": list(self.offsets), "sizes": list(self.sizes)}
        if self.layout is not None:
            raw.update(self.layout.to_json())
        return raw

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ShardSpec:
        """Parse :meth:`to_json`'s form.

        Raises:
            IntegrityError: If it is malformed.
        """
        try:
            spec = cls(tuple(int(x) for x in raw["global"]),
                       tuple(int(x) for x in raw["offsets"]),
                       tuple(int(x) for x in raw["sizes"]),
                       MeshLayout.from_json(raw) if "mesh" in raw else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"malformed shard record in a snapshot: {raw!r}") from exc
        if not (len(spec.global_shape) == len(spec.offsets) == len(spec.sizes)):
            raise IntegrityError(f"malformed shard record in a snapshot: {raw!r}")
        return spec


def chunk_rows(dim0: int, parts: int) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each of ``parts`` shards of ``dim0`` rows, as ``Shard(0)``
    splits them (like ``torch.chunk``: shards of ``ceil(dim0 / parts)`` rows, the last ones
    smaller or empty; an empty shard starts at ``dim0``, as DTensor reports it).

    Raises:
        ValueError: For ``parts < 1`` or ``dim0 < 0``.
    """
    if parts < 1 or dim0 < 0:
        raise ValueError(f"cannot split {dim0} rows into {parts} shards")
    return [_chunk(dim0, parts, index) for index in range(parts)]


def _chunk(dim0: int, parts: int, index: int) -> tuple[int, int]:
    """Shard ``index`` of :func:`chunk_rows` alone."""
    size = -(-dim0 // parts)
    start = min(index * size, dim0)
    return start, max(0, min(size, dim0 - start))


def shard_boxes(global_shape: Sequence[int], layout: MeshLayout) -> dict[int, Box]:
    """Every rank's box of a tensor of ``global_shape`` laid out as ``layout``.

    DTensor's placement, computed: along each mesh dimension in order, ``Shard(d)`` splits
    dimension ``d`` of the part placed so far as ``torch.chunk`` does (:func:`chunk_rows`)
    and the rank's coordinate on that mesh dimension picks its piece; ``Replicate`` keeps
    the part whole. A dimension sharded along two mesh dimensions is split by the first,
    then each piece by the second.

    Raises:
        ValueError: If a placement names a dimension the tensor does not have.
    """
    shape = tuple(int(d) for d in global_shape)
    for dim in layout.placements:
        if dim is not None and not 0 <= dim < len(shape):
            raise ValueError(f"Shard({dim}) of a {len(shape)}-dimensional tensor")
    boxes: dict[int, Box] = {}
    for position, rank in enumerate(layout.ranks):
        coords, rest = [], position
        for size in reversed(layout.shape):
            coords.append(rest % size)
            rest //= size
        boxes[rank] = _box(shape, layout, coords[::-1])
    return boxes


def _box(shape: tuple[int, ...], layout: MeshLayout, coords: Sequence[int]) -> Box:
    """The box of the rank at mesh coordinates ``coords`` (see :func:`shard_boxes`)."""
    offsets, sizes = [0] * len(shape), list(shape)
    for axis, dim in enumerate(layout.placements):
        if dim is not None:
            start, rows = _chunk(sizes[dim], layout.shape[axis], coords[axis])
            offsets[dim] += start
            sizes[dim] = rows
    return tuple(offsets), tuple(sizes)


def box_overlaps(
    box: Box, old: Mapping[int, Box]
) -> list[tuple[int, tuple[slice, ...], tuple[slice, ...]]]:
    """Which old boxes hold parts of ``box``, and where.

    Args:
        box: The new shard's ``(offsets, sizes)``.
        old: Every old rank's box.

    Returns:
        ``(old rank, the part's slices in the old shard, its slices in the new shard)`` for
        every non-empty overlap, in old rank order, each distinct old box once (a box
        replicated on several ranks is read from the first of them); together they cover
        ``box`` exactly when the old boxes tile the tensor.
    """
    offsets, sizes = box
    out = []
    seen: set[Box] = set()
    for rank in sorted(old):
        old_offsets, old_sizes = old[rank]
        if old[rank] in seen or 0 in old_sizes:
            continue
        seen.add(old[rank])
        lows = [max(a, b) for a, b in zip(offsets, old_offsets, strict=True)]
        highs = [min(a + n, b + m) for a, n, b, m in
                 zip(offsets, sizes, old_offsets, old_sizes, strict=True)]
        if any(hi <= lo for lo, hi in zip(lows, highs, strict=True)):
            continue
        out.append((rank,
                    tuple(slice(lo - o, hi - o) for lo, hi, o in
                          zip(lows, highs, old_offsets, strict=True)),
                    tuple(slice(lo - o, hi - o) for lo, hi, o in
                          zip(lows, highs, offsets, strict=True))))
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


def dtensor_spec(
    tensor: Any, where: str = "",
    layouts: dict[tuple[int, tuple[Any, ...]], MeshLayout | None] | None = None,
) -> ShardSpec:
    """The :class:`ShardSpec` of a DTensor whose placements are ``Shard(d)`` and
    ``Replicate``, on a device mesh of any shape.

    Args:
        tensor: The DTensor.
        where: Its key path, for messages.
        layouts: The layouts found so far in one walk of a state, by mesh and placements
            (every parameter of a model shares a few; listing a mesh's ranks walks all of
            them). Never kept past the walk: a mesh held on to would keep its process
            groups, and gloo's threads, alive after ``destroy_process_group()``.

    Raises:
        ConfigError: For any other layout, or one whose box :func:`shard_boxes` does not
            give as DTensor does (not built: it would be restored wrongly).
    """
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    shape = tuple(int(d) for d in tensor.shape)
    key = (id(mesh), placements)
    if layouts is None or key not in layouts:
        layout = _layout(mesh, placements)
        if layouts is not None:
            layouts[key] = layout
    else:
        layout = layouts[key]
    coords = mesh.get_coordinate()
    if layout is None or coords is None or any(
            d is not None and d >= len(shape) for d in layout.placements):
        raise _unsupported(where, placements, mesh.ndim)
    chunks = tensor.__create_chunk_list__()
    # Only this rank's box: a snapshot is taken every step, and the layout of every rank
    # is computed only at a restart (shard_boxes).
    mine = _box(shape, layout, coords)
    if len(chunks) != 1 or not _same_box(
            mine, (tuple(int(d) for d in chunks[0].offsets),
                   tuple(int(d) for d in chunks[0].sizes))):
        raise _unsupported(where, placements, mesh.ndim)
    return ShardSpec(shape, mine[0], mine[1], layout)


def _layout(mesh: Any, placements: tuple[Any, ...]) -> MeshLayout | None:
    """The :class:`MeshLayout` of DTensors on ``mesh`` with ``placements``, or None for a
    placement that is not ``Shard(d)`` or ``Replicate``."""
    from torch.distributed.tensor import Replicate, Shard

    dims: list[int | None] = []
    for placement in placements:
        # type() is: a strided shard (FSDP2 with tensor parallelism) is a Shard subclass
        # whose pieces are not one box per rank.
        if type(placement) is Shard:
            dims.append(int(placement.dim))
        elif type(placement) is Replicate:
            dims.append(None)
        else:
            return None
    return MeshLayout(tuple(int(d) for d in mesh.shape),
                      tuple(int(r) for r in mesh.mesh.flatten().tolist()), tuple(dims))


def _same_box(a: Box, b: Box) -> bool:
    # An empty shard holds nothing: where DTensor says it starts does not matter.
    return a == b or (a[1] == b[1] and 0 in a[1])


def _unsupported(where: str, placements: tuple[Any, ...], ndim: int) -> ConfigError:
    return ConfigError(
        f"DTensor at {render_path(where) if where else '?'} has placements {placements} on a "
        f"{ndim}-D mesh: snapshots reshard DTensors whose placements are Shard(d) and "
        "Replicate (one box per rank); give the snapshot a full or local tensor there "
        "(e.g. .full_tensor()) or use the DCP layout (docs/SNAPSHOTS.md)")


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
    # The meshes are alive for the whole walk (the state holds them): id() keys are safe.
    layouts: dict[tuple[int, tuple[Any, ...]], MeshLayout | None] = {}

    def local(tensor: torch.Tensor, key: str) -> torch.Tensor:
        if not is_dtensor(tensor):
            return tensor  # refused by the flattener, as any other subclass
        found[key] = (tensor, dtensor_spec(tensor, key, layouts))
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
