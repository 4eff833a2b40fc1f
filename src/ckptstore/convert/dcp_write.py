"""Write ``torch.distributed.checkpoint`` (DCP) folders from a stream of tensors.

``dcp.save`` gets a skeleton state whose tensors are ``meta`` tensors (shape and dtype
only). A planner hands DCP the real tensor for each item only when the writer asks for it,
pulling them one at a time from a :class:`TensorFeed`, and orders the items as the feed
produces them, so a single tensor (plus one data file's worth, see
:data:`DCP_FILE_BYTES`) is in memory at a time. No process group is needed.
"""

from __future__ import annotations

import logging
import queue
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ckptstore.convert.dcp_read import unwrap_dcp_error
from ckptstore.convert.heap import trim_heap
from ckptstore.errors import CkptError, IntegrityError, StorageError

__all__ = ["DCP_FILE_BYTES", "TensorFeed", "write_dcp"]

logger = logging.getLogger(__name__)

#: Tensor bytes per ``.distcp`` file written by :func:`write_dcp` (see _GroupedFileSystemWriter).
DCP_FILE_BYTES = 32 * 2**20


class TensorFeed:
    """Hands out tensors by key from a one-pass ``(key, tensor)`` iterator.

    Tensors that arrive before they are asked for are stashed; a key needed by several
    places (tied weights) stays stashed until its last use.

    Args:
        items: The iterator, e.g. ``ckptstore.format.iter_tensors(...)``.
        uses: How many times each key will be asked for (default 1).
    """

    def __init__(self, items: Iterator[tuple[str, torch.Tensor]], uses: Mapping[str, int]) -> None:
        self._items = items
        self._uses = dict(uses)
        self._stash: dict[str, torch.Tensor] = {}
        self.peak_stash_bytes = 0

    def get(self, key: str) -> torch.Tensor:
        """Return the tensor for ``key``.

        Raises:
            IntegrityError: If the iterator ends without producing it.
        """
        tensor = self._stash.get(key)
        if tensor is None:
            for got, value in self._items:
                if got == key:
                    tensor = value
                    break
                self._stash[got] = value
                self.peak_stash_bytes = max(
                    self.peak_stash_bytes, sum(t.nbytes for t in self._stash.values())
                )
            else:
                raise IntegrityError(
                    f"tensor {key!r} was never produced by the checkpoint reader; "
                    "run `ckpt verify` on the checkpoint"
                )
        remaining = self._uses.get(key, 1) - 1
        self._uses[key] = remaining
        if remaining > 0:
            self._stash[key] = tensor
        else:
            self._stash.pop(key, None)
        return tensor


class _StreamingSavePlanner(DefaultSavePlanner):
    """Resolves meta tensors of the skeleton to real tensors from a feed, in feed order."""

    def __init__(
        self,
        feed: TensorFeed,
        key_of: Mapping[int, str],
        order: Mapping[str, int],
        progress: Callable[[int], None] | None,
    ) -> None:
        super().__init__()
        self._feed = feed
        self._key_of = key_of
        self._order = order
        self._progress = progress
        self._last_bytes = 0

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        # The writer emits items in plan order (one thread, one file): match the feed's order
        # so nothing has to be stashed.
        items = sorted(plan.items, key=self._rank)
        return SavePlan(items=items, storage_data=plan.storage_data, planner_data=plan.planner_data)

    def _rank(self, item: WriteItem) -> int:
        if item.type == WriteItemType.BYTE_IO:
            return -1
        obj = self.state_dict.get(item.index.fqn)
        key = self._key_of.get(id(obj)) if isinstance(obj, torch.Tensor) else None
        return self._order.get(key, len(self._order)) if key is not None else len(self._order)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self._materialize(super().lookup_object(index))

    def _materialize(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                return obj
            # The writer has released the previous tensor by now: give its pages back.
            trim_heap(self._last_bytes)
            tensor = self._feed.get(self._key_of[id(obj)])
            self._last_bytes = tensor.nbytes
            if self._progress is not None:
                self._progress(tensor.nbytes)
            return tensor
        # Only plain containers can hold tensors (the skeleton comes from unflatten_state);
        # anything else, torch.Size included, is returned untouched.
        kind = type(obj)
        if kind is list or kind is tuple:
            values = [self._materialize(v) for v in obj]
            return values if kind is list else tuple(values)
        if kind is dict or kind is OrderedDict:
            return kind((k, self._materialize(v)) for k, v in obj.items())
        return obj


class _GroupedFileSystemWriter(FileSystemWriter):
    """Writes items in plan order into files of at most ``file_bytes`` of tensor data.

    ``FileSystemWriter`` keeps every tensor of a file referenced until the file is complete
    (for its safetensors mode), so one file per rank would hold the whole state; one file per
    item makes thousands of files. Bounded groups keep memory at one group.
    """

    def __init__(self, path: str, file_bytes: int) -> None:
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self._file_bytes = file_bytes

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        write = getattr(self, "_write_data", None)
        prefix = getattr(plan.storage_data, "prefix", None)
        if write is None or not isinstance(prefix, str):  # torch internals moved: stock path
            return super().write_data(plan, planner)
        groups: list[list[WriteItem]] = [[]]
        size = 0
        for item in plan.items:
            nbytes = _tensor_nbytes(item)
            if groups[-1] and nbytes and size + nbytes > self._file_bytes:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += nbytes
        file_queue: queue.Queue[tuple[Any, str, list[WriteItem]]] = queue.Queue()
        for number, group in enumerate(groups):
            file_name = f"{prefix}{number}.distcp"
            file_queue.put((self.fs.concat_path(self.path, file_name), file_name, group))
        return write(planner, file_queue)


def _tensor_nbytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    numel = 1
    for dim in item.tensor_data.size:
        numel *= dim
    return numel * item.tensor_data.properties.dtype.itemsize


def write_dcp(
    directory: Path,
    skeleton: dict[str, Any],
    feed: TensorFeed,
    key_of: Mapping[int, str],
    order: Sequence[str],
    *,
    progress: Callable[[int], None] | None = None,
    file_bytes: int | None = None,
) -> None:
    """Write a DCP folder from a skeleton of meta tensors and a feed of the real ones.

    Args:
        directory: Folder to write (created by DCP).
        skeleton: The state with every tensor replaced by a ``meta`` tensor.
        feed: Produces the real tensors.
        key_of: ``id(meta tensor)`` -> key in the feed.
        order: Keys in the order the feed yields them.
        progress: Called with the bytes of each tensor handed to the writer.
        file_bytes: Tensor bytes per data file (default :data:`DCP_FILE_BYTES`); bounds
            memory (a larger tensor gets a file of its own).

    Raises:
        StorageError: If writing fails.
    """
    planner = _StreamingSavePlanner(feed, key_of, {k: i for i, k in enumerate(order)}, progress)
    writer = _GroupedFileSystemWriter(str(directory), file_bytes or DCP_FILE_BYTES)
    try:
        dcp_save(skeleton, storage_writer=writer, planner=planner, no_dist=True)
    except CkptError:
        raise
    except OSError as exc:
        raise StorageError(f"writing DCP folder {directory} failed: {exc}") from exc
    except (CheckpointException, RuntimeError, ValueError) as exc:
        raise unwrap_dcp_error(exc, f"writing DCP folder {directory} failed") from exc
    if feed.peak_stash_bytes:
        logger.debug("DCP export stashed up to %s bytes out of order", feed.peak_stash_bytes)

