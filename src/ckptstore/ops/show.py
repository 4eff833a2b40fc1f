"""Plain-JSON views of checkpoints for ``ckpt show``, ``--json`` output and the UI.

Pure presentation: every function returns JSON-able dicts built from catalog records and
manifests; nothing here writes.
"""

from __future__ import annotations

from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import CkptError
from ckptstore.format import Manifest, read_manifest
from ckptstore.records import Checkpoint, expected_digest

__all__ = ["checkpoint_dict", "manifest_summary", "show_checkpoint"]


def checkpoint_dict(ck: Checkpoint) -> dict[str, Any]:
    """A checkpoint's catalog record as a JSON-able dict (replicas included)."""
    return {
        "id": ck.id,
        "ref": ck.ref,
        "run": ck.run,
        "step": ck.step,
        "version": ck.version,
        "state": str(ck.state),
        "kind": ck.kind,
        "base_id": ck.base_id,
        "parent_id": ck.parent_id,
        "created_at": ck.created_at.isoformat(),
        "metrics": dict(ck.metrics),
        "tags": list(ck.tags),
        "logical_bytes": ck.logical_bytes,
        "stored_bytes": ck.stored_bytes,
        "codec": ck.codec,
        "manifest_digest": ck.manifest_digest,
        "lossy": ck.lossy,
        "error_bound": ck.error_bound,
        "lossy_scope": list(ck.lossy_scope),
        "pinned": ck.pinned,
        "aliases": list(ck.aliases),
        "replicas": [
            {
                "tier": r.tier,
                "state": str(r.state),
                "bytes": r.bytes,
                "verified_at": r.verified_at.isoformat() if r.verified_at else None,
                "manifest_digest": r.manifest_digest,
            }
            for r in ck.replicas
        ],
    }


def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    """A short JSON-able summary of a manifest for ``ckpt show``."""
    dtypes: dict[str, int] = {}
    for entry in manifest.tensors.values():
        dtype = str(entry["torch_dtype"] if isinstance(entry, dict) else entry.torch_dtype)
        dtypes[dtype] = dtypes.get(dtype, 0) + 1
    chunks = 0
    for arr in manifest.arrays.values():
        chunk_list = arr["chunks"] if isinstance(arr, dict) else arr.chunks
        chunks += len(chunk_list)
    return {
        "format_version": manifest.format_version,
        "codec": manifest.codec,
        "kind": manifest.kind,
        "tensors": len(manifest.tensors),
        "dtypes": dtypes,
        "arrays": len(manifest.arrays),
        "chunks": chunks,
        "logical_bytes": manifest.logical_bytes,
        "stored_bytes": manifest.stored_bytes,
        "delta": manifest.delta.to_dict() if manifest.delta is not None else None,
    }


def show_checkpoint(core: StoreCore, ref: str) -> dict[str, Any]:
    """Everything needed to understand and reproduce a checkpoint.

    Returns:
        A JSON-able dict: the catalog record, the run's reproduction record and a summary of
        the manifest (tensor count, dtypes, bytes, codec, chunks).
    """
    ck = core.catalog.get(ref)
    info: dict[str, Any] = {"checkpoint": checkpoint_dict(ck)}
    record = core.catalog.run_record(ck.id)
    info["reproduction"] = {
        **record.get("run", {}),
        "parents": [p["ref"] for p in record.get("parents", [])],
        "metrics_at_save": record.get("metrics", {}),
        "edges": record.get("edges", []),
    }
    try:
        manifest = read_manifest(core.hot_dir_of(ck), expected_digest=expected_digest(ck, "hot"))
    except CkptError as exc:
        info["manifest"] = {"error": str(exc)}
        return info
    info["manifest"] = manifest_summary(manifest)
    return info
