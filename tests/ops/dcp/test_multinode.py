"""Multi-node training without a shared filesystem, simulated on one machine.

Each simulated node is one ``torchrun --nnodes 2 --node-rank K --rdzv-backend c10d`` launch
with its own ``CKPT_HOST`` and its own ``CKPT_HOT`` directory; the only storage both see is
the PostgreSQL catalog and a moto S3 warm tier (no directory is shared). One module-scoped
save (2 nodes x 2 ranks) feeds the stages, in order:

1. the save commits with one part per node and no file of one node in the other's directory;
2. archiving from node A alone leaves the warm copy incomplete: loading from it fails loudly
   and retention deletes nothing; archiving from node B completes and verifies it;
3. node B's disk is lost: one node with 3 ranks loads ``mn@1`` from its own part plus S3 and,
   with ``replicas = 2``, ``mn@2`` from its own disk alone (no S3 tier), bit-exact; then
   node A and a replacement node B with an empty disk load both, node A sending node B's
   part from its copy (``mn@2``, no S3) or sharing its download (``mn@1``);
4. hot retention then removes each node's parts on that node.

A rank killed mid-save (2 nodes x 1 rank) commits nothing; the previous checkpoint loads and
each node's ``ckpt gc`` removes its leftovers. Every launch is bounded in time.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_support import create_pg_database, drop_pg_database, require_pg
from process_support import acting_as_host, preloaded_children, torchrun

from ckptstore import CheckpointStore
from ckptstore.catalog import migrate
from ckptstore.cli.app import main as ckpt
from ckptstore.errors import ConfigError, IncompleteCheckpointError, ThawPendingError
from ckptstore.format import read_manifest
from ckptstore.format.dcp import verify_dcp
from ckptstore.format.dcp.layout import rank_of_file
from ckptstore.ops.dcp import load_dcp
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.gc import prune_parts
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.records import CheckpointState, ReplicaState, ThawState
from ckptstore.retention import RetentionPolicy
from ckptstore.testing.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.s3]

WORKER = Path(__file__).with_name("multinode_worker.py")
TIMEOUT_S = 240
NODES = ("node-a", "node-b")


@dataclass
class Cluster:
    """The simulated cluster: catalog, S3, one hot directory per node, reports."""

    tmp: Path
    catalog_url: str
    warm: str
    endpoint: str
    out: Path
    hot: dict[str, Path] = field(default_factory=dict)

    def env(self, node: str, *, warm: bool = True) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CKPT_HOST=node,
            CKPT_HOT=str(self.hot[node]), CKPT_ROOT=str(self.tmp / f"root-{node}"),
            CKPT_CATALOG_URL=self.catalog_url, CKPT_S3_ENDPOINT_URL=self.endpoint,
        )
        if warm:
            env["CKPT_WARM"] = self.warm
        for var in ("CKPT_CONFIG", "CKPT_FAULT_POINT", "CKPT_REPLICAS", "PREFECT_API_URL"):
            env.pop(var, None)
        return env

    def report(self, scenario: str, ws: int, rank: int) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(
            (self.out / f"{scenario}-ws{ws}-rank{rank}.json").read_text())
        assert data["ok"], data.get("trace") or data
        return data

    @contextlib.contextmanager
    def node(self, node: str, *, host: str | None = None,
             **overrides: Any) -> Iterator[CheckpointStore]:
        """This test process acting as ``node`` (its host name and its own hot directory),
        or as another ``host`` configured like it."""
        options = {"catalog_url": self.catalog_url, "hot": str(self.hot[node]),
                   "warm": self.warm, "storage_options": {"endpoint_url": self.endpoint}}
        options.update(overrides)
        with acting_as_host(host or node), \
                CheckpointStore.open(self.tmp / f"root-{host or node}", **options) as store:
            yield store


def _launch(cluster: Cluster, scenario: str, nodes: list[str], nproc: int, *,
            warm: bool = True) -> None:
    """One torchrun per simulated node, all at once, rendezvous over c10d on loopback."""
    port, rdzv = free_port(), f"mn-{uuid.uuid4().hex[:8]}"
    procs = []
    logs = []
    for k, node in enumerate(nodes):
        log = (cluster.tmp / f"{scenario}-{node}.log").open("w")
        logs.append(log)
        cmd = [*torchrun(cluster.tmp / "torchrun"), "--nnodes", str(len(nodes)),
               "--node-rank", str(k),
               "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv,
               "--max-restarts", "0", str(WORKER), scenario, str(cluster.out)]
        procs.append(subprocess.Popen(cmd, env=cluster.env(node, warm=warm), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        for log in logs:
            log.close()
    tails = "\n".join(
        f"--- {n}\n" + (cluster.tmp / f"{scenario}-{n}.log").read_text()[-3000:] for n in nodes)
    # A rank that failed first leaves the others waiting in a collective: its report (not
    # the others' timeouts in the log tails) says why.
    failed = "\n".join(
        f"--- {path.name}\n{json.loads(path.read_text()).get('trace')}"
        for path in sorted(cluster.out.glob(f"{scenario}-ws*-rank*.json"))
        if not json.loads(path.read_text()).get("ok"))
    assert codes == [0] * len(nodes), f"{failed}\n{tails}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_pg()
    from ckptstore.testing.s3 import MotoS3

    tmp = tmp_path_factory.mktemp("multinode")
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(MotoS3())
        url = create_pg_database("ckpt_multinode")
        stack.callback(drop_pg_database, url)
        migrate.upgrade(url)
        out = tmp / "out"
        out.mkdir()
        cluster = Cluster(tmp, url, s3.url("warm"), s3.endpoint_url, out,
                          {n: tmp / f"hot-{n}" for n in (*NODES, "node-c")})
        yield cluster


@pytest.fixture(scope="module")
def saved(cluster: Cluster) -> dict[str, Any]:
    started = time.monotonic()
    _launch(cluster, "save", list(NODES), 2)
    print(f"\n2 nodes x 2 ranks saved in {time.monotonic() - started:.1f}s (launch included)")
    return {rank: cluster.report("save", 4, rank) for rank in range(4)}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_save_commits_one_part_per_node_on_its_own_disk(cluster: Cluster,
                                                        saved: dict[int, Any]) -> None:
    ids = saved[0]
    assert all(saved[r]["mn1"] == ids["mn1"] and saved[r]["mn2"] == ids["mn2"] for r in saved)
    hosts = {r: saved[r]["host"] for r in saved}
    assert sorted(set(hosts.values())) == list(NODES)
    with cluster.node("node-a") as store:
        ck = store.get(ids["mn1"])
        assert ck.state == CheckpointState.COMMITTED and ck.hosts == NODES
        hot = store.catalog.parts(ck.id, "hot")
        assert [(p.part, p.stored_on, p.state) for p in hot] == [
            (n, n, ReplicaState.PRESENT) for n in NODES]
        ranks = store.catalog.part_ranks(ck.id)
        assert {h: sorted(r) for h, r in ranks.items()} == {
            h: sorted(r for r in hosts if hosts[r] == h) for h in NODES}
        for node in NODES:
            directory = cluster.hot[node] / "mn" / ck.id
            files = _files(directory)
            # Its own part, plus the shared documents, manifest and marker.
            assert "COMMITTED" in files and "manifest.json" in files
            owners = {rank_of_file(f) for f in files} - {None}
            assert owners == set(ranks[node]), (node, owners)
            part = next(p for p in hot if p.part == node)
            data = [f for f in files if rank_of_file(f) is not None]
            assert part.files == len(data)
        # replicas = 2: each node also keeps its neighbour's part of mn@2, recorded.
        peers = store.catalog.parts(ids["mn2"], "hot")
        assert {(p.part, p.stored_on) for p in peers if p.state == ReplicaState.PRESENT} == {
            ("node-a", "node-a"), ("node-b", "node-b"), ("node-a", "node-b"),
            ("node-b", "node-a")}
    for rank in saved:
        assert "needs the PostgreSQL catalog" in saved[rank]["sqlite"], saved[rank]["sqlite"]
        assert saved[rank]["sqlite"].startswith("ConfigError")


def _worker_helpers() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("dcp_worker", WORKER.with_name("dcp_worker.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class RacedArchive:
    """Two archivers of node A's part at once: ``report`` is the one that uploaded it."""

    report: Any
    late: Any  # took the part's lease only after ``report``'s run had uploaded the part


@pytest.fixture(scope="module")
def archived_a(cluster: Cluster, saved: dict[int, Any]) -> RacedArchive:
    """Node A archives mn1 twice at once (its agent's flow and an operator's ``ckpt
    archive``): both see the part missing, and the first uploads it while the second is
    about to take the part's lease."""
    from ckptstore.ops.leases import RenewingLease

    real_acquire = RenewingLease.acquire
    first: list[Any] = []

    def acquire_after_the_other_archiver(lease: Any) -> bool:
        if not first and lease.purpose.count(":") == 2:  # the part's lease, not the whole copy's
            first.append(None)  # the other archiver's own acquire below is the real one
            with cluster.node("node-a") as other:
                first[0] = archive_checkpoints(other, ref=saved[0]["mn1"])
        return bool(real_acquire(lease))

    with cluster.node("node-a") as store, pytest.MonkeyPatch.context() as patch:
        patch.setattr(RenewingLease, "acquire", acquire_after_the_other_archiver)
        late = archive_checkpoints(store, ref=saved[0]["mn1"])
    return RacedArchive(first[0], late)


@pytest.fixture(scope="module")
def archived_b(cluster: Cluster, saved: dict[int, Any], archived_a: Any) -> Any:
    with cluster.node("node-b") as store:
        return archive_checkpoints(store, ref=saved[0]["mn1"])


def test_archive_from_one_node_leaves_an_incomplete_copy_nobody_uses(
    cluster: Cluster, saved: dict[int, Any], archived_a: RacedArchive
) -> None:
    mn1 = saved[0]["mn1"]
    assert archived_a.report.parts == {mn1: ["node-a"]} and archived_a.report.archived == []
    assert "waiting for the parts of node-b" in archived_a.report.skipped[mn1]
    with cluster.node("node-c") as store:  # a third node: no hot part of its own
        ck = store.get(mn1)
        warm = ck.replica("warm")
        assert warm is not None and warm.state == ReplicaState.COPYING
        assert [(p.part, p.state) for p in store.catalog.parts(mn1, "warm")] == [
            ("node-a", ReplicaState.PRESENT)]
        # Loading from the warm copy alone fails loudly, naming the missing part.
        with pytest.raises(IncompleteCheckpointError, match="node-b") as info:
            store.load(mn1)
        # ... and the tensors stored in it (the first few, by DCP name).
        assert re.search(r"host node-b: [a-z_]+\.", str(info.value)), str(info.value)
        with pytest.raises(IncompleteCheckpointError, match="node-b"):
            restore_checkpoint(store, mn1, to=cluster.tmp / "restored")
    # Retention on node A: the hot parts stay, the warm copy is not complete.
    with cluster.node("node-a") as store:
        report = apply_retention(store, tier="hot", policy=RetentionPolicy(keep_last=0))
        assert report.executed == [] and report.failed == []
        assert store.get(mn1).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]
    for node in NODES:
        assert (cluster.hot[node] / "mn" / mn1 / "COMMITTED").is_file()


def test_an_archiver_that_finds_its_part_uploaded_meanwhile_leaves_it_alone(
    cluster: Cluster, saved: dict[int, Any], archived_a: RacedArchive
) -> None:
    # Re-uploading would mark the PRESENT part COPYING again: the host completing the copy
    # at that moment would find node A's part missing and fail.
    mn1 = saved[0]["mn1"]
    assert mn1 not in archived_a.late.parts and archived_a.late.failed == {}
    assert archived_a.late.bytes == 0
    with cluster.node("node-c") as store:
        uploads = [e.detail["part"] for e in store.catalog.events(mn1, limit=50)
                   if e.kind == "part_archived"]
        assert uploads.count("node-a") == 1, uploads
        assert [(p.part, p.state) for p in store.catalog.parts(mn1, "warm")] == [
            ("node-a", ReplicaState.PRESENT)]


def test_archive_from_the_second_node_completes_and_verifies(
    cluster: Cluster, saved: dict[int, Any], archived_b: Any
) -> None:
    mn1 = saved[0]["mn1"]
    assert archived_b.parts == {mn1: ["node-b"]} and archived_b.archived == [mn1]
    with cluster.node("node-c") as store:
        ck = store.get(mn1)
        warm = ck.replica("warm")
        assert warm is not None and warm.state == ReplicaState.PRESENT and warm.verified_at
        by = {e.detail["part"]: e.actor for e in store.catalog.events(mn1, limit=50)
              if e.kind == "part_archived"}
        assert sorted(by) == list(NODES)
        assert all(node in (actor or "") for node, actor in by.items()), by
        refs = torch.load(cluster.out / "ref.pt", weights_only=True)
        state = store.load(mn1)  # node C: every part from S3
        assert _worker_helpers()._same(state, refs["mn1"]) == []


def test_a_signed_checkpoint_saved_across_hosts_loads_with_its_signature_anywhere(
    cluster: Cluster, saved: dict[int, Any], archived_b: Any
) -> None:
    from ckptstore.ops.sharing.signing import generate_keypair, sign_checkpoint

    mn1 = saved[0]["mn1"]
    keys = cluster.tmp / "keys"
    keys.mkdir(exist_ok=True)
    generate_keypair(keys, "ops")
    with cluster.node("node-a") as store:  # signed where a part (and its manifest) is
        sign_checkpoint(store, mn1, keys / "ops.key")
    refs = torch.load(cluster.out / "ref.pt", weights_only=True)
    with cluster.node("node-c") as store:
        state = store.load(mn1, require_signature=keys / "ops.pub")
        assert _worker_helpers()._same(state, refs["mn1"]) == []


def test_a_damaged_chunk_of_a_local_part_is_read_from_s3_and_verify_reports_it(
    cluster: Cluster, saved: dict[int, Any], archived_b: Any
) -> None:
    from ckptstore.ops.upkeep.verify import verify_replicas

    mn1 = saved[0]["mn1"]
    directory = cluster.hot["node-a"] / "mn" / mn1
    victim = next(p for p in sorted(directory.rglob("c.*"))
                  if rank_of_file(str(p.relative_to(directory))) is not None)
    original = victim.read_bytes()
    victim.write_bytes(original[:-5] + bytes([original[-5] ^ 0xFF]) + original[-4:])
    refs = torch.load(cluster.out / "ref.pt", weights_only=True)
    try:
        with cluster.node("node-a") as store:
            report = verify_replicas(store, ref=mn1)
            assert f"{mn1}@warm" in report.ok
            assert f"{mn1}@hot" in report.damaged and f"{mn1}@hot" in report.unrepaired
            part = next(p for p in store.catalog.parts(mn1, "hot") if p.part == "node-a")
            assert part.state == ReplicaState.DAMAGED
            # The load reads that chunk from S3 instead: bit-exact, never zeros.
            assert _worker_helpers()._same(store.load(mn1), refs["mn1"]) == []
    finally:
        victim.write_bytes(original)
    with cluster.node("node-a") as store:
        assert f"{mn1}@hot" in verify_replicas(store, ref=mn1).ok
        assert store.get(mn1).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]


def test_show_tiers_and_the_report_list_parts_per_host_and_tier(
    cluster: Cluster, saved: dict[int, Any], archived_b: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    mn1, mn2 = saved[0]["mn1"], saved[0]["mn2"]
    env = {"CKPT_HOST": "node-c", "CKPT_HOT": str(cluster.hot["node-c"]),
           "CKPT_CATALOG_URL": cluster.catalog_url, "CKPT_WARM": cluster.warm,
           "CKPT_S3_ENDPOINT_URL": cluster.endpoint}
    root = str(cluster.tmp / "root-node-c")
    with _env(**env):
        capsys.readouterr()
        assert ckpt(["show", mn1, "--json", "--store", root]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["checkpoint"]["hosts"] == list(NODES)
        assert doc["manifest"]["world_size"] == 4 and doc["manifest"]["tensors"] > 0
        got = {(p["tier"], p["part"], p["stored_on"], p["state"]) for p in doc["parts"]}
        assert got == {("hot", n, n, "PRESENT") for n in NODES} | {
            ("warm", n, None, "PRESENT") for n in NODES}
        assert ckpt(["show", mn2, "--store", root]) == 0
        text = capsys.readouterr().out
        flat = re.sub(r"[\s│┃]+", "", text)  # the table folds long cells at 80 columns
        assert "parts(hot)" in flat and "node-bonnode-a,node-b" in flat, text
        assert ckpt(["tiers", "--hosts", "--json", "--store", root]) == 0
        hosts = {h["name"]: h for h in json.loads(capsys.readouterr().out)["hosts"]}
        # Each node's disk holds its own parts of mn@1 and mn@2 and its neighbour's of mn@2.
        assert {n: hosts[n]["stores"]["hot"]["checkpoints"] for n in NODES} == {
            "node-a": 3, "node-b": 3}
        assert {n: hosts[n]["parts"]["warm"]["checkpoints"] for n in NODES} == {
            "node-a": 1, "node-b": 1}
        assert ckpt(["report", "--html", str(cluster.tmp / "report.html"), "--store",
                     root]) == 0
    html = (cluster.tmp / "report.html").read_text()
    assert 'class="parts"' in html and 'data-part="node-b"' in html
    assert 'class="hosts"' in html and 'data-host="node-a"' in html



@pytest.fixture(scope="module")
def node_b_lost(cluster: Cluster, saved: dict[int, Any], archived_b: Any) -> dict[int, Any]:
    shutil.rmtree(cluster.hot["node-b"])
    started = time.monotonic()
    _launch(cluster, "load", ["node-a"], 3)
    print(f"\n1 node x 3 ranks loaded in {time.monotonic() - started:.1f}s (launch included)")
    return {rank: cluster.report("load", 3, rank) for rank in range(3)}


def test_after_losing_a_node_one_node_with_three_ranks_loads_bit_exact(
    node_b_lost: dict[int, Any]
) -> None:
    clean = {"shard0": [], "shard1": [], "fsdp": []}
    for rank, report in node_b_lost.items():
        # mn@1: node A's part from its own disk, node B's from S3.
        assert report["mn1_s3"] == clean, rank
        # mn@2 (replicas = 2): node B's part from the copy node A keeps; no S3 configured.
        assert report["mn2_local"] == clean, rank
        # mn@1 without S3: node B's part exists nowhere this node reads.
        assert report["mn1_local"].startswith("IncompleteCheckpointError"), report["mn1_local"]
        assert "node-b" in report["mn1_local"]
    # The three ranks shared the download of node B's part: what some fetched and sent to
    # the others is what the others received.
    said = [re.search(r"fetched (\d+) chunk files \((\d+) bytes\) for other ranks, "
                      r"sent (\d+) bytes and received (\d+) \((\d+) bytes\)", line)
            for report in node_b_lost.values() for line in report["shared"]]
    # One line per rank and load (three states are loaded), every rank in every load.
    assert said and all(said) and len({len(r["shared"]) for r in node_b_lost.values()}) == 1, [
        r["shared"] for r in node_b_lost.values()]
    fetched = [int(m.group(2)) for m in said if m]
    sent = [int(m.group(3)) for m in said if m]
    received = [int(m.group(5)) for m in said if m]
    assert sum(sent) == sum(received) > 0 and 0 < sum(fetched) <= sum(sent)


def _shared(lines: list[str]) -> tuple[int, int, int]:
    """(bytes fetched for others, bytes sent, bytes received) from one rank's share log."""
    said = [re.search(r"fetched (\d+) chunk files \((\d+) bytes\) for other ranks, "
                      r"sent (\d+) bytes and received (\d+) \((\d+) bytes\)", line)
            for line in lines]
    assert len(said) == 1 and said[0], lines
    return int(said[0].group(2)), int(said[0].group(3)), int(said[0].group(5))


def test_a_replacement_node_gets_the_lost_part_from_the_survivor_or_shares_its_download(
    cluster: Cluster, saved: dict[int, Any], node_b_lost: dict[int, Any],
    ranks: multiprocessing.context.BaseContext,
) -> None:
    # Node B comes back under its name with an empty disk, while the catalog still lists
    # node B's parts there: its part must be treated as remote, not read (and missed) here.
    procs = _one_rank_per_node(cluster, ranks, "replace")
    for p in procs:
        assert p.returncode == 0, p.stderr.read() if p.stderr else ""
    a, b = (cluster.report("replace", 2, rank) for rank in (0, 1))
    for report in (a, b):
        assert report["mn2_local"] == report["mn1_s3"] == report["mn1_a_offline"] == [], report
    # mn@2, no S3 configured: node A read node B's part from its copy and sent all of it.
    fetched_a, sent_a, _ = _shared(a["mn2_local_shared"])
    _, sent_b, received_b = _shared(b["mn2_local_shared"])
    assert fetched_a == sent_a == received_b > 0 and sent_b == 0
    # mn@1 (no copy on node A): both nodes downloaded a share of node B's part from S3.
    fetched_a, sent_a, _ = _shared(a["mn1_s3_shared"])
    _, _, received_b = _shared(b["mn1_s3_shared"])
    assert fetched_a == sent_a == received_b > 0
    # Node A without S3: node B downloaded all of its part, also what node A needed of it;
    # node A only sent what node B needed of node A's part, from its disk.
    _, _, received_a = _shared(a["mn1_a_offline_shared"])
    fetched_b, sent_b, _ = _shared(b["mn1_a_offline_shared"])
    assert fetched_b == sent_b == received_a > 0
    assert not any("failed" in line for line in a["mn1_a_offline_shared"])
    # A chunk node A was to send is gone from its copy: node A says so, and both ranks
    # fail naming the chunk instead of waiting for each other.
    assert any("w.big" in line and "failed" in line for line in a["mn2_damaged_shared"]), a
    assert "IntegrityError" in b["mn2_damaged"] and "r2/w.big/c." in b["mn2_damaged"], b
    assert "could not be fetched by the rank it was assigned to" in b["mn2_damaged"], b
    assert "IntegrityError" in a["mn2_damaged"], a


def test_doctor_reports_the_parts_of_a_host_gone_silent(
    cluster: Cluster, saved: dict[int, Any], node_b_lost: dict[int, Any]
) -> None:
    from ckptstore.ops.upkeep.doctor import doctor

    mn1, mn2 = saved[0]["mn1"], saved[0]["mn2"]
    with cluster.node("node-a", host_timeout_s=30.0) as store:
        from datetime import UTC, datetime, timedelta

        store.catalog.heartbeat("node-a", "agent")
        store.catalog.heartbeat("node-b", "agent", at=datetime.now(UTC) - timedelta(hours=2))
        report = doctor(store, tiers=["hot"])
    lost = {f.subject: f.detail for f in report.findings if f.kind == "lost-part"}
    assert set(lost) == {mn1, mn2}, report.render()
    assert "host node-b holds its part" in lost[mn1] and "the complete warm copy" in lost[mn1]
    # mn@2's part of node B is also on node A's disk (replicas = 2).
    assert "hot on node-a" in lost[mn2]
    assert not report.ok
    # Nothing else is wrong: node A's own parts verify.
    assert {f.kind for f in report.findings} == {"lost-part"}, report.render()



def test_hot_retention_leaves_each_node_to_prune_its_own_parts(
    cluster: Cluster, saved: dict[int, Any], node_b_lost: dict[int, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mn1, mn2 = saved[0]["mn1"], saved[0]["mn2"]
    with cluster.node("node-a") as store:
        directory = cluster.hot["node-a"] / "mn" / mn1
        # A part recorded DELETED has no file left: whoever sees the row (the aggregate
        # replica turns DELETED with the last part) never finds the directory still there.
        left_when_deleted: list[bool] = []
        real_set_part = store.catalog.set_part

        def set_part(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("state") == ReplicaState.DELETED:
                left_when_deleted.append(directory.exists())
            return real_set_part(*args, **kwargs)

        monkeypatch.setattr(store.catalog, "set_part", set_part)
        report = apply_retention(store, tier="hot", policy=RetentionPolicy(keep_last=0))
        assert [a.checkpoint_id for a in report.executed] == [mn1], report.to_dict()
        assert left_when_deleted == [False]
        assert not directory.exists()
        hot = store.get(mn1).replica("hot")
        assert hot is not None and hot.state == ReplicaState.DELETING  # node B's part left
        assert store.get(mn2).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]
    with cluster.node("node-b") as store:  # the replaced node B's agent (gc)
        assert prune_parts(store) == [f"{mn1}:node-b"]
        assert store.get(mn1).replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]
        refs = torch.load(cluster.out / "ref.pt", weights_only=True)
        assert _worker_helpers()._same(store.load(mn1), refs["mn1"]) == []


def test_restore_gathers_every_part_on_one_node(
    cluster: Cluster, saved: dict[int, Any], node_b_lost: dict[int, Any]
) -> None:
    mn1 = saved[0]["mn1"]
    refs = torch.load(cluster.out / "ref.pt", weights_only=True)
    with cluster.node("node-c") as store:
        # Into a directory of one's choosing: a complete, verified copy, nothing recorded.
        target = restore_checkpoint(store, mn1, to=cluster.tmp / "gathered")
        assert (target / "COMMITTED").is_file()
        manifest = read_manifest(target, expected_digest=store.get(mn1).manifest_digest)
        assert verify_dcp(target, manifest) == []
        assert _worker_helpers()._same(load_dcp(target, manifest), refs["mn1"]) == []
        # Onto this node's hot tier: every part recorded as kept here, the hot copy whole.
        restore_checkpoint(store, mn1)
        here = {p.part for p in store.catalog.parts(mn1, "hot")
                if p.stored_on == "node-c" and p.state == ReplicaState.PRESENT}
        assert here == set(NODES)
        assert store.get(mn1).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]
        assert _worker_helpers()._same(store.load(mn1), refs["mn1"]) == []


@dataclass
class Rank:
    """How one rank started by :func:`_one_rank_per_node` ended."""

    returncode: int
    stderr: io.StringIO  # what it wrote on stdout and stderr


#: What the ranks' forkserver imports once (installed packages only: the server does not get
#: this directory on its path; the children do). ``torch._dynamo``: torch imports it on the
#: first ``distribute_tensor`` call, which every rank makes (about 0.6 s of CPU each).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint",
            "torch.distributed.checkpoint.state_dict", "torch.distributed.device_mesh",
            "torch.distributed.fsdp", "torch.distributed.tensor", "sqlalchemy", "s3fs",
            "ckptstore", "ckptstore.store", "ckptstore.ops.dcp"]


@pytest.fixture(scope="module")
def ranks() -> Iterator[multiprocessing.context.BaseContext]:
    """Where :func:`_one_rank_per_node` starts its ranks: a forkserver that imported torch,
    torch.distributed and ckptstore once, stopped with the module. When another module's
    forkserver runs already (without this directory on its path), spawned children
    instead: slower, always right."""
    yield from preloaded_children(_PRELOAD, WORKER.parent)


def _one_rank_per_node(cluster: Cluster, ranks: multiprocessing.context.BaseContext,
                       scenario: str, hosts: tuple[str, ...] = NODES,
                       **extra: str) -> list[Rank]:
    """One plain process per node (world size 2), without torchrun's agents: a rank that
    dies then leaves the survivor running, as on a real cluster whose node crashed.
    ``hosts`` names the nodes (other names than ``NODES``: nodes without a hot directory).
    Each is a child of the ``ranks`` forkserver running multinode_worker.py as its script,
    with the environment its node's launcher would give it (tests/ops/dcp/rank_launch.py)."""
    import rank_launch

    port = free_port()
    children = []
    logs = []
    for rank, (node, name) in enumerate(zip(NODES, hosts, strict=True)):
        env = cluster.env(node)
        env.update(CKPT_HOST=name, CKPT_ROOT=str(cluster.tmp / f"root-{name}"))
        env.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   **extra)
        log = cluster.tmp / f"{scenario}-rank{rank}.log"
        child = ranks.Process(  # type: ignore[attr-defined]
            target=rank_launch.run_script,
            args=(str(WORKER), [scenario, str(cluster.out)], env, str(log)))
        child.start()
        children.append(child)
        logs.append(log)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for child in children:
            child.join(max(1.0, deadline - time.monotonic()))
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
                child.join()
    return [Rank(child.exitcode, io.StringIO(log.read_text() if log.exists() else ""))
            for child, log in zip(children, logs, strict=True)]


DISKLESS = ("diskless-a", "diskless-b")


@pytest.fixture(scope="module")
def s3hot(cluster: Cluster, ranks: multiprocessing.context.BaseContext) -> tuple[str, str]:
    """A checkpoint saved by two ranks on hosts without local disk: ``(id, hot tier URL)``."""
    hot = cluster.warm.rsplit("/", 1)[0] + "/hot"
    procs = _one_rank_per_node(cluster, ranks, "s3hot", DISKLESS, CKPT_HOT=hot)
    for p in procs:
        assert p.returncode == 0, p.stderr.read() if p.stderr else ""
    reports = [cluster.report("s3hot", 2, rank) for rank in (0, 1)]
    for report in reports:
        assert report["diffs"] == {"shard0": [], "shard1": []}
    return reports[0]["id"], hot


def test_ranks_without_local_disk_upload_their_shards_straight_to_s3(
    cluster: Cluster, s3hot: tuple[str, str]
) -> None:
    ckpt_id, hot = s3hot
    with cluster.node("node-c", host="diskless-c", hot=hot) as store:
        ck = store.get(ckpt_id)
        assert ck.hosts == DISKLESS
        assert ck.replica("hot").uri.startswith(hot)  # type: ignore[union-attr]
        parts = store.catalog.parts(ckpt_id, "hot")
        assert {(p.part, p.stored_on, p.state) for p in parts} == {
            (n, None, ReplicaState.PRESENT) for n in DISKLESS}
        tier = store.tier("hot")
        keys = tier.list_prefix(tier.prefix_for("direct", ckpt_id))
        groups = {k.split("/")[3] for k in keys
                  if k.split("/")[2] == "dcp_ranks" and len(k.split("/")) > 4}
        assert groups == {"r0", "r1"}  # one key prefix per rank
        assert not any((cluster.tmp / f"root-{n}" / "hot" / "direct").exists()
                       for n in DISKLESS)
        expected = torch.load(cluster.out / "s3hot.pt", weights_only=True)
        assert _worker_helpers()._same(store.load(ckpt_id), expected) == []
        with pytest.raises(ConfigError, match="only distributed saves"):
            store.save("plain", 1, {"x": torch.ones(2)})
        # Any host archives a copy every host can read as a whole.
        assert archive_checkpoints(store, ref=ckpt_id).archived == [ckpt_id]


def test_a_part_readable_only_from_glacier_is_thawed_then_loaded(
    cluster: Cluster, s3hot: tuple[str, str]
) -> None:
    ckpt_id, hot = s3hot
    cold = cluster.warm.rsplit("/", 1)[0] + "/glacier"
    expected = torch.load(cluster.out / "s3hot.pt", weights_only=True)
    glacier = {"cold": cold, "cold_storage_class": "GLACIER"}
    with cluster.node("node-c", host="diskless-c", hot=hot, **glacier) as store:
        assert archive_checkpoints(store, ref=ckpt_id, tier="cold").archived == [ckpt_id]
        for tier in ("warm", "hot"):  # the GLACIER copy becomes the only one
            replica = store.get(ckpt_id).replica(tier)
            if replica is not None and replica.state == ReplicaState.PRESENT:
                delete_replica(store, store.get(ckpt_id), tier)
    # A node with its own disk: no part is readable, every one is in the GLACIER copy.
    with cluster.node("node-c", **glacier) as store:
        with pytest.raises(ThawPendingError, match="thawing, expected ready in") as info:
            store.prefetch(ckpt_id)  # a scheduler's prefetch asks S3 first
        assert info.value.checkpoint_id == ckpt_id and info.value.tier == "cold"
        thaw = store.catalog.get_thaw(ckpt_id, "cold")
        assert thaw is not None and thaw.state == ThawState.PENDING and thaw.objects > 0
        with pytest.raises(ThawPendingError):  # before the expected time: asks nothing again
            store.load(ckpt_id)
        assert store.catalog.get_thaw(ckpt_id, "cold") == thaw
        # The time S3 gave has passed (moto restored at once): the parts are read in place.
        store.catalog.record_thaw(ckpt_id, "cold", retrieval=thaw.retrieval,
                                  objects=thaw.objects,
                                  expected_ready_at=datetime.now(UTC) - timedelta(seconds=1))
        assert _worker_helpers()._same(store.load(ckpt_id), expected) == []
        done = store.catalog.get_thaw(ckpt_id, "cold")
        assert done is not None and done.state == ThawState.DONE
        # `ckpt thaw --wait` of such a checkpoint gathers every part onto this node.
        path = store.thaw(ckpt_id, poll_s=0.01, timeout_s=30)
        assert path == store.checkpoint_dir("direct", ckpt_id) and (path / "COMMITTED").is_file()
        assert {p.part for p in store.catalog.parts(ckpt_id, "hot")
                if p.stored_on == "node-c" and p.state == ReplicaState.PRESENT} == set(DISKLESS)
        assert _worker_helpers()._same(store.load(ckpt_id), expected) == []


def test_a_rank_killed_mid_save_commits_nothing_and_each_node_cleans_up(
    cluster: Cluster, ranks: multiprocessing.context.BaseContext,
) -> None:
    started = time.monotonic()
    procs = _one_rank_per_node(cluster, ranks, "kill")
    codes = [p.returncode for p in procs]
    assert codes[1] == -9  # killed by its fault point after its first chunk
    assert codes[0] == 0, procs[0].stderr.read() if procs[0].stderr else ""
    report = cluster.report("kill", 2, 0)
    assert report["second"].startswith("CkptError: distributed save of kill@2 failed"), report
    assert report["error_after_s"] < 60
    assert report["latest"] == report["first"]
    assert time.monotonic() - started < TIMEOUT_S
    for node in NODES:  # dcp.save + the writer's context manager: each part has its marker
        assert (cluster.hot[node] / "kill" / report["first"] / "COMMITTED").is_file(), node
    with cluster.node("node-a") as store:
        failed = [ck for ck in store.list(run="kill", state=None) if ck.version == 2]
        assert failed and failed[0].state == CheckpointState.FAILED
        assert not (cluster.hot["node-a"] / "kill" / failed[0].id).exists()
        # Node B's partial files stay until node B's own gc (its agent) runs.
        assert (cluster.hot["node-b"] / "kill" / failed[0].id).exists()
    with _env(CKPT_HOST="node-b", CKPT_HOT=str(cluster.hot["node-b"]),
              CKPT_CATALOG_URL=cluster.catalog_url):
        assert ckpt(["gc", "--store", str(cluster.tmp / "root-node-b")]) == 0
    assert not (cluster.hot["node-b"] / "kill" / failed[0].id).exists()
    # The previous checkpoint is intact: archived from both nodes, it loads anywhere.
    first = report["first"]
    for node in NODES:
        with cluster.node(node) as store:
            archive_checkpoints(store, ref=first)
    with cluster.node("node-c") as store:
        expected = torch.load(cluster.out / "kill.pt", weights_only=True)
        assert _worker_helpers()._same(store.load(first), expected) == []
