"""The prefetch and thaw flows on a real Prefect test server, moto S3 and a real catalog."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.identity import host
from ckptstore.ops.reading.prefetch import prefetch_purpose, send_prefetch
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.records import ReplicaState, ThawState
from ckptstore.testing.s3 import MotoS3


@pytest.fixture
def glacier_config(tmp_path: Path) -> Iterator[Path]:
    """A config file: warm on moto S3, cold on moto S3 in the GLACIER class."""
    with MotoS3() as s3:
        prefix = uuid.uuid4().hex[:8]
        config = tmp_path / "ckpt.toml"
        config.write_text(s3.config_toml(tmp_path / "store", prefix, "GLACIER"),
                          encoding="utf-8")
        yield config


def _only_on(config: Path, step: int, tier: str) -> str:
    with CheckpointStore.open(config=config) as store:
        ck = store.save("flows", step, {"w": torch.arange(32.0) + step})
        archive_checkpoints(store, ref=ck.id, tier=tier)
        delete_replica(store, store.catalog.get(ck.id), "hot")
        return ck.id


def test_prefetch_flow_waits_for_the_thaw(glacier_config: Path) -> None:
    from ckptstore.flows.prefetch import prefetch_flow

    ckpt_id = _only_on(glacier_config, 1, "cold")
    result = prefetch_flow(ckpt_id, poll_s=0.01, config=str(glacier_config))
    assert result["checkpoint_id"] == ckpt_id and result["to"] == "hot"
    with CheckpointStore.open(config=glacier_config) as store:
        thaw = store.catalog.get_thaw(ckpt_id, "cold")
        assert thaw is not None and thaw.state == ThawState.DONE
        assert store.catalog.leases(checkpoint_ids=[ckpt_id], purpose=prefetch_purpose())
        assert torch.equal(store.load(ckpt_id)["w"], torch.arange(32.0) + 1)


def test_thaw_flow_restores(glacier_config: Path) -> None:
    from ckptstore.flows.prefetch import thaw_flow

    ckpt_id = _only_on(glacier_config, 2, "cold")
    result = thaw_flow(ckpt_id, poll_s=0.01, config=str(glacier_config))
    assert Path(result["path"]).is_dir()


def test_send_prefetch_runs_on_the_named_hosts_queue(glacier_config: Path) -> None:
    mine = _only_on(glacier_config, 3, "warm")
    other = _only_on(glacier_config, 4, "warm")
    with CheckpointStore.open(config=glacier_config) as store:
        send_prefetch(store, mine, host())
        # An embedded worker runs only its own host's queue: another host's agent does that.
        send_prefetch(store, other, "some-other-node")
    # Closing the store waited for the flows it started.
    with CheckpointStore.open(config=glacier_config) as store:
        hot = store.catalog.get(mine).replica("hot")
        assert hot is not None and hot.state == ReplicaState.PRESENT
        assert store.catalog.get(other).replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]
        sent = store.catalog.events(other, kind="prefetch_sent")
        assert sent and sent[0].detail["host"] == "some-other-node"
