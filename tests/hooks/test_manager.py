"""CheckpointManager and LossMonitor(action="save") against a real store."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore.errors import CheckpointNotFoundError, ConfigError, StorageError
from ckptstore.hooks.loss_monitor import LossMonitor
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.hooks.policies import EveryNSteps
from ckptstore.ops.writing.async_save import SaveHandle
from ckptstore.records import Checkpoint
from ckptstore.store import CheckpointStore


class Trainer:
    """A tiny model whose state changes every step, and counts state_fn calls."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 4)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.calls = 0

    def train_step(self) -> float:
        x = torch.randn(16, 8)
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def state_fn(self, step: int) -> Any:
        def build() -> dict[str, Any]:
            self.calls += 1
            return {
                "model": self.model.state_dict(),
                "optim": self.opt.state_dict(),
                "step": step,
            }

        return build


def steps_of(store: CheckpointStore, run: str) -> list[int]:
    return [c.step for c in store.list(run=run, order_by="step")]


def test_restore_latest_is_none_for_a_new_run(store: CheckpointStore) -> None:
    with CheckpointManager(store, "fresh", save_interval=5, handle_sigterm=False) as mgr:
        assert mgr.restore_latest() is None
        assert mgr.resumed_from is None


@pytest.mark.parametrize("async_save", [True, False])
def test_step_saves_on_interval_and_calls_state_fn_only_then(
    store: CheckpointStore, async_save: bool
) -> None:
    trainer = Trainer()
    results = []
    with CheckpointManager(
        store, "interval", save_interval=5, async_save=async_save, handle_sigterm=False
    ) as mgr:
        for step in range(1, 13):
            loss = trainer.train_step()
            results.append(mgr.step(step, trainer.state_fn(step), metrics={"loss": loss}))
    assert trainer.calls == 2
    saved = [r for r in results if r is not None]
    expected_type = SaveHandle if async_save else Checkpoint
    assert all(isinstance(r, expected_type) for r in saved)
    assert steps_of(store, "interval") == [5, 10]
    latest = store.latest("interval")
    assert "loss" in latest.metrics
    loaded = store.load(latest.id)
    assert loaded["step"] == 10
    assert set(loaded) == {"model", "optim", "step"}


def test_resume_continues_policy_and_records_parent(store: CheckpointStore) -> None:
    trainer = Trainer()
    with CheckpointManager(store, "resume", save_interval=4, handle_sigterm=False) as mgr:
        for step in range(1, 10):
            trainer.train_step()
            mgr.step(step, trainer.state_fn(step))
    first = store.latest("resume")
    assert first.step == 8

    fresh = Trainer()
    with CheckpointManager(store, "resume", save_interval=4, handle_sigterm=False) as mgr:
        state = mgr.restore_latest()
        assert state is not None and state["step"] == 8
        fresh.model.load_state_dict(state["model"])
        fresh.opt.load_state_dict(state["optim"])
        assert mgr.resumed_from is not None and mgr.resumed_from.id == first.id
        # Steps 9-11 are not due (next multiple of 4 after 8 is 12).
        for step in range(9, 13):
            fresh.train_step()
            mgr.step(step, fresh.state_fn(step))
    assert steps_of(store, "resume") == [4, 8, 12]
    newest = store.latest("resume")
    assert newest.parent_id == first.id
    assert [c.id for c in store.lineage(newest.id)][:1] == [first.id]


def test_ckpt_resume_picks_the_checkpoint_a_recipe_names(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `ckpt reproduce` recipe sets CKPT_RESUME: restore_latest (and the progressive one)
    resume from that checkpoint, not the run's newest; one this store lacks is a clear
    error, not a fresh start."""
    trainer = Trainer()
    with CheckpointManager(store, "pinned", save_interval=2, handle_sigterm=False) as mgr:
        for step in range(1, 7):
            trainer.train_step()
            mgr.step(step, trainer.state_fn(step))
    older = store.get("pinned@4")
    assert store.latest("pinned").step == 6
    monkeypatch.setenv("CKPT_RESUME", older.id)
    with CheckpointManager(store, "pinned", save_interval=2, handle_sigterm=False) as mgr:
        state = mgr.restore_latest()
        assert state is not None and state["step"] == 4
        assert mgr.resumed_from is not None and mgr.resumed_from.id == older.id
        progressive = mgr.restore_latest_progressive(["model/*"])
        assert progressive is not None and progressive.result()["step"] == 4
    monkeypatch.setenv("CKPT_RESUME", "pinned@99")
    with CheckpointManager(store, "pinned", save_interval=2, handle_sigterm=False) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="CKPT_RESUME='pinned@99'"):
            mgr.restore_latest()
        assert mgr.resumed_from is None


def test_restore_latest_into_existing_tensors(store: CheckpointStore) -> None:
    trainer = Trainer()
    with CheckpointManager(store, "into", save_interval=1, handle_sigterm=False) as mgr:
        trainer.train_step()
        mgr.step(1, trainer.state_fn(1))
    other = Trainer()
    with torch.no_grad():
        other.model.weight.zero_()
    target = {"model": other.model.state_dict(), "optim": trainer.opt.state_dict(), "step": 0}
    with CheckpointManager(store, "into", save_interval=1, handle_sigterm=False) as mgr:
        mgr.restore_latest(into=target)
    assert torch.equal(other.model.weight, trainer.model.weight)


def test_keep_last_prunes_the_hot_tier(store: CheckpointStore) -> None:
    trainer = Trainer()
    with CheckpointManager(
        store, "prune", save_interval=1, keep_last=2, handle_sigterm=False
    ) as mgr:
        for step in range(1, 6):
            trainer.train_step()
            mgr.step(step, trainer.state_fn(step))
    assert steps_of(store, "prune") == [4, 5]


def test_custom_prune_fn_and_on_commit_hooks_run_after_each_commit(
    store: CheckpointStore,
) -> None:
    pruned: list[str] = []
    committed: list[int] = []
    triggered: list[tuple[str, str]] = []
    # Record triggers instead of starting flows (on this instance only).
    store.trigger = lambda flow, ck: triggered.append((flow, ck.ref))  # type: ignore[attr-defined]
    trainer = Trainer()
    with CheckpointManager(
        store,
        "hooks",
        save_interval=2,
        keep_last=1,
        prune_fn=lambda st, run: pruned.append(run),
        on_commit=[lambda ck: committed.append(ck.step), lambda ck: 1 / 0],
        archive=True,
        handle_sigterm=False,
    ) as mgr:
        for step in range(1, 7):
            trainer.train_step()
            mgr.step(step, trainer.state_fn(step))
    assert pruned == ["hooks"] * 3
    assert committed == [2, 4, 6]
    assert triggered == [("archive", "hooks@v1"), ("archive", "hooks@v2"), ("archive", "hooks@v3")]
    assert mgr.last_checkpoint is not None and mgr.last_checkpoint.step == 6


def test_archive_without_store_trigger_is_a_no_op(store: CheckpointStore) -> None:
    with CheckpointManager(store, "noarch", save_interval=1, archive=True,
                           handle_sigterm=False) as mgr:
        mgr.step(1, lambda: {"w": torch.ones(2)})
    assert steps_of(store, "noarch") == [1]


def test_save_now_pins_and_tags(store: CheckpointStore) -> None:
    with CheckpointManager(store, "pin", save_interval=100, handle_sigterm=False) as mgr:
        handle = mgr.save_now(3, lambda: {"w": torch.ones(2)}, tags=("manual",), pin=True)
        assert isinstance(handle, SaveHandle)
        mgr.wait()
    ck = store.get("pin@latest")
    assert ck.pinned and ck.tags == ("manual",) and ck.step == 3


def test_save_now_without_state_fn_uses_the_last_one(store: CheckpointStore) -> None:
    with CheckpointManager(store, "last", save_interval=100, handle_sigterm=False) as mgr:
        with pytest.raises(ConfigError, match="state_fn"):
            mgr.save_now(1)
        mgr.step(1, lambda: {"w": torch.full((2,), 7.0)})
        mgr.save_now(2)
    assert torch.equal(store.load("last@2")["w"], torch.full((2,), 7.0))


def test_non_finite_metrics_are_dropped(store: CheckpointStore) -> None:
    with CheckpointManager(store, "nanmetric", save_interval=1, handle_sigterm=False) as mgr:
        mgr.step(1, lambda: {"w": torch.ones(1)},
                 metrics={"loss": math.nan, "acc": torch.tensor(0.5)})
    assert store.latest("nanmetric").metrics == {"acc": 0.5}


def test_time_policy_and_custom_policy(store: CheckpointStore) -> None:
    mgr = CheckpointManager(store, "timed", save_every_seconds=3600.0, handle_sigterm=False)
    assert mgr.step(1, lambda: {"w": torch.ones(1)}) is None  # clock just started
    mgr.close()
    mgr = CheckpointManager(store, "custom", policy=EveryNSteps(3), save_interval=1,
                            handle_sigterm=False)
    saved = [s for s in range(1, 8) if mgr.step(s, lambda: {"w": torch.ones(1)}) is not None]
    mgr.close()
    assert saved == [3, 6]


def test_background_failure_surfaces_on_wait(store: CheckpointStore) -> None:
    mgr = CheckpointManager(store, "mfail", save_interval=1, handle_sigterm=False)
    (store.hot / "mfail").write_text("not a directory")
    mgr.step(1, lambda: {"w": torch.ones(1)})
    with pytest.raises(StorageError):
        mgr.wait()
    (store.hot / "mfail").unlink()
    mgr.step(2, lambda: {"w": torch.ones(1)})
    mgr.close()
    assert steps_of(store, "mfail") == [2]


def test_closed_manager_refuses_steps(store: CheckpointStore) -> None:
    mgr = CheckpointManager(store, "closed", save_interval=1, handle_sigterm=False)
    mgr.close()
    mgr.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        mgr.step(1, lambda: {})


@pytest.mark.parametrize(
    "kwargs",
    [{"keep_last": 0}, {"keep_best": ("loss", "avg", 2)}, {"keep_best": ("loss",)},
     {"save_interval": 0}],
)
def test_rejects_bad_configuration(store: CheckpointStore, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        CheckpointManager(store, "bad", handle_sigterm=False, **kwargs)


def test_settings_provide_defaults(tmp_path: Any) -> None:
    st = CheckpointStore.open(tmp_path / "s", save_interval=3, keep_last=1)
    try:
        with CheckpointManager(st, "defaults", handle_sigterm=False) as mgr:
            assert mgr.keep_last == 1
            for step in range(1, 10):
                mgr.step(step, lambda: {"w": torch.ones(1)})
        assert steps_of(st, "defaults") == [9]
    finally:
        st.close()


# --------------------------------------------------------------------------- LossMonitor saves
def spiky_curve(n: int, spike_at: int) -> list[float]:
    rng = np.random.default_rng(0)
    curve = 2.0 * (1 + 0.01 * rng.standard_normal(n))
    curve[spike_at] = 5.0
    return curve.tolist()


def test_loss_monitor_saves_through_the_manager_tagged_and_pinned(
    store: CheckpointStore,
) -> None:
    trainer = Trainer()
    with CheckpointManager(
        store, "anomaly", save_interval=1000, keep_last=1, handle_sigterm=False
    ) as mgr:
        monitor = LossMonitor(window_size=20, threshold=0.05, manager=mgr)
        for step, loss in enumerate(spiky_curve(60, 40)):
            mgr.step(step, trainer.state_fn(step), metrics={"loss": loss})
            monitor.update(step, loss)
        # A regular save later: keep_last=1 would prune the anomaly one if it were not pinned.
        mgr.save_now(59)
    kept = store.list(run="anomaly", order_by="step")
    assert [c.step for c in kept] == [40, 59]
    anomaly = kept[0]
    assert anomaly.tags == ("anomaly",) and anomaly.pinned
    assert anomaly.metrics == {"loss": 5.0}
    assert [a.step for a in monitor.anomalies] == [40]


def test_loss_monitor_standalone_saves_on_nan(store: CheckpointStore) -> None:
    alerts: list[int] = []
    monitor = LossMonitor(
        window_size=10,
        store=store,
        run="standalone",
        state_fn=lambda: {"w": torch.ones(2)},
        on_alert=lambda step, loss, reason: alerts.append(step),
    )
    fired = [s for s, v in enumerate([1.0, 1.0, math.nan, 1.0]) if monitor.update(s, v)]
    assert fired == [2] and alerts == [2]
    ck = store.latest("standalone")
    assert ck.step == 2 and ck.pinned and ck.tags == ("anomaly",) and ck.metrics == {}
    assert isinstance(monitor.last_checkpoint, Checkpoint)


def test_run_is_recorded_with_experiment_and_config(store: CheckpointStore) -> None:
    mgr = CheckpointManager(store, "recorded", experiment="exp-a", config={"lr": 0.1},
                            handle_sigterm=False)
    mgr.close()
    info = store.catalog.get_run("recorded")
    assert info.experiment == "exp-a" and info.config == {"lr": 0.1}


def test_manager_records_the_run_context(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from context_support import assert_full_context, training_repo

    repo = training_repo(tmp_path / "repo", monkeypatch)
    with CheckpointStore.open(tmp_path / "ctx-store") as store:
        mgr = CheckpointManager(store, "ctx", save_interval=1, async_save=True,
                                handle_sigterm=False, config={"lr": 0.2, "hf_token": "x"},
                                data_version="v3")
        mgr.step(1, lambda: {"w": torch.zeros(2)})
        mgr.close()
        ck = store.latest("ctx")
        doc = store.catalog.context_of(ck).document
        assert_full_context(doc, repo)
        assert doc["config"] == {"lr": 0.2, "hf_token": "***"}
        assert doc["data_version"] == "v3"
        assert store.catalog.get_run("ctx").config == {"lr": 0.2, "hf_token": "***"}
