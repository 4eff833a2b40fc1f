"""Peer replicas of snapshots over a loopback socket: a replacement node resumes from its
neighbour's memory; a replica cut off mid-send is never read; budgets refuse what does not
fit."""

from __future__ import annotations

import json
import shutil
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.errors import ConfigError
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.ops.writing.async_save import close_saver
from ckptstore.ops.writing.snapshot import snapshot_dir
from ckptstore.ops.writing.snapshot_peer import SnapshotReplicaServer, pull_replica
from ckptstore.store import CheckpointStore


def _node(tmp_path: Path, shm_root: Path, name: str) -> CheckpointStore:
    # Nodes share the catalog and hot tier (one store); each has its own shared memory.
    return CheckpointStore.open(tmp_path / "store", memory_tier_dir=str(shm_root / name))


def _close(store: CheckpointStore) -> None:
    try:
        close_saver(store)
    finally:
        store.close()


def _train(store: CheckpointStore, port: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)
    opt = torch.optim.AdamW(model.parameters())
    with CheckpointManager(store, "r", snapshot_interval=1, save_interval=1000, replicas=2,
                           peer=f"127.0.0.1:{port}", handle_sigterm=False,
                           history=False) as mgr:
        for step in range(1, steps + 1):
            opt.zero_grad()
            model(torch.full((4, 128), float(step))).square().sum().backward()
            opt.step()
            mgr.step(step, lambda step=step: {"model": model.state_dict(), "step": step})
        replicator = mgr.replicator
    assert replicator is not None and replicator.last_error is None
    assert replicator.sent_step == steps
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_replacement_node_resumes_from_the_neighbours_replica(
    tmp_path: Path, shm_root: Path
) -> None:
    node_a, node_b = _node(tmp_path, shm_root, "a"), _node(tmp_path, shm_root, "b")
    server = SnapshotReplicaServer(node_b)
    try:
        expected = _train(node_a, server.address[1], steps=8)
        _close(node_a)
        shutil.rmtree(shm_root / "a")  # node a is lost, with its memory
        node_c = _node(tmp_path, shm_root, "c")  # its replacement: empty memory
        try:
            mgr = CheckpointManager(node_c, "r", snapshot_interval=1, replicas=2,
                                    peer=f"127.0.0.1:{server.address[1]}",
                                    handle_sigterm=False, history=False)
            try:
                state = mgr.restore_latest()
            finally:
                mgr.close()
            assert state is not None and state["step"] == 8 and mgr.resumed_step == 8
            assert all(torch.equal(state["model"][k], expected[k]) for k in expected)
        finally:
            _close(node_c)
    finally:
        server.close()
        _close(node_b)


def test_replica_cut_off_mid_send_is_never_read(tmp_path: Path, shm_root: Path) -> None:
    node_a, node_b = _node(tmp_path, shm_root, "a"), _node(tmp_path, shm_root, "b")
    server = SnapshotReplicaServer(node_b)
    try:
        _train(node_a, server.address[1], steps=3)
        slot = max(snapshot_dir(node_a, "r").glob("slot*.snap"), key=lambda p: p.stat().st_mtime)
        size = slot.stat().st_size
        # A sender that dies half-way through a newer replica.
        with socket.create_connection(server.address) as sock:
            raw = json.dumps({"op": "put", "run": "r", "rank": 0, "size": size}).encode()
            sock.sendall(struct.pack("!4sI", b"CKRP", len(raw)) + raw)
            sock.sendall(b"\x7f" * ((size - 4096) // 2))
        node_c = _node(tmp_path, shm_root, "c")
        try:
            assert pull_replica(node_c, "r", 0, server.address) == 3
            assert node_c.load("r@latest")["step"] == 3
        finally:
            _close(node_c)
        _close(node_a)
    finally:
        server.close()
        _close(node_b)


def test_budgets_count_the_neighbours_part(tmp_path: Path, shm_root: Path) -> None:
    node_a, node_b = _node(tmp_path, shm_root, "a"), _node(tmp_path, shm_root, "b")
    server = SnapshotReplicaServer(node_b, budget_bytes=64 * 1024)
    try:
        w = torch.zeros(256 * 1024)  # 1 MiB of state
        # Own 2 slots + the neighbour's 2: ~4.3 MiB; 3 MiB is refused before anything.
        mgr = CheckpointManager(node_a, "r", snapshot_interval=1, replicas=2,
                                peer=f"127.0.0.1:{server.address[1]}",
                                snapshot_budget_bytes=3 * 2**20, handle_sigterm=False,
                                history=False)
        try:
            with pytest.raises(ConfigError, match="2 for a neighbour's replica"):
                mgr.step(1, lambda: {"w": w})
        finally:
            mgr.close()
        # The neighbour refuses a replica over its own budget; training goes on.
        mgr = CheckpointManager(node_a, "r", snapshot_interval=1, replicas=2,
                                peer=f"127.0.0.1:{server.address[1]}",
                                handle_sigterm=False, history=False)
        try:
            mgr.step(1, lambda: {"w": w})
        finally:
            mgr.close()
        assert mgr.replicator is not None
        assert "over this node's replica budget" in (mgr.replicator.last_error or "")
        with pytest.raises(ConfigError, match="peer"):
            CheckpointManager(node_a, "r", snapshot_interval=1, replicas=2,
                              handle_sigterm=False)
        with pytest.raises(ConfigError, match="host:port"):
            CheckpointManager(node_a, "r", snapshot_interval=1, replicas=2, peer="nowhere",
                              handle_sigterm=False)
        _close(node_a)
    finally:
        server.close()
        _close(node_b)


def test_each_snapshot_waits_for_the_previous_replica_a_hung_neighbour_once(
    tmp_path: Path, shm_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node_a, node_b = _node(tmp_path, shm_root, "a"), _node(tmp_path, shm_root, "b")
    server = SnapshotReplicaServer(node_b)
    try:
        # A neighbour that keeps up: when mgr.step(k) returns, it holds step k - 1.
        w = torch.zeros(1024)
        with CheckpointManager(node_a, "r", snapshot_interval=1, replicas=2,
                               peer=f"127.0.0.1:{server.address[1]}", handle_sigterm=False,
                               history=False) as mgr:
            assert mgr.replicator is not None
            for step in range(1, 6):
                mgr.step(step, lambda: {"w": w})
                if step > 1:
                    assert (mgr.replicator.sent_step or 0) >= step - 1
    finally:
        server.close()
        _close(node_b)
    # A neighbour that accepts the connection and never reads: the send blocks once the
    # socket buffers are full (32 MiB of state is more than they hold).
    hung = socket.create_server(("127.0.0.1", 0))
    try:
        big = torch.zeros(8 * 1024**2)
        mgr = CheckpointManager(node_a, "r2", snapshot_interval=1, replicas=2,
                                peer=f"127.0.0.1:{hung.getsockname()[1]}",
                                handle_sigterm=False, history=False)
        assert mgr.replicator is not None
        mgr.replicator.wait_s = 0.5
        with caplog.at_level("WARNING", logger="ckptstore.ops.writing.snapshot_peer"):
            for step in range(1, 5):
                mgr.step(step, lambda: {"w": big})
        waits = [r for r in caplog.records if "still being sent" in r.getMessage()]
        assert len(waits) == 1  # waited once, then training went on without waiting
        assert mgr.replicator.sent == 0
    finally:
        hung.close()  # resets the connection: the stuck send fails and close() returns
    mgr.close()
    _close(node_a)
