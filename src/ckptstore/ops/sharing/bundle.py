"""Bundles: one checkpoint as a single tar file, to move between stores and machines.

A bundle holds ``ckptstore-bundle.json`` (what it is: id, run, step, digest, metrics, tags,
file list, and the run context the checkpoint was saved under with the blobs it names, so the
importing store can say how to reproduce it) and the checkpoint's own files under
``checkpoint/`` (chunks, Zarr metadata, ``manifest.json``, ``COMMITTED``, and ``SIGNATURE``
when signed). The header is not signed: like metrics and tags, the context is what the
exporter says, each part checked against its own digest.

A hot copy re-encoded with the archive codec (restored from such an archive copy, see
:mod:`ckptstore.ops.tiering.reencode`) is exported as it is, with the original manifest it carries
(``manifest.orig.json``): the header's ``manifest_digest`` is the checkpoint's own (original)
digest, the identity signatures sign, and ``copy_digest`` the re-encoded manifest's. The
importer checks the re-encoded manifest against the marker and ``copy_digest``, the original
bytes against ``manifest_digest`` (and the signature over it), and that both describe the same
chunks (:func:`ckptstore.ops.tiering.reencode.check_same_content`); the imported checkpoint
keeps the original digest and its hot replica records the re-encoded one.

Importing treats the tar as hostile. The tar itself is read through
:mod:`ckptstore.format.tarball` (extended headers bounded before ``tarfile`` allocates them,
safe member names, regular files only, bounded member count). Before anything is written the
importer then refuses members that are not a bundle's, members larger than their kind allows
(each chunk exactly the size its manifest records) and unexpected files; it checks the
manifest (size, JSON nesting/item counts, digest against ``COMMITTED`` and the header), when
asked the Ed25519 signature, and every chunk's decoded content against the manifest's blake3
(a chunk forged to keep its size and crc32c is refused here, naming checkpoint, tensor and
chunk). Files are then written one by one with exclusive, no-follow creates (never
``tarfile.extract``), every chunk is re-hashed on disk, the Zarr metadata must be what the
manifest implies, and only then is the commit marker written and the catalog row committed.
A failed import leaves nothing: no row, no file, no directory it created.

Export and import stay in one module, long as it is: they are the two sides of one file
format, and every rule the importer checks is a property the exporter writes.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from ckptstore.catalog.checks import check_metrics, check_step, check_tags
from ckptstore.core import StoreCore
from ckptstore.durable import fsync_fd, fsync_tree, rename_into_place
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptError,
    ConflictError,
    IntegrityError,
    InvalidNameError,
    StorageError,
)
from ckptstore.format import Manifest, read_manifest, verify_checkpoint
from ckptstore.format.constants import (
    BUNDLE_FILES,
    BUNDLE_HEADER,
    COMMIT_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    ZARR_JSON,
)
from ckptstore.format.manifest import manifest_digest
from ckptstore.format.sealed import DirectoryContents
from ckptstore.format.tarball import (
    MAX_JSON_ITEMS,
    HostileTarFile,
    bounded_json,
    open_hostile,
    read_member,
    scan_members,
)
from ckptstore.names import validate_name
from ckptstore.ops.sharing.signing import (
    SIGNATURE_NAME,
    SignatureDoc,
    check_signature,
    load_public_key,
)
from ckptstore.ops.tiering.reencode import check_original
from ckptstore.ops.writing.context import adopt_context, context_payload
from ckptstore.ops.writing.lossy import lossy_record
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState
from ckptstore.storage.local import LocalTier
from ckptstore.storage.transfer import (
    ORIGINAL_MANIFEST_NAME,
    is_reencoded,
    owned_files,
)

__all__ = ["BUNDLE_HEADER", "BundleContents", "bundle_contents", "export_bundle",
           "import_bundle"]

logger = logging.getLogger(__name__)

_PREFIX = BUNDLE_FILES
_FORMAT = "ckptstore-bundle"
_VERSION = 1
_MAX_SMALL = 64 * 1024  # zarr.json, COMMITTED, SIGNATURE
_MAX_HEADER = 16 * 1024 * 1024
#: JSON values the header may hold besides four per member: metrics, tags and the run context
#: (its config and notes; the patch and the lock are single base64 strings).
_CONTEXT_ITEMS = 65_536
_DEFAULT_MAX_MEMBERS = 200_000
_COPY_BLOCK = 4 * 1024 * 1024
#: Codec of the self-contained copy a delta is bundled as (``bundle_contents(workdir=)``).
_SELF_CONTAINED_CODEC = "zstd-1"


# ---------------------------------------------------------------------- export
def _tar_add(tar: tarfile.TarFile, name: str, data: IO[bytes], size: int, mtime: int) -> None:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = mtime
    info.type = tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, data)


@dataclass(frozen=True)
class BundleContents(DirectoryContents):
    """What a bundle of one checkpoint holds, before it is written anywhere: the members of
    :class:`~ckptstore.format.sealed.DirectoryContents` (header, directory, files, sizes),
    and the checkpoint they are.
    """

    checkpoint: Checkpoint


def bundle_contents(store: StoreCore, ref: str, *,
                    workdir: Path | None = None) -> BundleContents:
    """What a bundle of checkpoint ``ref`` holds (its hot copy checked first).

    An archived checkpoint is restored to the hot tier first. A checkpoint that reads chunks
    of others (a delta or dedup'd save) cannot be bundled alone, unless ``workdir`` is given:
    a self-contained copy of it is then re-encoded there
    (:func:`~ckptstore.ops.tiering.reencode.reencode_copy`, every chunk read, decoded and
    checked against its blake3) and bundled as any re-encoded copy is, with its original
    manifest. The caller removes ``workdir``.

    Raises:
        CheckpointNotFoundError: If the reference does not resolve.
        InvalidNameError: If the checkpoint is a delta.
        IntegrityError: If the hot copy is damaged.
    """
    from ckptstore.ops.tiering.reencode import read_copy_manifest
    from ckptstore.ops.tiering.restore import ensure_hot, hot_digest

    ck = store.catalog.get(ref)
    directory = ensure_hot(store, ck)
    if ck.manifest_digest is None:
        raise IntegrityError(f"checkpoint {ck.ref} has no manifest digest in the catalog")
    # The hot copy may be a re-encoded one: its original manifest must check out too.
    manifest = read_copy_manifest(directory, ck.manifest_digest, hot_digest(store, ck))
    if manifest.referenced_checkpoints() and workdir is not None:
        directory, manifest = _self_contained(store, ck, manifest, workdir, directory)
    elif manifest.referenced_checkpoints():
        raise InvalidNameError(
            f"checkpoint {ck.ref} is a delta (it reads chunks of "
            f"{', '.join(sorted(manifest.referenced_checkpoints()))}); a bundle holds one full "
            "checkpoint: re-save it in full (`ckpt convert REF --codec ...`) and export that"
        )
    problems = verify_checkpoint(directory, manifest, deep=False)
    if problems:
        raise IntegrityError(f"cannot export {ck.ref}: its hot copy is damaged: "
                             + "; ".join(problems[:3]) + "; run `ckpt verify` to repair it")
    files = owned_files(manifest)
    signature = directory / SIGNATURE_NAME
    if signature.is_file():
        files.append(SIGNATURE_NAME)
    sizes = {rel: (directory / rel).stat().st_size for rel in files}
    header = {
        "format": _FORMAT,
        "version": _VERSION,
        "checkpoint_id": ck.id,
        "run": ck.run,
        "step": ck.step,
        "manifest_digest": ck.manifest_digest,
        "metrics": dict(ck.metrics),
        "tags": list(ck.tags),
        "created_at": ck.created_at.isoformat(),
        "exported_at": datetime.now(UTC).isoformat(),
        "files": [{"path": rel, "size": sizes[rel]} for rel in files],
    }
    if is_reencoded(manifest):
        header["copy_digest"] = manifest.digest
    payload = context_payload(store.catalog, ck)
    if payload is not None:
        doc, digest, blobs = payload
        header["context"] = {"digest": digest, "document": doc, "blobs": {
            name: base64.b64encode(blob).decode("ascii") for name, blob in blobs.items()}}
    data = json.dumps(header, sort_keys=True, indent=1).encode()
    return BundleContents(header=data, directory=directory, files=files, sizes=sizes,
                          checkpoint=ck)


def _self_contained(store: StoreCore, ck: Checkpoint, manifest: Manifest, workdir: Path,
                    hot_dir: Path) -> tuple[Path, Manifest]:
    """A self-contained re-encoded copy of ``ck`` under ``workdir``: its directory and
    manifest (its signature copied along)."""
    from ckptstore.ops.tiering.reencode import reencode_copy
    from ckptstore.ops.tiering.replicas import run_resolver

    tier = LocalTier(workdir, name="hot")
    result = reencode_copy(store.tier("hot"), tier, ck.run, manifest, _SELF_CONTAINED_CODEC,
                           run_of=run_resolver(store, ck), own_digest=ck.manifest_digest,
                           threads=store.settings.threads, deep=True)
    directory = tier.local_dir(ck.run, ck.id)
    assert directory is not None
    signature = hot_dir / SIGNATURE_NAME
    if signature.is_file():
        shutil.copyfile(signature, directory / SIGNATURE_NAME)
    return directory, result.manifest


def export_bundle(store: StoreCore, ref: str, out_tar: str | os.PathLike[str], *,
                  progress: Progress | None = None) -> Path:
    """Write one committed checkpoint as a bundle (an uncompressed tar).

    An archived checkpoint is restored to the hot tier first. A bundle is self-contained by
    construction: a checkpoint that reads chunks of other checkpoints (deduplicated chunks,
    xor or lossy deltas) is bundled as a re-encoded copy that holds every chunk it reads
    (:func:`bundle_contents`), every chunk checked against its recorded blake3 on the way, so
    the importing store gets the same bytes, bit for bit.

    Args:
        store: The open store.
        ref: Checkpoint reference.
        out_tar: Output path; written atomically (a temp name, then a rename).
        progress: Called with the size of each file added; one with ``set_total``
            (:mod:`ckptstore.progress`) is first told the bytes of all of them.

    Returns:
        The bundle's path.

    Raises:
        CheckpointNotFoundError: If the reference does not resolve.
        IntegrityError: If the hot copy, or a chunk it reads, is damaged.
        StorageError: If the bundle cannot be written.
    """
    out = Path(out_tar)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # A checkpoint that reads chunks of others is bundled self-contained: its re-encoded
        # copy goes to a scratch directory beside the bundle (same file system), removed after.
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.chunks-", dir=out.parent))
    except OSError as exc:
        raise StorageError(exc.errno or 5, f"cannot write bundle {out}: "
                                           f"{exc.strerror or exc}; check the path") from exc
    try:
        return _write_bundle(store, bundle_contents(store, ref, workdir=scratch), out, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_bundle(store: StoreCore, contents: BundleContents, out: Path,
                  progress: Progress | None) -> Path:
    """Write ``contents`` as the bundle ``out`` (a temp name, then a rename)."""
    ck, directory, files, sizes = (contents.checkpoint, contents.directory, contents.files,
                                   contents.sizes)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    mtime = int(ck.created_at.timestamp())
    announce_total(progress, sum(sizes.values()))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            data = contents.header
            _tar_add(tar, BUNDLE_HEADER, io.BytesIO(data), len(data), mtime)
            for rel in files:
                with open(directory / rel, "rb") as fh:
                    _tar_add(tar, _PREFIX + rel, fh, sizes[rel], mtime)
                if progress is not None:
                    progress(sizes[rel])
        rename_into_place(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError(exc.errno or 5, f"cannot write bundle {out}: {exc.strerror or exc}; "
                                           "check the path and free space") from exc
    store.catalog.record_event("exported", checkpoint_id=ck.id,
                               detail={"bundle": str(out), "files": len(files),
                                       "signed": SIGNATURE_NAME in files})
    logger.info("exported %s (%s) to %s: %d files", ck.ref, ck.id, out, len(files))
    return out


# ---------------------------------------------------------------------- import: checks
def _check_member_name(name: str) -> None:
    """Refuse a (safe) member name that is not one of a bundle's."""
    if name != BUNDLE_HEADER and not name.startswith(_PREFIX):
        raise InvalidNameError(f"bundle member {name!r} is not part of a ckptstore bundle")


def _parse_header(data: bytes, members: int) -> dict[str, Any]:
    # The header lists every member (three JSON values each) plus metrics, tags and the run
    # context: bound its values by the member count (and the context's allowance), so a
    # small bundle cannot carry a huge header.
    header = bounded_json(data, f"the bundle header {BUNDLE_HEADER}",
                           min(MAX_JSON_ITEMS, 4 * members + _CONTEXT_ITEMS))
    if not isinstance(header, dict) or (header.get("format"), header.get("version")) != (
        _FORMAT, _VERSION
    ):
        raise IntegrityError(f"{BUNDLE_HEADER} is not a version {_VERSION} ckptstore bundle "
                             "header; refusing the bundle")
    for key, kind in (("checkpoint_id", str), ("manifest_digest", str), ("run", str),
                      ("metrics", dict), ("tags", list)):
        if not isinstance(header.get(key), kind):
            raise IntegrityError(f"{BUNDLE_HEADER}: field {key!r} is missing or malformed")
    if "copy_digest" in header and not isinstance(header["copy_digest"], str):
        raise IntegrityError(f"{BUNDLE_HEADER}: field 'copy_digest' is malformed")
    # What the catalog will record, checked against its columns here, at the boundary: a
    # 400-digit metric would otherwise end in an OverflowError (float() of it).
    try:
        header["metrics"] = check_metrics(header["metrics"])
        header["tags"] = list(check_tags(header["tags"]))
        if "step" in header:
            check_step(header["step"])
    except InvalidNameError as exc:
        raise IntegrityError(f"{BUNDLE_HEADER}: {exc}; refusing the bundle") from None
    if "context" in header:
        header["context"] = _parse_context(header["context"])
    return header


def _parse_context(value: Any) -> tuple[dict[str, Any], str, dict[str, bytes]]:
    """The header's run context: the document, its digest and its blobs, each checked
    against its digest here, before anything is written."""
    from ckptstore.capture import blob_digest, context_digest

    if not (isinstance(value, dict) and isinstance(value.get("document"), dict)
            and isinstance(value.get("digest"), str) and isinstance(value.get("blobs"), dict)):
        raise IntegrityError(f"{BUNDLE_HEADER}: field 'context' is malformed; refusing the "
                             "bundle")
    doc, digest = value["document"], value["digest"]
    if context_digest(doc) != digest:
        raise IntegrityError(f"{BUNDLE_HEADER}: the run context does not match its digest "
                             f"{digest}; refusing the bundle")
    blobs: dict[str, bytes] = {}
    for name, text in value["blobs"].items():
        try:
            blob = base64.b64decode(text, validate=True) if isinstance(text, str) else None
        except (binascii.Error, ValueError):
            blob = None
        if blob is None or blob_digest(blob) != name:
            raise IntegrityError(f"{BUNDLE_HEADER}: context blob {name[:80]!r} does not match "
                                 "its digest; refusing the bundle")
        blobs[name] = blob
    return doc, digest, blobs


def _parse_manifest(data: bytes, marker: bytes, header: dict[str, Any]) -> Manifest:
    if len(data) > MAX_MANIFEST_BYTES:
        raise IntegrityError("the bundle's manifest is over the size limit")
    # Checked before parsing: a hostile manifest costs nothing but a hash.
    digest = manifest_digest(data)
    if marker.decode("ascii", "replace").strip() != digest:
        raise IntegrityError(
            f"the bundle's {COMMIT_NAME} does not hold its manifest's digest {digest}: the "
            "bundle is damaged or was tampered with"
        )
    # A re-encoded copy's digest is the header's copy_digest; manifest_digest is then the
    # original's, checked against the original manifest bytes by the caller.
    named = header.get("copy_digest", header["manifest_digest"])
    if named != digest:
        raise IntegrityError(
            f"the bundle header names manifest {named}, but the manifest "
            f"has digest {digest}: the bundle was tampered with"
        )
    bounded_json(data, "the bundle's manifest")  # bounds the parse Manifest.from_json does
    manifest = Manifest.from_json(data)
    if is_reencoded(manifest) != ("copy_digest" in header) or (
            is_reencoded(manifest)
            and manifest.reencoded_from != header["manifest_digest"]):
        raise IntegrityError(
            "the bundle header and its manifest disagree on whether (and from which "
            "original) the copy was re-encoded: the bundle was tampered with"
        )
    if manifest.id != header["checkpoint_id"]:
        raise IntegrityError(f"the bundle header names checkpoint {header['checkpoint_id']}, "
                             f"but the manifest is checkpoint {manifest.id}")
    if manifest.referenced_checkpoints():
        raise IntegrityError("the bundle holds a delta checkpoint without its base")
    return manifest


def _size_limits(manifest: Manifest) -> dict[str, int]:
    """Exact size of every chunk file, and upper bounds for the small files."""
    limits: dict[str, int] = {}
    for array in manifest.arrays.values():
        for chunk in array.chunks:
            limits[array.chunk_path(chunk.i)] = chunk.nbytes
    for rel, nbytes, _crc in manifest.files:
        limits[rel] = nbytes
    for rel in owned_files(manifest):
        limits.setdefault(rel, MAX_MANIFEST_BYTES
                          if rel in (MANIFEST_NAME, ORIGINAL_MANIFEST_NAME) else _MAX_SMALL)
    limits[SIGNATURE_NAME] = _MAX_SMALL
    return limits


def _precheck_content(tar: HostileTarFile, members: dict[str, tarfile.TarInfo],
                      manifest: Manifest) -> None:
    """Check every chunk (size, crc32c and its decoded content's blake3) and the Zarr
    metadata straight from the tar, before the catalog or the hot tier is touched (one chunk
    in memory at a time)."""
    from ckptstore.format.chunkbytes import chunk_problem
    from ckptstore.format.zarrcheck import zarr_metadata_problems

    for array in manifest.arrays.values():
        for chunk in array.chunks:
            rel = array.chunk_path(chunk.i)
            data = read_member(tar, members[_PREFIX + rel], chunk.nbytes)
            problem = chunk_problem(manifest, array.name, chunk.i, data)
            if problem is not None:
                raise IntegrityError(
                    f"bundle member {_PREFIX + rel}: {problem}: the bundle is damaged or was "
                    "tampered with; refusing it"
                )
    docs = {rel: read_member(tar, info, _MAX_SMALL)
            for rel, info in ((n[len(_PREFIX):], i) for n, i in members.items())
            if rel.endswith(ZARR_JSON)}
    problems = zarr_metadata_problems(docs, manifest)
    if problems:
        raise IntegrityError("the bundle's Zarr metadata does not match its manifest: "
                             + "; ".join(problems[:3]) + "; refusing it")


# ---------------------------------------------------------------------- import: writing
def _write_member(tar: HostileTarFile, info: tarfile.TarInfo, target: Path) -> None:
    """Copy one member to ``target`` with an exclusive, no-follow create, fsynced."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle = tar.extractfile(info)
    if handle is None:
        raise IntegrityError(f"bundle member {info.name!r} cannot be read")
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        remaining = info.size
        with handle:
            while remaining > 0:
                block = handle.read(min(_COPY_BLOCK, remaining))
                if not block:
                    raise IntegrityError(f"bundle member {info.name!r} is truncated")
                view = memoryview(block)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                remaining -= len(block)
        fsync_fd(fd, target)
    finally:
        os.close(fd)


def import_bundle(
    store: StoreCore,
    tar_path: str | os.PathLike[str],
    *,
    run: str | None = None,
    require_signature: str | os.PathLike[str] | None = None,
    max_members: int = _DEFAULT_MAX_MEMBERS,
    progress: Progress | None = None,
) -> Checkpoint:
    """Register the checkpoint held in a bundle, after checking everything in it.

    The checkpoint keeps its id (so signatures and lineage stay valid); importing a bundle
    already in the store returns the existing checkpoint.

    Args:
        store: The open store.
        tar_path: The bundle (a tar, optionally compressed).
        run: Run to file it under (default: the run named in the bundle).
        require_signature: A PEM public key: refuse the bundle unless its signature verifies
            with that key.
        max_members: Refuse bundles with more members than this.
        progress: Called with the size of each file written to the hot tier; one with
            ``set_total`` (:mod:`ckptstore.progress`) is first told the bytes of all of them
            (once the bundle's header and manifest checked out).

    Returns:
        The COMMITTED checkpoint.

    Raises:
        InvalidNameError: For an unsafe member path or run name.
        IntegrityError: For a malformed, oversized, tampered or damaged bundle, or a missing
            or invalid signature when one is required.
        ConflictError: If the store has a different checkpoint with the same id.
        StorageError: If the bundle cannot be read or the hot tier cannot be written.
    """
    path = Path(tar_path)
    public_key = load_public_key(require_signature) if require_signature is not None else None
    if not path.is_file():
        raise StorageError(2, f"bundle {path} does not exist or is not a file")
    try:
        with open_hostile(path, "bundle") as tar:
            return _import(store, tar, path, run, public_key, max_members, progress)
    except tarfile.TarError as exc:
        raise IntegrityError(f"{path} is not a valid tar bundle ({exc})") from exc
    except EOFError as exc:
        raise IntegrityError(f"{path} is truncated ({exc})") from exc


def _import(store: StoreCore, tar: HostileTarFile, path: Path, run: str | None,
            public_key: Any, max_members: int, progress: Progress | None) -> Checkpoint:
    members = scan_members(tar, max_members, _check_member_name)
    if BUNDLE_HEADER not in members:
        raise IntegrityError(f"{path} has no {BUNDLE_HEADER}: it is not a ckptstore bundle")
    header = _parse_header(read_member(tar, members[BUNDLE_HEADER], _MAX_HEADER), len(members))
    for rel in (MANIFEST_NAME, COMMIT_NAME):
        if _PREFIX + rel not in members:
            raise IntegrityError(f"the bundle has no {rel}; refusing it")
    manifest_bytes = read_member(tar, members[_PREFIX + MANIFEST_NAME], MAX_MANIFEST_BYTES)
    marker = read_member(tar, members[_PREFIX + COMMIT_NAME], _MAX_SMALL)
    manifest = _parse_manifest(manifest_bytes, marker, header)
    limits = _size_limits(manifest)
    expected = set(owned_files(manifest))
    present = {name[len(_PREFIX):] for name in members if name != BUNDLE_HEADER}
    unexpected = sorted(present - expected - {SIGNATURE_NAME})
    if unexpected:
        raise IntegrityError(f"the bundle holds files that are not part of checkpoint "
                             f"{manifest.id}: {unexpected[:5]}; refusing it")
    missing = sorted(expected - present)
    if missing:
        raise IntegrityError(f"the bundle lacks {len(missing)} files of checkpoint "
                             f"{manifest.id} (first: {missing[0]}); it is incomplete")
    exact_sizes = {array.chunk_path(c.i) for array in manifest.arrays.values()
                   for c in array.chunks} | {rel for rel, _, _ in manifest.files}
    for rel in present:
        info = members[_PREFIX + rel]
        exact = rel in exact_sizes
        if (exact and info.size != limits[rel]) or info.size > limits.get(rel, _MAX_SMALL):
            raise IntegrityError(f"bundle member {info.name!r} is {info.size} bytes, but "
                                 f"{'exactly' if exact else 'at most'} {limits[rel]} are "
                                 "allowed; refusing the bundle")
    signature: SignatureDoc | None = None
    if SIGNATURE_NAME in present:
        signature = SignatureDoc.parse(read_member(tar, members[_PREFIX + SIGNATURE_NAME],
                                                    _MAX_SMALL))
    digest = manifest.digest
    # The checkpoint's identity: its original manifest (the copy's own when not re-encoded).
    original = manifest
    if is_reencoded(manifest):
        original = check_original(
            manifest,
            read_member(tar, members[_PREFIX + ORIGINAL_MANIFEST_NAME], MAX_MANIFEST_BYTES),
            header["manifest_digest"],
        )
    own = original.digest
    if public_key is not None:
        if signature is None:
            raise IntegrityError(f"bundle {path.name} is not signed, and a signature is "
                                 "required; refusing it")
        check_signature(signature, manifest.id, own, public_key)

    _precheck_content(tar, members, manifest)
    target_run = validate_name(run if run is not None else header["run"])
    existing = _existing(store, manifest.id, own)
    if existing is not None:
        logger.info("bundle %s is already in the store as %s", path, existing.ref)
        return existing
    directory = store.checkpoint_dir(target_run, manifest.id)
    before = _Before(run_dir=directory.parent.exists(), ck_dir=os.path.lexists(directory),
                     run=_has_run(store, target_run))
    ck = store.catalog.begin_checkpoint(
        target_run, manifest.step, ckpt_id=manifest.id, metrics=header["metrics"],
        tags=tuple(header["tags"]), codec=original.codec, kind="full",
    )
    announce_total(progress, sum(members[_PREFIX + rel].size for rel in present))
    try:
        _extract(tar, members, present, directory, store.hot, progress)
        # Re-hash what landed on disk (blake3 of every decoded chunk, sizes, crc32c).
        problems = verify_checkpoint(directory, manifest, deep=True, committed=False)
        if problems:
            raise IntegrityError(f"bundle {path.name} is damaged: " + "; ".join(problems[:3]))
        _write_member(tar, members[_PREFIX + COMMIT_NAME], directory / COMMIT_NAME)
        if progress is not None:
            progress(members[_PREFIX + COMMIT_NAME].size)
        fsync_tree(directory)
        read_manifest(directory, expected_digest=digest)
        if original is not manifest:
            # What landed on disk, not only what the tar held, must prove the original.
            check_original(manifest, (directory / ORIGINAL_MANIFEST_NAME).read_bytes(), own)
    except BaseException as exc:
        _abandon(store, ck, directory, exc, before)
        if isinstance(exc, OSError) and not isinstance(exc, CkptError):
            raise StorageError(exc.errno or 5, f"importing {path} failed: {exc}") from exc
        raise
    committed = store.catalog.commit_checkpoint(
        ck.id, manifest_digest=own, logical_bytes=original.logical_bytes,
        stored_bytes=original.stored_bytes, replica_bytes=manifest.stored_bytes,
        uri=str(directory), **lossy_record(original),
    )
    if original is not manifest:
        # commit_checkpoint records the checkpoint's own manifest on the hot replica; this
        # copy holds the re-encoded one. Until this update a reader of the new row gets a
        # clear digest mismatch (IntegrityError), never wrong data.
        store.catalog.set_replica(ck.id, "hot", state=ReplicaState.PRESENT,
                                  manifest_digest=digest)
        committed = store.catalog.get_any(ck.id)
    if "context" in header:
        adopt_context(store.catalog, committed, *header["context"])
    store.catalog.record_event(
        "imported", checkpoint_id=ck.id,
        detail={"bundle": path.name, "signed": signature is not None,
                "signature_verified": public_key is not None,
                "signer": signature.key_fingerprint if signature is not None else None},
    )
    logger.info("imported bundle %s as %s (%s)", path, committed.ref, committed.id)
    return committed


def _existing(store: StoreCore, ckpt_id: str, digest: str) -> Checkpoint | None:
    try:
        found = store.catalog.get_any(ckpt_id)
    except CheckpointNotFoundError:
        return None
    if found.state == CheckpointState.COMMITTED and found.manifest_digest == digest:
        return found
    raise ConflictError(
        f"the store already has checkpoint {ckpt_id} ({found.ref}, {found.state}) with other "
        "content; refusing to import a different checkpoint under the same id"
    )


def _extract(tar: HostileTarFile, members: dict[str, tarfile.TarInfo], present: set[str],
             directory: Path, root: Path, progress: Progress | None) -> None:
    directory.mkdir(parents=True, exist_ok=False)
    resolved_root = root.resolve()
    if directory.is_symlink() or resolved_root not in directory.resolve().parents:
        raise InvalidNameError(f"{directory} is not inside the hot tier {root}; refusing it")
    for rel in sorted(present - {COMMIT_NAME}):
        target = directory / rel
        if resolved_root not in target.parent.resolve().parents:
            raise InvalidNameError(f"bundle member {rel!r} would land outside {directory}")
        _write_member(tar, members[_PREFIX + rel], target)
        if progress is not None:
            progress(members[_PREFIX + rel].size)


def _has_run(store: StoreCore, run: str) -> bool:
    try:
        store.catalog.get_run(run)
    except CheckpointNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class _Before:
    """What existed before an import began, so a failed one removes only what it made."""

    run_dir: bool
    ck_dir: bool
    run: bool


def _abandon(store: StoreCore, ck: Checkpoint, directory: Path, exc: BaseException,
             before: _Before) -> None:
    """Leave the store as it was before the import: the checkpoint directory, run directory
    and run it created go (what was there before stays), and so does its row."""
    if not before.ck_dir and directory.is_dir() and not directory.is_symlink():
        shutil.rmtree(directory, ignore_errors=True)
    if not before.run_dir:
        try:
            directory.parent.rmdir()  # only when empty: another writer may use it now
        except OSError:
            pass
    try:
        store.catalog.fail_checkpoint(ck.id, f"bundle import failed: {type(exc).__name__}")
        store.catalog.forget_failed_arrival(ck.id)
        if not before.run:
            store.catalog.forget_empty_run(ck.run)
    except CkptError:  # the catalog may be what failed; gc finishes the job
        logger.warning("could not remove the row of imported checkpoint %s", ck.id,
                       exc_info=True)
