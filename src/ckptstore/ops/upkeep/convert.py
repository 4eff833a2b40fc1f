"""Convert checkpoints to and from plain PyTorch formats.

* :func:`export_checkpoint` writes a committed checkpoint as a ``torch.save`` file (``pt``),
  a safetensors file, a Hugging Face style folder (``hf``) or a
  ``torch.distributed.checkpoint`` folder (``dcp``). safetensors, hf and dcp stream: tensors
  are read one at a time from the checkpoint and written out at once, so memory holds one
  tensor (plus one chunk), not the state. ``pt`` cannot stream (``torch.save`` pickles one
  object), so it holds the full state in memory.
* :func:`import_checkpoint` saves a ``.pt``/``.bin``, safetensors, hf or DCP input as a new
  checkpoint, never unpickling arbitrary objects.
* :func:`convert_checkpoint` re-encodes a checkpoint with another codec as a new version.

Files converted without any store (``ckpt convert --input-dir D --output-dir O``) and the
readers and writers used here are in :mod:`ckptstore.convert`.

Behaviour choices:

* safetensors export keeps ckptstore's tensor keys verbatim (``model/encoder.weight``,
  ``optimizer/state/0/exp_avg``; see :mod:`ckptstore.format.keys`) and stores the state's
  JSON skeleton (all non-tensor values and the container structure) in ``__metadata__``
  under ``"ckptstore"``, so importing the file gives back the exact state. ``keys`` selects
  parts but never renames them; for clean weight names use ``hf``.
* hf export holds weights only: the ``model`` subtree when there is one (its prefix
  stripped), else every tensor; names are the key's parts joined with ``.`` (the usual
  ``state_dict`` names). The run's config becomes ``config.json``. hf import puts the
  weights back under ``model`` and the config into the run's config.
* dcp export writes int dict keys as strings and ndarray leaves as tensors (DCP's own rules);
  a state that is not a dict is written under the key ``"state"``.
* Export produces a file, not a checkpoint: it records a ``converted`` event. Import records
  an ``imported`` event; codec conversion records a ``converted-from`` lineage edge.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ckptstore.convert.dcp_write import TensorFeed, write_dcp
from ckptstore.convert.directory import check_format
from ckptstore.convert.readers import METADATA_KEY, read_source
from ckptstore.convert.safetensors import TensorSpec, hf_name_map
from ckptstore.convert.writers import staged_output, write_hf, write_pt, write_safetensors
from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, InvalidNameError
from ckptstore.format import (
    FlatState,
    Manifest,
    flatten_state,
    iter_tensors,
    iteration_order,
    read_manifest,
    unflatten_state,
)
from ckptstore.format.dcp.layout import is_dcp_manifest
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.tree import iter_tensor_refs, select_tree
from ckptstore.ops.reading.load import load_checkpoint
from ckptstore.ops.tiering.readrepair import is_repairable, read_repair
from ckptstore.ops.tiering.replicas import manifest_of
from ckptstore.ops.tiering.restore import ensure_hot, hot_digest
from ckptstore.ops.writing.save import save_checkpoint
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint
from ckptstore.save_options import SaveOptions

__all__ = [
    "convert_checkpoint",
    "export_checkpoint",
    "import_checkpoint",
]

logger = logging.getLogger(__name__)

_DEFAULT_SHARD_BYTES = 5 * 2**30


# --------------------------------------------------------------------------- export
def export_checkpoint(
    store: StoreCore,
    ref: str,
    fmt: str,
    out: str | os.PathLike[str],
    *,
    keys: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    shard_bytes: int = _DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write a committed checkpoint in a plain PyTorch format.

    The output appears under ``out`` only once complete (written under a temporary name
    next to it, then renamed).

    Args:
        store: The open store.
        ref: Checkpoint reference (uuid, ``run@latest``, ``run@v3``, alias, ...).
        fmt: ``pt`` (alias ``pytorch``), ``safetensors``, ``hf`` or ``dcp``.
        out: Output file (pt, safetensors) or folder (hf, dcp).
        keys: fnmatch patterns selecting parts of the state (e.g. ``["model/*"]``).
        progress: Called with the bytes of each tensor written (streaming formats).
        shard_bytes: Largest shard for ``hf`` (a bigger tensor gets a shard of its own).
        overwrite: Replace an existing ``out``.

    Returns:
        The output path.

    Raises:
        CheckpointNotFoundError: If ``ref`` does not resolve or no tier holds a copy.
        ConflictError: If ``out`` exists and ``overwrite`` is False.
        InvalidNameError: For an unknown format or keys that match nothing.
        CkptError: If a dtype cannot be represented in the target format.
        IntegrityError: If the checkpoint is damaged and no other verified copy can be read
            instead (read repair, :mod:`ckptstore.ops.tiering.readrepair`).
        StorageError: If writing fails.

    Example:
        >>> export_checkpoint(store, "run-a@latest", "hf", "out/model")  # doctest: +SKIP
    """
    fmt = check_format(fmt)
    out = Path(out)
    ck = store.catalog.get(ref)
    manifest = manifest_of(store, ck)
    if is_dcp_manifest(manifest):
        # Saved through DCP: its tensors are not in the packed arrays; store.load gives the
        # full (unsharded) state, which pt and dcp can write as it is.
        if fmt not in ("pt", "dcp"):
            raise InvalidNameError(
                f"checkpoint {ck.ref} was saved through torch.distributed.checkpoint; export "
                f"it as pt or dcp, or load it and save it with store.save to export {fmt}"
            )
        state = load_checkpoint(store, ck.id, keys=keys)
        with staged_output(out, overwrite=overwrite) as tmp:
            if fmt == "pt":
                write_pt(state, tmp)
            else:
                _save_dcp_folder(state, tmp)
        store.catalog.record_event(
            "converted", checkpoint_id=ck.id,
            detail={"fmt": fmt, "path": str(out.absolute()), "keys": list(keys) if keys else None},
        )
        return out
    tree = _selected_tree(manifest, keys)
    with staged_output(out, overwrite=overwrite) as tmp:
        if fmt == "pt":
            write_pt(load_checkpoint(store, ck.id, keys=keys), tmp)
        else:
            _export_streaming(store, ck, fmt, tmp, keys=keys, tree=tree, progress=progress,
                              shard_bytes=shard_bytes)
    store.catalog.record_event(
        "converted",
        checkpoint_id=ck.id,
        detail={"fmt": fmt, "path": str(out.absolute()), "keys": list(keys) if keys else None},
    )
    logger.info("exported %s as %s to %s", ck.ref, fmt, out)
    return out


def _export_streaming(
    store: StoreCore,
    ck: Checkpoint,
    fmt: str,
    tmp: Path,
    *,
    keys: Sequence[str] | None,
    tree: Any,
    progress: Callable[[int], None] | None,
    shard_bytes: int,
) -> None:
    """Write safetensors, hf or dcp from the hot copy, one tensor at a time.

    The hot copy is restored first when only another tier holds the checkpoint, as a load
    does; a damaged one met on the way is replaced by the next verified copy
    (:class:`_HotStream`).
    """
    stream = _HotStream(store, ck)
    hot = stream.manifest
    if fmt == "safetensors":
        part = _restrict(hot, _referenced(tree))
        doc = {"version": 1, "tree": tree, "checkpoint": {"id": ck.id, "ref": ck.ref}}
        write_safetensors(
            tmp,
            _specs(part, {k: k for k in part.tensors}),
            stream.tensors(part),
            metadata={"format": "pt", METADATA_KEY: json.dumps(doc)},
            progress=progress,
        )
    elif fmt == "hf":
        names = _hf_names(hot, keys, tree)
        part = _restrict(hot, set(names))
        write_hf(
            tmp,
            _specs(part, names),
            ((names[k], t) for k, t in stream.tensors(part)),
            shard_bytes=shard_bytes,
            config=_run_config(store, ck),
            progress=progress,
        )
    else:
        _export_dcp(stream, tree, tmp, progress)


class _HotStream:
    """The tensors of a checkpoint's hot copy, one at a time, with read repair.

    A damaged chunk met on the way (the hot copy PRESENT, but a flipped bit, a truncated or
    missing file) makes the copy be replaced by the next verified one
    (:func:`~ckptstore.ops.tiering.readrepair.read_repair`), and the stream goes on with the
    tensor that failed: the tensors already handed out were read whole and verified.
    """

    def __init__(self, store: StoreCore, ck: Checkpoint) -> None:
        self.store = store
        self.directory = ensure_hot(store, ck)
        self.ck = store.catalog.get_any(ck.id)  # as it is now: the read's "before"
        self.manifest = read_manifest(self.directory,
                                      expected_digest=hot_digest(store, self.ck))

    def _locate(self, ckpt_id: str) -> Path:
        other = self.store.catalog.get_any(ckpt_id)
        return self.store.checkpoint_dir(other.run, other.id)

    def tensors(self, part: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(key, tensor)`` for the tensors of ``part`` (a restriction of
        :attr:`manifest`), in :func:`iter_tensors` order."""
        done: set[str] = set()
        repaired = False
        while True:
            rest = _restrict(part, set(part.tensors) - done)
            try:
                for key, tensor in iter_tensors(self.directory, rest, locate=self._locate):
                    done.add(key)
                    yield key, tensor
                return
            except CkptError as exc:
                if repaired or not is_repairable(exc):
                    raise
                self.directory = read_repair(self.store, self.ck, exc, found_by="export")
                repaired = True
                self.ck = self.store.catalog.get_any(self.ck.id)
                again = read_manifest(self.directory,
                                      expected_digest=hot_digest(self.store, self.ck))
                part = _restrict(again, set(part.tensors))


def _save_dcp_folder(state: Any, path: Path) -> None:
    """Write a full in-memory state as a DCP folder (one process)."""
    import warnings

    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)


def _selected_tree(manifest: Manifest, keys: Sequence[str] | None) -> Any:
    if not keys:
        return manifest.tree
    tree, matched = select_tree(manifest.tree, list(keys))
    unmatched = [p for p in keys if p not in matched]
    if tree is None or unmatched:
        raise InvalidNameError(
            f"keys {unmatched or list(keys)} match nothing in checkpoint {manifest.id}; "
            "list its keys with `ckpt show` and use fnmatch patterns such as 'model/*'"
        )
    return tree


def _referenced(tree: Any) -> set[str]:
    return {key for _, _, key in iter_tensor_refs(tree)}


def _restrict(manifest: Manifest, keys: set[str]) -> Manifest:
    """The manifest limited to ``keys``: iter_tensors then reads only their chunks."""
    if keys == set(manifest.tensors):
        return manifest
    tensors = {k: e for k, e in manifest.tensors.items() if k in keys}
    return dataclasses.replace(manifest, tensors=tensors)


def _specs(manifest: Manifest, names: dict[str, str]) -> list[TensorSpec]:
    specs = []
    for key, entry in manifest.tensors.items():
        info = dtype_by_name(entry.torch_dtype)
        if info is None:
            raise CkptError(
                f"tensor {key!r} has dtype {entry.torch_dtype!r}, unknown to this torch build; "
                "export it with a newer torch"
            )
        specs.append(TensorSpec(names[key], info.torch_dtype, tuple(entry.shape)))
    return specs


def _hf_names(manifest: Manifest, keys: Sequence[str] | None, tree: Any) -> dict[str, str]:
    """Tensor key -> Hugging Face weight name, for the selected tensors."""
    selected = _referenced(tree) if keys else set(manifest.tensors)
    names = hf_name_map([k for k in manifest.tensors if k in selected])
    if not names:
        raise InvalidNameError(f"checkpoint {manifest.id} holds no tensors to export")
    return names


def _run_config(store: StoreCore, ck: Checkpoint) -> dict[str, Any] | None:
    try:
        config = store.catalog.get_run(ck.run).config
    except CkptError:
        return None
    return dict(config) if config else None


def _export_dcp(
    stream: _HotStream,
    tree: Any,
    tmp: Path,
    progress: Callable[[int], None] | None,
) -> None:
    refs = list(iter_tensor_refs(tree))
    part = _restrict(stream.manifest, {key for _, _, key in refs})
    metas = {
        key: torch.empty(entry.shape, dtype=_dtype(entry.torch_dtype), device="meta")
        for key, entry in part.tensors.items()
    }
    skeleton = unflatten_state(_as_tensor_nodes(tree), metas)
    if not isinstance(skeleton, dict):
        skeleton = {"state": skeleton}
    feed = TensorFeed(stream.tensors(part), Counter(key for _, _, key in refs))
    write_dcp(
        tmp,
        skeleton,
        feed,
        {id(m): k for k, m in metas.items()},
        iteration_order(part),
        progress=progress,
    )


def _dtype(name: str) -> torch.dtype:
    info = dtype_by_name(name)
    if info is None:
        raise CkptError(f"dtype {name!r} is unknown to this torch build; use a newer torch")
    return info.torch_dtype


def _as_tensor_nodes(node: Any) -> Any:
    """The tree with ndarray leaves turned into tensor leaves (DCP stores tensors only)."""
    if isinstance(node, dict):
        if node.get("t") == "ndarray":
            return {"t": "tensor", "key": node["key"]}
        if node.get("t") in ("list", "tuple", "dict", "odict"):
            return {**node, "v": [_as_tensor_nodes(v) for v in node["v"]]}
    return node


# --------------------------------------------------------------------------- import
def import_checkpoint(
    store: StoreCore,
    path: str | os.PathLike[str],
    *,
    run: str,
    step: int,
    fmt: str | None = None,
    metrics: dict[str, float] | None = None,
    tags: Sequence[str] = (),
    parent: str | None = None,
    codec: str | None = None,
    progress: Progress | None = None,
) -> Checkpoint:
    """Save a plain PyTorch checkpoint as a new version of ``run`` at ``step``.

    Nothing is ever unpickled beyond torch's weights-only allowlist, even with
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` set. The whole state is in memory while it is
    saved (``.pt`` files are memory-mapped, so their tensors stay file-backed).

    Args:
        store: The open store.
        path: A ``.pt``/``.pth``/``.bin`` or ``.safetensors`` file, a Hugging Face folder or
            a DCP folder.
        run: Run to save into.
        step: Training step.
        fmt: ``pt``, ``safetensors``, ``hf`` or ``dcp``; None detects it.
        metrics: Metrics to record.
        tags: Tags to record.
        parent: Reference of the checkpoint this one derives from.
        codec: Codec preset (default from the settings).
        progress: Called with the tensor bytes of each chunk saved; one with ``set_total``
            (:mod:`ckptstore.progress`) is first told the tensor bytes of the input.

    Returns:
        The committed checkpoint.

    Raises:
        UnsafeObjectError: If the input needs arbitrary unpickling (nothing of it runs).
        InvalidNameError: If the format cannot be detected or is unknown.
        IntegrityError: If the input is damaged.
        StorageError: If it cannot be read, or the save fails.
    """
    source_path = Path(path)
    source = read_source(source_path, check_format(fmt) if fmt else None)
    if source.config is not None:
        info = store.catalog.ensure_run(run, config=source.config)
        if info.config != source.config:
            logger.warning(
                "run %s already has a config; the config.json of %s was not applied",
                run, source_path,
            )
    # hf weights go under "model", so that exporting as hf again gives the same names.
    state = {"model": source.state} if source.fmt == "hf" else source.state
    # Flattened once: the progress total and the save both take it.
    flat = flatten_state(state)
    if progress is not None:
        announce_total(progress, _tensor_bytes(flat))
    options = SaveOptions(metrics=metrics, tags=tuple(tags), parent=parent, codec=codec)
    ck = save_checkpoint(store, run, step, flat, options, progress=progress)
    store.catalog.record_event(
        "imported",
        checkpoint_id=ck.id,
        detail={"fmt": source.fmt, "path": str(source_path.absolute())},
    )
    logger.info("imported %s (%s) as %s", source_path, source.fmt, ck.ref)
    return ck


def _tensor_bytes(flat: FlatState) -> int:
    """Bytes of the tensors in ``flat`` (each once; what a save reports as progress)."""
    return sum(t.nelement() * t.element_size() for t in flat.tensors.values())


def convert_checkpoint(store: StoreCore, ref: str, *, codec: str) -> Checkpoint:
    """Rewrite a checkpoint with another codec, as a new version of the same run and step.

    The new checkpoint keeps the metrics, tags and parent of the source and gets a
    ``converted-from`` lineage edge from it. Idempotent: if the source was already
    converted to ``codec`` (a committed ``converted-from`` target with that codec exists),
    that checkpoint is returned and nothing is written; a source already in ``codec`` is
    returned as is. The full state is in memory while it is copied.

    Args:
        store: The open store.
        ref: The source checkpoint reference.
        codec: Codec preset of the new version (see ``ckptstore.format.CODEC_PRESETS``).

    Returns:
        The new (or already existing) committed checkpoint.

    Raises:
        CheckpointNotFoundError: If ``ref`` does not resolve or has no hot copy.
        IntegrityError: If the source is damaged.
        ConfigError: If ``codec`` is not a known preset (raised by the save).
    """
    src = store.catalog.get(ref)
    if src.codec == codec:
        logger.info("%s is already encoded with %s; nothing to do", src.ref, codec)
        return src
    done = _converted_to(store, src, codec)
    if done is not None:
        logger.info("%s was already re-encoded with %s as %s", src.ref, codec, done.ref)
        return done
    state = load_checkpoint(store, src.id)
    options = SaveOptions(metrics=src.metrics, tags=src.tags, parent=src.parent_id,
                          codec=codec)
    new = save_checkpoint(store, src.run, src.step, state, options)
    del state
    store.catalog.add_edge(src.id, new.id, "converted-from")
    store.catalog.record_event(
        "converted", checkpoint_id=new.id, detail={"from": src.id, "codec": codec}
    )
    logger.info("re-encoded %s with %s as %s", src.ref, codec, new.ref)
    return new


def _converted_to(store: StoreCore, src: Checkpoint, codec: str) -> Checkpoint | None:
    """An earlier committed re-encoding of ``src`` with ``codec``, if any."""
    for edge_src, edge_dst, kind in store.catalog.edges(src.id):
        if edge_src != src.id or kind != "converted-from":
            continue
        try:
            candidate = store.catalog.get(edge_dst)
        except CkptError:  # deleted or never committed
            continue
        if candidate.codec == codec:
            return candidate
    return None
