"""The DCP ``StorageReader`` for a committed DCP-layout checkpoint, and a safe load planner.

Every rank reads only the chunks that overlap its shards, whatever the world size and
placement at save time: the metadata DCP plans with is rebuilt from the manifest's JSON
index (no pickle is ever read) and every chunk is verified before it is used
(:mod:`ckptstore.format.dcp.chunks`). Non-tensor items go back to DCP's planner as the
``torch.save`` bytes DCP produced; :class:`SafeLoadPlanner` loads them with
``weights_only=True``.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, IntegrityError, UnsafeObjectError
from ckptstore.format import Manifest, read_manifest
from ckptstore.format.constants import COMMIT_NAME, DCP_ARRAY_GROUP
from ckptstore.format.dcp.boxes import BoxLoc, build_metadata, stored_boxes
from ckptstore.format.dcp.chunks import ChunkSource, load_blob
from ckptstore.format.dcp.layout import BlobItem
from ckptstore.format.dcp.requests import Request, run_requests
from ckptstore.format.dcp.verify import index_of
from ckptstore.ops.dcp.share import run_shared
from ckptstore.ops.tiering.parts import PartsSource, parts_source
from ckptstore.ops.tiering.thaw import thawed_source

__all__ = ["REMOTE_READ_THREADS", "SafeLoadPlanner", "ZarrStorageReader", "dcp_reader"]

logger = logging.getLogger(__name__)

#: Reader threads when some chunks come from object storage: each GET waits on the network,
#: so more run at once than the disk-bound default.
REMOTE_READ_THREADS = 8


class ZarrStorageReader(StorageReader):
    """DCP ``StorageReader`` for a committed DCP-layout checkpoint directory.

    Every rank reads only the chunks that overlap its shards, whatever the world size and
    placement at save time. Usually made by ``store.dcp_reader(ref)``.

    Args:
        directory: The checkpoint directory (hot tier).
        manifest: Its verified manifest (read and checked against ``COMMITTED`` if None).
        threads: Reader threads.
        source: Where the chunks come from (default: ``directory``): a checkpoint saved
            across hosts reads each host's part from the best copy this host can reach
            (:class:`~ckptstore.ops.tiering.parts.PartsSource`).
        share_group: With a parts ``source`` under a process group of several ranks: the
            ranks share the downloads of the parts no local disk holds
            (:mod:`ckptstore.ops.dcp.share`; None for the default group). Every rank of
            the load must pass the same ``share``.
        share: Whether to share remote reads that way.

    Raises:
        IncompleteCheckpointError: If the directory was never committed.
        IntegrityError: If the manifest or index is damaged, or the checkpoint is not a DCP
            checkpoint.
    """

    def __init__(
        self, directory: str | os.PathLike[str], manifest: Manifest | None = None,
        *, threads: int = 2, source: ChunkSource | None = None,
        share: bool = False, share_group: Any = None,
    ) -> None:
        self.threads = threads
        self._share = share and isinstance(source, PartsSource)
        self._share_group = share_group
        self._open(Path(directory), manifest, source)

    def _open(self, directory: Path, manifest: Manifest | None,
              source: ChunkSource | None = None) -> None:
        self.directory = directory
        self.manifest = manifest if manifest is not None else read_manifest(directory)
        self.index = index_of(self.manifest)
        self._source = source or ChunkSource(directory, self.manifest.id, self.index)
        self._metadata: Metadata | None = None
        self._where: dict[MetadataIndex, BoxLoc | BlobItem] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Switch to another checkpoint directory when ``checkpoint_id`` (a path) is given."""
        if checkpoint_id is not None:
            self._open(Path(checkpoint_id), None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP metadata rebuilt from our JSON index (no pickle is ever read)."""
        if self._metadata is None:
            self._metadata, self._where = build_metadata(self.index, stored_boxes(self.index))
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Nothing to set up: every rank opened the same directory."""
        if self._metadata is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's items: tensors in parallel into their targets, then bytes items.

        Raises:
            IntegrityError: On a damaged or missing chunk, or an item not in the checkpoint.
        """
        self.read_metadata()
        failure: CkptError | None = None
        try:
            requests, resolved, blobs = self._resolve(plan, planner)
        except CkptError as exc:
            # Raised after the shared reads: the other ranks are in their collectives.
            failure, requests, resolved, blobs = exc, [], [], []
        if self._share:
            assert isinstance(self._source, PartsSource)
            threads = max(self.threads, REMOTE_READ_THREADS)
            try:
                run_shared(self._source, requests, blobs=[b for _, b in blobs],
                           threads=threads, group=self._share_group)
                if failure is not None:
                    raise failure
                self._finish(planner, resolved, blobs)
            finally:
                self._source.forget_received()
        else:
            if failure is not None:
                raise failure
            run_requests(self._source, requests, self.threads)
            self._finish(planner, resolved, blobs)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _finish(self, planner: LoadPlanner, resolved: list[tuple[ReadItem, torch.Tensor]],
                blobs: list[tuple[ReadItem, BlobItem]]) -> None:
        """Hand the tensors read and the bytes items to the planner."""
        for item, target in resolved:
            planner.commit_tensor(item, target)
        for item, blob in blobs:
            planner.load_bytes(item, io.BytesIO(load_blob(self._source, blob)))

    def _resolve(self, plan: LoadPlan, planner: LoadPlanner) -> tuple[
        list[Request], list[tuple[ReadItem, torch.Tensor]], list[tuple[ReadItem, BlobItem]]
    ]:
        """The plan's tensor reads (with their targets) and its bytes items.

        Raises:
            IntegrityError: If the plan names an item the checkpoint does not hold.
        """
        requests: list[Request] = []
        resolved: list[tuple[ReadItem, torch.Tensor]] = []
        blobs: list[tuple[ReadItem, BlobItem]] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                blob = self._where.get(item.storage_index)
                if not isinstance(blob, BlobItem):
                    raise IntegrityError(
                        f"checkpoint {self.manifest.id} holds no item "
                        f"{item.storage_index.fqn!r}"
                    )
                blobs.append((item, blob))
                continue
            box = self._where.get(item.storage_index)
            if not isinstance(box, BoxLoc):
                raise IntegrityError(
                    f"checkpoint {self.manifest.id} holds no chunk of {item.storage_index.fqn!r} "
                    f"at {tuple(item.storage_index.offset or ())}; the load plan does not match "
                    "this checkpoint"
                )
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != tuple(item.lengths):
                raise CkptError(
                    f"the load planner gave a {tuple(target.shape)} target for "
                    f"{item.dest_index.fqn!r}, expected {tuple(item.lengths)}"
                )
            requests.append(
                Request(box, tuple(item.storage_offsets), tuple(item.lengths), target)
            )
            resolved.append((item, target))
        return requests, resolved, blobs

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a committed DCP-layout checkpoint directory."""
        path = Path(checkpoint_id)
        return (path / COMMIT_NAME).is_file() and (path / DCP_ARRAY_GROUP).is_dir()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor items load with ``weights_only=True``.

    DCP's own planner unpickles them with ``weights_only=False`` (arbitrary code); the store
    never does.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load one non-tensor item without arbitrary unpickling.

        Raises:
            UnsafeObjectError: If the item needs arbitrary unpickling.
        """
        import pickle

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeObjectError(
                f"non-tensor item {fqn!r} needs arbitrary unpickling, which the store refuses: "
                f"{str(exc).splitlines()[0]}; load with dcp.load and a planner you trust"
            ) from exc
        if self.flatten_state_dict:
            # What DefaultLoadPlanner.load_bytes does with its (unsafe) result.
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_reader(store: StoreCore, ref: str) -> ZarrStorageReader:
    """A :class:`ZarrStorageReader` for a committed checkpoint (restored to hot if needed).

    Raises:
        CheckpointNotFoundError: If the reference does not resolve.
        IntegrityError: If the manifest is damaged or it is not a DCP checkpoint.
    """
    from ckptstore.ops.tiering.restore import ensure_hot

    ck = store.catalog.get(ref)
    if ck.parted:
        from ckptstore.ops.tiering.restore import unseal_parts_here

        manifest, source = parts_source(store, ck, thaw=thawed_source,
                                        unseal=unseal_parts_here)
        threads = store.settings.threads
        return ZarrStorageReader(source.directory, manifest, source=source,
                                 threads=max(threads, REMOTE_READ_THREADS) if source.remote
                                 else threads)
    directory = ensure_hot(store, ck)
    manifest = read_manifest(directory, expected_digest=ck.manifest_digest)
    return ZarrStorageReader(directory, manifest, threads=store.settings.threads)
