"""A checkpoint's Zarr metadata checked against its manifest, and rewritten from it.

Our reader never uses ``zarr.json`` (it reads chunks itself, with the codec the manifest
names from a fixed preset list), but ``zarr.open_group`` users do, so a planted codec, a
changed dtype or shape, or Zarr v2 metadata (``.zarray``/``.zgroup``, which zarr may prefer
to trust) would mislead them. The manifest fully determines every ``zarr.json`` the writers
produce, for the packed layout (:mod:`ckptstore.format.zarrmeta`) and the DCP layout
(:mod:`ckptstore.format.dcp.zarrdocs`) alike: :func:`expected_metadata` rebuilds them,
:func:`zarr_metadata_problems` compares documents with them (``ckpt doctor``, bundle import)
and :func:`rewrite_zarr_metadata` writes them back (``ckpt doctor --fix``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ckptstore.durable import replace_file
from ckptstore.format.codecs import codec_spec
from ckptstore.format.constants import DCP_ARRAY_GROUP, DCP_PACK_GROUP, ZARR_JSON
from ckptstore.format.dcp.zarrdocs import array_doc, group_doc, root_doc
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.fsio import read_regular
from ckptstore.format.manifest import Manifest
from ckptstore.format.zarrmeta import build_metadata

__all__ = [
    "MAX_ZARR_JSON",
    "V2_METADATA",
    "check_zarr_metadata",
    "expected_metadata",
    "rewrite_zarr_metadata",
    "zarr_metadata_problems",
]

logger = logging.getLogger(__name__)

#: Largest ``zarr.json`` read: ours are well under a kilobyte.
MAX_ZARR_JSON = 64 * 1024
#: Zarr v2 metadata: never part of our checkpoints; zarr.open_group may read it.
V2_METADATA = frozenset({".zarray", ".zgroup", ".zattrs", ".zmetadata"})
# The codecs our presets produce; anything else in a zarr.json was not written by us.
_OUR_CODECS = frozenset({"bytes", "blosc", "crc32c"})


def expected_metadata(manifest: Manifest) -> dict[str, Any]:
    """Relative path -> the parsed ``zarr.json`` the writer produced for ``manifest``."""
    if manifest.dcp is not None:
        index = manifest.dcp
        raw = {ZARR_JSON: root_doc(manifest.id),
               f"{DCP_ARRAY_GROUP}/{ZARR_JSON}": group_doc(),
               f"{DCP_PACK_GROUP}/{ZARR_JSON}": group_doc()}
        for path, array in index.arrays.items():
            raw[f"{path}/{ZARR_JSON}"] = array_doc(array.dtype, index.codec, array.shape,
                                                   array.chunk_shape)
        return {rel: json.loads(data) for rel, data in raw.items()}
    docs: dict[str, Any] = {}
    for name, entry in manifest.arrays.items():
        info = dtype_by_name(entry.torch_dtype)
        if info is None:  # the manifest was validated; unreachable for a parsed manifest
            continue
        built = build_metadata(manifest.id, [(name, entry.length, entry.chunk_len, info)],
                               codec_spec(entry.codec))
        for rel, data in built.items():
            docs[rel] = json.loads(data)
    if not manifest.arrays:
        built = build_metadata(manifest.id, [], codec_spec(manifest.codec))
        docs.update({rel: json.loads(data) for rel, data in built.items()})
    return docs


def check_zarr_metadata(directory: Path, manifest: Manifest) -> list[str]:
    """Check a local copy's Zarr metadata against the manifest.

    Each ``zarr.json`` must be exactly the document the writer produces for that array or
    group (same dtype, shape, chunking, and only the bytes/blosc/crc32c codecs), and no Zarr
    v2 metadata file may be present.

    Args:
        directory: The checkpoint directory.
        manifest: Its (verified) manifest.

    Returns:
        One line per problem; ``[]`` when the metadata is what the writer wrote.
    """
    problems: list[str] = []
    docs: dict[str, bytes] = {}
    for rel in expected_metadata(manifest):
        try:
            docs[rel] = read_regular(directory / rel, MAX_ZARR_JSON + 1)
        except FileNotFoundError:
            continue  # reported as missing below
        except OSError as exc:
            problems.append(f"{rel}: unreadable ({exc.strerror or exc})")
    problems += zarr_metadata_problems(docs, manifest)
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            if name in V2_METADATA:
                rel = os.path.relpath(os.path.join(dirpath, name), directory)
                problems.append(f"{rel}: Zarr v2 metadata in a v3 checkpoint (not ours)")
    return problems


def zarr_metadata_problems(docs: dict[str, bytes], manifest: Manifest) -> list[str]:
    """Compare ``zarr.json`` documents (relative path -> bytes) with the manifest.

    Returns:
        One line per missing, oversized, malformed or unexpected document.
    """
    problems: list[str] = []
    for rel, want in expected_metadata(manifest).items():
        raw = docs.get(rel)
        if raw is None:
            problems.append(f"{rel}: missing")
            continue
        if len(raw) > MAX_ZARR_JSON:
            problems.append(f"{rel}: over {MAX_ZARR_JSON} bytes")
            continue
        try:
            got = json.loads(raw)
        except ValueError:
            problems.append(f"{rel}: not valid JSON")
            continue
        if got != want:
            problems.append(f"{rel}: {_describe_difference(got, want)}")
    return problems


def _describe_difference(got: Any, want: dict[str, Any]) -> str:
    if not isinstance(got, dict):
        return "is not a JSON object"
    codecs = got.get("codecs")
    if isinstance(codecs, list):
        names = {c.get("name") for c in codecs if isinstance(c, dict)}
        foreign = sorted(str(n) for n in names - _OUR_CODECS)
        if foreign:
            return f"names codecs {foreign} that ckptstore never writes (hostile or foreign)"
    keys = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    return f"differs from what the manifest implies in {keys}"


def rewrite_zarr_metadata(directory: Path, manifest: Manifest) -> None:
    """Write the expected ``zarr.json`` documents back (atomically) and drop v2 metadata.

    Raises:
        StorageError: If a document cannot be written.
        OSError: If a v2 metadata file cannot be removed.
    """
    for rel, doc in expected_metadata(manifest).items():
        replace_file(directory / rel, json.dumps(doc, indent=2).encode())
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            if name in V2_METADATA:
                os.unlink(os.path.join(dirpath, name))
