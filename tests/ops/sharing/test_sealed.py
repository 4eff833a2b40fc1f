"""Encrypted (sealed) copies: keys, push/pull through a remote on S3, encrypted bundles, and
every bad input (wrong, missing or misused keys, tampered, truncated or swapped ciphertext),
each refused with our error and nothing written.

Stores a (SQLite + S3 warm), b (PostgreSQL + S3 warm, the untrusted remote) and c (SQLite,
hot only) come from tests/remote_support.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from ckptstore.cli.app import main
from ckptstore.errors import (
    CheckpointNotFoundError,
    ConfigError,
    DecryptionError,
    IntegrityError,
)
from ckptstore.format.sealed import SEALED_DIR
from ckptstore.keyfiles import load_decryption_key, load_encryption_key
from ckptstore.ops.sharing.crypt import generate_encryption_keypair
from ckptstore.ops.sharing.remote import open_remote
from ckptstore.ops.sharing.sealed import export_sealed, import_sealed, is_sealed_bundle
from ckptstore.ops.sharing.sealed_remote import pull_sealed, push_sealed
from ckptstore.ops.sharing.signing import generate_keypair, load_public_key, sign_checkpoint
from ckptstore.records import CheckpointState

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """Encryption pairs ``agg`` and ``eve``, signing pair ``sig``."""
    out = tmp_path / "keys"
    agg_key, agg_pub = generate_encryption_keypair(out, "agg")
    eve_key, eve_pub = generate_encryption_keypair(out, "eve")
    sig_key, sig_pub = generate_keypair(out, "sig")
    return {"agg.key": agg_key, "agg.pub": agg_pub, "eve.key": eve_key, "eve.pub": eve_pub,
            "sig.key": sig_key, "sig.pub": sig_pub}


def _garbage(directory: Path) -> Path:
    path = directory / "garbage.pub"
    path.write_text("-----BEGIN NOT A KEY-----\n")
    return path


def _sealed_keys(store: Any) -> list[str]:
    return list(store.tier("warm").list_prefix(f"{SEALED_DIR}/"))


def _nothing_in(store: Any) -> None:
    """No checkpoint row (any state) and no run directory in the hot tier."""
    rows = [ck for ck in store.catalog.list() if ck.state != CheckpointState.DELETED]
    assert rows == []
    hot = store.hot
    assert not any(p for p in hot.iterdir() if not p.name.startswith(".")), list(hot.iterdir())
    assert not any(p.name.startswith(".sealed-work-") for p in hot.iterdir())


def test_keygen_kinds_refused_where_the_other_is_expected(keys: dict[str, Path]) -> None:
    assert stat.S_IMODE(os.stat(keys["agg.key"]).st_mode) == 0o600
    load_encryption_key(keys["agg.pub"])
    load_decryption_key(keys["agg.key"])
    with pytest.raises(ConfigError, match="Ed25519 signing key"):
        load_encryption_key(keys["sig.pub"])
    with pytest.raises(ConfigError, match="Ed25519 signing key"):
        load_decryption_key(keys["sig.key"])
    with pytest.raises(ConfigError, match="is a private key"):
        load_encryption_key(keys["agg.key"])
    with pytest.raises(ConfigError, match="is a public key"):
        load_decryption_key(keys["agg.pub"])
    with pytest.raises(ConfigError, match="not an Ed25519"):
        load_public_key(keys["agg.pub"])
    with pytest.raises(ConfigError, match="cannot read the decryption"):
        load_decryption_key(keys["agg.key"].with_name("missing.key"))
    with pytest.raises(ConfigError, match="not a PEM public key"):
        load_encryption_key(_garbage(keys["agg.key"].parent))


def test_push_pull_roundtrip_remote_sees_ciphertext_only(stores: Any, kit: Any,
                                                         keys: dict[str, Path]) -> None:
    state = kit.state(1)
    ck = stores.a.save("secret-run", 7, state, metrics={"samples": 1234.0})
    sign_checkpoint(stores.a, ck.id, keys["sig.key"])
    b = open_remote(stores.a, "b")
    try:
        report = push_sealed(stores.a, b, [ck.id], remote="b", encrypt_to=[keys["agg.pub"]])
        assert [c["checkpoint"] for c in report.copies] == [ck.id]
        # The remote's catalog learned nothing; its tier holds numbered ciphertext only.
        assert b.catalog.list() == []
        objects = _sealed_keys(b)
        assert any(k.endswith("/envelope.json") for k in objects)
        blob = b"".join(b.tier("warm").get_bytes(k) for k in objects)
        for secret in (b"secret-run", ck.id.encode(), b"samples", b"manifest", b"w/c/0"):
            assert secret not in blob
        # The remote's doctor takes them for no orphan of its own: --fix leaves them.
        from ckptstore.ops.upkeep.doctor import doctor

        findings = doctor(b, fix=True).findings
        assert not [f for f in findings if SEALED_DIR in str(f.subject)]
        assert _sealed_keys(b) == objects
        # Pushed again to the same recipient: found, nothing sent.
        again = push_sealed(stores.a, b, [ck.id], remote="b", encrypt_to=[keys["agg.pub"]])
        assert again.present == [ck.id] and again.copies == []
    finally:
        b.close()
    b = open_remote(stores.c, "b")
    try:
        got = pull_sealed(stores.c, b, ["secret-run@latest"], remote="b",
                          key=keys["agg.key"], require_signature=keys["sig.pub"])
    finally:
        b.close()
    assert [c["checkpoint"] for c in got.copies] == [ck.id]
    pulled = stores.c.get(ck.id)
    assert pulled.run == "secret-run" and pulled.step == 7
    assert pulled.metrics["samples"] == 1234.0
    assert kit.same(stores.c.load(ck.id), state)


def test_pull_with_wrong_or_signing_key_writes_nothing(stores: Any, kit: Any,
                                                       keys: dict[str, Path]) -> None:
    ck = stores.a.save("r", 1, kit.state(2))
    b = open_remote(stores.a, "b")
    try:
        with pytest.raises(ConfigError, match="Ed25519 signing key"):
            push_sealed(stores.a, b, [ck.id], remote="b", encrypt_to=[keys["sig.pub"]])
        assert _sealed_keys(b) == []
        push_sealed(stores.a, b, [ck.id], remote="b", encrypt_to=[keys["agg.pub"]])
    finally:
        b.close()
    b = open_remote(stores.c, "b")
    try:
        with pytest.raises(DecryptionError, match="encrypted to other keys"):
            pull_sealed(stores.c, b, [ck.id], remote="b", key=keys["eve.key"])
        with pytest.raises(ConfigError, match="Ed25519 signing key"):
            pull_sealed(stores.c, b, [ck.id], remote="b", key=keys["sig.key"])
        with pytest.raises(CheckpointNotFoundError):
            pull_sealed(stores.c, b, ["other@latest"], remote="b", key=keys["agg.key"])
    finally:
        b.close()
    _nothing_in(stores.c)


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap", "index"])
def test_damaged_ciphertext_is_refused(stores: Any, kit: Any, keys: dict[str, Path],
                                       damage: str) -> None:
    ck = stores.a.save("r", 1, kit.state(3))
    b = open_remote(stores.a, "b")
    try:
        push_sealed(stores.a, b, [ck.id], remote="b", encrypt_to=[keys["agg.pub"]])
        warm = b.tier("warm")

        def put(key: str, data: bytes) -> None:  # objects are written once: replace
            warm.delete(key)
            warm.put_bytes(key, data)

        objects = sorted(k for k in _sealed_keys(b) if "/o/" in k)
        # The largest objects are chunk files.
        first, second = sorted(objects, key=warm.size)[-2:]
        if damage == "flip":
            data = bytearray(warm.get_bytes(first))
            data[len(data) // 2] ^= 1
            put(first, bytes(data))
        elif damage == "truncate":
            put(first, warm.get_bytes(first)[:-5])
        elif damage == "swap":
            one, two = warm.get_bytes(first), warm.get_bytes(second)
            assert len(one) == len(two)
            put(first, two)
            put(second, one)
        else:
            index = next(k for k in _sealed_keys(b) if k.endswith("/index"))
            data = bytearray(warm.get_bytes(index))
            data[3] ^= 0x40
            put(index, bytes(data))
    finally:
        b.close()
    b = open_remote(stores.c, "b")
    try:
        with pytest.raises(DecryptionError) as info:
            pull_sealed(stores.c, b, [ck.id], remote="b", key=keys["agg.key"])
    finally:
        b.close()
    if damage != "index":
        assert "object o/" in str(info.value)
    _nothing_in(stores.c)


def test_encrypted_bundle(stores: Any, kit: Any, keys: dict[str, Path],
                          tmp_path: Path) -> None:
    state = kit.state(4)
    ck = stores.a.save("r", 3, state, metrics={"samples": 10.0})
    sign_checkpoint(stores.a, ck.id, keys["sig.key"])
    out = export_sealed(stores.a, ck.id, tmp_path / "x.tar",
                        [keys["agg.pub"], keys["eve.pub"]])
    assert is_sealed_bundle(out)
    with tarfile.open(out) as tar:
        names = tar.getnames()
        blob = b"".join(tar.extractfile(m).read() for m in tar.getmembers())  # type: ignore[union-attr]
    assert "ckptstore-sealed.json" in names and not any("manifest" in n for n in names)
    assert b"samples" not in blob and ck.id.encode() not in blob
    with pytest.raises(DecryptionError, match="give the private key"):
        import_sealed(stores.c, out, None)
    with pytest.raises(ConfigError, match="signing key"):
        import_sealed(stores.c, out, keys["sig.key"])
    truncated = tmp_path / "t.tar"
    truncated.write_bytes(out.read_bytes()[: out.stat().st_size // 2])
    with pytest.raises(DecryptionError):
        import_sealed(stores.c, truncated, keys["agg.key"])
    _nothing_in(stores.c)
    # Either recipient opens it; the signature is checked on the plaintext.
    got = import_sealed(stores.c, out, keys["eve.key"], require_signature=keys["sig.pub"])
    assert got.id == ck.id and kit.same(stores.c.load(ck.id), state)


def test_bundle_for_someone_else(stores: Any, kit: Any, keys: dict[str, Path],
                                 tmp_path: Path) -> None:
    ck = stores.a.save("r", 1, kit.state(5))
    out = export_sealed(stores.a, ck.id, tmp_path / "x.tar", [keys["eve.pub"]])
    with pytest.raises(DecryptionError, match="was not encrypted to the key"):
        import_sealed(stores.c, out, keys["agg.key"])
    _nothing_in(stores.c)


def _ckpt(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main(list(args))
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in args and out.strip() else out


def test_cli_keygen_push_pull_export_import(stores: Any, kit: Any, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    a_cfg, c_cfg = str(stores.a_config), str(stores.c_config)
    out = str(tmp_path / "k")
    code, made = _ckpt(capsys, "keygen", "--encryption", "--out", out, "--name", "site",
                       "--json")
    assert code == 0 and made["kind"] == "x25519"
    assert stat.S_IMODE(os.stat(made["private_key"]).st_mode) == 0o600
    code, signing = _ckpt(capsys, "keygen", "--out", out, "--name", "sig", "--json")
    assert code == 0 and signing["kind"] == "ed25519"
    code, err = _ckpt(capsys, "keygen", "--encryption", "--out", out, "--name", "site",
                      "--json")
    assert code == 1 and "never overwritten" in err["error"]["message"]

    state = kit.state(6)
    ck = stores.a.save("cli", 4, state)
    # A signing key as recipient: our error, exit 1, nothing on the remote.
    code, err = _ckpt(capsys, "push", ck.id, "--to", "b", "--config", a_cfg,
                      "--encrypt-to", signing["public_key"], "--json")
    assert code == 1 and err["error"]["type"] == "ConfigError"
    # Options that cannot go together: bad usage, exit 2.
    code, _ = _ckpt(capsys, "push", ck.id, "--to", "b", "--config", a_cfg,
                    "--encrypt-to", made["public_key"], "--self-contained")
    assert code == 2
    code, pushed = _ckpt(capsys, "push", ck.id, "--to", "b", "--config", a_cfg,
                         "--encrypt-to", made["public_key"], "--json")
    assert code == 0 and pushed["encrypted"] and pushed["copies"][0]["checkpoint"] == ck.id
    # No key: the remote's catalog does not know it, and the error says why.
    code, err = _ckpt(capsys, "pull", "cli@latest", "--from", "b", "--config", c_cfg, "--json")
    assert code == 1 and "holds encrypted copies" in err["error"]["message"]
    # A signing key given to sign with is fine; an encryption key is refused.
    code, err = _ckpt(capsys, "sign", ck.id, "--key", made["private_key"], "--config", a_cfg,
                      "--json")
    assert code == 1 and "X25519 encryption key" in err["error"]["message"]
    # The key from the environment.
    monkeypatch.setenv("CKPT_DECRYPT_KEY", signing["private_key"])
    code, err = _ckpt(capsys, "pull", "cli@latest", "--from", "b", "--config", c_cfg, "--json")
    assert code == 1 and err["error"]["type"] == "ConfigError"
    monkeypatch.setenv("CKPT_DECRYPT_KEY", made["private_key"])
    code, pulled = _ckpt(capsys, "pull", "cli@latest", "--from", "b", "--config", c_cfg,
                         "--json")
    assert code == 0 and pulled["copies"][0]["checkpoint"] == ck.id
    assert kit.same(stores.c.load(ck.id), state)
    # With a key in the environment, a plain checkpoint is still pulled the plain way.
    plain = stores.a.save("plain", 1, kit.state(9))
    code, _ = _ckpt(capsys, "push", plain.id, "--to", "b", "--config", a_cfg, "--json")
    assert code == 0
    code, pulled = _ckpt(capsys, "pull", "plain@latest", "--from", "b", "--config", c_cfg,
                         "--json")
    assert code == 0 and pulled["pushed"] == [plain.id] and "encrypted" not in pulled
    monkeypatch.delenv("CKPT_DECRYPT_KEY")

    bundle = str(tmp_path / "b.tar")
    code, exported = _ckpt(capsys, "export", ck.id, "--out", bundle, "--config", a_cfg,
                           "--encrypt-to", made["public_key"], "--json")
    assert code == 0 and exported["encrypted"]
    d_cfg = kit.write_config(tmp_path / "d.toml", tmp_path / "d")
    code, err = _ckpt(capsys, "import-bundle", bundle, "--config", str(d_cfg), "--json")
    assert code == 1 and err["error"]["type"] == "DecryptionError"
    code, imported = _ckpt(capsys, "import-bundle", bundle, "--config", str(d_cfg),
                           "--key", made["private_key"], "--json")
    assert code == 0 and imported["id"] == ck.id
    # The key from the config file (relative to it).
    e_cfg = kit.write_config(tmp_path / "e.toml", tmp_path / "e")
    e_cfg.write_text(f'decrypt_key = "k/site.key"\n{e_cfg.read_text()}')
    code, imported = _ckpt(capsys, "import-bundle", bundle, "--config", str(e_cfg), "--json")
    assert code == 0 and imported["id"] == ck.id


def test_push_killed_midway_leaves_no_readable_copy_and_the_rerun_cleans_up(
        stores: Any, kit: Any, keys: dict[str, Path]) -> None:
    ck = stores.a.save("crash", 1, kit.state(7))
    env = dict(os.environ, CKPT_FAULT_POINT="sealed.object:3")
    proc = subprocess.run(
        [sys.executable, "-m", "ckptstore", "push", ck.id, "--to", "b", "--config",
         str(stores.a_config), "--encrypt-to", str(keys["agg.pub"])],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    b = open_remote(stores.a, "b")
    try:
        left = _sealed_keys(b)
        assert left and not any(k.endswith("/envelope.json") for k in left)
        # Readers see no copy at all.
        with pytest.raises(CheckpointNotFoundError, match="no finished sealed copies"):
            pull_sealed(stores.c, b, [ck.id], remote="b", key=keys["agg.key"])
        # The next push removes what the killed one wrote and makes one whole copy.
        report = push_sealed(stores.a, b, [ck.id], remote="b", encrypt_to=[keys["agg.pub"]])
        copy_id = report.copies[0]["copy"]
        assert {k.split("/")[1] for k in _sealed_keys(b)} == {copy_id}
        pull_sealed(stores.c, b, [ck.id], remote="b", key=keys["agg.key"])
    finally:
        b.close()
    assert kit.same(stores.c.load(ck.id), kit.state(7))


def test_forged_content_properly_encrypted_is_refused_after_decryption(
        stores: Any, kit: Any, keys: dict[str, Path], tmp_path: Path) -> None:
    # Anyone with the recipient's public key can encrypt for it: the ciphertext is genuine,
    # the content is forged (same size and crc32c). The plaintext blake3 catches it.
    from forge_support import first_chunk_file, forge_chunk_file

    ck = stores.a.save("r", 1, kit.state(8))
    forge_chunk_file(first_chunk_file(stores.a.checkpoint_dir(ck.run, ck.id)))
    out = export_sealed(stores.a, ck.id, tmp_path / "forged.tar", [keys["agg.pub"]])
    with pytest.raises(IntegrityError, match="blake3"):
        import_sealed(stores.c, out, keys["agg.key"])
    _nothing_in(stores.c)
