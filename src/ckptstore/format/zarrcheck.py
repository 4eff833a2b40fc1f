"""A checkpoint's Zarr metadata checked against its manifest, and rewritten from it.

Our reader never uses ``zarr.json`` (it reads chunks itself, with the codec the manifest
names from a fixed preset list), but ``zarr.open_group`` users do, so a planted codec, a
changed dtype or shape, or Zarr v2 metadata (``.zarray``/``.zgroup``, which zarr may prefer
to trust) would mislead them.

Format version 2 records the blake3 of every ``zarr.json`` in the manifest (and, for an
array with chunks of other checkpoints, of its chunk-reference variant): a document is
checked byte for byte against the digest that applies to the copy — the plain one when the
copy holds every chunk file of the array itself, the reference variant when it does not
(docs/FORMAT.md, "Exact or loud"). For version 1 and the DCP layout, the manifest fully
determines every document the writers produce (:mod:`ckptstore.format.zarrmeta`,
:mod:`ckptstore.format.dcp.zarrdocs`), and :func:`expected_metadata` rebuilds them to compare.
:func:`zarr_metadata_problems` compares documents (``ckpt doctor``, ``ckpt verify``, bundle
import) and :func:`rewrite_zarr_metadata` writes them back (``ckpt doctor --fix``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ckptstore.durable import replace_file
from ckptstore.errors import IntegrityError
from ckptstore.format.codecs import codec_spec
from ckptstore.format.constants import (
    CHUNK_REF_CODEC,
    DELTA_CODEC,
    ZARR_JSON,
)
from ckptstore.format.dcp.zarrdocs import dcp_documents
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.fsio import read_regular
from ckptstore.format.manifest import Manifest
from ckptstore.format.zarrmeta import (
    ArrayMeta,
    array_metas,
    build_metadata,
    digest,
    document_variants,
    ref_document,
)

__all__ = [
    "MAX_ZARR_JSON",
    "V2_METADATA",
    "check_zarr_metadata",
    "complete_arrays",
    "expected_documents",
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
_REFUSING = frozenset({CHUNK_REF_CODEC, DELTA_CODEC})


def expected_metadata(manifest: Manifest) -> dict[str, Any]:
    """Relative path -> the parsed ``zarr.json`` the writer produced for ``manifest``."""
    if manifest.dcp is not None:
        raw = dcp_documents(manifest.id, manifest.dcp, manifest.format_version)
        return {rel: json.loads(data) for rel, data in raw.items()}
    docs: dict[str, Any] = {}
    for name, entry in manifest.arrays.items():
        info = dtype_by_name(entry.torch_dtype)
        if info is None:  # the manifest was validated; unreachable for a parsed manifest
            continue
        built = build_metadata(manifest.id, [ArrayMeta(name, entry.length, entry.chunk_len,
                                                       info, codec_spec(entry.codec))],
                               manifest.format_version)
        for rel, data in built.items():
            docs[rel] = json.loads(data)
    if not manifest.arrays:
        built = build_metadata(manifest.id, [], manifest.format_version)
        docs.update({rel: json.loads(data) for rel, data in built.items()})
    return docs


def _versioned(manifest: Manifest) -> bool:
    """Whether the manifest records the digest of every document (version 2)."""
    return bool(manifest.metadata)


def complete_arrays(directory: Path, manifest: Manifest) -> set[str]:
    """Arrays of a local copy whose chunk files are all in the copy's own directory."""
    done: set[str] = set()
    for name, entry in manifest.arrays.items():
        if all(os.path.lexists(directory / entry.chunk_path(c.i)) for c in entry.chunks):
            done.add(name)
    return done


def expected_digest(manifest: Manifest, rel: str, complete: bool) -> str:
    """The digest document ``rel`` of a version-2 copy must have.

    Args:
        manifest: The checkpoint's manifest.
        rel: Relative path of a ``zarr.json``.
        complete: Whether the copy holds every chunk file of that array itself.
    """
    if not complete and rel in manifest.metadata_ref:
        return manifest.metadata_ref[rel]
    return manifest.metadata[rel]


def expected_documents(manifest: Manifest, complete: set[str]) -> dict[str, bytes]:
    """The ``zarr.json`` bytes a version-2 copy must hold, rebuilt from the manifest.

    Args:
        manifest: The checkpoint's manifest.
        complete: Arrays whose chunk files the copy holds itself.

    Raises:
        IntegrityError: If a rebuilt document is not the one the manifest records (the zarr
            that wrote it formats documents differently): repair the copy from another one.
    """
    if manifest.dcp is not None:
        docs = dcp_documents(manifest.id, manifest.dcp, manifest.format_version)
        for rel, data in docs.items():
            if digest(data) != manifest.metadata.get(rel):
                raise IntegrityError(
                    f"cannot rebuild {rel} of checkpoint {manifest.id} byte for byte; repair "
                    "the copy from another replica (`ckpt verify --repair`)"
                )
        return docs
    plain = build_metadata(manifest.id, array_metas(manifest), manifest.format_version)
    chunks = {name: list(entry.chunks) for name, entry in manifest.arrays.items()}
    incomplete = set(manifest.arrays) - complete
    docs, _, _ = document_variants(manifest.id, plain, chunks, incomplete)
    for name in incomplete & {n for n, e in manifest.arrays.items() if _shared(e)}:
        rel = f"{name}/{ZARR_JSON}"
        docs[rel] = ref_document(manifest, name, plain[rel])
    for rel, data in docs.items():
        array = rel.rpartition("/")[0]
        if digest(data) != expected_digest(manifest, rel, array not in incomplete):
            raise IntegrityError(
                f"cannot rebuild {rel} of checkpoint {manifest.id} byte for byte (written by "
                "another zarr version); repair the copy from another replica (`ckpt verify "
                "--repair`)"
            )
    return docs


def _shared(entry: Any) -> bool:
    return any(c.src is not None for c in entry.chunks) and all(
        c.enc == "raw" for c in entry.chunks)


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
    rels = list(manifest.metadata) if _versioned(manifest) else list(expected_metadata(manifest))
    for rel in rels:
        try:
            docs[rel] = read_regular(directory / rel, MAX_ZARR_JSON + 1)
        except FileNotFoundError:
            continue  # reported as missing below
        except OSError as exc:
            problems.append(f"{rel}: unreadable ({exc.strerror or exc})")
    complete = complete_arrays(directory, manifest) if _versioned(manifest) else None
    problems += zarr_metadata_problems(docs, manifest, complete=complete)
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            if name in V2_METADATA:
                rel = os.path.relpath(os.path.join(dirpath, name), directory)
                problems.append(f"{rel}: Zarr v2 metadata in a v3 checkpoint (not ours)")
    return problems


def zarr_metadata_problems(
    docs: dict[str, bytes], manifest: Manifest, *, complete: set[str] | None = None
) -> list[str]:
    """Compare ``zarr.json`` documents (relative path -> bytes) with the manifest.

    Args:
        docs: The copy's documents.
        manifest: Its manifest.
        complete: Version 2: the arrays whose chunk files the copy holds itself (default:
            all of them, as in a bundle).

    Returns:
        One line per missing, oversized, malformed or unexpected document.
    """
    problems: list[str] = []
    if _versioned(manifest):
        held = set(manifest.arrays) if complete is None else complete
        for rel in manifest.metadata:
            raw = docs.get(rel)
            if raw is None:
                problems.append(f"{rel}: missing")
                continue
            array = rel.rpartition("/")[0]
            want = expected_digest(manifest, rel, array in held or array not in manifest.arrays)
            if digest(raw) != want:
                problems.append(f"{rel}: {_describe_v2(raw, manifest, rel)}")
        return problems
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


def _describe_v2(raw: bytes, manifest: Manifest, rel: str) -> str:
    try:
        got = json.loads(raw)
    except ValueError:
        return "not valid JSON (its digest is not the one the manifest records)"
    if isinstance(got, dict) and isinstance(got.get("codecs"), list):
        names = {c.get("name") for c in got["codecs"] if isinstance(c, dict)}
        foreign = sorted(str(n) for n in names - _OUR_CODECS - _REFUSING)
        if foreign:
            return f"names codecs {foreign} that ckptstore never writes (hostile or foreign)"
    return "differs from the document the manifest records (its digest does not match)"


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
    if _versioned(manifest):
        for rel, data in expected_documents(manifest, complete_arrays(directory, manifest)).items():
            replace_file(directory / rel, data)
    else:
        for rel, doc in expected_metadata(manifest).items():
            replace_file(directory / rel, json.dumps(doc, indent=2).encode())
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            if name in V2_METADATA:
                os.unlink(os.path.join(dirpath, name))
