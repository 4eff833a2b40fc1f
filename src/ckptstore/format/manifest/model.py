"""The manifest: the index of one checkpoint, and its canonical JSON form and digest.

``manifest.json`` is canonical JSON (sorted object keys, no whitespace, ASCII), so the same
manifest always has the same bytes and :attr:`Manifest.digest` identifies it. Order-carrying
parts are lists: tensors are listed in flatten order and the state tree encodes dicts as
key/value lists (see :mod:`ckptstore.format.tree`). ``extra`` is free caller metadata (plain
JSON; NaN/Infinity allowed; its object key order is not kept).

The format's own data that older writers put inside ``extra`` keeps its place in the JSON
(so existing checkpoints read, and re-serialise, to the same bytes) but is a typed field
here: :attr:`Manifest.dcp` (the DCP index, ``extra["dcp"]``), :attr:`Manifest.files`
(files of other layouts, ``extra["files"]``) and :attr:`Manifest.reencoded_from` (a
re-encoded copy's original digest, ``extra["reencoded_from"]``). Parsing
(:meth:`Manifest.from_json`) is :mod:`ckptstore.format.manifest.parse`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from ckptstore.format.constants import DCP_INDEX_KEY, FILES_KEY, REENCODED_FROM_KEY, ZARR_JSON
from ckptstore.format.manifest.dcpindex import DcpIndex
from ckptstore.format.manifest.parse import parse_manifest
from ckptstore.format.manifest.records import ArrayEntry, DeltaInfo, FileEntry, TensorEntry

__all__ = ["FORMAT_KEYS", "BaseRef", "Manifest", "manifest_digest"]

#: Keys of ``extra`` that hold the format's own data (see the module docstring).
FORMAT_KEYS: tuple[str, ...] = (DCP_INDEX_KEY, FILES_KEY, REENCODED_FROM_KEY)


def manifest_digest(data: bytes) -> str:
    """Hex blake3 of manifest bytes: the value in ``COMMITTED`` and the catalog."""
    return blake3.blake3(data).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """Index of one checkpoint: where every tensor and chunk is, and what the state holds.

    Attributes:
        format_version: Layout version (:data:`~ckptstore.format.constants.FORMAT_VERSION`).
        id: Checkpoint id (uuid).
        run: Run name.
        step: Training step.
        created_at: ISO-8601 creation time (UTC).
        kind: ``"full"``, or ``"delta"`` when some chunks live in other checkpoints.
        base_id: The base checkpoint of a delta, else None.
        codec: Codec preset used for the chunks this checkpoint wrote.
        chunk_bytes: Target chunk size the writer used.
        arrays: Array name -> entry.
        tensors: Tensor key -> entry, in flatten order.
        tree: JSON skeleton of the state.
        logical_bytes: Sum of the stored tensors' sizes.
        stored_bytes: Bytes of chunk files this checkpoint physically wrote.
        extra: Free-form JSON metadata from the caller. It may not hold a value under one
            of :data:`FORMAT_KEYS` (a null or empty one, as some callers wrote, is kept).
        delta: How it was encoded relative to other checkpoints (None: written without a
            delta mode; a ``kind == "delta"`` manifest without it is a plain dedup delta).
        dcp: For a checkpoint saved through the DCP layout, its index (its tensors are then
            in the DCP arrays, not in ``arrays``); else None.
        files: Files the checkpoint owns outside the packed arrays (the DCP layout's),
            data files first.
        reencoded_from: For a copy re-encoded with another codec, the digest of the
            checkpoint's own (original) manifest; else None.
        metadata: Version 2: relative path -> blake3 of every ``zarr.json`` of a
            self-contained copy (for an array with delta-encoded chunks, the document that
            declares the delta codec). Empty for version 1.
        metadata_ref: Version 2: for each array some of whose chunks belong to other
            checkpoints, the blake3 of the ``zarr.json`` a copy that does not hold those
            chunk files itself must have (it declares the chunk-reference codec).
    """

    format_version: int
    id: str
    run: str
    step: int
    created_at: str
    kind: str
    base_id: str | None
    codec: str
    chunk_bytes: int
    arrays: dict[str, ArrayEntry]
    tensors: dict[str, TensorEntry]
    tree: Any
    logical_bytes: int
    stored_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)
    delta: DeltaInfo | None = None
    dcp: DcpIndex | None = None
    files: tuple[FileEntry, ...] = ()
    reencoded_from: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    metadata_ref: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # One home per datum: a format key with a value in extra would shadow (or be
        # shadowed by) the typed field when the JSON is written.
        taken = [key for key in FORMAT_KEYS if self.extra.get(key)]
        if taken:
            raise ValueError(
                f"manifest extra may not hold {taken}: the format keeps that data in the "
                "dcp, files and reencoded_from fields"
            )

    def to_json(self) -> bytes:
        """Canonical JSON bytes (deterministic: same manifest, same bytes)."""
        doc = {
            "format_version": self.format_version,
            "id": self.id,
            "run": self.run,
            "step": self.step,
            "created_at": self.created_at,
            "kind": self.kind,
            "base_id": self.base_id,
            "codec": self.codec,
            "chunk_bytes": self.chunk_bytes,
            "arrays": {name: a.to_dict() for name, a in self.arrays.items()},
            "tensors": self._tensors_doc(),
            "tree": self.tree,
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "extra": self._extra_doc(),
        }
        if self.delta is not None:
            # Only when set: manifests written without a delta mode keep their exact bytes.
            doc["delta"] = self.delta.to_dict()
        if self.format_version >= 2:
            doc["metadata"] = self.metadata
            doc["metadata_ref"] = self.metadata_ref
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode(
            "ascii"
        )

    def _tensors_doc(self) -> list[dict[str, Any]]:
        """The common tensor index: every tensor of every layout (a DCP checkpoint's tensors
        with their pieces, from format 2 on)."""
        if self.dcp is not None and self.format_version >= 2:
            return self.dcp.tensor_entries()
        return [t.to_dict() for t in self.tensors.values()]

    def _extra_doc(self) -> dict[str, Any]:
        """``extra`` as written: caller metadata plus the typed fields under their keys."""
        if self.dcp is None and not self.files and self.reencoded_from is None:
            return self.extra
        doc = dict(self.extra)
        if self.dcp is not None:
            doc[DCP_INDEX_KEY] = self.dcp.to_json(1 if self.format_version == 1 else 2)
        if self.files:
            doc[FILES_KEY] = [f.to_list() for f in self.files]
        if self.reencoded_from is not None:
            doc[REENCODED_FROM_KEY] = self.reencoded_from
        return doc

    @property
    def digest(self) -> str:
        """Hex blake3 of :meth:`to_json`."""
        return manifest_digest(self.to_json())

    def tensor_keys(self) -> list[str]:
        """Tensor keys in flatten order."""
        return list(self.tensors)

    def referenced_checkpoints(self) -> set[str]:
        """Ids of other checkpoints whose chunk files this one reads (dedup and delta bases)."""
        return {
            owner
            for a in self.arrays.values()
            for c in a.chunks
            for owner in c.owners()
            if owner is not None
        }

    def chunk_refs(self) -> list[tuple[str, str, int]]:
        """Every chunk file a full read opens: ``(owner id, array name, chunk index)``.

        Includes the checkpoint's own files, chunks it references in other checkpoints
        (``src``) and the base chunks its delta-encoded chunks are decoded against.
        """
        refs: dict[tuple[str, str, int], None] = {}
        for a in self.arrays.values():
            for c in a.chunks:
                for owner in c.owners():
                    refs.setdefault((owner or self.id, a.name, c.i))
        return list(refs)

    @property
    def lossy(self) -> bool:
        """Whether some values are stored approximately (see :attr:`delta`)."""
        return self.delta is not None and self.delta.lossy

    def metadata_files(self) -> list[str]:
        """Relative paths of every ``zarr.json`` of the regular layout: the root group, its
        subgroups (``tensors``), then each array."""
        groups: dict[str, None] = {"": None}
        for name in self.arrays:
            parts = name.split("/")
            for i in range(1, len(parts)):
                groups.setdefault("/".join(parts[:i]))
        paths = [f"{g}/{ZARR_JSON}" if g else ZARR_JSON for g in groups]
        return paths + [f"{name}/{ZARR_JSON}" for name in self.arrays]

    def tensors_in_chunk(self, array: str, index: int) -> list[str]:
        """Keys of the tensors with elements in chunk ``index`` of ``array`` (for messages)."""
        return [
            t.key
            for t in self.tensors.values()
            if t.array == array and t.chunk_start <= index < t.chunk_stop
        ]

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate manifest bytes (treated as hostile).

        Raises:
            IntegrityError: If the bytes are too large, not JSON, or fail any check
                (:func:`~ckptstore.format.manifest.parse.parse_manifest`).
        """
        return cls(**parse_manifest(data))


@dataclass(frozen=True)
class BaseRef:
    """The base checkpoint a new checkpoint deduplicates chunks (or encodes deltas) against.

    Attributes:
        manifest: The base's (committed) manifest.
        directory: The base's directory.
        locate: Finds the directories of checkpoints the base itself reads chunks from
            (needed to XOR-encode against a base chunk the base deduplicated).
    """

    manifest: Manifest
    directory: Path
    locate: Callable[[str], Path] | None = None
