"""Plain-JSON views of checkpoints for ``ckpt show``, ``--json`` output and the UI.

Pure presentation: every function returns JSON-able dicts built from catalog records and
manifests; nothing here writes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ckptstore.catalog.lineage import MERGE_EVENT
from ckptstore.core import StoreCore
from ckptstore.errors import CkptError
from ckptstore.format import Manifest, read_manifest
from ckptstore.ops.reading.reproduce import how_to_reproduce
from ckptstore.ops.tiering.parts import parted_manifest
from ckptstore.records import Checkpoint, ReplicaPart, checkpoint_dict, expected_digest

__all__ = ["copies_record", "hosts_overview", "manifest_summary", "merge_record",
           "part_dict", "show_checkpoint"]


def part_dict(part: ReplicaPart) -> dict[str, Any]:
    """One copy of one host's part as a JSON-able dict."""
    return {
        "tier": part.tier,
        "part": part.part,
        "stored_on": part.stored_on,
        "state": str(part.state),
        "bytes": part.bytes,
        "files": part.files,
        "verified_at": part.verified_at.isoformat() if part.verified_at else None,
    }


def hosts_overview(core: StoreCore) -> list[dict[str, Any]]:
    """Every host the catalog knows: last heartbeat, and the part copies per tier.

    For each host: ``name``, ``first_seen``, ``last_seen``, ``age_s`` (since the last
    heartbeat), ``role``, ``gone`` (silent for longer than ``host_timeout_s``), ``stores``
    (copies on its own disk: tier -> checkpoints, bytes) and ``parts`` (copies of its parts
    on every tier, wherever stored: tier -> checkpoints, bytes).
    """
    now = datetime.now(UTC)
    out: dict[str, dict[str, Any]] = {}
    for h in core.catalog.hosts():
        age = (now - h.last_seen).total_seconds()
        out[h.name] = {"name": h.name, "first_seen": h.first_seen.isoformat(),
                       "last_seen": h.last_seen.isoformat(), "age_s": round(age, 1),
                       "role": h.role, "gone": age > core.settings.host_timeout_s,
                       "stores": {}, "parts": {}}
    for tier, part, stored_on, count, nbytes in core.catalog.part_usage():
        for name, key in ((stored_on, "stores"), (part, "parts")):
            if name is None:
                continue
            entry = out.setdefault(name, {"name": name, "first_seen": None, "last_seen": None,
                                          "age_s": None, "role": "", "gone": False,
                                          "stores": {}, "parts": {}})
            slot = entry[key].setdefault(tier, {"checkpoints": 0, "bytes": 0})
            slot["checkpoints"] += count
            slot["bytes"] += nbytes
    return [out[name] for name in sorted(out)]


def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    """A short JSON-able summary of a manifest for ``ckpt show``."""
    if manifest.dcp is not None:
        # Saved through DCP: the tensors are in the DCP index, not the packed arrays.
        index = manifest.dcp
        counts: dict[str, int] = {}
        for item in index.tensors.values():
            counts[item.dtype] = counts.get(item.dtype, 0) + 1
        return {
            "format_version": manifest.format_version,
            "codec": manifest.codec,
            "kind": manifest.kind,
            "tensors": len(index.tensors),
            "dtypes": counts,
            "arrays": len(index.arrays),
            "chunks": sum(len(a.chunks) for a in index.arrays.values()),
            "logical_bytes": manifest.logical_bytes,
            "stored_bytes": manifest.stored_bytes,
            "delta": None,
            "world_size": index.world_size,
        }
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


def merge_record(core: StoreCore, ck: Checkpoint) -> dict[str, Any] | None:
    """How a merged checkpoint was made, or None for one that is not a merge.

    Returns:
        ``{"method", "accumulate", "keys", "weights_from_metric", "inputs": [{"id", "ref",
        "state", "weight", "position"}, ...]}``: the inputs in their order (the first one
        supplied integer tensors and non-tensor values), from the merged-from edges; the
        rest from the ``merged`` event.
    """
    links = core.catalog.merge_inputs(ck.id)
    if not links:
        return None
    inputs = []
    for link in links:
        try:
            parent = core.catalog.get_any(link.src)
            ref, state = parent.ref, str(parent.state)
        except CkptError:
            ref, state = link.src, "unknown"
        inputs.append({"id": link.src, "ref": ref, "state": state, "weight": link.weight,
                       "position": link.position})
    events = core.catalog.events(ck.id, kind=MERGE_EVENT, limit=1)
    detail = events[0].detail if events else {}
    return {
        "method": detail.get("method"),
        "accumulate": detail.get("accumulate"),
        "keys": detail.get("keys"),
        "weights_from_metric": detail.get("weights_from_metric"),
        "inputs": inputs,
    }


def show_checkpoint(core: StoreCore, ref: str) -> dict[str, Any]:
    """Everything needed to understand and reproduce a checkpoint.

    Returns:
        A JSON-able dict: the catalog record, the run's reproduction record and a summary of
        the manifest (tensor count, dtypes, bytes, codec, chunks); for a checkpoint saved
        across hosts also ``parts``: every copy of every host's part (:func:`part_dict`);
        for a merged one ``merge``: its inputs, weights and method (:func:`merge_record`).
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
    ctx = core.catalog.context_of(ck)
    info["reproduction"]["context"] = how_to_reproduce(ctx) if ctx is not None else None
    merged = merge_record(core, ck)
    if merged is not None:
        info["merge"] = merged
    if ck.parted:
        info["parts"] = [part_dict(p) for p in core.catalog.parts(ck.id)]
    try:
        if ck.parted:
            manifest = parted_manifest(core, ck)[0]
        else:
            manifest = read_manifest(core.hot_dir_of(ck),
                                     expected_digest=expected_digest(ck, "hot"))
    except CkptError as exc:
        info["manifest"] = {"error": str(exc)}
        return info
    info["manifest"] = manifest_summary(manifest)
    info["copies"] = copies_record(core, ck, manifest)
    return info


def copies_record(core: StoreCore, ck: Checkpoint, hot: Manifest) -> list[dict[str, Any]]:
    """Per copy of ``ck``: whether it holds every chunk it reads, and which checkpoints it
    reads chunks of (refs). A copy with the hot copy's manifest reads what the hot copy
    reads; a re-encoded copy (another manifest digest: archived with re-encoding, pushed or
    imported self-contained) holds all of its chunks."""
    reads = []
    for owner in sorted(hot.referenced_checkpoints()):
        try:
            reads.append(core.catalog.get_any(owner).ref)
        except CkptError:
            reads.append(owner)  # a base the catalog no longer knows: its id
    out = []
    for replica in ck.replicas:
        own = (replica.manifest_digest in (None, ck.manifest_digest) or replica.tier == "hot") \
            and not replica.sealed
        copy_reads = reads if own else []
        entry: dict[str, Any] = {"tier": replica.tier, "state": str(replica.state),
                                 "self_contained": not copy_reads, "reads": copy_reads}
        if replica.sealed is not None:
            entry["encrypted"] = True
            entry["recipients"] = _recipients(core, ck, replica.sealed)
        out.append(entry)
    return out


def _recipients(core: StoreCore, ck: Checkpoint, copy_id: str) -> int | None:
    """How many recipients sealed copy ``copy_id`` was encrypted to, as the event that
    wrote it recorded (the catalog's answer: ``show`` reads no tier)."""
    for event in core.catalog.events(ck.id, limit=1000):
        detail = dict(event.detail)
        if event.kind in ("archived", "demoted") and detail.get("copy") == copy_id:
            count = detail.get("recipients")
            return count if isinstance(count, int) else None
    return None
