"""CheckpointStore end to end on the embedded defaults (SQLite catalog + local hot tier)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from ckptstore import (
    CheckpointNotFoundError,
    CheckpointStore,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidNameError,
    StorageError,
    UnsafeObjectError,
)
from ckptstore.records import CheckpointState
from ckptstore.storage.marker import MARKER_NAME


def _train_state(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        x = torch.randn(32, 8, generator=gen)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_resume_training_identically(tmp_store: CheckpointStore) -> None:
    model, opt = _train_state()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    _steps(model, opt, 3, seed=1)
    sched.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "step": 3,
    }
    ck = tmp_store.save("train", step=3, state=state, metrics={"loss": 1.5})
    assert ck.version == 1 and ck.state == CheckpointState.COMMITTED
    loaded = tmp_store.load("train@latest")
    model2, opt2 = _train_state(seed=99)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    assert loaded["step"] == 3
    assert torch.equal(loaded["rng"], state["rng"])
    assert _steps(model, opt, 3, seed=2) == _steps(model2, opt2, 3, seed=2)


def test_references_and_versions(tmp_store: CheckpointStore) -> None:
    t = {"w": torch.arange(4.0)}
    a = tmp_store.save("r", step=9, state=t, metrics={"loss": 3.0, "acc": 0.1})
    b = tmp_store.save("r", step=10, state=t, metrics={"loss": 1.0, "acc": 0.5})
    c = tmp_store.save("r", step=10, state=t, metrics={"loss": 2.0, "acc": 0.9})
    assert (a.version, b.version, c.version) == (1, 2, 3)
    assert tmp_store.get("r@latest").id == c.id
    assert tmp_store.get("r@10").id == c.id  # newest version at that step
    assert tmp_store.get("r@9").id == a.id
    assert tmp_store.get("r@v2").id == b.id
    assert tmp_store.get("r@best:loss").id == b.id
    assert tmp_store.get("r@best:acc:max").id == c.id
    assert tmp_store.get(a.id).id == a.id
    tmp_store.alias("r@v1", "first")
    assert tmp_store.get("first").id == a.id
    assert [ck.version for ck in tmp_store.list(run="r", order_by="version")] == [1, 2, 3]
    assert tmp_store.runs()[0].checkpoints == 3


def test_not_found_lists_what_exists(tmp_store: CheckpointStore) -> None:
    tmp_store.save("r", step=100, state={"x": torch.ones(1)})
    with pytest.raises(CheckpointNotFoundError, match="100"):
        tmp_store.load("r@7")
    with pytest.raises(LookupError):
        tmp_store.load(str(uuid.uuid4()))
    with pytest.raises(CheckpointNotFoundError, match="r"):
        tmp_store.load("nosuchrun@latest")


def _written(store: CheckpointStore) -> list[Path]:
    """What the hot tier holds besides the store marker written when the store was opened."""
    return [p for p in store.hot.rglob("*") if p.name != MARKER_NAME]


@pytest.mark.parametrize("bad", ["a/b", "..", "../etc", "x\x00", ".hidden", "x" * 201])
def test_bad_run_names(tmp_store: CheckpointStore, bad: str) -> None:
    with pytest.raises(InvalidNameError):
        tmp_store.save(bad, step=1, state={"x": torch.ones(1)})
    with pytest.raises(InvalidNameError):
        tmp_store.save("ok", step=1, state={"x": torch.ones(1)}, tags=[bad])
    assert _written(tmp_store) == []  # nothing written anywhere


def test_bad_step_and_metrics(tmp_store: CheckpointStore) -> None:
    with pytest.raises(InvalidNameError):
        tmp_store.save("r", step=-1, state={})
    with pytest.raises(ValueError):
        tmp_store.save("r", step=1, state={}, metrics={"loss": float("nan")})
    assert tmp_store.list(state=None) == []


def test_unsafe_object_refused_before_anything_is_written(tmp_store: CheckpointStore) -> None:
    class Custom:
        pass

    with pytest.raises(UnsafeObjectError, match="opt/state/extra"):
        tmp_store.save("r", step=1, state={"opt": {"state": {"extra": Custom()}}})
    assert tmp_store.list(state=None) == []
    assert _written(tmp_store) == []


def _chunk_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("c/*") if p.is_file())


def test_damage_is_an_integrity_error(tmp_store: CheckpointStore) -> None:
    ck = tmp_store.save("r", step=1, state={"w": torch.randn(1000)}, codec="none")
    chunk = _chunk_files(tmp_store.checkpoint_dir("r", ck.id))[0]
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="w"):
        tmp_store.load("r@latest")
    assert tmp_store.verify("r@latest")  # problems reported
    chunk.unlink()
    with pytest.raises(IntegrityError):
        tmp_store.load("r@latest")


def test_damaged_manifest(tmp_store: CheckpointStore) -> None:
    ck = tmp_store.save("r", step=1, state={"w": torch.randn(10)})
    manifest = tmp_store.checkpoint_dir("r", ck.id) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step"', b'"stip"'))
    with pytest.raises(IntegrityError):
        tmp_store.load(ck.id)


def test_killed_save_is_invisible_and_gc_cleans(store_root: Path) -> None:
    with CheckpointStore.open(store_root) as store:
        first = store.save("r", step=1, state={"w": torch.ones(10)})
    code = (
        f"import torch, ckptstore; s = ckptstore.CheckpointStore.open({str(store_root)!r}); "
        "s.save('r', step=2, state={'w': torch.randn(3_000_000)})"
    )
    env = {**os.environ, "CKPT_FAULT_POINT": "save.chunks_written"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=120)
    assert proc.returncode == -9  # SIGKILL at the fault point
    with CheckpointStore.open(store_root) as store:
        assert store.get("r@latest").id == first.id
        assert [c.step for c in store.list(run="r")] == [1]
        pending = [c for c in store.list(state=None) if c.state == CheckpointState.PENDING]
        assert len(pending) == 1
        with pytest.raises(IncompleteCheckpointError):
            store.load(pending[0].id)
        dry = store.gc(dry_run=True)
        assert dry.failed_rows == [pending[0].id]
        assert store.checkpoint_dir("r", pending[0].id).exists()
        report = store.gc()
        assert report.failed_rows == [pending[0].id]
        assert not store.checkpoint_dir("r", pending[0].id).exists()
        assert store.gc().empty
        assert torch.equal(store.load("r@latest")["w"], torch.ones(10))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}); "
                    "ENOSPC is covered by the format layer's fault-injection test")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_is_a_storage_error(tmp_path: Path, tiny_tmpfs: Path) -> None:
    with CheckpointStore.open(tmp_path / "s", hot=str(tiny_tmpfs / "hot")) as store:
        store.save("r", step=1, state={"w": torch.ones(1000)})
        with pytest.raises(StorageError, match=r"(?i)space|full"):
            store.save("r", step=2, state={"w": torch.randn(4_000_000)}, codec="none")
        assert store.get("r@latest").step == 1
        assert torch.equal(store.load("r@latest")["w"], torch.ones(1000))
        failed = [c for c in store.list(state=None) if c.state == CheckpointState.FAILED]
        assert len(failed) == 1
        store.gc()
        assert not store.checkpoint_dir("r", failed[0].id).exists()


def test_show_and_keys(tmp_store: CheckpointStore) -> None:
    state = {"model": {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)},
             "optimizer": {"lr": 0.1}}
    tmp_store.run("r", config={"lr": 0.1}, code_version="abc123", data_version="d1")
    ck = tmp_store.save("r", step=5, state=state, metrics={"loss": 0.5})
    info = tmp_store.show(ck.ref)
    assert info["manifest"]["tensors"] == 2
    assert info["reproduction"]["code_version"] == "abc123"
    part = tmp_store.load(ck.ref, keys=["model/a"])
    assert set(part["model"]) == {"a"}
