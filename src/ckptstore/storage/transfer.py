"""Copy one checkpoint between tiers and verify the copy before it may be used.

The copy follows the :class:`~ckptstore.storage.base.Tier` call order: data files (in
parallel), then ``manifest.json``, each read back from the destination and compared with the
bytes read from the source, and only then the ``COMMITTED`` marker. A copy that fails half way
has no marker, so it can never be mistaken for a checkpoint; rerunning the copy keeps the files
that already match and redoes only the rest.

Chunk ownership (dedup): a manifest may point at chunks physically stored in another
checkpoint (``src`` = that checkpoint's id). Only the chunks this checkpoint owns are copied;
the others must already be on the destination, inside their owner's prefix — copy the owner
first (the archive and restore operations order that).

Copies between the tiers of one store check each source file's size and crc32c: they guard
against damage. A copy from **another store** (``untrusted``: push, pull, sync) must also
guard against forgery: crc32c is linear, so a chunk can be changed and four bytes fixed to
keep its size and crc32c. There, every chunk file's decoded content must hash to the
manifest's blake3 (:func:`ckptstore.format.chunkbytes.chunk_problem`) before it is written,
and what lands is read back and compared by blake3.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import blake3
import crc32c

from ckptstore.errors import ConflictError, IntegrityError, MissingBaseError, StorageError
from ckptstore.format import Manifest, chunk_files
from ckptstore.format.chunkbytes import chunk_problem
from ckptstore.format.constants import ORIGINAL_MANIFEST_NAME, ZARR_JSON, chunk_rel
from ckptstore.format.zarrmeta import ref_document
from ckptstore.storage.base import COMMIT_NAME, MANIFEST_NAME, Tier, is_not_found

__all__ = [
    "ORIGINAL_MANIFEST_NAME",
    "ChunkRef",
    "ManifestLike",
    "chunk_rel",
    "content_problems",
    "copy_checkpoint",
    "copy_foreign_chunks",
    "copy_keys",
    "foreign_chunks",
    "is_reencoded",
    "iter_chunks",
    "owned_files",
    "put_verified",
    "require_foreign_chunks",
    "source_checker",
]

logger = logging.getLogger(__name__)

Progress = Callable[[int], None]



class ManifestLike(Protocol):
    """What transfer needs from :class:`ckptstore.format.Manifest`."""

    @property
    def id(self) -> str: ...

    @property
    def arrays(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk a manifest uses.

    Attributes:
        owner: Id of the checkpoint whose directory physically holds the chunk file.
        array: Array name (the dtype name, e.g. ``float32``).
        index: Chunk index in the array.
        rel: File path relative to the owner's directory.
    """

    owner: str
    array: str
    index: int
    rel: str


def _field(entry: Any, name: str) -> Any:
    if isinstance(entry, Mapping):
        return entry.get(name)
    return getattr(entry, name, None)


def iter_chunks(manifest: ManifestLike) -> Iterator[ChunkRef]:
    """Every chunk the manifest uses, with the checkpoint that owns it."""
    for name, array in manifest.arrays.items():
        chunks = _field(array, "chunks") or []
        items = chunks.items() if isinstance(chunks, Mapping) else enumerate(chunks)
        for position, chunk in items:
            if chunk is None:
                continue
            index = _field(chunk, "i")
            index = int(position if index is None else index)
            owner = _field(chunk, "src") or manifest.id
            yield ChunkRef(str(owner), name, index, chunk_rel(name, index))
            # A delta-encoded chunk also needs the base chunk it decodes against.
            base = _field(chunk, "base")
            if base is not None:
                yield ChunkRef(str(_field(base, "src")), name, index, chunk_rel(name, index))


def foreign_chunks(manifest: ManifestLike) -> dict[str, list[ChunkRef]]:
    """Chunks the manifest uses but another checkpoint owns, grouped by owner id."""
    out: dict[str, list[ChunkRef]] = {}
    for ref in iter_chunks(manifest):
        if ref.owner != manifest.id:
            out.setdefault(ref.owner, []).append(ref)
    return out


def owned_files(manifest: ManifestLike) -> list[str]:
    """Relative paths of every file the checkpoint owns, marker last.

    Delegates to :func:`ckptstore.format.chunk_files`, the format's authority on which files
    make up a checkpoint, and only reorders so ``manifest.json`` and ``COMMITTED`` come last.
    A re-encoded copy also owns :data:`ORIGINAL_MANIFEST_NAME` (just before its manifest),
    so every copy, demotion, restore and repair carries it along.
    """
    files = list(chunk_files(manifest))  # type: ignore[arg-type]
    data = [f for f in files if f not in (MANIFEST_NAME, COMMIT_NAME)]
    if is_reencoded(manifest):
        data.append(ORIGINAL_MANIFEST_NAME)
    return [*data, MANIFEST_NAME, COMMIT_NAME]


def is_reencoded(manifest: ManifestLike) -> bool:
    """Whether ``manifest`` is that of a re-encoded copy (it names its original's digest)."""
    return bool(getattr(manifest, "reencoded_from", None))


def _digest(data: bytes, deep: bool) -> str:
    if deep:
        return "blake3:" + blake3.blake3(data).hexdigest()
    return f"crc32c:{crc32c.crc32c(data):08x}"


def copy_keys(
    src: Tier,
    dst: Tier,
    pairs: Sequence[tuple[str, str]],
    *,
    threads: int = 4,
    progress: Progress | None = None,
    deep: bool = False,
    existing: set[str] | None = None,
    check_source: Callable[[str, bytes], str | None] | None = None,
    rewrite: Callable[[str, bytes], bytes] | None = None,
    untrusted: bool = False,
) -> int:
    """Copy files ``src_key -> dst_key`` and verify each one on the destination.

    Each file is read from ``src``, written to ``dst`` (write-once), read back from ``dst``
    and compared (size + crc32c, or blake3 when ``deep``). A destination file that already
    exists is kept when it matches the source, and replaced when it does not, which is what
    makes a rerun after a crash redo only what is missing.

    Args:
        src: Source tier.
        dst: Destination tier.
        pairs: ``(source key, destination key)`` pairs.
        threads: Parallel transfers.
        progress: Called with the byte count of every file actually written.
        deep: Compare blake3 hashes instead of crc32c.
        existing: Destination keys known to exist (skips one existence request per file).
        check_source: Called with ``(source key, bytes)``; returns a problem description
            when the source bytes are damaged, so damage is never propagated to a new copy.
        rewrite: Called with ``(source key, checked bytes)``; returns the bytes the
            destination file must hold (the ``zarr.json`` variant a copy needs).
        untrusted: ``src`` is another store's tier: a file ``check_source`` refuses is
            reported as refused (not as damage to repair here), and read-backs compare blake3.

    Returns:
        Total bytes of the files (written or already present).

    Raises:
        StorageError: If a tier fails; remaining transfers are cancelled.
        IntegrityError: If a source file is damaged, or a file read back from ``dst`` differs
            from the source.
        ConflictError: If another writer creates a key with different bytes at the same
            moment.
    """

    def one(pair: tuple[str, str]) -> int:
        src_key, dst_key = pair
        data = src.get_bytes(src_key)
        problem = check_source(src_key, data) if check_source is not None else None
        if problem is not None and untrusted:
            raise IntegrityError(
                f"{src.name} tier of the other store: {src_key}: {problem}; refusing it, and "
                "nothing of the checkpoint is committed here. The other store's copy is "
                "forged or damaged: run `ckpt verify` there"
            )
        if problem is not None:
            raise IntegrityError(
                f"{src.name} tier: {src_key} is damaged ({problem}); not copying it to "
                f"{dst.name}. Run `ckpt verify` to repair the {src.name} copy from another one"
            )
        if rewrite is not None:
            data = rewrite(src_key, data)
        present = dst_key in existing if existing is not None else dst.exists(dst_key)
        return put_verified(dst, dst_key, data, deep=deep or untrusted, present=present,
                            progress=progress, origin=src.name)

    if not pairs:
        return 0
    if threads <= 1 or len(pairs) == 1:
        return sum(one(pair) for pair in pairs)
    pool = ThreadPoolExecutor(max_workers=min(threads, len(pairs)),
                              thread_name_prefix="ckpt-copy")
    try:
        futures: list[Future[int]] = [pool.submit(one, pair) for pair in pairs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in done:
            if fut.exception() is not None:
                # Stop queued transfers early: with S3 down, each one would fail slowly.
                pool.shutdown(wait=True, cancel_futures=True)
                raise fut.exception()  # type: ignore[misc]
        return sum(f.result() for f in futures)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def put_verified(
    dst: Tier,
    key: str,
    data: bytes,
    *,
    deep: bool = False,
    present: bool | None = None,
    progress: Progress | None = None,
    origin: str = "the source",
) -> int:
    """Write ``data`` to ``key`` on ``dst`` (write-once) and read it back to compare.

    A file already at ``key`` is kept when it holds exactly ``data`` and replaced when it
    does not (what a dead attempt left), so reruns redo only what is missing or wrong.

    Args:
        dst: Destination tier.
        key: Destination key.
        data: The bytes the file must hold.
        deep: Compare blake3 instead of size + crc32c.
        present: Whether the key exists (None: ask the tier).
        progress: Called with ``len(data)`` when the file was actually written.
        origin: Where the bytes came from, for messages.

    Returns:
        ``len(data)``.

    Raises:
        StorageError: If the tier fails.
        IntegrityError: If the file does not read back identical.
        ConflictError: If another writer creates the key with other bytes at the same moment.
    """
    expect = _digest(data, deep)
    if present is None:
        present = dst.exists(key)
    if present:
        if _matches(dst, key, data, expect, deep):
            logger.debug("%s tier: %s already present and intact", dst.name, key)
            return len(data)
        logger.info("%s tier: replacing %s (differs from %s)", dst.name, key, origin)
        dst.delete(key)
    try:
        dst.put_bytes(key, data)
    except ConflictError:
        # Another copier (say, one carrying a base's chunks for a delta) created the same
        # key a moment ago; identical bytes are fine, anything else is not.
        if not _matches(dst, key, data, expect, deep):
            raise
        return len(data)
    if not _matches(dst, key, data, expect, deep):
        raise IntegrityError(
            f"{dst.name} tier: {key} does not match what was written from {origin} (size or "
            "hash differs); the copy is unusable, retry the transfer"
        )
    if progress is not None:
        progress(len(data))
    return len(data)


def _matches(dst: Tier, key: str, data: bytes, expect: str, deep: bool) -> bool:
    if not dst.readable:
        # Archival classes (GLACIER) cannot be read back without a restore request; S3 has
        # already checked the upload's integrity, so the size is what we can verify here.
        return dst.size(key) == len(data)
    back = dst.get_bytes(key)
    return len(back) == len(data) and _digest(back, deep) == expect


def source_checker(
    manifest: ManifestLike,
    key_of: Callable[[str, str], str],
    *,
    fetch: Callable[[str], bytes] | None = None,
) -> Callable[[str, bytes], str | None]:
    """A ``check_source`` for :func:`copy_keys` that checks files against the manifest.

    Chunk files (its own and those it reads from other checkpoints) must have the recorded
    size and crc32c (the format stores the crc32c of the encoded bytes as a 4-byte
    little-endian trailer); ``manifest.json`` must hash to the manifest's digest and
    ``COMMITTED`` must hold that digest. Other files pass unchecked.

    Args:
        manifest: The checkpoint's manifest.
        key_of: Maps ``(owner checkpoint id, relative path)`` to the key on the source tier.
        fetch: For a copy from another store: reads a source key (the base chunk a
            delta-encoded chunk decodes against). Given, every chunk file's decoded content
            must also hash to the manifest's blake3; ``manifest`` must then be a
            :class:`~ckptstore.format.Manifest`.
    """
    expected: dict[str, tuple[int, int]] = {}
    # For content checks: key -> (array, index, base record when the file is a base chunk).
    roles: dict[str, tuple[str, int, Any]] = {}
    for name, array in manifest.arrays.items():
        for position, chunk in enumerate(_field(array, "chunks") or []):
            index = _field(chunk, "i")
            index = int(position if index is None else index)
            rel = chunk_rel(name, index)
            owner = str(_field(chunk, "src") or manifest.id)
            expected[key_of(owner, rel)] = (int(_field(chunk, "nbytes")),
                                            int(_field(chunk, "crc32c")))
            roles[key_of(owner, rel)] = (name, index, None)
            base = _field(chunk, "base")
            if base is not None:
                expected[key_of(str(_field(base, "src")), rel)] = (
                    int(_field(base, "nbytes")), int(_field(base, "crc32c")))
                roles.setdefault(key_of(str(_field(base, "src")), rel), (name, index, base))
    digest = str(getattr(manifest, "digest", "") or "")
    # Version 2: a zarr.json is one of the documents the manifest records for it.
    docs: dict[str, set[str]] = {}
    for rel, value in (getattr(manifest, "metadata", None) or {}).items():
        docs.setdefault(key_of(manifest.id, rel), set()).add(value)
    for rel, value in (getattr(manifest, "metadata_ref", None) or {}).items():
        docs.setdefault(key_of(manifest.id, rel), set()).add(value)
    manifest_key = key_of(manifest.id, MANIFEST_NAME)
    marker_key = key_of(manifest.id, COMMIT_NAME)
    original_key = key_of(manifest.id, ORIGINAL_MANIFEST_NAME)
    original = str(getattr(manifest, "reencoded_from", None) or "")

    def check(key: str, data: bytes) -> str | None:
        if key in expected:
            nbytes, crc = expected[key]
            if len(data) != nbytes:
                return f"{len(data)} bytes, the manifest records {nbytes}"
            got = crc32c.crc32c(data[:-4])
            trailer = int.from_bytes(data[-4:], "little") if len(data) >= 4 else -1
            if got != crc or trailer != crc:
                return f"crc32c {got:#010x} differs from the manifest's {crc:#010x}"
            if fetch is not None:
                return _content_problem(key, data)
        elif key in docs:
            if blake3.blake3(data).hexdigest() not in docs[key]:
                return "a zarr.json that is not the document the manifest records"
        elif digest and key == manifest_key:
            got_digest = blake3.blake3(data).hexdigest()
            if got_digest != digest:
                return f"digest {got_digest} differs from the catalog's {digest}"
        elif (digest and key == marker_key
              and data.decode("ascii", "replace").strip() != digest):
            return "the marker does not hold the manifest digest"
        elif original and key == original_key:
            got_digest = blake3.blake3(data).hexdigest()
            if got_digest != original:
                return (f"original manifest digest {got_digest} differs from the "
                        f"{original} the re-encoded manifest names")
        return None

    def _content_problem(key: str, data: bytes) -> str | None:
        assert isinstance(manifest, Manifest) and fetch is not None
        array, index, as_base = roles[key]
        chunk = manifest.arrays[array].chunks[index]
        base_data = None
        if as_base is None and chunk.base is not None:
            base_data = fetch(key_of(chunk.base.src, chunk_rel(array, index)))
        return chunk_problem(manifest, array, index, data, base_data=base_data,
                             as_base=as_base)

    return check


def content_problems(
    tier: Tier, manifest: Manifest, key_of: Callable[[str, str], str]
) -> list[str]:
    """Re-hash every chunk a copy on ``tier`` reads (its own and its bases'), one at a time.

    Each chunk file must have its recorded size and crc32c and decode to content with the
    manifest's blake3 (:func:`ckptstore.format.chunkbytes.chunk_problem`); works on any
    readable tier (object storage is read chunk by chunk).

    Args:
        tier: The tier holding the copy.
        manifest: The copy's manifest (already checked against the catalog).
        key_of: Maps ``(owner checkpoint id, relative path)`` to the key on ``tier``.

    Returns:
        One line per problem (naming checkpoint, tensor and chunk); empty when intact.

    Raises:
        StorageError: If the tier fails (a missing chunk file is a problem, not an error).
    """
    check = source_checker(manifest, key_of, fetch=tier.get_bytes)
    problems: list[str] = []
    seen: set[str] = set()
    for ref in iter_chunks(manifest):
        key = key_of(ref.owner, ref.rel)
        if key in seen:
            continue
        seen.add(key)
        try:
            problem = check(key, tier.get_bytes(key))
        except StorageError as exc:
            if not is_not_found(exc):
                raise
            problem = f"{key}: missing on the {tier.name} tier"
        if problem is not None:
            problems.append(problem)
    return problems


def copy_foreign_chunks(
    src: Tier,
    dst: Tier,
    manifest: ManifestLike,
    run_of: Callable[[str], str],
    *,
    threads: int = 4,
    progress: Progress | None = None,
    deep: bool = False,
    untrusted: bool = False,
) -> int:
    """Copy the chunk files a checkpoint reads from other checkpoints, where ``dst`` lacks them.

    Each file goes to its owner's prefix on ``dst`` (the owner gets no marker from this: it is
    not a copy of the owner, only of chunks the owner holds). Source files are checked
    against the manifest's sizes and crc32c first, and with ``untrusted`` (``src`` is
    another store's tier) their decoded content against its blake3.

    Returns:
        Bytes of the chunk files now on ``dst`` for this checkpoint's foreign chunks.

    Raises:
        StorageError: If a tier fails (including a chunk missing on ``src``).
        IntegrityError: If a source chunk is damaged or does not read back identical.
    """
    def key_of(tier: Tier) -> Callable[[str, str], str]:
        return lambda owner, rel: tier.key_for(run_of(owner), owner, rel)

    pairs: list[tuple[str, str]] = []
    existing: set[str] = set()
    for owner, refs in foreign_chunks(manifest).items():
        existing.update(dst.list_prefix(dst.prefix_for(run_of(owner), owner)))
        pairs.extend((key_of(src)(owner, r.rel), key_of(dst)(owner, r.rel)) for r in refs)
    check = source_checker(manifest, key_of(src), fetch=src.get_bytes if untrusted else None)
    return copy_keys(src, dst, pairs, threads=threads, progress=progress, deep=deep,
                     existing=existing, check_source=check, untrusted=untrusted)


def require_foreign_chunks(
    dst: Tier,
    manifest: ManifestLike,
    run_of: Callable[[str], str],
) -> None:
    """Check that every chunk owned by another checkpoint is on ``dst`` in its owner's prefix.

    Raises:
        MissingBaseError: Naming the owner and a missing chunk, if any is absent.
    """
    for owner, refs in foreign_chunks(manifest).items():
        present = set(dst.list_prefix(dst.prefix_for(run_of(owner), owner)))
        missing = [r for r in refs if dst.key_for(run_of(owner), owner, r.rel) not in present]
        if missing:
            raise MissingBaseError(
                f"checkpoint {manifest.id} uses {len(missing)} chunks stored in checkpoint "
                f"{owner} that are not on the {dst.name} tier (first: {missing[0].rel}); "
                f"copy checkpoint {owner} to {dst.name} first"
            )


def _reference_documents(
    manifest: ManifestLike, src: Tier, run: str, ckpt_id: str
) -> Callable[[str, bytes], bytes] | None:
    """The rewrite that gives a copy the documents it needs (format version 2).

    A copy made here holds its own chunk files only; the chunks it shares with other
    checkpoints stay in their owners' prefixes. Each array with such chunks therefore gets
    its chunk-reference ``zarr.json``, which plain Zarr readers refuse, derived from the
    source's plain document when the source held those chunks itself (docs/FORMAT.md).
    """
    refs: dict[str, str] = dict(getattr(manifest, "metadata_ref", None) or {})
    if not refs:
        return None
    by_key = {src.key_for(run, ckpt_id, rel): rel for rel in refs}

    def rewrite(key: str, data: bytes) -> bytes:
        rel = by_key.get(key)
        if rel is None or blake3.blake3(data).hexdigest() == refs[rel]:
            return data
        array = rel[: -len(ZARR_JSON) - 1]
        return ref_document(manifest, array, data)  # type: ignore[arg-type]

    return rewrite


def copy_checkpoint(
    src: Tier,
    dst: Tier,
    run: str,
    ckpt_id: str,
    manifest: ManifestLike,
    *,
    threads: int = 4,
    progress: Progress | None = None,
    deep: bool = False,
    run_of: Callable[[str], str] | None = None,
    untrusted: bool = False,
) -> int:
    """Copy one checkpoint's own files from ``src`` to ``dst``, verified, marker last.

    Args:
        src: Tier holding a complete copy.
        dst: Tier to copy to.
        run: The checkpoint's run.
        ckpt_id: The checkpoint's id.
        manifest: Its manifest (already verified against the catalog digest).
        threads: Parallel transfers for data files.
        progress: Called with the byte count of every file written.
        deep: Verify with blake3 instead of crc32c.
        run_of: Maps the id of a checkpoint owning deduplicated chunks to its run name
            (default: the same run).
        untrusted: ``src`` is another store's tier: every chunk's decoded content must hash
            to the manifest's blake3 before it is written, and read-backs compare blake3.

    Returns:
        Bytes of the checkpoint's files on ``dst`` (what its replica occupies).

    Raises:
        MissingBaseError: If chunks owned by another checkpoint are not on ``dst``.
        IntegrityError: If a source file does not match the manifest (with ``untrusted``:
            a chunk whose content is not what the manifest records, naming checkpoint,
            tensor and chunk), or a copied file does not read back identical.
        StorageError: If either tier fails. The destination then holds no marker.
    """
    resolve = run_of or (lambda _owner: run)
    if untrusted and getattr(manifest, "files", None):
        raise IntegrityError(
            f"checkpoint {ckpt_id} holds files of another layout (DCP) that its manifest pins "
            "by size and crc32c only, which cannot prove them against forgery; refusing to "
            "take it from another store. Share a copy in the regular layout instead (`ckpt "
            "convert REF --codec zstd-1` makes one)"
        )
    require_foreign_chunks(dst, manifest, resolve)
    files = owned_files(manifest)
    marker = dst.key_for(run, ckpt_id, COMMIT_NAME)
    # A marker already there means we are re-doing this copy (a repair, or a crash after the
    # marker but before the catalog update): it is not complete until we say so again.
    if dst.exists(marker):
        dst.delete(marker)
    existing = set(dst.list_prefix(dst.prefix_for(run, ckpt_id)))

    def pairs(rels: Sequence[str]) -> list[tuple[str, str]]:
        return [(src.key_for(run, ckpt_id, r), dst.key_for(run, ckpt_id, r)) for r in rels]

    check = source_checker(manifest, lambda owner, rel: src.key_for(resolve(owner), owner, rel),
                           fetch=src.get_bytes if untrusted else None)
    data_files = files[:-2]
    total = copy_keys(src, dst, pairs(data_files), threads=threads, progress=progress,
                      deep=deep, existing=existing, check_source=check,
                      rewrite=_reference_documents(manifest, src, run, ckpt_id),
                      untrusted=untrusted)
    total += copy_keys(src, dst, pairs([MANIFEST_NAME]), progress=progress, deep=deep,
                       existing=existing, check_source=check, untrusted=untrusted)
    # Everything above is on dst and read back intact: only now may the copy become visible.
    total += copy_keys(src, dst, pairs([COMMIT_NAME]), progress=progress, deep=deep,
                       existing=set(), check_source=check, untrusted=untrusted)
    logger.info("copied %s/%s from %s to %s: %s files, %s bytes",
                run, ckpt_id, src.name, dst.name, len(files), total)
    return total
