"""The save/load methods compared by ``bench_save_load.py``, one class each.

Every method has the same life cycle inside one benchmark round: ``setup(workdir)`` (not
timed), ``save(state, step)`` (timed; returns only once the data is durable), one or more
``load(variant, live)`` calls (timed), then ``teardown()`` (not timed). Durability is made
equal on purpose: torch.save and safetensors do not fsync, so their timed save includes an
explicit fsync of the file and of its directory; DCP (``sync_files=True``) and ckptstore fsync
by themselves.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import fsync_dir
from benchmarks.state import TrainState, copy_into, flat_tensors

__all__ = [
    "CkptstoreMethod",
    "DcpMethod",
    "LoadSpec",
    "Method",
    "SafetensorsMethod",
    "TorchSaveMethod",
    "all_methods",
]

logger = logging.getLogger(__name__)

_PAGE = 4096


@dataclass(frozen=True)
class LoadSpec:
    """One way to load what a method saved.

    Attributes:
        key: Short id used in the JSON output (``fresh``, ``into``, ``mmap_into``).
        label: Human-readable description for the table.
        into: True when the load fills the live state in place (no new tensors).
    """

    key: str
    label: str
    into: bool


class Method:
    """Base class: a named save method and its load variants."""

    name: str = ""
    loads: tuple[LoadSpec, ...] = ()

    def __init__(self) -> None:
        """Create the method; nothing touches the disk until :meth:`setup`."""
        self.workdir = Path()

    def open(self, base: Path) -> None:
        """Once before all rounds (not timed): long-lived set-up under ``base``."""

    def close(self) -> None:
        """Once after all rounds: undo :meth:`open`."""

    def setup(self, workdir: Path) -> None:
        """Prepare an empty working directory for one round (not timed).

        Args:
            workdir: Directory of this round's files; created here.
        """
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=False)

    def save(self, state: TrainState, step: int) -> None:
        """Save ``state`` durably (timed)."""
        raise NotImplementedError

    def load(self, variant: str, live: TrainState) -> Any:
        """Load with ``variant`` (timed); return the loaded state, or None for in-place loads."""
        raise NotImplementedError

    def data_root(self) -> Path:
        """The files the saved checkpoint consists of (for size, file count and eviction)."""
        return self.workdir

    def teardown(self) -> None:
        """Release resources (not timed); the caller deletes the working directory."""


class TorchSaveMethod(Method):
    """``torch.save`` of the nested state to one file, + fsync of file and directory."""

    name = "torch.save"
    loads = (
        LoadSpec("fresh", "torch.load (fresh tensors)", into=False),
        LoadSpec("mmap_into", "torch.load(mmap=True) + copy_ into live", into=True),
    )

    @property
    def path(self) -> Path:
        """The checkpoint file."""
        return self.workdir / "state.pt"

    def save(self, state: TrainState, step: int) -> None:
        """Pickle-zip the state, then fsync file and directory."""
        with open(self.path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(self.workdir)

    def load(self, variant: str, live: TrainState) -> Any:
        """``fresh``: torch.load; ``mmap_into``: torch.load(mmap=True) then copy_ into live."""
        if variant == "fresh":
            return torch.load(self.path, weights_only=True)
        loaded = torch.load(self.path, mmap=True, weights_only=True)
        copy_into(live, loaded)
        return None


def _touch_pages(tensors: dict[str, torch.Tensor]) -> None:
    # safetensors' load_file maps the file lazily and returns in milliseconds; reading one byte
    # of every page makes the data actually resident, which is what a load must deliver.
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::_PAGE].sum()


class SafetensorsMethod(Method):
    """``safetensors.torch.save_file`` of the flattened tensors, + fsync of file and directory.

    The optimizer's non-tensor state (param_groups) goes into the file's string metadata as
    JSON, so the file holds the same information as the other formats.
    """

    name = "safetensors"
    loads = (
        LoadSpec("fresh", "load_file (mmap) + touch every page", into=False),
        LoadSpec("mmap_into", "load_file (mmap) + copy_ into live", into=True),
    )

    @property
    def path(self) -> Path:
        """The checkpoint file."""
        return self.workdir / "state.safetensors"

    def save(self, state: TrainState, step: int) -> None:
        """Flatten, write, fsync file and directory."""
        from safetensors.torch import save_file

        metadata = {"param_groups": json.dumps(state["optimizer"]["param_groups"])}
        save_file(flat_tensors(state), str(self.path), metadata=metadata)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.workdir)

    def load(self, variant: str, live: TrainState) -> Any:
        """``fresh``: load_file and touch all pages; ``mmap_into``: load_file then copy_."""
        from safetensors.torch import load_file

        loaded = load_file(str(self.path))
        if variant == "fresh":
            _touch_pages(loaded)
            return loaded
        copy_into(live, loaded)
        return None


class DcpMethod(Method):
    """``torch.distributed.checkpoint`` with ``FileSystemWriter(thread_count=2)``, no process
    group; loads in place into the live state (DCP's only load mode)."""

    name = "dcp"
    loads = (LoadSpec("into", "dcp.load into live", into=True),)

    def save(self, state: TrainState, step: int) -> None:
        """``dcp.save`` with two writer threads and ``sync_files=True`` (fsyncs itself)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        writer = FileSystemWriter(self.workdir, thread_count=2, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer, no_dist=True)  # type: ignore[attr-defined]

    def load(self, variant: str, live: TrainState) -> Any:
        """``dcp.load`` into the live tensors."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        reader = FileSystemReader(self.workdir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(live, storage_reader=reader, no_dist=True)  # type: ignore[attr-defined]
        return None


class CkptstoreMethod(Method):
    """``CheckpointStore.open(dir).save(...)`` with one codec preset (fsyncs itself)."""

    loads = (
        LoadSpec("fresh", "store.load(ref) (fresh tensors)", into=False),
        LoadSpec("into", "store.load(ref, into=live)", into=True),
    )

    def __init__(self, codec: str) -> None:
        """Benchmark the store with codec preset ``codec``."""
        super().__init__()
        self.codec = codec
        self.name = f"ckptstore-{codec}"
        self._store: Any = None
        self._ref: str | None = None

    def open(self, base: Path) -> None:
        """Open one store for all rounds: catalog creation and migration are not part of a save.

        Each round saves a new version into it and deletes that checkpoint's directory after
        its measurements (the catalog keeps one row per round, which costs nothing measurable).
        """
        from ckptstore import CheckpointStore

        self._store = CheckpointStore.open(base / f"{self.name}-store", codec=self.codec)

    def close(self) -> None:
        """Close the store's catalog."""
        if self._store is not None:
            self._store.close()
            self._store = None

    def save(self, state: TrainState, step: int) -> None:
        """``store.save`` (catalog row, chunks, manifest, commit marker, all durable)."""
        self._ref = None
        ck = self._store.save("bench", step, state, codec=self.codec, delta=False)
        self._ref = ck.id

    def load(self, variant: str, live: TrainState) -> Any:
        """``fresh``: ``store.load(ref)``; ``into``: ``store.load(ref, into=live)``."""
        if variant == "fresh":
            return self._store.load(self._ref)
        self._store.load(self._ref, into=live)
        return None

    def data_root(self) -> Path:
        """The checkpoint's directory on the hot tier (the catalog file is not counted)."""
        if self._store is None or self._ref is None:
            return self.workdir
        path: Path = self._store.checkpoint_dir("bench", self._ref)
        return path

    def teardown(self) -> None:
        """Delete this round's checkpoint directory (the disk is freed between methods)."""
        if self._ref is not None:
            shutil.rmtree(self.data_root(), ignore_errors=True)
        self._ref = None


CODECS = ("auto", "none", "lz4", "zstd-1", "zstd-3")


def all_methods() -> list[Method]:
    """Every method in the benchmark, in table order."""
    methods: list[Method] = [TorchSaveMethod(), SafetensorsMethod(), DcpMethod()]
    methods.extend(CkptstoreMethod(codec) for codec in CODECS)
    return methods
