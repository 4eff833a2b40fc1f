"""Every flow, run for real under the session's Prefect harness on a real store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.errors import ConfigError
from ckptstore.records import ReplicaState
from ckptstore.testing.invariants import check_invariants

pytestmark = pytest.mark.prefect


def _state(i: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((32,), float(i)), "b": torch.arange(8.0)}, "step": i}


def test_retention_flow_dry_run_then_real(flow_store: CheckpointStore) -> None:
    from ckptstore.flows.retention import retention_flow

    saved = [flow_store.save("r", i * 10, _state(i)) for i in range(5)]
    root = str(flow_store.settings.root)
    dry = retention_flow(store_root=root, keep_last=2, dry_run=True)
    assert dry["dry_run"] is True and dry["executed"] == []
    assert [a["checkpoint_id"] for a in dry["planned"]] == [ck.id for ck in saved[2::-1]]
    assert "3 actions" in dry["plan_text"]
    assert len(flow_store.list(run="r")) == 5

    real = retention_flow(store_root=root, keep_last=2)
    assert [a["checkpoint_id"] for a in real["executed"]] == [ck.id for ck in saved[2::-1]]
    assert [ck.id for ck in flow_store.list(run="r")] == [ck.id for ck in saved[3:]]
    assert check_invariants(flow_store) == []
    again = retention_flow(store_root=root, keep_last=2)
    assert again["planned"] == []


def test_tier_lifecycle_flows_on_s3(tmp_path: Path, s3_config: tuple[Path, Any]) -> None:
    from ckptstore.flows.archive import archive_flow, demote_flow
    from ckptstore.flows.restore import restore_flow
    from ckptstore.flows.retention import retention_flow
    from ckptstore.flows.verify import verify_flow

    config, _s3 = s3_config
    with CheckpointStore.open(config=config) as store:
        saved = [store.save(run, i, _state(i)) for run in ("a", "b") for i in range(3)]
    cfg = str(config)

    archived = archive_flow(config=cfg)
    assert sorted(archived["archived"]) == sorted(ck.id for ck in saved)
    assert archive_flow(config=cfg)["archived"] == []  # idempotent

    verified = verify_flow(config=cfg, tier="warm")
    assert verified["checked"] == len(saved) and not verified["damaged"]

    pruned = retention_flow(config=cfg, keep_last=1)
    hot_drops = {a["checkpoint_id"] for a in pruned["executed"]}
    assert hot_drops == {ck.id for ck in saved if ck.step < 2}
    assert all(a["kind"] == "delete-replica" for a in pruned["executed"])

    first = saved[0]
    restored = restore_flow(first.id, config=cfg)
    assert Path(restored["path"]).is_dir()

    demoted = demote_flow(0.0, config=cfg)
    assert set(demoted["archived"]) == {ck.id for ck in saved}

    with CheckpointStore.open(config=config) as store:
        ck = store.catalog.get_any(first.id)
        assert ck.replica("hot") is not None and ck.replica("hot").state == ReplicaState.PRESENT
        assert ck.replica("cold") is not None and ck.replica("cold").state == ReplicaState.PRESENT
        assert torch.equal(store.load(first.id)["model"]["w"], torch.full((32,), 0.0))
        assert check_invariants(store) == []


def test_archive_flow_reencodes_with_the_configured_codec(tmp_path: Path) -> None:
    """archive_codec from the config: a self-contained zstd-3 warm copy that carries the
    original manifest, restores and loads bit-exactly, and keeps the store's invariants."""
    from ckptstore.flows.archive import archive_flow
    from ckptstore.ops.tiering.reencode import ORIGINAL_MANIFEST_NAME
    from ckptstore.ops.tiering.replicas import delete_replica

    config = tmp_path / "ckpt.toml"
    config.write_text(
        f'root = "{tmp_path / "store"}"\ncodec = "lz4"\narchive_codec = "zstd-3"\n'
        f'[tiers]\nwarm = "{tmp_path / "warm"}"\n', encoding="utf-8")
    state = {"w": torch.arange(4096, dtype=torch.float32) % 7, "step": 1}
    with CheckpointStore.open(config=config) as store:
        ck = store.save("r", 1, state)
    archived = archive_flow(config=str(config))
    assert archived["archived"] == [ck.id] and archived["reencode"] == "zstd-3"
    assert set(archived["reencoded"]) == {ck.id}
    assert (tmp_path / "warm" / "r" / ck.id / ORIGINAL_MANIFEST_NAME).is_file()
    with CheckpointStore.open(config=config) as store:
        warm = store.get(ck.id).replica("warm")
        assert warm is not None and warm.manifest_digest not in (None, ck.manifest_digest)
        delete_replica(store, store.get(ck.id), "hot")
        loaded = store.load(ck.id)  # restored from the re-encoded warm copy
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 1
        assert store.get(ck.id).replica("hot").manifest_digest == warm.manifest_digest  # type: ignore[union-attr]
        assert check_invariants(store) == []


def test_archive_flow_rejects_unconfigured_tier(flow_store: CheckpointStore) -> None:
    from ckptstore.flows.archive import archive_flow

    flow_store.save("r", 1, _state(1))
    with pytest.raises(ConfigError, match="not configured"):
        archive_flow(store_root=str(flow_store.settings.root))


def test_convert_and_import_flows(flow_store: CheckpointStore, tmp_path: Path) -> None:
    from ckptstore.flows.convert import convert_flow, import_flow

    ck = flow_store.save("r", 7, _state(7))
    root = str(flow_store.settings.root)
    out = tmp_path / "export.safetensors"
    result = convert_flow(ck.ref, "safetensors", str(out), store_root=root)
    assert Path(result["path"]).exists()
    imported = import_flow(str(out), "imported", 7, store_root=root)
    loaded = flow_store.load(imported["id"])
    assert torch.equal(loaded["model"]["w"], torch.full((32,), 7.0))
    assert loaded["step"] == 7


def test_compact_flow_rewrites_a_delta_as_full(flow_store: CheckpointStore) -> None:
    from ckptstore.flows.compact import compact_flow

    flow_store.save("r", 1, _state(1), delta="xor")
    delta = flow_store.save("r", 2, _state(2), delta="xor")
    assert delta.kind == "delta"
    result = compact_flow(delta.ref, store_root=str(flow_store.settings.root))
    compacted = flow_store.get(result["compacted"])
    assert compacted.kind == "full"
    assert torch.equal(flow_store.load(compacted.id)["model"]["w"],
                       flow_store.load(delta.id)["model"]["w"])
    assert compact_flow(delta.ref, store_root=str(flow_store.settings.root))["compacted"] == \
        compacted.id  # idempotent


def test_gc_flow_removes_orphans(flow_store: CheckpointStore) -> None:
    from ckptstore.flows.gc import gc_flow

    flow_store.save("r", 1, _state(1))
    orphan = flow_store.hot / "r" / "00000000-0000-4000-8000-000000000000"
    orphan.mkdir(parents=True)
    (orphan / "junk").write_text("x")
    root = str(flow_store.settings.root)
    dry = gc_flow(dry_run=True, store_root=root)
    assert str(orphan) in dry["removed_dirs"] and orphan.exists()
    gc_flow(store_root=root)
    assert not orphan.exists()
    assert check_invariants(flow_store) == []


def test_flow_state_failed_on_error(flow_store: CheckpointStore) -> None:
    from ckptstore.flows.restore import restore_flow

    state = restore_flow(
        "nope@latest", store_root=str(flow_store.settings.root), return_state=True
    )
    assert state.is_failed()
