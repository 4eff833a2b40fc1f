"""Push, pull and sync between two real stores (SQLite + moto S3, PostgreSQL + moto S3) and a
third one (SQLite, hot only), through src/ckptstore/ops/sharing/push.py."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from ckptstore.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    InvalidNameError,
    LeaseHeldError,
    RemoteError,
    StorageError,
)
from ckptstore.ops.sharing.push import push_checkpoints
from ckptstore.ops.sharing.remote import (
    add_remote,
    list_remotes,
    open_remote,
    remove_remote,
    store_id,
)
from ckptstore.ops.sharing.signing import generate_keypair, sign_checkpoint, verify_signature
from ckptstore.ops.sharing.sync import sync_run
from ckptstore.ops.upkeep.doctor import doctor
from ckptstore.records import ReplicaState

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


def _prefix_sizes(store: Any, ck: Any, tier: str = "warm") -> dict[str, int]:
    t = store.tier(tier)
    return {k: t.size(k) for k in t.list_prefix(t.prefix_for(ck.run, ck.id))}


def test_push_dedup_and_xor_then_pull_into_a_third_store(stores: Any, kit: Any) -> None:
    a, b, c = stores.a, stores.b, stores.c
    a.run("base", code_version="git:1f3c2e", data_version="data-v7")
    s1 = kit.state(1)
    c1 = a.save("base", 1, s1, metrics={"loss": 1.0}, tags=["best"])
    s2 = kit.tweaked(s1)
    c2 = a.save("base", 2, s2, metrics={"loss": 0.5}, parent=c1.id)
    x1 = a.save("xor", 1, s1, delta="xor")
    s3 = kit.tweaked(s1, 2.0)
    x2 = a.save("xor", 2, s3, delta="xor")
    assert a.get(x2.id).kind == "delta" and a.get(x2.id).base_id == x1.id
    assert any(ch.src == c1.id for arr in a.manifest(c2.id).arrays.values()
               for ch in arr.chunks), "the fine-tune shares chunks with its base"

    report = push_checkpoints(a, b, [c2.id, x2.id], remote="b")
    # Bases first: each arrives as a checkpoint the destination can load on its own.
    assert report.pushed == [c1.id, c2.id, x1.id, x2.id]
    assert report.tier == "warm" and report.bytes_sent > 0
    for ck, state in ((c1, s1), (c2, s2), (x1, s1), (x2, s3)):
        there = b.get(ck.id)
        assert there.replica("warm").state == ReplicaState.PRESENT  # type: ignore[union-attr]
        assert kit.same(b.load(ck.id), state)
    assert b.get(x2.id).kind == "delta" and b.get(x2.id).base_id == x1.id
    assert b.get("base@latest").id == c2.id

    # Pulled back into a third store (hot tier only): bases come along, bit-exact.
    with open_remote(c, "b") as remote_b:
        pulled = push_checkpoints(remote_b, c, ["base@latest", x2.id], remote="b",
                                  direction="pull")
    assert pulled.tier == "hot" and set(pulled.pushed) == {c1.id, c2.id, x1.id, x2.id}
    assert kit.same(c.load(c2.id), s2) and kit.same(c.load(x2.id), s3)
    got = c.get(c2.id)
    assert got.metrics == {"loss": 0.5} and got.step == 2 and got.parent_id == c1.id
    assert c.get(c1.id).tags == ("best",)
    assert [ck.id for ck in c.lineage(c2.id)] == [c1.id]
    run = c.catalog.get_run("base")
    assert (run.code_version, run.data_version) == ("git:1f3c2e", "data-v7")
    assert next(e.kind for e in c.events(c2.id)) == "received"
    assert c.verify(c2.id) == [] and c.verify(x2.id) == []
    # Both catalogs agree with their tiers: no orphans, no missing copies.
    assert doctor(b).ok and doctor(c).ok


def test_second_push_of_a_fine_tune_sends_only_its_new_chunks(stores: Any, kit: Any) -> None:
    a, b = stores.a, stores.b
    s1 = kit.state(2)
    base = a.save("ft", 1, s1)
    first = push_checkpoints(a, b, [base.id], remote="b")
    before = _prefix_sizes(b, base)
    tuned = a.save("ft", 2, kit.tweaked(s1), parent=base.id)
    second = push_checkpoints(a, b, [tuned.id], remote="b")
    assert second.pushed == [tuned.id] and second.present == [base.id]
    own = [ch for arr in a.manifest(tuned.id).arrays.values() for ch in arr.chunks
           if ch.src is None]
    shared = [ch for arr in a.manifest(tuned.id).arrays.values() for ch in arr.chunks
              if ch.src is not None]
    assert len(own) == 1 and len(shared) >= 3
    # Everything sent lies in the fine-tune's own prefix: its one new chunk and its small
    # documents. Not one byte of the base was written again.
    sizes = _prefix_sizes(b, tuned)
    assert second.bytes_sent == sum(sizes.values())
    assert sum(1 for k in sizes if "/c/" in k) == 1
    assert _prefix_sizes(b, base) == before
    assert second.bytes_sent < first.bytes_sent / 2
    print(f"\nfirst push {first.bytes_sent} B, fine-tune push {second.bytes_sent} B")
    assert kit.same(b.load(tuned.id), kit.tweaked(s1))
    # And again: nothing.
    again = push_checkpoints(a, b, [tuned.id], remote="b")
    assert again.pushed == [] and again.present == [tuned.id] and again.bytes_sent == 0


def test_self_contained_push_sends_no_base(stores: Any, kit: Any) -> None:
    a, b = stores.a, stores.b
    s1 = kit.state(3)
    x1 = a.save("sc", 1, s1, delta="xor")
    x2 = a.save("sc", 2, kit.tweaked(s1), delta="xor")
    report = push_checkpoints(a, b, [x2.id], remote="b", self_contained=True)
    assert report.pushed == [x2.id] and report.self_contained == [x2.id]
    with pytest.raises(CheckpointNotFoundError):
        b.catalog.get_any(x1.id)
    there = b.get(x2.id)
    assert there.kind == "full" and there.base_id is None
    assert there.manifest_digest == a.get(x2.id).manifest_digest
    assert kit.same(b.load(x2.id), kit.tweaked(s1))


def test_lineage_to_checkpoints_not_pushed_is_kept_as_a_reference(stores: Any,
                                                                  kit: Any) -> None:
    a, b = stores.a, stores.b
    parent = a.save("p", 1, kit.state(4))
    child = a.save("child", 1, kit.state(5), parent=parent.id, delta=False)
    a.catalog.add_edge(parent.id, child.id, "fine-tuned-from")
    report = push_checkpoints(a, b, [child.id], remote="b")
    refs = report.lineage_elsewhere[child.id]
    assert {"kind": "parent", "checkpoint": parent.id, "store": store_id(a)} in refs
    assert any(r["kind"] == "fine-tuned-from" and r["checkpoint"] == parent.id for r in refs)
    assert b.get(child.id).parent_id is None
    received = next(e for e in b.events(child.id) if e.kind == "received")
    assert received.detail["from_store"] == store_id(a)
    assert received.detail["lineage_elsewhere"] == refs
    # Once the parent arrives too, the edge between them is added at the destination.
    push_checkpoints(a, b, [parent.id], remote="b")
    assert (parent.id, child.id, "fine-tuned-from") in b.catalog.edges(child.id)


def test_signed_checkpoint_is_verified_on_arrival(stores: Any, kit: Any, tmp_path: Path) -> None:
    a, b = stores.a, stores.b
    private, public = generate_keypair(tmp_path / "keys", "trusted")
    other_private, _ = generate_keypair(tmp_path / "keys", "other")
    good = a.save("signed", 1, kit.state(6))
    sign_checkpoint(a, good.id, private)
    report = push_checkpoints(a, b, [good.id], remote="b", require_signature=public)
    assert report.pushed == [good.id]
    verify_signature(b, good.id, public)  # the warm-only copy: the signature came as an event
    # And on from there: the event is what vouches for it in the next store too.
    with open_remote(stores.c, "b") as remote_b:
        pulled = push_checkpoints(remote_b, stores.c, [good.id], remote="b", direction="pull",
                                  require_signature=public)
    assert pulled.pushed == [good.id]
    verify_signature(stores.c, good.id, public, deep=True)

    wrong_key = a.save("signed", 2, kit.state(7))
    sign_checkpoint(a, wrong_key.id, other_private)
    unsigned = a.save("signed", 3, kit.state(8))
    tampered = a.save("signed", 4, kit.state(9))
    sign_checkpoint(a, tampered.id, private)
    path = a.checkpoint_dir("signed", tampered.id) / "SIGNATURE"
    doc = json.loads(path.read_text())
    raw = bytearray(base64.b64decode(doc["signature"]))
    raw[0] ^= 0x01  # still 64 bytes: a well-formed signature that does not verify
    doc["signature"] = base64.b64encode(bytes(raw)).decode()
    path.write_text(json.dumps(doc))
    malformed = a.save("signed", 5, kit.state(14))
    sign_checkpoint(a, malformed.id, private)
    (a.checkpoint_dir("signed", malformed.id) / "SIGNATURE").write_text("{}")
    for ck in (wrong_key, unsigned, tampered, malformed):
        with pytest.raises(IntegrityError):
            push_checkpoints(a, b, [ck.id], remote="b", require_signature=public)
        # A failing signature blocks the commit: no row, not a single file.
        with pytest.raises(CheckpointNotFoundError):
            b.catalog.get_any(ck.id)
        assert _prefix_sizes(b, ck) == {}


def test_concurrent_push_of_the_same_checkpoint_is_refused(stores: Any, kit: Any) -> None:
    a, b = stores.a, stores.b
    ck = a.save("conc", 1, kit.state(10))
    refused: list[BaseException] = []

    def meanwhile(_nbytes: int) -> None:
        if refused:
            return
        try:
            push_checkpoints(a, b, [ck.id], remote="b")
        except LeaseHeldError as exc:
            refused.append(exc)
        else:
            refused.append(AssertionError("the second push was not refused"))

    first = push_checkpoints(a, b, [ck.id], remote="b", progress=meanwhile, threads=1)
    assert len(refused) == 1 and isinstance(refused[0], LeaseHeldError)
    assert "being pushed" in str(refused[0])
    assert first.pushed == [ck.id]
    assert kit.same(b.load(ck.id), kit.state(10))
    # Serialised: once the first push is done, another finds it there.
    assert push_checkpoints(a, b, [ck.id], remote="b").present == [ck.id]


def test_a_failed_push_leaves_nothing_visible(stores: Any, kit: Any) -> None:
    a, b = stores.a, stores.b
    ck = a.save("bad", 1, kit.state(11))
    chunk = next(p for p in a.checkpoint_dir("bad", ck.id).rglob("*")
                 if p.is_file() and "/c/" in str(p))
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.chmod(0o644)
    chunk.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="damaged"):
        push_checkpoints(a, b, [ck.id], remote="b")
    with pytest.raises(CheckpointNotFoundError):
        b.catalog.get_any(ck.id)
    assert _prefix_sizes(b, ck) == {}
    assert b.list(run="bad") == []


def test_sync_pushes_what_is_new_and_only_the_best_when_asked(stores: Any, kit: Any) -> None:
    a, b = stores.a, stores.b
    s = kit.state(12)
    one = a.save("sy", 1, s, metrics={"loss": 3.0})
    two = a.save("sy", 2, kit.tweaked(s), metrics={"loss": 1.0})
    three = a.save("sy", 3, kit.tweaked(s, 3.0), metrics={"loss": 2.0})
    best = sync_run(a, b, "sy", remote="b", best="loss")
    assert best.pushed == [one.id, two.id]  # the best (two) and the base it dedups against
    full = sync_run(a, b, "sy", remote="b")
    assert full.pushed == [three.id] and set(full.present) == {one.id, two.id}
    assert sync_run(a, b, "sy", remote="b").bytes_sent == 0


def test_bad_inputs_raise_our_errors(stores: Any, kit: Any, tmp_path: Path) -> None:
    a, b = stores.a, stores.b
    ck = a.save("in", 1, kit.state(13))
    with pytest.raises(RemoteError, match="no remote called 'nope'"):
        open_remote(a, "nope")
    with pytest.raises(RemoteError, match="already exists"):
        add_remote(a, "b", stores.b_config)
    with pytest.raises(RemoteError, match="cannot be read"):
        add_remote(a, "x", tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("root = [unterminated\n")
    with pytest.raises(RemoteError):
        add_remote(a, "x", broken)
    with pytest.raises(RemoteError, match="this very store"):
        add_remote(a, "self", stores.a_config)
    with pytest.raises(InvalidNameError):
        add_remote(a, "bad/name", stores.b_config)
    with pytest.raises(RemoteError):
        remove_remote(a, "nope")
    with pytest.raises(RemoteError, match="this very store"):
        push_checkpoints(a, a, [ck.id], remote="a")
    with pytest.raises(CheckpointNotFoundError):
        push_checkpoints(a, b, ["in@v9"], remote="b")
    with pytest.raises(InvalidNameError):
        push_checkpoints(a, b, ["in@@"], remote="b")
    with pytest.raises(ConfigError, match="tier 'cold' is not configured"):
        push_checkpoints(a, b, [ck.id], remote="b", tier="cold")
    with pytest.raises(ConfigError, match="codec"):
        push_checkpoints(a, b, [ck.id], remote="b", self_contained=True, codec="gzip-99")
    with pytest.raises((ConfigError, StorageError)):
        push_checkpoints(a, b, [ck.id], remote="b", require_signature=tmp_path / "no.pub")
    with pytest.raises(CheckpointNotFoundError):
        sync_run(a, b, "no-such-run", remote="b")
    # None of it left anything behind.
    assert b.list(run="in") == []
    assert [r.name for r in list_remotes(a)] == ["b"]


def test_lossy_delta_arrives_with_its_bounds(stores: Any, kit: Any) -> None:
    a, b = stores.a, stores.b
    lossy = {"threshold": 1e-7, "quantize": 8}
    s = {"w": kit.state(15)["w"], "exp_avg": kit.state(16)["w"]}
    a.save("lossy", 1, s, delta=lossy)
    moved = {"w": s["w"], "exp_avg": s["exp_avg"] + 0.01 * kit.state(17)["w"]}
    ck = a.get(a.save("lossy", 2, moved, delta=lossy).id)
    assert ck.lossy and ck.error_bound is not None and ck.lossy_scope
    push_checkpoints(a, b, [ck.id], remote="b")
    there = b.get(ck.id)
    assert (there.lossy, there.error_bound, there.lossy_scope) == (
        ck.lossy, ck.error_bound, ck.lossy_scope)
    assert kit.same(b.load(ck.id), a.load(ck.id))  # the same approximation, bit for bit


def test_the_context_travels_with_the_checkpoint(stores: Any, kit: Any) -> None:
    from ckptstore.capture import capture_context

    a, b, c = stores.a, stores.b, stores.c
    ck = a.save("ctx", 1, kit.state(1))
    captured = capture_context(config={"lr": 0.25})
    a.catalog.record_context("ctx", ck.version, captured.document, captured.digest,
                             captured.blobs)
    push_checkpoints(a, b, [ck.id], remote="b")
    with open_remote(c, "b") as remote_b:
        push_checkpoints(remote_b, c, [ck.id], remote="b", direction="pull")
    for store in (b, c):
        there = store.catalog.context_of(store.get(ck.id))
        assert there is not None and there.digest == captured.digest
        assert there.document["config"] == {"lr": 0.25}
        lock = there.document["environment"]["lock"]
        assert store.catalog.context_blob(lock) == captured.blobs[lock]
