"""``ckpt prefetch`` and ``ckpt thaw``: exit codes (75 while thawing), JSON, bad inputs.

A real store with a GLACIER-class cold tier on moto S3, configured through a config file as
a user would.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cli_support import Ckpt

from ckptstore import CheckpointStore
from ckptstore.cli.prefetch import EXIT_THAW_PENDING
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.records import ReplicaState, ThawState
from ckptstore.testing.s3 import MotoS3


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    with MotoS3() as server:
        yield server


@pytest.fixture
def config(tmp_path: Path, s3: MotoS3) -> Path:
    prefix = uuid.uuid4().hex[:12]
    path = tmp_path / "ckptstore.toml"
    path.write_text(s3.config_toml(tmp_path / "store", prefix, "GLACIER"),
                    encoding="utf-8")
    return path


def _save(config: Path, step: int, *, tier: str) -> str:
    with CheckpointStore.open(config=config) as store:
        ck = store.save("cli", step, {"w": torch.arange(16.0) * step})
        archive_checkpoints(store, ref=ck.id, tier=tier)
        delete_replica(store, store.catalog.get(ck.id), "hot")
        return ck.id


def test_help_documents_the_thaw_exit_code(ckpt: Ckpt) -> None:
    result = ckpt("--help")
    assert result.code == 0
    assert f"{EXIT_THAW_PENDING} the checkpoint's only copy is in GLACIER" in " ".join(
        result.out.split())


def test_restore_exits_75_while_thawing_then_thaw_restores(ckpt: Ckpt, config: Path) -> None:
    ckpt_id = _save(config, 1, tier="cold")
    result = ckpt("--config", config, "restore", ckpt_id)
    assert result.code == EXIT_THAW_PENDING
    assert "thawing, expected ready in ~5 h" in result.err
    result = ckpt("--config", config, "prefetch", ckpt_id, "--json")
    assert result.code == EXIT_THAW_PENDING
    assert json.loads(result.out)["error"]["type"] == "ThawPendingError"

    result = ckpt("--config", config, "thaw", ckpt_id, "--wait", "--poll", "0.01", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["checkpoint_id"] == ckpt_id
    with CheckpointStore.open(config=config) as store:
        thaw = store.catalog.get_thaw(ckpt_id, "cold")
        assert thaw is not None and thaw.state == ThawState.DONE
        assert torch.equal(store.load(ckpt_id)["w"], torch.arange(16.0))


def test_prefetch_from_warm(ckpt: Ckpt, config: Path) -> None:
    ckpt_id = _save(config, 2, tier="warm")
    result = ckpt("--config", config, "prefetch", ckpt_id, "--hold", "60", "--json")
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    assert doc["to"] == "hot" and doc["bytes_moved"] > 0 and doc["checkpoint_id"] == ckpt_id
    with CheckpointStore.open(config=config) as store:
        hot = store.catalog.get(ckpt_id).replica("hot")
        assert hot is not None and hot.state == ReplicaState.PRESENT
        (lease,) = store.catalog.leases(checkpoint_ids=[ckpt_id])
        assert lease.purpose.startswith("prefetch:")
    text = ckpt("--config", config, "prefetch", ckpt_id)
    assert text.code == 0 and "prefetched cli@v1 to hot" in text.out


def test_bad_inputs(ckpt: Ckpt, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt_id = _save(config, 3, tier="warm")
    assert ckpt("--config", config, "prefetch", ckpt_id, "--to", "disk").code == 2
    assert ckpt("--config", config, "prefetch", ckpt_id, "--hold", "abc").code == 2
    result = ckpt("--config", config, "prefetch", ckpt_id, "--hold", "0")
    assert result.code == 1 and "hold_s" in result.err
    result = ckpt("--config", config, "prefetch", "nope@latest")
    assert result.code == 1 and "nope" in result.err
    result = ckpt("--config", config, "prefetch", ckpt_id, "--to", "memory")
    assert result.code == 1 and "memory_tier_bytes" in result.err
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    result = ckpt("--config", config, "prefetch", ckpt_id, "--host", "other-node")
    assert result.code == 1 and "PREFECT_API_URL" in result.err
    result = ckpt("--config", config, "thaw", ckpt_id, "--wait", "--poll", "0")
    assert result.code == 1 and "poll_s" in result.err


def test_thaw_of_an_encrypted_copy_takes_the_key(ckpt: Ckpt, config: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstore.ops.sharing.crypt import generate_encryption_keypair

    monkeypatch.delenv("CKPT_DECRYPT_KEY", raising=False)
    key, pub = generate_encryption_keypair(tmp_path / "keys", "ops")
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace("[tiers]\n", f'[tiers]\nencrypt_to = ["{pub}"]\n'),
                      encoding="utf-8")
    ckpt_id = _save(config, 5, tier="cold")
    # No key: refused before S3 is asked for anything (exit 1, not 75).
    result = ckpt("--config", config, "thaw", ckpt_id, "--wait", "--poll", "0.01")
    assert result.code == 1 and "--key" in result.err
    with CheckpointStore.open(config=config) as store:
        assert not store.catalog.thaws(checkpoint_ids=[ckpt_id])
    result = ckpt("--config", config, "restore", ckpt_id, "--key", key)
    assert result.code == EXIT_THAW_PENDING, result.err
    assert "thawing, expected ready in ~5 h" in result.err
    result = ckpt("--config", config, "thaw", ckpt_id, "--wait", "--poll", "0.01",
                  "--key", key, "--json")
    assert result.code == 0, result.err
    with CheckpointStore.open(config=config) as store:
        assert torch.equal(store.load(ckpt_id)["w"], torch.arange(16.0) * 5)
