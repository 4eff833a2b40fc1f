"""Retention and tier moves with chunk references: dedup never pins whole checkpoints, xor and
lossy deltas keep their keyframe, and no kept checkpoint ever loses a chunk it reads."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from delta_helpers import CHUNK, make_state, states_equal, train_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import CheckpointStore
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica, referenced_chunks
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.records import CheckpointState, ReplicaState
from ckptstore.retention import RetentionPolicy

_FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") else None


def _disk_bytes(root: Path) -> int:
    """Bytes on disk: a chunk hard-linked into several checkpoints counts once."""
    inodes = {(st.st_dev, st.st_ino): st.st_size
              for p in root.rglob("*") if p.is_file() and (st := p.stat())}
    return sum(inodes.values())


def _check_hot(store: CheckpointStore, expected: dict[str, Any]) -> None:
    """Every kept checkpoint loads bit-exact; every file left by a deleted one is still read."""
    for ckpt_id, state in expected.items():
        assert states_equal(store.load(ckpt_id), state), ckpt_id
    still = referenced_chunks(store, "hot")
    live = {ck.id for ck in store.list(state=CheckpointState.COMMITTED)
            if (r := ck.replica("hot")) is not None and r.state == ReplicaState.PRESENT}
    for run_dir in store.hot.iterdir():
        if run_dir.name.startswith("."):  # the store's marker (run names never start so)
            continue
        for ck_dir in run_dir.iterdir():
            if ck_dir.name in live:
                continue
            files = [p for p in ck_dir.rglob("*") if p.is_file()]
            assert files, f"empty directory {ck_dir} left behind"
            for path in files:
                array, _c, index = path.relative_to(ck_dir).parts
                assert (ck_dir.name, array, int(index)) in still, f"unreferenced {path}"


def test_keep_last_3_over_20_dedup_saves_keeps_3_checkpoints_worth(
    store: CheckpointStore,
) -> None:
    state = make_state()
    states: dict[str, Any] = {}
    for i in range(20):
        ck = store.save("ft", i, state)
        states[ck.id] = state
        # A different pair of layers trains every few steps: chunks are shared for a while
        # and written by various checkpoints.
        state = train_step(state, trainable=lambda layer, i=i: layer in (i % 3, 5), seed=i)
    full = store.save("probe", 0, state, delta=False).stored_bytes
    report = apply_retention(store, run="ft", policy=RetentionPolicy(keep_last=3))
    assert report.ok, report.to_dict()
    assert len(report.executed) == 17
    kept = store.list(run="ft")
    assert len(kept) == 3
    expected = {ck.id: states[ck.id] for ck in kept}
    _check_hot(store, expected)
    used = _disk_bytes(store.hot / "ft")
    assert used <= 3 * full, (used, full)
    # The oldest kept one shares most chunks with pruned ones: their files survive it...
    oldest = kept[-1]
    assert store.manifest(oldest.id).referenced_checkpoints()
    # ...and are freed once it goes too.
    report = apply_retention(store, run="ft", policy=RetentionPolicy(keep_last=1))
    assert report.ok, report.to_dict()
    newest = store.list(run="ft")
    assert len(newest) == 1
    _check_hot(store, {newest[0].id: states[newest[0].id]})
    assert _disk_bytes(store.hot / "ft") <= 1.2 * full


def test_xor_chain_keeps_its_keyframe_only_while_needed(store: CheckpointStore) -> None:
    state = make_state()
    made, states = [], {}
    for i in range(10):  # keyframes at 0, 4, 8 (keyframe_every = 4)
        ck = store.save("run", i, state, delta="xor")
        made.append(ck)
        states[ck.id] = state
        state = train_step(state, seed=i)
    report = apply_retention(store, run="run", policy=RetentionPolicy(keep_last=3))
    assert report.ok, report.to_dict()
    left = {ck.id for ck in store.list(run="run")}
    # v8 (keyframe), v9 kept by the policy; v7 by the policy; its keyframe v5 is its base.
    assert left == {made[i].id for i in (4, 7, 8, 9)}, report.plan.render()
    _check_hot(store, {cid: states[cid] for cid in left})


def test_archived_dedup_and_xor_deltas_restore_after_pruning(tmp_path: Path) -> None:
    with CheckpointStore.open(tmp_path / "s", chunk_bytes=CHUNK, keyframe_every=3,
                              warm=str(tmp_path / "warm")) as store:
        state = make_state()
        states: dict[str, Any] = {}
        for i in range(6):
            mode = "dedup" if i < 3 else "xor"
            ck = store.save("run", i, state, delta=mode)
            states[ck.id] = state
            state = train_step(state, trainable=lambda layer: layer >= 3, seed=i)
        archived = archive_checkpoints(store, run="run", tier="warm")
        assert len(archived.archived) == 6
        # Hot keeps the newest; the others go from hot (warm holds them), keeping the
        # chunk files hot checkpoints still read.
        report = apply_retention(store, run="run", policy=RetentionPolicy(keep_last=1))
        assert report.ok, report.to_dict()
        # Warm is the last tier: there old checkpoints are deleted for good.
        report = apply_retention(store, run="run", tier="warm",
                                 policy=RetentionPolicy(keep_last=4))
        assert report.ok, report.to_dict()
        kept = store.list(run="run")
        assert 4 <= len(kept) < 6
        for ck in kept:
            replica = ck.replica("hot")
            if replica is not None and replica.state == ReplicaState.PRESENT:
                delete_replica(store, ck, "hot", keep_referenced=True)
        for ck in kept:  # each comes back from warm, with every chunk it reads
            assert states_equal(store.load(ck.id), states[ck.id]), ck.ref


# ---------------------------------------------------------------------- property
def _tiny(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": [torch.randn(1024, generator=g) for _ in range(4)],
            "opt": {"exp_avg": torch.randn(2048, generator=g)}}


@settings(max_examples=int(os.environ.get("CKPT_PROP_EXAMPLES", "10")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_retention_with_dedup_and_delta_chains_property(data: st.DataObject) -> None:
    """Random saves (dedup, xor, lossy, full; random parts changing) then retention: every
    kept checkpoint loads as saved (within its recorded bound when lossy), nothing left on
    disk is unreferenced, and a second run has nothing to do."""
    with tempfile.TemporaryDirectory(dir=_FAST_TMP) as root, CheckpointStore.open(
        root, chunk_bytes=4096, keyframe_every=data.draw(st.integers(2, 4), label="every")
    ) as store:
        state = _tiny(0)
        saved: dict[str, Any] = {}
        for i in range(data.draw(st.integers(1, 8), label="saves")):
            mode = data.draw(st.sampled_from(["dedup", "xor", "lossy", False]), label="mode")
            delta: Any = {"quantize": 8} if mode == "lossy" else mode
            ck = store.save("r", i, state, delta=delta)
            saved[ck.id] = state
            changed = data.draw(st.lists(st.integers(0, 4), max_size=3), label="changed")
            state = {"w": list(state["w"]), "opt": dict(state["opt"])}
            for part in changed:
                if part == 4:
                    state["opt"]["exp_avg"] = state["opt"]["exp_avg"] * 0.9 + 0.01
                else:
                    state["w"][part] = state["w"][part] + 0.001 * (i + 1)
        policy = RetentionPolicy(keep_last=data.draw(st.integers(0, 4), label="keep_last"))
        report = apply_retention(store, policy=policy)
        assert report.ok, report.to_dict()
        for ck in store.list(run="r"):
            manifest = store.manifest(ck.id)
            out, want = store.load(ck.id), saved[ck.id]
            if manifest.lossy:
                assert manifest.delta is not None
                err = float((out["opt"]["exp_avg"] - want["opt"]["exp_avg"]).abs().max())
                assert err <= manifest.delta.max_abs_error
                assert all(torch.equal(a, b) for a, b in zip(out["w"], want["w"], strict=True))
            else:
                assert states_equal(out, want)
        _check_hot(store, {})
        again = apply_retention(store, policy=policy)
        assert again.plan.actions == []


@pytest.mark.parametrize("mode", ["dedup", "xor"])
def test_deleting_a_hot_copy_keeps_chunks_others_read(store: CheckpointStore, mode: str) -> None:
    state = make_state()
    first = store.save("run", 0, state, delta=mode)
    second = store.save("run", 1, train_step(state, trainable=lambda layer: layer == 0),
                        delta=mode)
    # Pretend the first checkpoint is archived, so its hot copy may go.
    store.catalog.set_replica(first.id, "warm", uri="x", state=ReplicaState.PRESENT,
                              verified=True)
    delete_replica(store, store.get(first.id), "hot", keep_referenced=True)
    directory = store.checkpoint_dir("run", first.id)
    assert not (directory / "COMMITTED").exists() and not (directory / "manifest.json").exists()
    assert any(directory.rglob("*/c/*"))
    assert store.load(second.id) is not None
