"""The other store is untrusted (issue 31): forged chunks, lying catalogs, overlapping tiers,
prunes on either side and pulls that fail half way, through src/ckptstore/ops/sharing/ and
the ``ckpt`` commands where an operator meets them.

A forged chunk here has other content but the same size and crc32c as the real one
(tests/forge_support.py): only the manifest's blake3 tells them apart.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from forge_support import first_chunk_file, forge_chunk_bytes, forge_chunk_file
from sqlalchemy import update

from ckptstore.catalog.models import CheckpointRow
from ckptstore.cli.app import main
from ckptstore.errors import CheckpointNotFoundError, IntegrityError, RemoteError
from ckptstore.ops.sharing.push import push_checkpoints
from ckptstore.ops.sharing.remote import add_remote, open_remote
from ckptstore.ops.sharing.signing import generate_keypair, sign_checkpoint
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.records import CheckpointState, ReplicaState
from ckptstore.retention import RetentionPolicy
from ckptstore.store import CheckpointStore

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


def _ckpt(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main(list(args))
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in args else out


def _forge_on(store: Any, ck: Any, tier: str = "warm") -> str:
    """Forge the first chunk file of ``ck``'s copy on ``tier``; returns its key."""
    t = store.tier(tier)
    key = next(k for k in t.list_prefix(t.prefix_for(ck.run, ck.id)) if "/c/" in k)
    data = t.get_bytes(key)
    t.delete(key)
    t.put_bytes(key, forge_chunk_bytes(data))
    return key


def _nothing_of(store: Any, ck: Any, run_existed: bool = False) -> None:
    """No row, no file, no directory of ``ck`` (nor its run, unless it existed before)."""
    with pytest.raises(CheckpointNotFoundError):
        store.catalog.get_any(ck.id)
    assert not store.checkpoint_dir(ck.run, ck.id).exists()
    if not run_existed:
        assert ck.run not in {r.name for r in store.runs()}
        assert not (store.hot / ck.run).exists()


def test_a_forged_chunk_is_refused_by_pull_push_sync_and_import(
        stores: Any, kit: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a, b, c = stores.a, stores.b, stores.c
    a_cfg, c_cfg = str(stores.a_config), str(stores.c_config)
    # Pull: the remote's warm copy holds a forged chunk; `ckpt pull` refuses it by name.
    pulled = a.save("fg", 1, kit.state(50), delta=False)
    push_checkpoints(a, b, [pulled.id], remote="b")
    key = _forge_on(b, pulled)
    code, err = _ckpt(capsys, "pull", pulled.id, "--from", "b", "--config", c_cfg, "--json")
    assert code == 1 and err["error"]["type"] == "IntegrityError", err
    message = err["error"]["message"]
    assert pulled.id in message and "tensor w" in message and "float32/c/0" in message
    assert "blake3" in message and key.split("/", 2)[2] in message
    _nothing_of(c, pulled)
    code, report = _ckpt(capsys, "doctor", "--config", c_cfg, "--json")
    assert code == 0, report["findings"]

    # Push and sync: this store's own copy was forged; the remote receives nothing of it.
    for command in ("push", "sync"):
        ck = a.save(f"fg-{command}", 1, kit.state(51), delta=False)
        forge_chunk_file(first_chunk_file(a.checkpoint_dir(ck.run, ck.id)))
        args = ([command, ck.id, "--to", "b"] if command == "push"
                else [command, ck.run, "--to", "b"])
        code, err = _ckpt(capsys, *args, "--config", a_cfg, "--json")
        assert code == 1 and err["error"]["type"] == "IntegrityError", err
        assert ck.id in err["error"]["message"] and "tensor w" in err["error"]["message"]
        with pytest.raises(CheckpointNotFoundError):
            b.catalog.get_any(ck.id)
        warm = b.tier("warm")
        assert warm.list_prefix(warm.prefix_for(ck.run, ck.id)) == []

    # Import: a bundle whose chunk member was forged the same way.
    ck = a.save("fg-bundle", 1, kit.state(52), delta=False)
    bundle = tmp_path / "fg.tar"
    code, _ = _ckpt(capsys, "export", ck.id, "--out", str(bundle), "--config", a_cfg,
                    "--json")
    assert code == 0
    forged = tmp_path / "forged.tar"
    with tarfile.open(bundle) as src, tarfile.open(forged, "w", format=tarfile.PAX_FORMAT) as out:
        for info in src.getmembers():
            data = src.extractfile(info).read()  # type: ignore[union-attr]
            if info.name.endswith("float32/c/0"):
                data = forge_chunk_bytes(data)
            out.addfile(info, io.BytesIO(data))
    code, err = _ckpt(capsys, "import-bundle", str(forged), "--config", c_cfg, "--json")
    assert code == 1 and err["error"]["type"] == "IntegrityError", err
    assert ck.id in err["error"]["message"] and "tensor w" in err["error"]["message"]
    _nothing_of(c, ck)
    assert c.list(state=None) == []
    code, report = _ckpt(capsys, "doctor", "--config", c_cfg, "--json")
    assert code == 0, report["findings"]


def test_require_signature_covers_the_bytes_that_land(
        stores: Any, kit: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a, b, c = stores.a, stores.b, stores.c
    private, public = generate_keypair(tmp_path / "keys", "trusted")
    ck = a.save("sig", 1, kit.state(53), delta=False)
    sign_checkpoint(a, ck.id, private)
    push_checkpoints(a, b, [ck.id], remote="b", require_signature=public)
    _forge_on(b, ck)  # a validly signed manifest, forged chunk content
    code, err = _ckpt(capsys, "pull", ck.id, "--from", "b", "--require-signature",
                      str(public), "--config", str(stores.c_config), "--json")
    assert code == 1 and err["error"]["type"] == "IntegrityError", err
    assert "tensor w" in err["error"]["message"]
    _nothing_of(c, ck)


def test_a_remote_overlapping_this_store_is_refused_and_destroys_nothing(
        stores: Any, kit: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    c = stores.c
    c_cfg = str(stores.c_config)
    ck = c.save("mine", 1, kit.state(54), delta=False)
    files = {p: p.read_bytes() for p in c.checkpoint_dir("mine", ck.id).rglob("*")
             if p.is_file()}
    # The remote's warm tier is this store's hot directory: refused at `remote add`.
    evil = kit.write_config(tmp_path / "evil.toml", tmp_path / "evil")
    evil.write_text(evil.read_text() + f'[tiers]\nwarm = "{c.hot}"\n')
    code, err = _ckpt(capsys, "--config", c_cfg, "remote", "add", "evil", "--config",
                      str(evil), "--json")
    assert code == 1 and err["error"]["type"] == "RemoteError", err
    assert "the same as this store's hot tier" in err["error"]["message"]
    assert not (tmp_path / "evil").exists()  # refused before the remote was even opened
    # A remote rooted inside this store's hot tier: refused too.
    inside = kit.write_config(tmp_path / "inside.toml", c.hot / "inside")
    code, err = _ckpt(capsys, "--config", c_cfg, "remote", "add", "inside", "--config",
                      str(inside), "--json")
    assert code == 1 and "inside this store's hot tier" in err["error"]["message"]
    # A good remote whose config changes afterwards is refused at push time.
    good = kit.write_config(tmp_path / "good.toml", tmp_path / "good")
    add_remote(c, "good", good)
    good.write_text(good.read_text() + f'[tiers]\nwarm = "{c.hot.parent}"\n')
    code, err = _ckpt(capsys, "push", ck.id, "--to", "good", "--config", c_cfg, "--json")
    assert code == 1 and "above this store's hot tier" in err["error"]["message"]
    with pytest.raises(RemoteError):
        push_checkpoints(c, c, [ck.id], remote="self")
    assert {p: p.read_bytes() for p in files} == files
    assert kit.same(c.load(ck.id), kit.state(54))

    # A store created inside this hot tier by other means: this store's gc keeps it whole.
    with CheckpointStore.open(root=c.hot / "nested") as nested:
        theirs = nested.save("theirs", 1, kit.state(55), delta=False)
        nested_files = sorted(p for p in (c.hot / "nested").rglob("*") if p.is_file())
        code, _ = _ckpt(capsys, "gc", "--config", c_cfg, "--json")
        assert code == 0
        assert sorted(p for p in (c.hot / "nested").rglob("*") if p.is_file()) == nested_files
        code, report = _ckpt(capsys, "doctor", "--fix", "--config", c_cfg, "--json")
        assert any("another store's marker" in f["detail"] for f in report["findings"])
        assert sorted(p for p in (c.hot / "nested").rglob("*") if p.is_file()) == nested_files
        assert kit.same(nested.load(theirs.id), kit.state(55))
    assert kit.same(c.load(ck.id), kit.state(54))


def test_pull_and_sync_keep_working_after_prunes_on_either_side(
        stores: Any, kit: Any, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, c = stores.a, stores.b, stores.c
    a_cfg, c_cfg = str(stores.a_config), str(stores.c_config)
    s = kit.state(56)
    one = a.save("pr", 1, s, metrics={"loss": 2.0}, delta=False)
    two = a.save("pr", 2, kit.tweaked(s), metrics={"loss": 1.0}, delta=False)
    code, synced = _ckpt(capsys, "sync", "pr", "--to", "b", "--config", a_cfg, "--json")
    assert code == 0 and synced["pushed"] == [one.id, two.id]

    # Pulled, pruned here, pulled again: the same id and content, present again.
    code, _ = _ckpt(capsys, "pull", one.id, two.id, "--from", "b", "--config", c_cfg, "--json")
    assert code == 0
    apply_retention(c, run="pr", policy=RetentionPolicy(keep_last=1))
    assert c.catalog.get_any(one.id).state == CheckpointState.DELETED
    code, again = _ckpt(capsys, "pull", one.id, "--from", "b", "--config", c_cfg, "--json")
    assert code == 0 and again["pushed"] == [one.id] and again["revived"] == [one.id], again
    back = c.get(one.id)
    assert back.state == CheckpointState.COMMITTED and back.version == 1
    assert kit.same(c.load(one.id), s)
    assert any(e.kind == "revived" for e in c.events(one.id))

    # The remote prunes what sync sent: the next sync still sends what is new.
    apply_retention(b, run="pr", tier="warm", policy=RetentionPolicy(keep_last=1))
    assert b.catalog.get_any(one.id).state == CheckpointState.DELETED
    three = a.save("pr", 3, kit.tweaked(s, 2.0), metrics={"loss": 0.5}, delta=False)
    code, synced = _ckpt(capsys, "sync", "pr", "--to", "b", "--config", a_cfg, "--json")
    assert code == 0, synced
    assert synced["pushed"] == [three.id] and synced["pruned_there"] == [one.id]
    assert kit.same(b.load(three.id), kit.tweaked(s, 2.0))
    # An explicit push sends it again.
    code, pushed = _ckpt(capsys, "push", one.id, "--to", "b", "--config", a_cfg, "--json")
    assert code == 0 and pushed["revived"] == [one.id]
    assert kit.same(b.load(one.id), s)


def test_a_checkpoint_whose_base_the_source_pruned_still_travels(
        stores: Any, kit: Any) -> None:
    b, c = stores.b, stores.c  # c: a hot tier only, so a prune deletes the checkpoint
    s = kit.state(57)
    base = c.save("pb", 1, s)
    tuned = c.save("pb", 2, kit.tweaked(s))
    assert base.id in c.manifest(tuned.id).referenced_checkpoints()
    apply_retention(c, run="pb", policy=RetentionPolicy(keep_last=1))
    assert c.catalog.get_any(base.id).state == CheckpointState.DELETED  # its chunks stay
    report = push_checkpoints(c, b, [tuned.id], remote="b")
    assert report.pushed == [tuned.id] and report.self_contained == [tuned.id]
    assert kit.same(b.load(tuned.id), kit.tweaked(s))


def test_verify_signature_deep_hashes_a_readable_copy_or_fails(
        stores: Any, kit: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    c = stores.c
    c_cfg = str(stores.c_config)
    private, public = generate_keypair(tmp_path / "keys", "k")
    ck = c.save("vs", 1, kit.state(58), delta=False)
    sign_checkpoint(c, ck.id, private)
    chunk = first_chunk_file(c.checkpoint_dir("vs", ck.id))
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x01
    chunk.chmod(0o644)
    chunk.write_bytes(bytes(data))
    code, _ = _ckpt(capsys, "verify", ck.id, "--config", c_cfg, "--json")
    assert code == 1 and c.get(ck.id).replica("hot").state == ReplicaState.DAMAGED
    code, err = _ckpt(capsys, "verify-signature", ck.id, "--pubkey", str(public), "--deep",
                      "--config", c_cfg, "--json")
    assert code == 1 and err["error"]["type"] == "IntegrityError", err
    assert "hot:DAMAGED" in err["error"]["message"]


def test_what_a_pull_records_comes_from_the_manifest_not_the_remote_catalog(
        stores: Any, kit: Any, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = stores.a, stores.b
    ck = a.save("lie", 7, kit.state(59), delta=False)
    push_checkpoints(a, b, [ck.id], remote="b")
    with b.catalog._write() as session:  # the remote's catalog lies about its checkpoint
        session.execute(update(CheckpointRow).where(CheckpointRow.id == ck.id).values(
            stored_bytes=2**63 - 1, logical_bytes=2**63 - 1, step=123456, codec="zstd-3"))
    code, _ = _ckpt(capsys, "pull", ck.id, "--from", "b", "--config", str(stores.c_config),
                    "--json")
    assert code == 0
    code, listed = _ckpt(capsys, "ls", "--run", "lie", "--config", str(stores.c_config),
                         "--json")
    manifest = a.manifest(ck.id)
    row = next(r for r in listed if r["id"] == ck.id)
    assert (row["stored_bytes"], row["logical_bytes"], row["step"], row["codec"]) == (
        manifest.stored_bytes, manifest.logical_bytes, 7, manifest.codec)


def test_a_failed_pull_leaves_the_destination_as_it_was(
        stores: Any, kit: Any, capsys: pytest.CaptureFixture[str]) -> None:
    b, c = stores.b, stores.c
    a = stores.a
    c_cfg = str(stores.c_config)
    gone = a.save("fail-gone", 1, kit.state(60), delta=False)
    cut = a.save("fail-cut", 1, kit.state(61), delta=False)
    push_checkpoints(a, b, [gone.id, cut.id], remote="b")
    # The remote vanishes mid-pull: its objects are gone after the first file arrived.
    warm = b.tier("warm")

    def vanish(_nbytes: int) -> None:
        warm.delete_keys(warm.list_prefix(warm.prefix_for(gone.run, gone.id)))

    with open_remote(c, "b") as remote, pytest.raises(Exception) as failed:
        push_checkpoints(remote, c, [gone.id], remote="b", direction="pull", progress=vanish,
                         threads=1)
    assert not isinstance(failed.value, AssertionError)
    _nothing_of(c, gone)
    # A truncated chunk.
    key = next(k for k in warm.list_prefix(warm.prefix_for(cut.run, cut.id)) if "/c/" in k)
    data = warm.get_bytes(key)
    warm.delete(key)
    warm.put_bytes(key, data[:-100])
    code, err = _ckpt(capsys, "pull", cut.id, "--from", "b", "--config", c_cfg, "--json")
    assert code == 1 and err["error"]["type"] == "IntegrityError", err
    _nothing_of(c, cut)
    assert c.list(state=None) == []
    code, report = _ckpt(capsys, "doctor", "--config", c_cfg, "--json")
    assert code == 0, report["findings"]


def test_pull_refuses_a_manifest_that_is_not_the_checkpoint(stores: Any, kit: Any) -> None:
    """The remote's catalog names one checkpoint, its files hold another (whose digest the
    catalog records too): the id inside the manifest must be the checkpoint's."""
    a, b, c = stores.a, stores.b, stores.c
    one = a.save("swap", 1, kit.state(62), delta=False)
    two = a.save("swap", 2, kit.state(63), delta=False)
    push_checkpoints(a, b, [one.id, two.id], remote="b")
    warm = b.tier("warm")
    for rel in ("manifest.json", "COMMITTED"):
        data = warm.get_bytes(warm.key_for("swap", two.id, rel))
        warm.delete(warm.key_for("swap", one.id, rel))
        warm.put_bytes(warm.key_for("swap", one.id, rel), data)
    with b.catalog._write() as session:
        session.execute(update(CheckpointRow).where(CheckpointRow.id == one.id).values(
            manifest_digest=b.get(two.id).manifest_digest))
    with open_remote(c, "b") as remote, pytest.raises(IntegrityError, match="describes"):
        push_checkpoints(remote, c, [one.id], remote="b", direction="pull")
    _nothing_of(c, one)
