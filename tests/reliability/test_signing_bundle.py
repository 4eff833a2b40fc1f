"""Signatures (Ed25519 over id + manifest digest) and bundles (hostile tars refused)."""

from __future__ import annotations

import io
import json
import logging
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ckpt_reliability_checks as checks
import pytest

from ckptstore.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    InvalidNameError,
)
from ckptstore.format.manifest import manifest_digest
from ckptstore.ops.sharing.bundle import BUNDLE_HEADER, export_bundle, import_bundle
from ckptstore.ops.sharing.signing import (
    SIGNATURE_NAME,
    generate_keypair,
    sign_checkpoint,
    verify_signature,
)
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.store import CheckpointStore
from ckptstore.testing.fault_injection import flip_bit

NBYTES = 256 * 1024


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return generate_keypair(tmp_path / "keys", "alice")


@pytest.fixture
def other_keys(tmp_path: Path) -> tuple[Path, Path]:
    return generate_keypair(tmp_path / "keys", "mallory")


@pytest.fixture
def store(new_root: Any, tmp_path: Path) -> Any:
    with CheckpointStore.open(new_root(), warm=str(tmp_path / "warm"),
                              chunk_bytes=64 * 1024) as opened:
        yield opened


# ---------------------------------------------------------------------- signing
def test_sign_and_verify(store: Any, w: Any, keys: Any, other_keys: Any,
                         caplog: pytest.LogCaptureFixture) -> None:
    private, public = keys
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    with pytest.raises(Exception, match="never overwritten"):
        generate_keypair(private.parent, "alice")
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    with pytest.raises(IntegrityError, match="not signed"):
        verify_signature(store, ck.id, public)
    caplog.set_level(logging.DEBUG)
    path = sign_checkpoint(store, ck.ref, private)
    assert path == store.checkpoint_dir("r", ck.id) / SIGNATURE_NAME
    verify_signature(store, ck.id, public, deep=True)
    with pytest.raises(IntegrityError, match=r"another key|signed by key"):
        verify_signature(store, ck.id, other_keys[1])
    signed = [e for e in store.events(ck.id) if e.kind == "signed"]
    assert len(signed) == 1 and signed[0].detail["checkpoint_id"] == ck.id
    # No private key material anywhere.
    secret = private.read_text().splitlines()[1]
    everything = [r.getMessage() for r in caplog.records] + [json.dumps(e.detail)
                                                            for e in store.events()]
    assert not [t for t in everything if secret in t]
    with pytest.raises(ConfigError):
        sign_checkpoint(store, ck.id, public)  # a public key cannot sign
    with pytest.raises(ConfigError):
        verify_signature(store, ck.id, private.parent / "missing.pub")


@pytest.mark.parametrize("tamper", ["signature", "manifest", "swap", "chunk"])
def test_tampering_is_detected(store: Any, w: Any, keys: Any, tamper: str) -> None:
    private, public = keys
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    other = store.save("r", 2, w.make_state(2, NBYTES))
    sign_checkpoint(store, ck.id, private)
    sign_checkpoint(store, other.id, private)
    directory = store.checkpoint_dir("r", ck.id)
    if tamper == "signature":
        doc = json.loads((directory / SIGNATURE_NAME).read_text())
        raw = bytearray(__import__("base64").b64decode(doc["signature"]))
        raw[5] ^= 1
        doc["signature"] = __import__("base64").b64encode(bytes(raw)).decode()
        (directory / SIGNATURE_NAME).write_text(json.dumps(doc))
        # ... and the event copy too, so nothing valid remains.
        with store.catalog.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM events WHERE kind = 'signed' AND "
                                 f"checkpoint_id = '{ck.id}'")
    elif tamper == "manifest":
        flip_bit(directory / "manifest.json", seed=1)
    elif tamper == "swap":
        # A valid signature, but of another checkpoint.
        other_sig = store.checkpoint_dir("r", other.id) / SIGNATURE_NAME
        (directory / SIGNATURE_NAME).write_bytes(other_sig.read_bytes())
        with store.catalog.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM events WHERE kind = 'signed' AND "
                                 f"checkpoint_id = '{ck.id}'")
    elif tamper == "chunk":
        flip_bit(directory / "float32" / "c" / "0", offset=10)
    with pytest.raises(IntegrityError):
        verify_signature(store, ck.id, public, deep=True)
    verify_signature(store, other.id, public, deep=True)


def test_signature_survives_archive_and_restore(store: Any, w: Any, keys: Any) -> None:
    private, public = keys
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    sign_checkpoint(store, ck.id, private)
    archive_checkpoints(store, tier="warm", threads=2)
    delete_replica(store, store.catalog.get(ck.id), "hot")
    verify_signature(store, ck.id, public)  # from the catalog event
    from ckptstore.ops.tiering.restore import restore_checkpoint

    restore_checkpoint(store, ck.id)
    verify_signature(store, ck.id, public, deep=True)


def test_load_can_require_a_signature(store: Any, w: Any, keys: Any, other_keys: Any) -> None:
    private, public = keys
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    with pytest.raises(IntegrityError, match="not signed"):
        store.load(ck.id, require_signature=public)
    sign_checkpoint(store, ck.id, private)
    state = store.load(ck.id, require_signature=public)
    assert w.states_equal(state, w.make_state(1, NBYTES))
    with pytest.raises(IntegrityError):
        store.load(ck.id, require_signature=other_keys[1])


# ---------------------------------------------------------------------- bundles
def test_bundle_roundtrip_between_stores(store: Any, new_root: Any, w: Any, keys: Any,
                                         tmp_path: Path, figures: Any) -> None:
    private, public = keys
    ck = store.save("r", 3, w.make_state(5, NBYTES), metrics={"loss": 0.25}, tags=["best"])
    sign_checkpoint(store, ck.id, private)
    bundle = export_bundle(store, ck.ref, tmp_path / "out" / "ck.tar")
    with CheckpointStore.open(new_root("other")) as other:
        imported = import_bundle(other, bundle, require_signature=public)
        assert imported.id == ck.id and imported.step == 3 and imported.run == "r"
        assert imported.metrics == {"loss": 0.25} and imported.tags == ("best",)
        assert imported.manifest_digest == ck.manifest_digest
        checks.assert_loads_bit_exact(other, {ck.id: (5, NBYTES)})
        verify_signature(other, ck.id, public, deep=True)
        again = import_bundle(other, bundle)
        assert again.id == imported.id and len(other.list()) == 1
        renamed = import_bundle(new_store := CheckpointStore.open(new_root("third")), bundle,
                                run="elsewhere")
        assert renamed.run == "elsewhere"
        new_store.close()
        checks.assert_sound(other)


def test_unsigned_or_foreign_signed_bundle_refused_when_required(
    store: Any, new_root: Any, w: Any, keys: Any, other_keys: Any, tmp_path: Path
) -> None:
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    plain = export_bundle(store, ck.id, tmp_path / "plain.tar")
    sign_checkpoint(store, ck.id, other_keys[0])
    foreign = export_bundle(store, ck.id, tmp_path / "foreign.tar")
    with CheckpointStore.open(new_root("other")) as other:
        with pytest.raises(IntegrityError, match="not signed"):
            import_bundle(other, plain, require_signature=keys[1])
        with pytest.raises(IntegrityError):
            import_bundle(other, foreign, require_signature=keys[1])
        assert other.list(state=None) == []


def _members(bundle: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    out = []
    with tarfile.open(bundle) as tar:
        for info in tar.getmembers():
            handle = tar.extractfile(info)
            out.append((info, handle.read() if handle is not None else b""))
    return out


def _rewrite(bundle: Path, target: Path,
             edit: Callable[[list[tuple[tarfile.TarInfo, bytes]]], None]) -> Path:
    members = _members(bundle)
    edit(members)
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if info.isreg():
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return target


def _find(members: list[tuple[tarfile.TarInfo, bytes]], suffix: str) -> int:
    return next(i for i, (info, _) in enumerate(members) if info.name.endswith(suffix))


def _add(members: list[Any], name: str, data: bytes = b"x", kind: bytes = tarfile.REGTYPE,
         link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    members.append((info, data))


def _set(members: list[Any], suffix: str, data: bytes) -> None:
    i = _find(members, suffix)
    members[i] = (members[i][0], data)


def _hostile_manifest(members: list[Any]) -> None:
    data = (b'{"tensors":[' + b",".join([b"{}"] * 3_000_000) + b"]}")
    _set(members, "manifest.json", data)
    _set(members, "COMMITTED", manifest_digest(data).encode())
    header = json.loads(members[0][1])
    header["manifest_digest"] = manifest_digest(data)
    members[0] = (members[0][0], json.dumps(header).encode())


def _flip_chunk(members: list[Any]) -> None:
    i = _find(members, "float32/c/0")
    data = bytearray(members[i][1])
    data[len(data) // 2] ^= 4
    members[i] = (members[i][0], bytes(data))


def _pickle_codec(members: list[Any]) -> None:
    i = _find(members, "float32/zarr.json")
    doc = json.loads(members[i][1])
    doc["codecs"] = [{"name": "numcodecs.pickle"}]
    members[i] = (members[i][0], json.dumps(doc).encode())


def _big_chunk(members: list[Any]) -> None:
    i = _find(members, "float32/c/0")
    members[i] = (members[i][0], members[i][1] + b"\0" * 4096)


def _pax_escape(members: list[Any]) -> None:
    info = tarfile.TarInfo("checkpoint/harmless")
    info.pax_headers = {"path": "../../escaped"}
    info.size = 1
    members.append((info, b"x"))


HOSTILE_TARS: dict[str, tuple[type[Exception], Callable[[list[Any]], None]]] = {
    "dotdot": (InvalidNameError, lambda m: _add(m, "checkpoint/../../evil")),
    "absolute": (InvalidNameError, lambda m: _add(m, "/tmp/ckpt-evil-absolute")),
    "outside-prefix": (InvalidNameError, lambda m: _add(m, "evil.py")),
    "backslash": (InvalidNameError, lambda m: _add(m, "checkpoint\\..\\evil")),
    "pax-path": (InvalidNameError, _pax_escape),
    "symlink": (IntegrityError, lambda m: _add(m, "checkpoint/link", b"", tarfile.SYMTYPE,
                                               "/etc/passwd")),
    "hardlink": (IntegrityError, lambda m: _add(m, "checkpoint/hard", b"", tarfile.LNKTYPE,
                                                "/etc/passwd")),
    "device": (IntegrityError, lambda m: _add(m, "checkpoint/dev", b"", tarfile.CHRTYPE)),
    "fifo": (IntegrityError, lambda m: _add(m, "checkpoint/fifo", b"", tarfile.FIFOTYPE)),
    "directory": (IntegrityError, lambda m: _add(m, "checkpoint/float32/", b"",
                                                 tarfile.DIRTYPE)),
    "oversized-chunk": (IntegrityError, _big_chunk),
    "unexpected-file": (IntegrityError, lambda m: _add(m, "checkpoint/float32/evil.py")),
    "duplicate": (IntegrityError, lambda m: m.append(m[_find(m, "float32/c/0")])),
    "missing-chunk": (IntegrityError, lambda m: m.pop(_find(m, "float32/c/0"))),
    "missing-header": (IntegrityError, lambda m: m.pop(0)),
    "flipped-chunk": (IntegrityError, _flip_chunk),
    "tampered-manifest": (IntegrityError, lambda m: _set(m, "manifest.json",
                                                         m[_find(m, "manifest.json")][1]
                                                         .replace(b'"step":1', b'"step":2'))),
    "hostile-manifest": (IntegrityError, _hostile_manifest),
    "pickle-codec": (IntegrityError, _pickle_codec),
    "bad-header": (IntegrityError, lambda m: _set(m, BUNDLE_HEADER, b"\x80\x02pickle")),
}


@pytest.mark.parametrize("attack", sorted(HOSTILE_TARS))
def test_hostile_bundles_are_refused(store: Any, new_root: Any, w: Any, tmp_path: Path,
                                     attack: str, figures: Any) -> None:
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    bundle = export_bundle(store, ck.id, tmp_path / "good.tar")
    error, edit = HOSTILE_TARS[attack]
    hostile = _rewrite(bundle, tmp_path / f"{attack}.tar", edit)
    target = new_root("target")
    with CheckpointStore.open(target) as other:
        before = checks.dir_snapshot(tmp_path)
        with pytest.raises(error):
            import_bundle(other, hostile)
        assert other.list(state=None) == []  # nothing registered, not even FAILED
        assert checks.dir_snapshot(tmp_path) == before  # nothing written anywhere
        assert not Path("/tmp/ckpt-evil-absolute").exists()
    figures.add("bad_inputs")


def test_member_count_is_bounded(store: Any, new_root: Any, w: Any, tmp_path: Path) -> None:
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    bundle = export_bundle(store, ck.id, tmp_path / "good.tar")

    def many(members: list[Any]) -> None:
        for i in range(300):
            _add(members, f"checkpoint/extra-{i}")

    hostile = _rewrite(bundle, tmp_path / "many.tar", many)
    with CheckpointStore.open(new_root("target")) as other, \
            pytest.raises(IntegrityError, match="more than"):
        import_bundle(other, hostile, max_members=100)


def test_export_refuses_missing_and_delta(store: Any, w: Any, tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        export_bundle(store, "r@latest", tmp_path / "x.tar")
    assert not (tmp_path / "x.tar").exists()


# ---------------------------------------------------------------------- header bombs
_DECLARED = 512 * 1024 * 1024  # what a hostile extended header claims to hold
_BLOCK = 1024 * 1024


def _header(name: str, kind: bytes, size: int, **fields: Any) -> bytes:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    for key, value in fields.items():
        setattr(info, key, value)
    return info.tobuf(tarfile.GNU_FORMAT if kind in (tarfile.GNUTYPE_LONGNAME,
                                                   tarfile.GNUTYPE_SPARSE)
                      else tarfile.USTAR_FORMAT)


def _stream(out: Any, size: int, pattern: bytes = b"\0") -> None:
    """Write ``size`` bytes of ``pattern`` repeated, then pad to a tar block."""
    block = (pattern * (_BLOCK // len(pattern) + 1))[:_BLOCK]
    left = size
    while left > 0:
        out.write(block[: min(left, _BLOCK)])
        left -= _BLOCK
    out.write(b"\0" * (-size % tarfile.BLOCKSIZE))


def _pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


def _bomb(kind: str, good: Path, out: Path) -> Path:
    """A gzip bundle whose first headers ask tarfile for far more memory than they are worth,
    followed by a complete, valid bundle (so only the headers can make the import fail)."""
    import gzip

    with gzip.open(out, "wb", compresslevel=1) as gz:
        if kind in ("pax", "pax-global"):
            kind_byte = tarfile.XHDTYPE if kind == "pax" else tarfile.XGLTYPE
            gz.write(_header("././@PaxHeader", kind_byte, _DECLARED))
            _stream(gz, _DECLARED)
        elif kind == "gnu-longname":
            gz.write(_header("././@LongLink", tarfile.GNUTYPE_LONGNAME, _DECLARED))
            _stream(gz, _DECLARED)
        elif kind == "pax-chain":
            # 2,000 extended headers of 60 KiB each in front of one member.
            record = _pax_record("comment", "x" * (60 * 1024))
            for _ in range(2000):
                gz.write(_header("././@PaxHeader", tarfile.XHDTYPE, len(record)))
                gz.write(record + b"\0" * (-len(record) % tarfile.BLOCKSIZE))
        elif kind == "pax-sparse":
            # GNU sparse 1.0: the sparse map is read from the data, number by number.
            record = (_pax_record("GNU.sparse.major", "1") + _pax_record("GNU.sparse.minor", "0")
                      + _pax_record("GNU.sparse.name", "checkpoint/x")
                      + _pax_record("GNU.sparse.realsize", "1"))
            gz.write(_header("././@PaxHeader", tarfile.XHDTYPE, len(record)))
            gz.write(record + b"\0" * (-len(record) % tarfile.BLOCKSIZE))
            gz.write(_header("checkpoint/x", tarfile.REGTYPE, 32 * _BLOCK + 13))
            gz.write(b"999999999999\n")
            _stream(gz, 32 * _BLOCK, b"1\n")
        elif kind == "gnu-sparse":
            # An old-GNU sparse member whose header says "more sparse blocks follow", forever.
            info = tarfile.TarInfo("checkpoint/x")
            info.type = tarfile.GNUTYPE_SPARSE
            buf = bytearray(info.tobuf(tarfile.GNU_FORMAT))
            buf[482] = 1  # isextended
            buf[148:156] = b" " * 8
            buf[148:156] = b"%06o\0 " % sum(buf)
            gz.write(bytes(buf))
            block = bytearray(b"".join(b"%011o\0%011o\0" % (i + 1, 1) for i in range(21)))
            block += b"\0" * (504 - len(block)) + b"\1" + b"\0" * 7
            for _ in range(128 * 1024):
                gz.write(bytes(block))
        else:
            raise AssertionError(kind)
        gz.write(good.read_bytes())
    return out


@pytest.mark.parametrize("kind", ["pax", "gnu-longname", "pax-global", "pax-chain",
                                  "pax-sparse", "gnu-sparse"])
def test_extended_header_bombs_are_refused_before_allocating(
    store: Any, new_root: Any, w: Any, procs: Any, tmp_path: Path, kind: str, figures: Any
) -> None:
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    good = export_bundle(store, ck.id, tmp_path / "good.tar")
    hostile = _bomb(kind, good, tmp_path / f"{kind}.tar.gz")
    assert hostile.stat().st_size < 8 * 1024 * 1024  # small on disk, huge when inflated
    target = new_root("target")
    CheckpointStore.open(target).close()
    before = checks.dir_snapshot(target / "hot")
    queue = procs.SimpleQueue()
    child = checks.start_child(procs, w.import_bundle_measured, str(target), str(hostile),
                               queue)
    assert checks.join(child, 300.0) == 0
    outcome, message, grown = queue.get()
    figures.add("bad_inputs")
    figures.set(f"bundle_{kind}", {"outcome": outcome, "rss_growth_mb": round(grown, 1)})
    assert outcome in ("IntegrityError", "InvalidNameError"), (outcome, message, grown)
    assert grown < 64, f"RSS grew {grown:.0f} MiB before the bundle was refused"
    with CheckpointStore.open(target) as other:
        assert other.list(state=None) == []  # nothing registered, not even FAILED
    assert checks.dir_snapshot(target / "hot") == before  # nothing written
