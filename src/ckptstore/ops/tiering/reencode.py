"""Re-encode a checkpoint's copy with another codec (the archive codec, e.g. ``zstd-3``).

A re-encoded copy is **self-contained**: every chunk the checkpoint reads — its own, the ones
it deduplicated against other checkpoints (``src``) and its delta-encoded (xor / q8 / q4)
chunks, decoded to their exact stored content — is written as a plain ``raw`` chunk with the
new codec into the copy's own files. Its manifest is the original one with ``codec`` and the
arrays' codec replaced, every chunk entry ``src=None``, ``enc="raw"``, ``base=None`` with its
new size and crc32c, ``kind="full"``; the tensors, tree, ids and per-chunk blake3 (a hash of
the unencoded content) are unchanged, and :attr:`Manifest.reencoded_from
<ckptstore.format.manifest.Manifest.reencoded_from>` names the digest of the checkpoint's
own manifest. That manifest has another digest, which the catalog records
on the replica (:attr:`ckptstore.records.Replica.manifest_digest`).

**The original manifest travels with the copy** as ``manifest.orig.json``
(:data:`ORIGINAL_MANIFEST_NAME`, byte for byte the checkpoint's own ``manifest.json``), so a
re-encoded copy proves which content it holds without the original layout's files. A reader
of such a copy (:func:`read_copy_manifest`) checks (1) ``manifest.json`` against the replica's
digest, (2) the original bytes against the checkpoint's digest (the one signatures sign, see
:mod:`ckptstore.ops.sharing.signing`) and (3) that both describe the same content
(:func:`check_same_content`: same ids, tree and tensors, and chunk by chunk the same
unencoded lengths and blake3). A chunk that passes its blake3 in the re-encoded copy is then
exactly the chunk the original vouches for, so trust in the original transfers to the copy.

**Names.** The copy's arrays are renamed ``<array>__<codec>`` (``float32__zstd3``). Another
checkpoint archived *without* re-encoding that deduplicated against this one copies the
chunks it reads into this checkpoint's prefix under their original names
(:func:`ckptstore.storage.transfer.copy_foreign_chunks`), and on S3 files are write-once:
distinct names mean those files and ours never collide, and deleting this copy keeps exactly
the original-layout files others read (:func:`ckptstore.ops.tiering.replicas.referenced_chunks`).
Writer array names are dtype names with at most a ``_small``/``_lossy`` suffix and never
contain ``__``.

**Order and reruns** are those of a plain copy: chunk files (in parallel, one chunk in memory
per thread), array and group ``zarr.json``, ``manifest.orig.json``, ``manifest.json``, then the
``COMMITTED`` marker;
each file is read back from the destination and compared before the next step. Files a dead
attempt left are kept when they hold exactly the bytes this run produces and replaced
otherwise (:func:`ckptstore.storage.transfer.put_verified`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np

from ckptstore.errors import ConfigError, IntegrityError, StorageError
from ckptstore.format import ArrayEntry, ChunkEntry, Manifest, read_manifest
from ckptstore.format.chunkio import ChunkReader
from ckptstore.format.codecs import CODEC_PRESETS, TRAILER, codec_spec, crc32c_update, encode
from ckptstore.format.constants import MAX_MANIFEST_BYTES, ZARR_JSON, chunk_rel
from ckptstore.format.manifest import manifest_digest
from ckptstore.format.zarrmeta import array_metas, build_metadata
from ckptstore.format.zarrmeta import digest as digest_of
from ckptstore.storage import COMMIT_NAME, MANIFEST_NAME, LocalTier, Tier, is_not_found
from ckptstore.storage.transfer import (
    ORIGINAL_MANIFEST_NAME,
    is_reencoded,
    put_verified,
)

__all__ = [
    "ORIGINAL_MANIFEST_NAME",
    "ReencodeResult",
    "check_codec",
    "check_original",
    "check_same_content",
    "is_reencoded",
    "original_manifest_bytes",
    "original_problems",
    "read_copy_manifest",
    "reencode_copy",
    "reencode_name",
    "why_not_reencode",
]

logger = logging.getLogger(__name__)

Progress = Callable[[int], None]

_SEP = "__"
_MAX_NAME = 64


@dataclass(frozen=True)
class ReencodeResult:
    """What one re-encoded copy holds.

    Attributes:
        manifest: The copy's manifest (its ``digest`` goes into the replica row).
        bytes: Bytes of every file of the copy on the destination.
        source_bytes: Encoded size of the chunk data in the source layout (each chunk entry
            counted once, whichever checkpoint holds it): the "before" of ``bytes``' chunks.
        chunk_bytes: Bytes of the re-encoded chunk files alone: the "after".
    """

    manifest: Manifest
    bytes: int
    source_bytes: int
    chunk_bytes: int


def check_codec(codec: str) -> str:
    """Return ``codec`` if it is a codec preset.

    Raises:
        ConfigError: Naming the presets, if it is not one.
    """
    if codec not in CODEC_PRESETS:
        raise ConfigError(
            f"unknown archive codec {codec!r}; choose one of {', '.join(CODEC_PRESETS)} "
            "(--reencode, archive_codec in the config, or CKPT_ARCHIVE_CODEC)"
        )
    return codec


def reencode_name(array: str, codec: str) -> str:
    """Name of ``array`` in a copy re-encoded with ``codec`` (``float32`` → ``float32__zstd3``).

    A name that is already re-encoded keeps its original stem, so re-encoding a re-encoded
    copy (repair from another tier) does not stack suffixes.
    """
    if "/" in array:
        # A tensor's own array (``tensors/<escaped key>``): the group gets the suffix, since
        # an escaped key may itself hold the separator.
        group, leaf = array.split("/", 1)
        return f"{group.split(_SEP, 1)[0]}{_SEP}{codec.replace('-', '')}/{leaf}"
    stem = array.split(_SEP, 1)[0] if _SEP in array else array
    name = f"{stem}{_SEP}{codec.replace('-', '')}"
    if len(name) > _MAX_NAME:  # not reachable with writer names; stays a valid identifier
        tag = hashlib.blake2b(name.encode(), digest_size=6).hexdigest()
        name = f"{stem[: _MAX_NAME - len(tag) - 3]}{_SEP}r{tag}"
    return name


def why_not_reencode(manifest: Manifest, codec: str) -> str | None:
    """Why a copy of ``manifest`` is made as is instead of re-encoded (None: re-encode it).

    * Files of another layout (a DCP checkpoint's N-d arrays, :attr:`Manifest.files`): the
      packed-array re-encoder does not know them.
    * Already in ``codec`` and self-contained: re-encoding would write the same data.
    """
    if manifest.files:
        return "holds files of another layout (DCP); copied as is"
    if (manifest.codec == codec and all(a.codec == codec for a in manifest.arrays.values())
            and not manifest.referenced_checkpoints()):
        return f"already {codec}"
    return None


def _encode_chunk(codec: str, data: np.ndarray, itemsize: int) -> bytes:
    """One chunk file: the codec's encoding of ``data`` + crc32c trailer (the writer's)."""
    spec = codec_spec(codec)
    body = encode(spec, data, itemsize) if spec.compressed else data.tobytes()
    return body + TRAILER.pack(crc32c_update(body, 0))


class _Source:
    """Reads decoded chunks of one checkpoint copy, from a local or a remote tier.

    A local tier is read in place. A remote one is staged chunk by chunk: the one or two
    files a chunk needs are downloaded into a temporary directory laid out like a tier, read
    there with the format's own :class:`~ckptstore.format.chunkio.ChunkReader` (which checks
    sizes and crc32c against the manifest), and deleted — so memory and disk stay bounded by
    a chunk per thread.
    """

    def __init__(self, tier: Tier, manifest: Manifest, run: str,
                 run_of: Callable[[str], str]) -> None:
        self.tier, self.manifest, self.run, self.run_of = tier, manifest, run, run_of
        local = tier.local_dir(run, manifest.id)
        self._reader: ChunkReader | None = None
        if local is not None:
            def locate(ckpt_id: str) -> Path:
                found = tier.local_dir(run_of(ckpt_id), ckpt_id)
                assert found is not None  # a local tier has local directories
                return found

            self._reader = ChunkReader(local, manifest, locate)

    def read(self, array: ArrayEntry, index: int, out: np.ndarray) -> None:
        if self._reader is not None:
            self._reader.read(array, index, [(0, out)])
            return
        with self._staged(array, index) as reader:
            reader.read(array, index, [(0, out)])

    @contextmanager
    def _staged(self, array: ArrayEntry, index: int) -> Iterator[ChunkReader]:
        chunk = array.chunks[index]
        owners = {self.manifest.id if o is None else o for o in chunk.owners()}
        with tempfile.TemporaryDirectory(prefix="ckpt-reencode-") as tmp:
            scratch = LocalTier(Path(tmp), name=self.tier.name)
            for owner in owners:
                key = self.tier.key_for(self.run_of(owner), owner, array.chunk_path(index))
                try:
                    self.tier.get_file(key, Path(tmp) / key)
                except StorageError as exc:
                    if not is_not_found(exc):
                        raise
                    # The reader reports a missing file with checkpoint, tensor and chunk.

            def locate(ckpt_id: str) -> Path:
                return scratch.local_dir(self.run_of(ckpt_id), ckpt_id)

            directory = scratch.local_dir(self.run, self.manifest.id)
            for owner in owners:
                scratch.local_dir(self.run_of(owner), owner).mkdir(parents=True, exist_ok=True)
            yield ChunkReader(directory, self.manifest, locate)


def reencode_copy(
    src: Tier,
    dst: Tier,
    run: str,
    manifest: Manifest,
    codec: str,
    *,
    run_of: Callable[[str], str],
    own_digest: str | None = None,
    threads: int = 4,
    progress: Progress | None = None,
    deep: bool = False,
) -> ReencodeResult:
    """Write a self-contained copy of a checkpoint onto ``dst``, every chunk in ``codec``.

    Args:
        src: Tier holding a complete copy (its chunks, and the chunks it reads from other
            checkpoints in their owners' prefixes).
        dst: Tier to write to.
        run: The checkpoint's run.
        manifest: The source copy's manifest, already checked against the catalog.
        codec: The codec preset to write with.
        run_of: Maps checkpoint ids (owners of deduplicated chunks) to run names.
        own_digest: Digest of the checkpoint's own manifest, recorded in the copy's
            :attr:`~Manifest.reencoded_from` (default: ``manifest``'s, or what it records).
        threads: Chunks re-encoded in parallel.
        progress: Called with the byte count of each file written.
        deep: Compare blake3 instead of crc32c when reading files back.

    Returns:
        The :class:`ReencodeResult`; the copy is committed (marker written) on ``dst``.

    Raises:
        ConfigError: If ``codec`` is unknown or ``src`` cannot be read back (archival class).
        IntegrityError: If a source chunk is damaged or does not decode to the content the
            manifest records (MissingBaseError when a deduplicated chunk is gone), the
            original manifest is missing or does not have the checkpoint's digest, or a
            file does not read back identical from ``dst``.
        StorageError: If a tier fails. ``dst`` then holds no marker.
    """
    check_codec(codec)
    if not src.readable:
        raise ConfigError(
            f"cannot re-encode from the {src.name} tier: its objects are in an archival "
            "storage class; archive from a readable tier (hot) instead"
        )
    ckpt_id = manifest.id
    origin = own_digest or manifest.reencoded_from or manifest.digest
    # The original manifest is checked before any chunk is written: a copy that cannot
    # prove what it re-encodes is never started.
    original_bytes = original_manifest_bytes(src, run, manifest, origin)
    original = Manifest.from_json(original_bytes)
    names = {name: reencode_name(name, codec) for name in manifest.arrays}
    if len(set(names.values())) != len(names):
        raise IntegrityError(f"checkpoint {ckpt_id}: re-encoded array names collide: {names}")
    marker = dst.key_for(run, ckpt_id, COMMIT_NAME)
    # A marker there means a previous attempt (or the copy being repaired) finished: it is
    # not complete again until this run says so.
    if dst.exists(marker):
        dst.delete(marker)
    existing = set(dst.list_prefix(dst.prefix_for(run, ckpt_id)))
    source = _Source(src, manifest, run, run_of)

    def one(job: tuple[ArrayEntry, int]) -> tuple[ChunkEntry, int]:
        array, index = job
        old = array.chunks[index]
        content = np.empty(array.chunk_nbytes, dtype=np.uint8)
        source.read(array, index, content)
        # The blake3 in the manifest is of the unencoded (reconstructed) chunk: what a load
        # returns. Checking it here makes the new copy bit-exact by construction.
        digest = blake3.blake3(content.data).hexdigest()
        if digest != old.blake3:
            raise IntegrityError(
                f"{src.name} copy of checkpoint {ckpt_id}: chunk {array.chunk_path(index)} "
                f"decodes to blake3 {digest}, the manifest records {old.blake3}; not "
                f"re-encoding damaged data. Run `ckpt verify` to repair the {src.name} copy"
            )
        data = _encode_chunk(codec, content, array.itemsize)
        rel = chunk_rel(names[array.name], index)
        key = dst.key_for(run, ckpt_id, rel)
        put_verified(dst, key, data, deep=deep, present=key in existing, progress=progress,
                     origin=f"re-encoding {src.name}")
        crc = int.from_bytes(data[-TRAILER.size:], "little")
        return ChunkEntry(index, len(data), crc, old.blake3), len(data)

    jobs = [(array, chunk.i) for array in manifest.arrays.values() for chunk in array.chunks]
    results = _parallel(one, jobs, threads)
    chunks: dict[str, list[ChunkEntry]] = {name: [] for name in manifest.arrays}
    for (array, _), (entry, _) in zip(jobs, results, strict=True):
        chunks[array.name].append(entry)
    chunk_total = sum(n for _, n in results)
    arrays = {
        names[name]: dataclasses.replace(a, name=names[name], codec=codec,
                                         chunks=tuple(chunks[name]))
        for name, a in manifest.arrays.items()
    }
    tensors = {
        key: dataclasses.replace(t, array=names[t.array])
        for key, t in manifest.tensors.items()
    }
    new = dataclasses.replace(
        manifest, kind="full", base_id=None, codec=codec, arrays=arrays, tensors=tensors,
        stored_bytes=chunk_total, reencoded_from=origin, metadata={}, metadata_ref={},
    )
    # Self-contained: every array's document is the plain one.
    docs = build_metadata(ckpt_id, array_metas(new), new.format_version)
    if new.format_version >= 2:
        new = dataclasses.replace(new, metadata={rel: digest_of(d) for rel, d in docs.items()})
    data = new.to_json()
    # Our own output goes through the hostile-input parser once: a bug here must fail the
    # archive, not a restore months later.
    Manifest.from_json(data)
    if new.referenced_checkpoints():  # the replica bookkeeping relies on this
        raise IntegrityError(f"re-encoded copy of {ckpt_id} still references other chunks")
    # What every later reader checks (signatures transfer through it): check it now.
    check_same_content(original, new)
    total = chunk_total
    # Array documents first, the group's last, as the writer does.
    for rel in sorted(docs, key=lambda r: (r == ZARR_JSON, r)):
        key = dst.key_for(run, ckpt_id, rel)
        total += put_verified(dst, key, docs[rel], deep=deep, present=key in existing,
                              progress=progress)
    # Before the copy's own manifest: a copy whose manifest is there has its original too.
    key = dst.key_for(run, ckpt_id, ORIGINAL_MANIFEST_NAME)
    total += put_verified(dst, key, original_bytes, deep=deep, present=key in existing,
                          progress=progress)
    key = dst.key_for(run, ckpt_id, MANIFEST_NAME)
    total += put_verified(dst, key, data, deep=deep, present=key in existing,
                          progress=progress)
    # Everything above is on dst and read back intact: only now may the copy become visible.
    total += put_verified(dst, marker, (new.digest + "\n").encode("ascii"), deep=deep,
                          present=False, progress=progress)
    source_bytes = sum(c.nbytes for a in manifest.arrays.values() for c in a.chunks)
    logger.info("re-encoded %s/%s from %s (%s) to %s (%s): chunks %d -> %d bytes",
                run, ckpt_id, src.name, manifest.codec, dst.name, codec, source_bytes,
                chunk_total)
    return ReencodeResult(new, total, source_bytes, chunk_total)


def original_manifest_bytes(src: Tier, run: str, manifest: Manifest, digest: str) -> bytes:
    """The checkpoint's original ``manifest.json`` bytes, as the copy of ``manifest`` on ``src``
    holds them, checked against ``digest`` (the checkpoint's own manifest digest).

    For a copy in the original layout that is the manifest itself (its canonical bytes); a
    re-encoded copy holds them in :data:`ORIGINAL_MANIFEST_NAME`.

    Raises:
        IntegrityError: If they are missing (a copy re-encoded before the original manifest
            travelled with it) or do not hash to ``digest``.
        StorageError: If the tier fails.
    """
    where = f"the {src.name} copy of checkpoint {manifest.id}"
    if not is_reencoded(manifest):
        data = manifest.to_json()
        if manifest_digest(data) != digest:
            # Written by something that serializes differently: the file's own bytes.
            data = src.get_bytes(src.key_for(run, manifest.id, MANIFEST_NAME))
    else:
        key = src.key_for(run, manifest.id, ORIGINAL_MANIFEST_NAME)
        try:
            if src.size(key) > MAX_MANIFEST_BYTES:
                raise IntegrityError(f"{where}: {ORIGINAL_MANIFEST_NAME} is over the size "
                                     "limit of a manifest")
            data = src.get_bytes(key)
        except StorageError as exc:
            if not is_not_found(exc):
                raise
            raise _no_original(where) from None
    got = manifest_digest(data)
    if got != digest:
        raise IntegrityError(
            f"{where}: the original manifest has digest {got}, the checkpoint's is {digest}; "
            f"not re-encoding it. Run `ckpt verify` to repair the {src.name} copy"
        )
    return data


def _no_original(where: str) -> IntegrityError:
    return IntegrityError(
        f"{where} is re-encoded but holds no {ORIGINAL_MANIFEST_NAME} (it was made before "
        "re-encoded copies carried the original manifest), so it cannot prove which content "
        "it holds: delete that copy and re-run `ckpt archive --reencode CODEC` from a copy "
        "in the original layout"
    )


def check_same_content(original: Manifest, reencoded: Manifest) -> None:
    """Check that a re-encoded manifest describes exactly the content of the original one.

    Same id, run, step, creation time, tree, chunk size and byte counts; the same tensors in
    the same order at the same places; every array renamed with
    :func:`reencode_name`, of the same dtype, length and chunking; and chunk by chunk the
    same unencoded content hash (blake3), with every re-encoded chunk self-contained.
    Together with the per-chunk blake3 check of every read, a signature over the original
    manifest's digest then vouches for every byte read from the re-encoded copy.

    Raises:
        IntegrityError: Naming the first difference.
    """
    def fail(what: str) -> IntegrityError:
        return IntegrityError(
            f"the re-encoded manifest of checkpoint {reencoded.id} does not describe the "
            f"content of its original manifest ({what}); the copy was tampered with or "
            "damaged: run `ckpt verify` to repair it"
        )

    if is_reencoded(original):
        raise fail("the original manifest is itself a re-encoded one")
    if reencoded.reencoded_from != original.digest:
        raise fail(f"it names original {reencoded.reencoded_from}, the original "
                   f"has digest {original.digest}")
    for name in ("format_version", "id", "run", "step", "created_at", "chunk_bytes",
                 "logical_bytes", "tree", "delta"):
        if getattr(original, name) != getattr(reencoded, name):
            raise fail(f"{name} differs")
    if (reencoded.extra, reencoded.dcp, reencoded.files) != (
            original.extra, original.dcp, original.files):
        raise fail("extra differs")
    codec = reencoded.codec
    if any(a.codec != codec for a in reencoded.arrays.values()):
        raise fail(f"an array is not in the copy's codec {codec}")
    names = {name: reencode_name(name, codec) for name in original.arrays}
    if sorted(names.values()) != sorted(reencoded.arrays):
        raise fail(f"arrays {sorted(reencoded.arrays)} are not {sorted(names.values())}")
    for name, old in original.arrays.items():
        new = reencoded.arrays[names[name]]
        if (old.torch_dtype, old.zarr_dtype, old.itemsize, old.length, old.chunk_len) != (
                new.torch_dtype, new.zarr_dtype, new.itemsize, new.length, new.chunk_len):
            raise fail(f"array {name}: dtype, length or chunking differs")
        if len(old.chunks) != len(new.chunks):
            raise fail(f"array {name}: {len(new.chunks)} chunks instead of {len(old.chunks)}")
        for a, b in zip(old.chunks, new.chunks, strict=True):
            if a.i != b.i or a.blake3 != b.blake3:
                raise fail(f"chunk {new.chunk_path(b.i)} has other content than "
                           f"{old.chunk_path(a.i)}")
            if b.src is not None or b.base is not None or b.enc != "raw":
                raise fail(f"chunk {new.chunk_path(b.i)} is not self-contained")
    if list(original.tensors) != list(reencoded.tensors):
        raise fail("the tensor keys differ")
    for key, t in original.tensors.items():
        u = reencoded.tensors[key]
        if u != dataclasses.replace(t, array=names.get(t.array, "")):
            raise fail(f"tensor {key} is placed differently")


def check_original(reencoded: Manifest, original_bytes: bytes, own_digest: str) -> Manifest:
    """Check a re-encoded copy's original manifest bytes; return the original manifest.

    Checks (2) the bytes hash to ``own_digest`` (the checkpoint's digest, which signatures
    sign) and (3) :func:`check_same_content`.

    Raises:
        IntegrityError: If either check fails.
    """
    got = manifest_digest(original_bytes)
    if got != own_digest:
        raise IntegrityError(
            f"the {ORIGINAL_MANIFEST_NAME} of the re-encoded copy of checkpoint "
            f"{reencoded.id} has digest {got}, but the checkpoint's manifest digest is "
            f"{own_digest}: the copy was tampered with or damaged; run `ckpt verify` to "
            "repair it"
        )
    original = Manifest.from_json(original_bytes)
    check_same_content(original, reencoded)
    return original


def _read_original(directory: Path, ckpt_id: str) -> bytes:
    """The bytes of ``directory/manifest.orig.json``: bounded, no links, no FIFOs."""
    path = directory / ORIGINAL_MANIFEST_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _no_original(f"the copy of checkpoint {ckpt_id} in {directory}") from None
    except OSError as exc:
        raise StorageError(exc.errno or 5, f"cannot read {path}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MANIFEST_BYTES:
            raise IntegrityError(f"{path} is not a regular file of at most "
                                 f"{MAX_MANIFEST_BYTES} bytes; the copy was tampered with")
        chunks: list[bytes] = []
        remaining = info.st_size + 1
        while remaining > 0:
            block = os.read(fd, min(remaining, 1 << 24))
            if not block:
                break
            chunks.append(block)
            remaining -= len(block)
        return b"".join(chunks)
    except OSError as exc:
        raise StorageError(exc.errno or 5, f"cannot read {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def original_problems(directory: Path, manifest: Manifest, own_digest: str | None) -> list[str]:
    """Problems of a local copy's original manifest (``[]``: fine, or not a re-encoded copy).

    For scrubs: the checks of :func:`check_original` on ``directory``'s
    :data:`ORIGINAL_MANIFEST_NAME`, as lines instead of an exception.
    """
    if not is_reencoded(manifest) or own_digest is None:
        return []
    try:
        check_original(manifest, _read_original(directory, manifest.id), own_digest)
    except (IntegrityError, StorageError) as exc:
        return [f"{ORIGINAL_MANIFEST_NAME}: {exc}"]
    return []


def read_copy_manifest(directory: Path, own_digest: str,
                       copy_digest: str | None = None) -> Manifest:
    """Read the manifest of a local copy of a checkpoint and check what it vouches for.

    ``copy_digest`` is the digest the catalog records for the copy (a re-encoded replica's
    own, :func:`ckptstore.records.expected_digest`); None or ``own_digest`` when the copy
    holds the checkpoint's own manifest. For a re-encoded copy this checks (1) its
    ``manifest.json`` against ``copy_digest``, (2) its :data:`ORIGINAL_MANIFEST_NAME` against
    ``own_digest`` and (3) :func:`check_same_content`; otherwise the manifest must have
    ``own_digest``.

    Args:
        directory: The checkpoint directory.
        own_digest: The checkpoint's own manifest digest (the catalog's, the signed one).
        copy_digest: The copy's manifest digest when it differs.

    Returns:
        The copy's manifest (the one its files follow).

    Raises:
        IntegrityError: If any check fails, or a re-encoded copy lacks its original
            manifest (made before this check existed: re-run the archive).
        IncompleteCheckpointError, CheckpointNotFoundError, StorageError: As
            :func:`ckptstore.format.read_manifest`.
    """
    manifest = read_manifest(directory, expected_digest=copy_digest or own_digest)
    if not is_reencoded(manifest):
        if manifest.digest != own_digest:
            raise IntegrityError(
                f"the copy of checkpoint {manifest.id} in {directory} holds manifest "
                f"{manifest.digest}, which is neither the checkpoint's ({own_digest}) nor a "
                "re-encoded copy of it; run `ckpt verify` to repair it"
            )
        return manifest
    check_original(manifest, _read_original(directory, manifest.id), own_digest)
    return manifest


def _parallel(
    fn: Callable[[tuple[ArrayEntry, int]], tuple[ChunkEntry, int]],
    jobs: list[tuple[ArrayEntry, int]],
    threads: int,
) -> list[tuple[ChunkEntry, int]]:
    """``[fn(job) for job in jobs]`` on ``threads`` threads; the first error cancels the rest."""
    if threads <= 1 or len(jobs) <= 1:
        return [fn(job) for job in jobs]
    pool = ThreadPoolExecutor(max_workers=min(threads, len(jobs)),
                              thread_name_prefix="ckpt-reencode")
    try:
        futures: list[Future[tuple[ChunkEntry, int]]] = [pool.submit(fn, j) for j in jobs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in done:
            exc = fut.exception()
            if exc is not None:
                # With a tier down every queued chunk would fail slowly: stop now.
                pool.shutdown(wait=True, cancel_futures=True)
                raise exc
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)

