"""Storage faults: disk full, damaged files, S3 dying mid-upload, throttling, short reads.

Each fault is injected for real (a 4 MiB tmpfs, bits flipped on disk, a proxy answering
503 SlowDown or dropping connections, a moto server stopped mid-upload, reads cut short by
the kernel interface). Every outcome is a typed error or a successful retry — never a wrong
tensor — and nothing committed before the fault is lost.
"""

from __future__ import annotations

import errno
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import ckpt_reliability_checks as checks
import pytest
import torch
from ckpt_reliability_checks import FULL
from pg_support import PG_ADMIN_URL

from ckptstore.errors import (
    IncompleteCheckpointError,
    IntegrityError,
    StorageError,
)
from ckptstore.format import iter_tensors, read_manifest
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import manifest_of
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.records import CheckpointState, ReplicaState
from ckptstore.storage import is_retryable
from ckptstore.storage.transfer import owned_files
from ckptstore.store import CheckpointStore
from ckptstore.testing.fault_injection import (
    FaultyProxy,
    flip_bit,
    mount_tmpfs,
    short_reads,
    truncate_file,
)

NBYTES = 3 * 1024 * 1024
CHUNK = 512 * 1024


@pytest.fixture
def tmpfs(tmp_path: Path) -> Any:
    """A 4 MiB tmpfs (skipped when this machine cannot mount one)."""
    try:
        with mount_tmpfs(tmp_path / "tmpfs", "4m") as mount:
            yield mount
    except StorageError as exc:
        if "cannot mount" not in str(exc):
            raise
        pytest.skip(str(exc))


# ---------------------------------------------------------------------- disk full
def _fill(path: Path) -> Path:
    """Fill the file system holding ``path`` (unbuffered, so closing cannot fail)."""
    try:
        with open(path, "wb", buffering=0) as fh:
            for _ in range(100_000):
                fh.write(b"\0" * 65536)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    return path


def test_disk_full_on_the_hot_tier(new_root: Any, tmpfs: Path, w: Any, figures: Any) -> None:
    with CheckpointStore.open(new_root(), hot=str(tmpfs / "hot"), chunk_bytes=CHUNK) as store:
        first = store.save("r", 1, w.make_state(1, 1024 * 1024))
        with pytest.raises(StorageError) as info:
            store.save("r", 2, w.make_state(2, 8 * 1024 * 1024), codec="none")
        assert info.value.errno == errno.ENOSPC
        assert "full" in str(info.value)
        assert store.latest("r").id == first.id
        failed = store.catalog.list(state=CheckpointState.FAILED)
        assert len(failed) == 1
        assert not store.checkpoint_dir("r", failed[0].id).exists()
        store.gc()
        assert checks.staging_left(store) == []
        # Space is back (the failed save cleaned up): the next save works.
        second = store.save("r", 3, w.make_state(3, 1024 * 1024))
        checks.assert_loads_bit_exact(store, {first.id: (1, 1024 * 1024),
                                              second.id: (3, 1024 * 1024)})
        checks.assert_sound(store)
        figures.add("faults", {"disk-full": 1})


def test_disk_full_on_an_archive_tier(new_root: Any, tmpfs: Path, w: Any,
                                      figures: Any) -> None:
    with CheckpointStore.open(new_root(), warm=str(tmpfs / "warm"), chunk_bytes=CHUNK) as store:
        small = store.save("r", 1, w.make_state(1, 1024 * 1024))
        big = store.save("r", 2, w.make_state(2, 6 * 1024 * 1024), codec="none")
        with pytest.raises(StorageError) as info:
            archive_checkpoints(store, tier="warm", threads=2)
        assert info.value.errno == errno.ENOSPC
        assert store.catalog.get(small.id).replica("warm").state == ReplicaState.PRESENT
        assert store.catalog.get(big.id).replica("warm").state == ReplicaState.DELETED
        assert not (tmpfs / "warm" / "r" / big.id / "COMMITTED").exists()
        assert checks.remote_claims(store, "warm") == []
        checks.assert_loads_bit_exact(store, {small.id: (1, 1024 * 1024),
                                              big.id: (2, 6 * 1024 * 1024)})
        checks.assert_sound(store)
        figures.add("faults", {"disk-full": 1})


def test_disk_full_under_the_catalog(tmp_path: Path, tmpfs: Path, w: Any, figures: Any) -> None:
    """The SQLite catalog cannot grow: the save fails typed, nothing half-registered."""
    with CheckpointStore.open(tmpfs / "store", hot=str(tmp_path / "hot")) as store:
        first = store.save("r", 1, w.make_state(1, 256 * 1024))
        filler = _fill(tmpfs / "filler")

        def save_until_full() -> None:
            for step in range(2, 40):  # the first write that needs a new page fails
                store.save("r", step, w.make_state(step, 64 * 1024),
                           metrics={f"m{i}": float(i) for i in range(40)})

        with pytest.raises(StorageError, match="full"):
            save_until_full()
        with store.catalog.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
        filler.unlink()
        assert store.latest("r").id == first.id or store.latest("r").step > 1
        store.gc()
        committed = {ck.id for ck in store.list()}
        assert first.id in committed
        checks.assert_sound(store)
        figures.add("faults", {"disk-full": 1})


def _block_catalog(store: CheckpointStore, backend: str, tmpfs: Path) -> Any:
    """Make the catalog fail from now on; return a function that undoes it."""
    if backend == "sqlite":
        # Empty the WAL first (it would otherwise absorb the next commit), then fill the disk.
        with store.catalog.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        filler = _fill(tmpfs / "filler")
        return lambda: filler.unlink(missing_ok=True)
    from sqlalchemy import create_engine, text

    name = store.catalog.engine.url.database
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
        conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = :n AND pid <> pg_backend_pid()"), {"n": name})

    def undo() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()

    return undo


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_catalog_fails_between_data_and_commit(tmp_path: Path, tmpfs: Path, w: Any,
                                               request: Any, backend: str,
                                               figures: Any) -> None:
    """The data is durable, then the catalog commit fails (disk full / server gone): the
    save raises a typed error, nothing becomes visible, integrity holds, and the leftovers
    are cleaned up without waiting for this (live) process to die."""
    url = request.getfixturevalue("pg_url") if backend == "postgresql" else None
    root = tmpfs / "store" if backend == "sqlite" else tmp_path / "store"
    with CheckpointStore.open(root, hot=str(tmp_path / "hot"), catalog_url=url) as store:
        first = store.save("r", 1, w.make_state(1, 64 * 1024))
        real_commit = store.catalog.commit_checkpoint
        undo: list[Any] = []

        def fail_then_commit(*args: Any, **kwargs: Any) -> Any:
            undo.append(_block_catalog(store, backend, tmpfs))
            return real_commit(*args, **kwargs)

        store.catalog.commit_checkpoint = fail_then_commit  # type: ignore[method-assign]
        try:
            with pytest.raises(StorageError):
                store.save("r", 2, w.make_state(2, 64 * 1024))
        finally:
            del store.catalog.commit_checkpoint
            for fn in undo:
                fn()
        if backend == "sqlite":
            with store.catalog.engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
        assert [ck.id for ck in store.list()] == [first.id]
        assert store.latest("r").id == first.id
        checks.assert_loads_bit_exact(store, {first.id: (1, 64 * 1024)})
        store.gc()
        left = checks.staging_left(store) + [
            f"directory of uncommitted {ck.ref} ({ck.state})"
            for ck in store.catalog.list(state=None)
            if ck.state != CheckpointState.COMMITTED
            and store.checkpoint_dir(ck.run, ck.id).exists()
        ]
        figures.add("faults", {f"catalog-down-{backend}": 1})
        assert not left, f"a save whose commit failed left {left}"
        checks.assert_sound(store)


# ---------------------------------------------------------------------- damage on disk
DAMAGE = ["flip-chunk", "flip-trailer", "truncate-chunk", "empty-chunk", "delete-chunk",
          "swap-chunk", "flip-manifest", "truncate-manifest", "delete-manifest",
          "delete-marker", "bad-marker"]


def _w_chunk(store: CheckpointStore, ck: Any) -> str:
    """Relative path of chunk 1 of the array holding model/w (an array of its own)."""
    array = store.manifest(ck.id).tensors["model/w"].array
    return f"{array}/c/1"


def _damage(store: CheckpointStore, ck: Any, other: Any, how: str) -> None:
    directory = store.checkpoint_dir(ck.run, ck.id)
    chunk = directory / _w_chunk(store, ck)
    if how == "flip-chunk":
        flip_bit(chunk, offset=chunk.stat().st_size // 2)
    elif how == "flip-trailer":
        flip_bit(chunk, offset=chunk.stat().st_size - 1, bit=7)
    elif how == "truncate-chunk":
        truncate_file(chunk, -1)
    elif how == "empty-chunk":
        truncate_file(chunk, 0)
    elif how == "delete-chunk":
        chunk.unlink()
    elif how == "swap-chunk":
        # A valid chunk (its own crc trailer matches) from another checkpoint.
        shutil.copyfile(store.checkpoint_dir(other.run, other.id) / _w_chunk(store, other),
                        chunk)
    elif how == "flip-manifest":
        flip_bit(directory / "manifest.json", seed=3)
    elif how == "truncate-manifest":
        truncate_file(directory / "manifest.json", -10)
    elif how == "delete-manifest":
        (directory / "manifest.json").unlink()
    elif how == "delete-marker":
        (directory / "COMMITTED").unlink()
    elif how == "bad-marker":
        (directory / "COMMITTED").write_text("0" * 64 + "\n")


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_copy_never_loads_a_wrong_tensor(new_root: Any, w: Any, how: str,
                                                  figures: Any) -> None:
    with CheckpointStore.open(new_root(), chunk_bytes=CHUNK, codec="none") as store:
        other = store.save("r", 1, w.make_state(1, NBYTES))
        ck = store.save("r", 2, w.make_state(2, NBYTES))
        _damage(store, ck, other, how)
        directory = store.checkpoint_dir(ck.run, ck.id)
        attempts = {
            "load": lambda: store.load(ck.id),
            "load-keys": lambda: store.load(ck.id, keys=["model/w"]),
            "load-into": lambda: store.load(ck.id, into=w.make_state(0, NBYTES)),
            "iter": lambda: list(iter_tensors(directory, read_manifest(directory))),
        }
        for name, attempt in attempts.items():
            with pytest.raises((IntegrityError, IncompleteCheckpointError)) as info:
                attempt()
            message = str(info.value)
            if how.endswith("chunk") or how == "flip-trailer":
                assert ck.id in message and _w_chunk(store, ck) in message, (name, message)
        problems = store.verify(ck.id) if how.endswith(("chunk", "trailer")) else None
        if problems is not None:
            assert problems and all(_w_chunk(store, ck) in p for p in problems)
        # The other checkpoint is untouched.
        checks.assert_loads_bit_exact(store, {other.id: (1, NBYTES)})
        figures.add("faults", {"damaged-file": 1})


def test_random_bit_flips_are_caught(new_root: Any, w: Any, figures: Any) -> None:
    """Seeded sweep: flip one random bit of one random file of a committed copy, load.
    Only two outcomes are allowed: a typed error, or exactly the saved tensors (a flip in a
    zarr.json that our loader never reads)."""
    flips = 120 if FULL else 24
    rng = random.Random(42)
    with CheckpointStore.open(new_root(), chunk_bytes=CHUNK) as store:
        ck = store.save("r", 1, w.make_state(7, NBYTES))
        directory = store.checkpoint_dir(ck.run, ck.id)
        expected = w.make_state(7, NBYTES)
        files = sorted(p for p in directory.rglob("*") if p.is_file())
        pristine = {p: p.read_bytes() for p in files}
        outcomes: dict[str, int] = {}
        for _ in range(flips):
            path = rng.choice(files)
            flip_bit(path, offset=rng.randrange(path.stat().st_size), bit=rng.randrange(8))
            try:
                state = store.load(ck.id)
                assert w.states_equal(state, expected), f"wrong tensor after a flip in {path}"
                outcome = "identical"
            except (IntegrityError, IncompleteCheckpointError) as exc:
                outcome = type(exc).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            path.write_bytes(pristine[path])
        assert outcomes.get("identical", 0) < flips
        figures.add("faults", {"bit-flip": flips})
        figures.set("bit_flip_outcomes", outcomes)


# ---------------------------------------------------------------------- short reads
@pytest.mark.parametrize("codec", ["none", "lz4"])
def test_short_reads_still_load_bit_exact(new_root: Any, w: Any, codec: str,
                                          figures: Any) -> None:
    with CheckpointStore.open(new_root(), chunk_bytes=256 * 1024, codec=codec,
                              threads=1) as store:
        ck = store.save("r", 1, w.make_state(3, 1024 * 1024))
        with short_reads(4093) as served:
            state = store.load(ck.id)
            problems = store.verify(ck.id)
        assert sum(served.values()) > 10
        assert w.states_equal(state, w.make_state(3, 1024 * 1024))
        assert problems == []
        figures.add("faults", {"short-read": sum(served.values())})


# ---------------------------------------------------------------------- S3
def _s3_store(root: Path, s3: Any, endpoint: str, *, attempts: int = 3) -> CheckpointStore:
    # botocore's own retries multiply s3fs's (5 each): keep them few so outages fail fast.
    options = {**s3.storage_options, "endpoint_url": endpoint,
               "config_kwargs": {"connect_timeout": 2, "read_timeout": 20,
                                 "retries": {"max_attempts": attempts, "mode": "standard"}}}
    return CheckpointStore.open(root, warm=s3.url(f"{uuid.uuid4().hex[:10]}/warm"),
                                storage_options=options, chunk_bytes=CHUNK)


def _check_warm_copies(store: CheckpointStore, expected: checks.Expected, w: Any,
                       tmp: Path) -> None:
    """Every PRESENT warm copy restores (from warm alone) to the exact saved tensors."""
    for ckpt_id, (seed, nbytes) in expected.items():
        ck = store.catalog.get(ckpt_id)
        if ck.replica("warm") is None or ck.replica("warm").state != ReplicaState.PRESENT:
            continue
        target = tmp / f"restore-{ckpt_id}"
        # Hot copies are not used: the data must come back from S3.
        directory = _restore_from_warm(store, ck, target)
        manifest = read_manifest(directory, expected_digest=ck.manifest_digest)
        state = dict(iter_tensors(directory, manifest))
        assert torch.equal(state["model/w"], w.make_state(seed, nbytes)["model"]["w"])


def _restore_from_warm(store: CheckpointStore, ck: Any, target: Path) -> Path:
    from ckptstore.ops.tiering.replicas import tier_of
    from ckptstore.storage import LocalTier, copy_checkpoint

    warm = tier_of(store, "warm")
    local = LocalTier(target, name="scratch")
    copy_checkpoint(warm, local, ck.run, ck.id, manifest_of(store, ck), threads=2)
    directory = local.local_dir(ck.run, ck.id)
    assert directory is not None
    return directory


@pytest.fixture
def few_s3fs_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """s3fs retries every failed call 5 times with backoff; against a dead server that is
    ~2 s per call and the test would spend most of its time waiting."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)


@pytest.mark.usefixtures("few_s3fs_retries")
@pytest.mark.slow
def test_s3_killed_mid_upload(new_root: Any, s3: Any, w: Any, tmp_path: Path,
                              figures: Any) -> None:
    """The S3 server dies after a few uploads of an archive run (moto stopped for real)."""
    with FaultyProxy(s3.endpoint_url) as proxy:
        store = _s3_store(new_root(), s3, proxy.endpoint_url, attempts=1)
        with store:
            expected = {}
            for i in range(2):
                ck = store.save("r", i, w.make_state(i, NBYTES))
                expected[ck.id] = (i, NBYTES)
            files = len(owned_files(manifest_of(store, store.list()[0])))

            def kill_server(uploads: int) -> None:
                if uploads == files + 3:  # mid-way through the second checkpoint
                    s3.stop()

            proxy.on_upload = kill_server
            try:
                with pytest.raises(StorageError) as info:
                    archive_checkpoints(store, tier="warm", threads=2)
            finally:
                proxy.on_upload = None
                s3.start()
            assert is_retryable(info.value)
            states = [store.catalog.get(c).replica("warm").state for c in expected]
            assert states[0] == ReplicaState.PRESENT
            assert states[1] != ReplicaState.PRESENT
            assert checks.remote_claims(store, "warm") == []
            second = list(expected)[1]
            objects = s3.keys()
            assert not [k for k in objects if second in k and k.endswith("/COMMITTED")]
            checks.assert_loads_bit_exact(store, expected)
            report = archive_checkpoints(store, tier="warm", threads=2)
            assert report.ok and report.archived == [second]
            _check_warm_copies(store, expected, w, tmp_path)
            checks.assert_sound(store)
            figures.add("faults", {"s3-server-killed": 1})


@pytest.mark.skipif(not FULL, reason="CKPT_RELIABILITY_FULL=1 only (the kill test covers it)")
@pytest.mark.usefixtures("few_s3fs_retries")
def test_s3_blackout_mid_upload_then_rerun(new_root: Any, s3: Any, w: Any, tmp_path: Path,
                                           figures: Any) -> None:
    """Every connection dropped without an answer after N uploads (a hung/crashed server)."""
    with FaultyProxy(s3.endpoint_url) as proxy:
        store = _s3_store(new_root(), s3, proxy.endpoint_url, attempts=1)
        with store:
            ck = store.save("r", 1, w.make_state(4, NBYTES))
            proxy.blackout_after(3)
            with pytest.raises(StorageError):
                archive_checkpoints(store, tier="warm", threads=2)
            assert store.catalog.get(ck.id).replica("warm").state != ReplicaState.PRESENT
            proxy.end_blackout()
            assert archive_checkpoints(store, tier="warm", threads=2).ok
            _check_warm_copies(store, {ck.id: (4, NBYTES)}, w, tmp_path)
            figures.add("faults", {"s3-dropped-connection": proxy.counts["dropped"]})


@pytest.mark.slow
def test_s3_slowdown_30_percent(new_root: Any, s3: Any, w: Any, tmp_path: Path,
                                figures: Any) -> None:
    """~30% of uploads answered 503 SlowDown (10% of them after the server applied them):
    archive succeeds through retries or fails typed; what is recorded always restores."""
    with FaultyProxy(s3.endpoint_url, seed=5, slowdown=0.2, slowdown_after_apply=0.1) as proxy:
        store = _s3_store(new_root(), s3, proxy.endpoint_url)
        with store:
            expected = {}
            for i in range(3 if FULL else 2):
                ck = store.save("r", i, w.make_state(10 + i, NBYTES))
                expected[ck.id] = (10 + i, NBYTES)
            outcome = "ok"
            for _ in range(3):  # a typed, retryable failure may happen; a rerun resumes
                try:
                    archive_checkpoints(store, tier="warm", threads=2)
                    break
                except StorageError as exc:
                    if not is_retryable(exc):
                        raise
                    outcome = "retried"
            assert proxy.counts["slowdown"] + proxy.counts["slowdown_after_apply"] > 3
            assert checks.remote_claims(store, "warm") == []
            proxy.set_rates()
            _check_warm_copies(store, expected, w, tmp_path)
            figures.add("faults", {"s3-503-slowdown": proxy.counts["slowdown"],
                                   "s3-503-after-apply": proxy.counts["slowdown_after_apply"]})
            figures.set("slowdown_outcome", outcome)


def test_s3_short_and_corrupt_reads_on_restore(new_root: Any, s3: Any, w: Any,
                                               figures: Any) -> None:
    """Restoring from S3 while 25% of GETs are cut short and 10% arrive with a flipped bit:
    the restore retries or fails typed, and a finished restore is bit-exact."""
    with FaultyProxy(s3.endpoint_url, seed=11) as proxy:
        store = _s3_store(new_root(), s3, proxy.endpoint_url)
        with store:
            ck = store.save("r", 1, w.make_state(21, NBYTES))
            archive_checkpoints(store, tier="warm", threads=2)
            # Only the warm copy remains.
            from ckptstore.ops.tiering.replicas import delete_replica

            delete_replica(store, store.catalog.get(ck.id), "hot")
            proxy.set_rates(truncate_get=0.25, corrupt_get=0.1)
            errors: dict[str, int] = {}
            restored = False
            for _ in range(6):
                try:
                    restore_checkpoint(store, ck.id, threads=2, wait_s=5)
                    restored = True
                    break
                except (IntegrityError, StorageError) as exc:
                    # Typed and retryable; anything else (a wrong tensor, a crash) propagates.
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            proxy.set_rates()
            if not restored:
                restore_checkpoint(store, ck.id, threads=2, wait_s=5)
            checks.assert_loads_bit_exact(store, {ck.id: (21, NBYTES)})
            assert proxy.counts["truncated"] + proxy.counts["corrupted"] > 0
            figures.add("faults", {"s3-short-read": proxy.counts["truncated"],
                                   "s3-corrupt-read": proxy.counts["corrupted"]})
            figures.set("restore_errors_before_success", errors)
