"""Encrypted tiers holding checkpoints saved across hosts: each host seals its own part.

Two simulated nodes (one plain process each, their own ``CKPT_HOST`` and ``CKPT_HOT``, a
PostgreSQL catalog; tests/ops/dcp/multinode_worker.py's ``marked`` scenario) save three
parted checkpoints (a run each) whose ``mark`` tensor holds a run of values no random tensor
does, half on each node. The warm and cold tiers are directories both nodes reach (a shared
mount) and are encrypted (``encrypt_to``). Then, acting as each node in this process: each
node archives its own part, the copy is not PRESENT until the last part is in, the tier holds
no plaintext, and a third node restores (or loads) it bit-exact with the key only; without
the key, or with a tampered or missing part, nothing is written to the hot tier. Demote,
delete, gc, verify and doctor handle such a copy too.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_support import create_pg_database, drop_pg_database, require_pg
from process_support import acting_as_host, wait_sessions

from ckptstore import CheckpointStore, ReplicaState
from ckptstore.catalog import migrate
from ckptstore.errors import DecryptionError, IncompleteCheckpointError
from ckptstore.ops.sharing.crypt import generate_encryption_keypair
from ckptstore.ops.tiering.archive import archive_checkpoints, demote_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica, store_tiers
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.records import SEALED_DIR
from ckptstore.testing.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

WORKER = Path(__file__).parents[1] / "dcp" / "multinode_worker.py"
NODES = ("node-a", "node-b")
TIMEOUT_S = 180
_MARK = torch.arange(8192, dtype=torch.float32) * 0.5 + 12345.0  # multinode_worker.marker()
#: A run of the mark in node A's half and one in node B's half (Shard(0) over two ranks).
_PATTERNS = (_MARK[100:132].numpy().tobytes(), _MARK[5000:5032].numpy().tobytes())


@dataclass
class Cluster:
    """Two nodes' hot directories, a third node's, the shared tiers, catalog and keys."""

    tmp: Path
    catalog_url: str
    keys: dict[str, Path]
    ids: list[str]
    refs: dict[str, Any]

    def hot(self, node: str) -> Path:
        return self.tmp / f"hot-{node}"

    @contextlib.contextmanager
    def node(self, node: str, **overrides: Any) -> Iterator[CheckpointStore]:
        """This test process acting as ``node``: its host name and its own hot directory."""
        options: dict[str, Any] = {
            "catalog_url": self.catalog_url, "hot": str(self.hot(node)),
            "warm": str(self.tmp / "warm"), "cold": str(self.tmp / "cold"),
            "encrypt_to": [str(self.keys["pub"])]}
        options.update(overrides)
        with acting_as_host(node), \
                CheckpointStore.open(self.tmp / f"root-{node}", **options) as store:
            yield store


def _save_across_nodes(tmp: Path, catalog_url: str) -> dict[str, Any]:
    """Three parted checkpoints, one rank per node (two plain processes, no torchrun)."""
    out = tmp / "out"
    out.mkdir()
    port = free_port()
    procs = []
    for rank, node in enumerate(NODES):
        env = dict(os.environ)
        for var in ("CKPT_CONFIG", "CKPT_FAULT_POINT", "CKPT_REPLICAS", "CKPT_WARM",
                    "CKPT_COLD", "CKPT_ENCRYPT_TO", "CKPT_DECRYPT_KEY", "PREFECT_API_URL"):
            env.pop(var, None)
        env.update(CKPT_HOST=node, CKPT_HOT=str(tmp / f"hot-{node}"),
                   CKPT_ROOT=str(tmp / f"root-{node}"), CKPT_CATALOG_URL=catalog_url,
                   RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "marked", str(out)],
                                      env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    wait_sessions(procs, TIMEOUT_S)
    for p in procs:
        assert p.returncode == 0, p.stderr.read()[-3000:] if p.stderr else ""
    report = json.loads((out / "marked-ws2-rank0.json").read_text())
    assert report["ok"], report
    assert report["hosts"] == list(NODES)
    return {"ids": report["ids"],
            "refs": torch.load(out / "marked.pt", weights_only=True)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_pg()
    tmp = tmp_path_factory.mktemp("sealparts")
    url = create_pg_database("ckpt_sealparts")
    try:
        migrate.upgrade(url)
        keys_dir = tmp / "keys"
        key, pub = generate_encryption_keypair(keys_dir, "ops")
        other_key, _ = generate_encryption_keypair(keys_dir, "other")
        saved = _save_across_nodes(tmp, url)
        yield Cluster(tmp, url, {"key": key, "pub": pub, "other_key": other_key},
                      saved["ids"], saved["refs"])
    finally:
        drop_pg_database(url)


@pytest.fixture(autouse=True)
def _no_ambient_key(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CKPT_DECRYPT_KEY", "CKPT_ENCRYPT_TO", "CKPT_WARM", "CKPT_COLD", "CKPT_HOT",
                "CKPT_CATALOG_URL", "CKPT_CONFIG"):
        monkeypatch.delenv(var, raising=False)


def _same(a: Any, b: Any) -> list[str]:
    sys.path.insert(0, str(WORKER.parent))
    try:
        from dcp_worker import _same as same
    finally:
        sys.path.remove(str(WORKER.parent))
    return list(same(a, b))


def _objects(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _hot_snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if not p.name.startswith(".ckptstore")) if root.exists() else []


def _warm_copy(store: CheckpointStore, ckpt_id: str, tier: str = "warm") -> Path:
    replica = store.get(ckpt_id).replica(tier)
    assert replica is not None and replica.sealed, replica
    return Path(replica.uri)


@dataclass
class HalfArchived:
    """``enc-a@1`` archived by node A only: what node A's archive and gc reported."""

    report: Any
    gc_removed: list[str]


@pytest.fixture(scope="module")
def half_archived(cluster: Cluster) -> HalfArchived:
    ckpt_id = cluster.ids[0]
    with cluster.node("node-a") as store:
        report = archive_checkpoints(store, ref=ckpt_id)
        # A gc on node A while node B has not sealed its part yet: the copy under way is
        # not a killed archive's leftover.
        removed = store.gc().sealed_removed
    return HalfArchived(report, removed)


@pytest.fixture(scope="module")
def archived(cluster: Cluster, half_archived: HalfArchived) -> Any:
    with cluster.node("node-b") as store:
        return archive_checkpoints(store, ref=cluster.ids[0])


def test_the_save_is_parted_and_each_node_holds_its_half_of_the_mark(cluster: Cluster) -> None:
    with cluster.node("node-a") as store:
        for ckpt_id in cluster.ids:
            assert store.get(ckpt_id).hosts == NODES
    for node, pattern in zip(NODES, _PATTERNS, strict=True):
        data = b"".join(_objects(cluster.hot(node) / "enc-a" / cluster.ids[0]).values())
        assert pattern in data, node  # so the searches of the tier below can fail


def test_the_copy_is_not_present_while_one_hosts_part_is_missing(
        cluster: Cluster, half_archived: HalfArchived) -> None:
    ckpt_id = cluster.ids[0]
    report = half_archived.report
    assert report.ok and report.parts == {ckpt_id: ["node-a"]} and report.archived == []
    assert "waiting for the parts of node-b" in report.skipped[ckpt_id]
    assert half_archived.gc_removed == []
    with cluster.node("node-c", decrypt_key=str(cluster.keys["key"])) as store:
        warm = store.get(ckpt_id).replica("warm")
        assert warm is not None and warm.state == ReplicaState.COPYING and warm.sealed
        assert [(p.part, p.state) for p in store.catalog.parts(ckpt_id, "warm")] == [
            ("node-a", ReplicaState.PRESENT)]
        copy = Path(warm.uri)
        # Node A's part is sealed under p/0; there is no top-level envelope yet.
        assert (copy / "p" / "0" / "envelope.json").is_file()
        assert not (copy / "envelope.json").exists() and not (copy / "p" / "1").exists()
        before = _hot_snapshot(cluster.hot("node-c"))
        # Neither a load nor a restore takes an incomplete copy for one, key or not.
        with pytest.raises(IncompleteCheckpointError, match="node-b"):
            store.load(ckpt_id)
        with pytest.raises(IncompleteCheckpointError, match="node-b"):
            restore_checkpoint(store, ckpt_id, key=cluster.keys["key"])
        assert _hot_snapshot(cluster.hot("node-c")) == before
    # Retention keeps the hot parts: the warm copy is not complete.
    from ckptstore.ops.tiering.retention import apply_retention
    from ckptstore.retention import RetentionPolicy

    with cluster.node("node-a") as store:
        done = apply_retention(store, tier="hot", run="enc-a",
                               policy=RetentionPolicy(keep_last=0))
        assert done.executed == []
    assert (cluster.hot("node-a") / "enc-a" / ckpt_id / "COMMITTED").is_file()


def test_the_last_host_completes_a_copy_of_ciphertext_only(
        cluster: Cluster, archived: Any) -> None:
    ckpt_id = cluster.ids[0]
    assert archived.ok and archived.parts == {ckpt_id: ["node-b"]}
    assert archived.archived == [ckpt_id]
    with cluster.node("node-c") as store:
        ck = store.get(ckpt_id)
        warm = ck.replica("warm")
        assert warm is not None and warm.state == ReplicaState.PRESENT and warm.verified_at
        assert warm.sealed is not None
        parts = store.catalog.parts(ckpt_id, "warm")
        assert [(p.part, p.state) for p in parts] == [
            ("node-a", ReplicaState.PRESENT), ("node-b", ReplicaState.PRESENT)]
        events = store.catalog.events(ckpt_id, limit=50)
        uploads = {e.detail["part"]: e.detail for e in events if e.kind == "part_archived"}
        assert sorted(uploads) == list(NODES)
        assert all(d["encrypted"] and d["copy"] == warm.sealed for d in uploads.values())
        done = [e for e in events if e.kind == "archived"]
        assert len(done) == 1 and done[0].detail["encrypted"] is True
        assert done[0].detail["recipients"] == 1
        copy = _warm_copy(store, ckpt_id)
        objects = _objects(cluster.tmp / "warm")
        assert objects and all(k.startswith(f"{SEALED_DIR}/{warm.sealed}/") for k in objects)
        assert sum(len(v) for v in objects.values()) == warm.bytes
        assert {k.split("/")[3] for k in objects if k.split("/")[2] == "p"} == {"0", "1"}
        assert (copy / "envelope.json").is_file()
        # The tier holds no plaintext: no run of the mark from either half, no run name,
        # no checkpoint id, no host name.
        for key, data in objects.items():
            for pattern in _PATTERNS:
                assert pattern not in data, key
            for word in (b"enc-a", ckpt_id.encode(), b"node-a", b"node-b"):
                assert word not in data, (key, word)
        # Without a key: the envelopes, every object they count and the sizes check out.
        from ckptstore.ops.upkeep.verify import verify_replicas

        assert verify_replicas(store, ref=ckpt_id, tier="warm").clean


def test_a_third_node_restores_bit_exact_with_the_key_only(
        cluster: Cluster, archived: Any, tmp_path: Path) -> None:
    ckpt_id = cluster.ids[0]
    with cluster.node("node-c") as store:
        before = _hot_snapshot(cluster.hot("node-c"))
        with pytest.raises(DecryptionError, match="--key"):
            restore_checkpoint(store, ckpt_id)
        with pytest.raises(DecryptionError, match="not encrypted to"):
            restore_checkpoint(store, ckpt_id, key=cluster.keys["other_key"])
        assert _hot_snapshot(cluster.hot("node-c")) == before
        assert not [p for p in store.catalog.parts(ckpt_id, "hot") if p.stored_on == "node-c"]
        warm = store.get(ckpt_id).replica("warm")
        assert warm is not None and warm.state == ReplicaState.PRESENT  # not marked damaged
        # Into a directory of one's choosing: complete and verified, nothing recorded.
        target = restore_checkpoint(store, ckpt_id, to=tmp_path / "gathered",
                                    key=cluster.keys["key"])
        assert (target / "COMMITTED").is_file()
        assert not [p for p in store.catalog.parts(ckpt_id, "hot") if p.stored_on == "node-c"]
        # Onto node C's hot tier: every part recorded as kept here, the copy whole.
        restore_checkpoint(store, ckpt_id, key=cluster.keys["key"])
        here = {p.part for p in store.catalog.parts(ckpt_id, "hot")
                if p.stored_on == "node-c" and p.state == ReplicaState.PRESENT}
        assert here == set(NODES)
        assert _same(store.load(ckpt_id), cluster.refs[ckpt_id]) == []
        events = [e for e in store.catalog.events(ckpt_id, limit=50) if e.kind == "restored"]
        assert events[0].detail["from"] == "warm"


def test_a_load_on_a_node_without_its_parts_decrypts_with_the_configured_key(
        cluster: Cluster, archived: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt_id = cluster.ids[0]
    with cluster.node("node-d") as store:
        with pytest.raises(DecryptionError, match="--key"):
            store.load(ckpt_id)
        assert _hot_snapshot(cluster.hot("node-d")) == []
        monkeypatch.setenv("CKPT_DECRYPT_KEY", str(cluster.keys["key"]))
        assert _same(store.load(ckpt_id), cluster.refs[ckpt_id]) == []
        here = {p.part for p in store.catalog.parts(ckpt_id, "hot")
                if p.stored_on == "node-d" and p.state == ReplicaState.PRESENT}
        assert here == set(NODES)


def test_verify_and_doctor_with_the_key(cluster: Cluster, archived: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstore.ops.upkeep.doctor import doctor
    from ckptstore.ops.upkeep.verify import verify_replicas

    ckpt_id = cluster.ids[0]
    monkeypatch.setenv("CKPT_DECRYPT_KEY", str(cluster.keys["key"]))
    with cluster.node("node-c") as store:
        report = verify_replicas(store, ref=ckpt_id, tier="warm")
        assert report.clean and f"{ckpt_id}@warm" in report.ok
        found = doctor(store, deep=True, tiers=["warm"], key=cluster.keys["key"])
        assert not [f for f in found.findings if f.subject == ckpt_id], found.render()


@pytest.mark.parametrize("damage", ["flip", "drop-part"])
def test_a_tampered_or_missing_part_is_refused_and_nothing_is_written(
        cluster: Cluster, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt_id = cluster.ids[1]
    for node in NODES:
        with cluster.node(node) as store:
            replica = store.get(ckpt_id).replica("warm")
            if replica is None or replica.state != ReplicaState.PRESENT:
                archive_checkpoints(store, ref=ckpt_id)
    node = f"node-{damage}"
    with cluster.node(node) as store:
        copy = _warm_copy(store, ckpt_id)
        part = copy / "p" / "1"
        saved = _objects(part)
        try:
            if damage == "flip":
                victim = part / "o" / "1"
                data = victim.read_bytes()
                victim.chmod(0o644)
                victim.write_bytes(data[:20] + bytes([data[20] ^ 1]) + data[21:])
            else:
                for path in sorted(part.rglob("*"), reverse=True):
                    path.chmod(0o755) if path.is_dir() else path.unlink()
            before = _hot_snapshot(cluster.hot(node))
            why = r"part 1 \(node-b\).*(does not decrypt|lacks envelope\.json)"
            with pytest.raises(DecryptionError, match=why):
                restore_checkpoint(store, ckpt_id, key=cluster.keys["key"])
            monkeypatch.setenv("CKPT_DECRYPT_KEY", str(cluster.keys["key"]))
            with pytest.raises(DecryptionError, match=why):
                store.load(ckpt_id)
            assert _hot_snapshot(cluster.hot(node)) == before
            assert not list(cluster.hot(node).glob(".sealed-work-*"))
            assert not [p for p in store.catalog.parts(ckpt_id, "hot") if p.stored_on == node]
            # doctor --deep with the key finds it, and says how to repair it
            from ckptstore.ops.upkeep.doctor import doctor

            seen = [f for f in doctor(store, deep=True, tiers=["warm"]).findings
                    if f.subject == ckpt_id]
            assert [f.kind for f in seen] == ["damaged-replica"], seen
            assert "archive` on each of its hosts" in seen[0].detail
            # verify finds it with the key (a flipped bit keeps every size) and without one
            # (a missing part); a copy sealed part by part is not resealed from one host.
            from ckptstore.ops.upkeep.verify import verify_replicas

            found = verify_replicas(store, ref=ckpt_id, tier="warm")
            assert f"{ckpt_id}@warm" in found.damaged, found
            assert "archive` on each of its hosts" in found.unrepaired[f"{ckpt_id}@warm"]
            monkeypatch.delenv("CKPT_DECRYPT_KEY")
            plain = verify_replicas(store, ref=ckpt_id, tier="warm", repair=False)
            assert (f"{ckpt_id}@warm" in plain.damaged) == (damage == "drop-part")
        finally:
            for rel, data in saved.items():
                path = part / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                if path.exists():
                    path.chmod(0o644)
                path.write_bytes(data)
            store.catalog.set_replica(ckpt_id, "warm", state=ReplicaState.PRESENT)
    with cluster.node(node) as store:  # intact again: it restores
        restore_checkpoint(store, ckpt_id, key=cluster.keys["key"])
        assert _same(store.load(ckpt_id), cluster.refs[ckpt_id]) == []


def test_demote_delete_and_archive_again(cluster: Cluster) -> None:
    ckpt_id = cluster.ids[2]
    for node in NODES:
        with cluster.node(node) as store:
            archive_checkpoints(store, ref=ckpt_id)
    with cluster.node("node-a") as store:
        warm = _warm_copy(store, ckpt_id)
        report = demote_checkpoints(store, older_than_days=0, run="enc-c")
        assert report.ok and report.archived == [ckpt_id] and report.removed == [ckpt_id]
        now = store.get(ckpt_id)
        cold = now.replica("cold")
        assert cold is not None and cold.state == ReplicaState.PRESENT
        assert cold.sealed == warm.name  # the same ciphertext, moved
        assert now.replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
        assert not warm.exists()
        assert {p.state for p in store.catalog.parts(ckpt_id, "warm")} == {
            ReplicaState.DELETED}
        for data in _objects(cluster.tmp / "cold").values():
            for pattern in _PATTERNS:
                assert pattern not in data
    with cluster.node("node-e", decrypt_key=str(cluster.keys["key"])) as store:
        restore_checkpoint(store, ckpt_id, to=cluster.tmp / "from-cold")
        assert _same(store.load(ckpt_id), cluster.refs[ckpt_id]) == []
        # Deleting the cold copy removes its prefix, parts and all.
        delete_replica(store, store.get(ckpt_id), "cold")
        assert not Path(store.get(ckpt_id).replica("cold").uri).exists()  # type: ignore[union-attr]
    # Each host archives to warm again: a new copy, complete when both are in.
    for node in NODES:
        with cluster.node(node) as store:
            archive_checkpoints(store, ref=ckpt_id)
    with cluster.node("node-e") as store:
        again = store.get(ckpt_id).replica("warm")
        assert again is not None and again.state == ReplicaState.PRESENT
        assert again.sealed and again.sealed != warm.name
        assert store_tiers(store)["warm"].list_prefix(f"{SEALED_DIR}/{again.sealed}/")


def test_a_host_without_encrypt_to_cannot_add_a_plain_part(cluster: Cluster) -> None:
    from ckptstore.errors import ConfigError

    ckpt_id = cluster.ids[1]
    with cluster.node("node-b") as store:  # a fresh warm copy, begun sealed by node B
        delete_replica(store, store.get(ckpt_id), "warm")
        archive_checkpoints(store, ref=ckpt_id)
    with cluster.node("node-a", encrypt_to=[]) as store:
        report = archive_checkpoints(store, ref=ckpt_id, raise_errors=False)
        assert "encrypt_to" in report.failed[ckpt_id]
        with pytest.raises(ConfigError, match="same \\[tiers\\] encrypt_to"):
            archive_checkpoints(store, ref=ckpt_id)
        warm = store.get(ckpt_id).replica("warm")
        assert warm is not None and warm.state == ReplicaState.COPYING and warm.sealed


def test_gc_and_a_part_lost_before_the_copy_completes(cluster: Cluster) -> None:
    ckpt_id = cluster.ids[2]
    warm_tier = cluster.tmp / "warm"

    def archive(*nodes: str) -> Any:
        for node in nodes:
            with cluster.node(node) as store:
                last = archive_checkpoints(store, ref=ckpt_id)
        return last

    def parts_states(store: CheckpointStore) -> set[ReplicaState]:
        return {p.state for p in store.catalog.parts(ckpt_id, "warm")}

    # A delete that stopped half way (the row DELETING, the objects there): gc finishes it,
    # parts and all, and each host's next archive seals its part again.
    archive(*NODES)
    with cluster.node("node-a") as store:
        warm = store.get(ckpt_id).replica("warm")
        assert warm is not None and warm.state == ReplicaState.PRESENT and warm.sealed
        store.catalog.set_replica(ckpt_id, "warm", state=ReplicaState.DELETING)
        assert store.gc().sealed_removed == [f"warm:{SEALED_DIR}/{warm.sealed}"]
        assert not [k for k in _objects(warm_tier) if warm.sealed in k]
        assert store.get(ckpt_id).replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
        assert parts_states(store) == {ReplicaState.DELETED}
    # Node A's sealed part is lost from the tier before node B completes the copy: node B
    # records it gone instead of sealing a copy without it; node A seals it again.
    archive("node-a")
    with cluster.node("node-b") as store:
        copy = _warm_copy(store, ckpt_id)
    for path in sorted((copy / "p" / "0").rglob("*"), reverse=True):
        if path.is_file():
            path.unlink()
    report = archive("node-b")
    assert report.archived == [] and "node-a are gone" in report.skipped[ckpt_id]
    with cluster.node("node-a") as store:
        assert store.get(ckpt_id).replica("warm").state == ReplicaState.COPYING  # type: ignore[union-attr]
        assert {(p.part, p.state) for p in store.catalog.parts(ckpt_id, "warm")} == {
            ("node-a", ReplicaState.DELETED), ("node-b", ReplicaState.PRESENT)}
    assert archive("node-a").archived == [ckpt_id]
    with cluster.node("node-f", decrypt_key=str(cluster.keys["key"])) as store:
        assert _warm_copy(store, ckpt_id) == copy  # the same copy, completed
        assert _same(store.load(ckpt_id), cluster.refs[ckpt_id]) == []
