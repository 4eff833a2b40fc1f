"""Distributed checkpoints for real: torchrun with gloo on CPU, loopback only.

One launch of 2 ranks saves every kind of state (DTensor fp32/bf16, FSDP2 + AdamW, async,
DDP-style replicated, a rank raising mid-save) and reloads it on the same 2 ranks; then the
checkpoints load at world size 3 (torchrun) and 1 (in this process), with Shard(0) and
Shard(1) placements, bit-exact; a plain load without a process group returns full tensors;
and a rank SIGKILLed mid-save makes the other rank fail fast with nothing committed.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from process_support import torchrun

from ckptstore import CheckpointStore
from ckptstore.errors import CheckpointNotFoundError
from ckptstore.format import read_manifest
from ckptstore.ops.dcp import is_dcp_manifest, load_dcp, verify_dcp
from ckptstore.records import CheckpointState
from ckptstore.testing.ports import free_port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("dcp_worker.py")
TIMEOUT_S = 120


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    env.pop("CKPT_FAULT_POINT", None)
    return env


def _torchrun(nproc: int, scenarios: str, root: Path, out: Path) -> None:
    cmd = [
        *torchrun(out.parent / "torchrun"), "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(WORKER), scenarios, str(root), str(out),
    ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    # Status 0 also means every rank ended its gloo threads before interpreter shutdown
    # (dcp_worker.main exits 1 otherwise): threads left running there abort a rank by chance.
    assert proc.returncode == 0, proc.stderr[-4000:]


def _report(out: Path, scenario: str, ws: int, rank: int) -> dict[str, Any]:
    report: dict[str, Any] = json.loads((out / f"{scenario}-ws{ws}-rank{rank}.json").read_text())
    assert report["ok"], report.get("trace") or report
    return report


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Save everything at world size 2 and reload it there (one torchrun launch)."""
    base = tmp_path_factory.mktemp("dcp")
    root, out = base / "store", base / "out"
    out.mkdir()
    _torchrun(2, "save,load", root, out)
    return root, out


def _load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dcp_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_rank_saw_the_same_committed_checkpoints(saved: tuple[Path, Path]) -> None:
    root, out = saved
    r0, r1 = _report(out, "save", 2, 0), _report(out, "save", 2, 1)
    for key in ("dt", "fsdp", "async", "ddp", "failed_id"):
        assert r0[key] == r1[key], key
    with CheckpointStore.open(root) as store:
        for key in ("dt", "fsdp", "async", "ddp"):
            assert store.get(r0[key]).state == CheckpointState.COMMITTED
        assert {ck.version for ck in store.list(run="dt")} == {1, 2}
        for key in ("dt", "fsdp", "async"):
            ck = store.get(r0[key])
            directory = store.checkpoint_dir(ck.run, ck.id)
            manifest = read_manifest(directory, expected_digest=ck.manifest_digest)
            assert is_dcp_manifest(manifest)
            assert verify_dcp(directory, manifest) == []
        ddp = store.get(r0["ddp"])
        assert not is_dcp_manifest(read_manifest(store.checkpoint_dir(ddp.run, ddp.id)))


def test_a_rank_raising_fails_the_save_everywhere(saved: tuple[Path, Path]) -> None:
    root, out = saved
    reports = [_report(out, "save", 2, r) for r in (0, 1)]
    assert all(r["fail_raw"] == "CheckpointException" for r in reports)
    assert all(r["bad_codec"].startswith("InvalidNameError") for r in reports)
    with CheckpointStore.open(root) as store:
        failed = store.catalog.get_any(reports[0]["failed_id"])
        assert failed.state == CheckpointState.FAILED
        assert not store.checkpoint_dir("dt", failed.id).exists()
        assert store.latest("dt").id == reports[0]["async"]  # the previous one still loads
        with pytest.raises(CheckpointNotFoundError):
            store.get("dt@3")


def test_reload_at_world_size_2(saved: tuple[Path, Path]) -> None:
    _, out = saved
    for rank in (0, 1):
        diffs = _report(out, "load", 2, rank)["diffs"]
        assert diffs == {"dt-shard0": [], "dt-shard1": [], "fsdp": [], "async": []}


def test_reload_at_world_size_3(saved: tuple[Path, Path]) -> None:
    root, out = saved
    _torchrun(3, "load", root, out)
    for rank in range(3):
        diffs = _report(out, "load", 3, rank)["diffs"]
        assert diffs == {"dt-shard0": [], "dt-shard1": [], "fsdp": [], "async": []}


def test_reload_at_world_size_1(saved: tuple[Path, Path]) -> None:
    import torch.distributed as dist

    root, out = saved
    worker = _load_module()
    store_file = root.parent / "ws1.store"
    dist.init_process_group(
        "gloo", init_method=f"file://{store_file}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        with CheckpointStore.open(root) as store:
            report = worker.run_scenario("load", store, out)
    finally:
        left = worker.shutdown_distributed()
    assert report["ok"], report.get("trace")
    assert report["diffs"] == {"dt-shard0": [], "dt-shard1": [], "fsdp": [], "async": []}
    # A group that outlives destroy_process_group() keeps gloo's threads running into
    # interpreter shutdown, where they abort the process now and then (dcp_worker.py).
    assert left == []


def test_plain_load_returns_full_tensors(saved: tuple[Path, Path]) -> None:
    root, out = saved
    worker = _load_module()
    ids = _report(out, "save", 2, 0)
    ref = torch.load(out / "ref.pt", weights_only=True)
    with CheckpointStore.open(root) as store:
        for key in ("dt", "fsdp"):
            ck = store.get(ids[key])
            directory = store.checkpoint_dir(ck.run, ck.id)
            state = load_dcp(directory, read_manifest(directory))
            assert worker._same(state, ref[key]) == []
        ddp = store.load(ids["ddp"])
        assert worker._same(ddp, ref["ddp"]) == []


def test_killed_rank_fails_the_other_fast_and_commits_nothing(tmp_path: Path) -> None:
    root, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    port = free_port()
    procs = []
    started = time.monotonic()
    for rank in range(2):
        env = _env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), "kill", str(root), str(out)], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ))
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes[1] == -9  # killed by its fault point after its first chunk
    assert codes[0] == 0, procs[0].stderr.read() if procs[0].stderr else ""
    assert time.monotonic() - started < TIMEOUT_S
    report = _report(out, "kill", 2, 0)
    assert report["second"].startswith("CkptError: distributed save of kill@2 failed")
    assert report["error_after_s"] < 30
    with CheckpointStore.open(root) as store:
        assert [ck.version for ck in store.list(run="kill")] == [1]
        failed = [ck for ck in store.list(run="kill", state=None) if ck.version == 2]
        assert failed and failed[0].state == CheckpointState.FAILED
        assert not store.checkpoint_dir("kill", failed[0].id).exists()
        first = store.get(report["first"])
        directory = store.checkpoint_dir("kill", first.id)
        state = load_dcp(directory, read_manifest(directory))
        assert state["meta"] == {"step": 5, "names": ["a", "b"]}
        assert state["w"]["big"].shape == (1201, 300)
