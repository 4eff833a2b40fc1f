"""Lightning adapter with a real Trainer on CPU: saves, top-k removals, async ordering,
resume from a store reference, and what Lightning puts in a checkpoint."""

from __future__ import annotations

import copy
import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.fabric.utilities.data import AttributeDict  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from process_support import finish_child, preloaded_children  # noqa: E402

from ckptstore.errors import CheckpointNotFoundError, ConfigError, UnsafeObjectError  # noqa: E402
from ckptstore.integrations.lightning import (  # noqa: E402
    CkptStoreCallback,
    CkptStoreIO,
    alias_for_path,
    lightning_state,
    read_pointer,
)
from ckptstore.ops.writing.snapshot import (  # noqa: E402
    HEADER_BYTES,
    SnapshotWriter,
    parse_header,
    snapshots_here,
)
from ckptstore.store import CheckpointStore  # noqa: E402

# Lightning's advice (dataloader workers, resumable loaders) is noise for these tiny runs.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class TinyModule(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, lr: float = 0.05, hidden: int = 8, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Seeded: the weights (so the losses) must not depend on which tests ran before.
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(),
                                           torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        # Improves at every step: a top-k monitor on it saves every candidate.
        self.log("neg_step", -float(self.global_step))
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2)}


def _loader() -> torch.utils.data.DataLoader[Any]:
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=gen),
                                          torch.randn(64, 1, generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _trainer(io: CkptStoreIO, steps: int, callbacks: list[Any]) -> Any:
    return pl.Trainer(
        max_steps=steps, plugins=[io], callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )


def _aliases(store: CheckpointStore, run: str) -> dict[str, str]:
    return {alias: ck.id for ck in store.list(run=run) for alias in ck.aliases}


@pytest.mark.parametrize("async_save", [False, True])
def test_model_checkpoint_top_k_maps_to_aliases(
    store: CheckpointStore, tmp_path: Path, async_save: bool
) -> None:
    io = CkptStoreIO(store, run="pl-a", async_save=async_save)
    ckpt_dir = tmp_path / "ckpts"
    # A monitor that improves at every step, so each of the 5 candidates is saved (a loss
    # need not improve: how many candidates it saves would depend on the losses).
    mc = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=2, every_n_train_steps=2,
                         monitor="neg_step", mode="min", save_last=True)
    _trainer(io, 10, [mc, CkptStoreCallback(tags=("unit",))]).fit(TinyModule(), _loader())

    files = sorted(p.name for p in ckpt_dir.iterdir())
    assert "last.ckpt" in files and len(files) == 3  # top-2 + last; pruned ones are gone
    saved = store.list(run="pl-a")
    # Every save is a checkpoint: 5 top-k candidates + 5 last.ckpt (no overwrite, new versions).
    assert len(saved) == 10 and {ck.step for ck in saved} == {2, 4, 6, 8, 10}
    assert all({"lightning", "unit"} <= set(ck.tags) for ck in saved)
    assert all("train_loss" in ck.metrics for ck in saved)
    # Exactly the files Lightning still keeps are aliased, each to the checkpoint its
    # pointer file names: removals dropped the others' aliases (and nothing was deleted).
    expected = {alias_for_path(ckpt_dir / name): read_pointer(ckpt_dir / name)["id"]  # type: ignore[index]
                for name in files}
    assert _aliases(store, "pl-a") == expected
    assert mc.best_model_path and read_pointer(mc.best_model_path) is not None


def test_removal_waits_for_the_pending_save_of_its_path(
    store: CheckpointStore, tmp_path: Path
) -> None:
    io = CkptStoreIO(store, run="pl-order", async_save=True)
    big = {"state_dict": {"w": torch.randn(2048, 2048)}, "global_step": 7}
    path = tmp_path / "epoch=0-step=7.ckpt"
    io.save_checkpoint(big, path)
    io.remove_checkpoint(path)  # Lightning does this right away when the file drops out
    other = tmp_path / "epoch=0-step=8.ckpt"
    io.save_checkpoint({**big, "global_step": 8}, other)
    io.wait()
    assert not path.exists() and read_pointer(other) is not None
    assert _aliases(store, "pl-order") == {alias_for_path(other): read_pointer(other)["id"]}  # type: ignore[index]
    # The removed path's checkpoint is still there: retention decides when it goes.
    assert [ck.step for ck in store.list(run="pl-order", order_by="created_at")] == [7, 8]


def test_fit_resumes_from_a_store_reference_and_from_last(
    store: CheckpointStore, tmp_path: Path
) -> None:
    io = CkptStoreIO(store, run="pl-r", async_save=True)
    ckpt_dir = tmp_path / "ck"
    first = TinyModule()
    _trainer(io, 6, [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_last=True),
                     CkptStoreCallback()]).fit(first, _loader())
    saved = store.load("pl-r@latest")
    assert saved["global_step"] == 6
    assert isinstance(saved["hyper_parameters"], dict)
    assert torch.equal(saved["state_dict"]["net.0.weight"], first.net[0].weight.detach())

    resumed = TinyModule()
    trainer = _trainer(io, 8, [CkptStoreCallback()])
    trainer.fit(resumed, _loader(), ckpt_path="pl-r@latest")
    assert trainer.global_step == 8
    assert store.latest("pl-r").step == 6  # no ModelCheckpoint: nothing new saved

    again = _trainer(io, 7, [ModelCheckpoint(dirpath=ckpt_dir)])
    again.fit(TinyModule(), _loader(), ckpt_path="last")  # found through the pointer file
    assert again.global_step == 7

    with pytest.raises(CheckpointNotFoundError, match="not a checkpoint of this store"):
        io.load_checkpoint(str(tmp_path / "nothing.ckpt"))


def test_attribute_dicts_become_dicts_and_unsafe_objects_are_named(
    store: CheckpointStore, tmp_path: Path
) -> None:
    checkpoint = {"hyper_parameters": AttributeDict(lr=0.1, nested=AttributeDict(a=1)),
                  "state_dict": {"w": torch.ones(2)}, "global_step": 1}
    clean = lightning_state(checkpoint)
    assert type(clean["hyper_parameters"]) is dict
    assert type(clean["hyper_parameters"]["nested"]) is dict
    io = CkptStoreIO(store, run="pl-u")
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert store.load("pl-u@latest")["hyper_parameters"] == {"lr": 0.1, "nested": {"a": 1}}

    trainer = _trainer(io, 2, [ModelCheckpoint(dirpath=tmp_path / "u", every_n_train_steps=2)])
    with pytest.raises(UnsafeObjectError, match=r"hyper_parameters/extra.*save_hyperparameters"):
        trainer.fit(TinyModule(extra=Path("/data/set-a")), _loader())


def test_plain_torch_checkpoint_files_load_weights_only(
    store: CheckpointStore, tmp_path: Path
) -> None:
    io = CkptStoreIO(store, run="pl-p")
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.arange(3)}, "global_step": 3}, path)
    loaded = io.load_checkpoint(str(path))
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(3))
    assert os.path.exists(path)


def test_hparams_and_the_run_context_are_recorded(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from context_support import assert_full_context, training_repo

    repo = training_repo(tmp_path / "repo", monkeypatch)
    with CheckpointStore.open(tmp_path / "store") as store:
        io = CkptStoreIO(store, run="pl-ctx")
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2)
        _trainer(io, 2, [ckpt]).fit(TinyModule(lr=0.01), _loader())
        doc = store.catalog.context_of(store.latest("pl-ctx")).document
    assert_full_context(doc, repo)
    assert doc["config"]["lr"] == 0.01 and doc["config"]["hidden"] == 8


# ---------------------------------------------------------------- snapshots


class _Recorder(pl.Callback):  # type: ignore[misc]
    """The weights and optimizer state after each step, and what a resumed fit starts from."""

    def __init__(self) -> None:
        self.after: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        self.start: tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None = None
        self.first_step: int | None = None

    @staticmethod
    def _state(trainer: Any, module: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return weights, copy.deepcopy(trainer.optimizers[0].state_dict())

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.start = (trainer.global_step, *self._state(trainer, module))

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if self.first_step is None:
            self.first_step = trainer.global_step
        self.after[trainer.global_step] = self._state(trainer, module)


def _same(a: Any, b: Any) -> bool:
    """Equal nested states, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _assert_resumed_at(rec: _Recorder, before: _Recorder, step: int) -> None:
    assert rec.start is not None
    got_step, weights, optim = rec.start
    want_weights, want_optim = before.after[step]
    assert got_step == step
    assert not _same(want_weights, before.after[step - 1][0])  # a step tells them apart
    assert _same(weights, want_weights) and _same(optim, want_optim)
    assert rec.first_step == step + 1  # training goes on from the snapshotted step


def _snapshot_fit(store: CheckpointStore, tmp_path: Path, run: str,
                  monkeypatch: pytest.MonkeyPatch) -> tuple[_Recorder, list[int]]:
    """Five steps with a snapshot after each and a durable checkpoint at step 3."""
    taken: list[int] = []
    take = SnapshotWriter.take

    def recorded(writer: SnapshotWriter, step: int, flat: Any, **kwargs: Any) -> None:
        taken.append(step)
        take(writer, step, flat, **kwargs)

    monkeypatch.setattr(SnapshotWriter, "take", recorded)
    io = CkptStoreIO(store, run=run, snapshot_interval=1)
    rec = _Recorder()
    mc = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1)
    _trainer(io, 5, [mc, rec, CkptStoreCallback()]).fit(TinyModule(), _loader())
    assert io._snapshots is None  # closed when training ended; the slot files stay
    return rec, taken


def test_fit_resumes_from_a_snapshot_newer_than_the_last_checkpoint(
    snap_store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, taken = _snapshot_fit(snap_store, tmp_path, "pl-snap", monkeypatch)
    # Every step; step 3 twice: the ModelCheckpoint save of that step refreshed it.
    assert taken == [1, 2, 3, 3, 4, 5]
    assert [ck.step for ck in snap_store.list(run="pl-snap")] == [3]
    assert [f.step for f in snapshots_here(snap_store, "pl-snap")] == [5, 4]

    io = CkptStoreIO(snap_store, run="pl-snap", snapshot_interval=1)
    rec = _Recorder()
    trainer = _trainer(io, 7, [rec, CkptStoreCallback()])
    trainer.fit(TinyModule(), _loader(), ckpt_path="pl-snap@latest")
    assert io.resumed_step == 5
    assert io.resumed_from is not None and io.resumed_from.step == 3
    _assert_resumed_at(rec, before, 5)
    assert trainer.global_step == 7 and taken[6:] == [6, 7]  # step 5 not taken again
    assert [f.step for f in snapshots_here(snap_store, "pl-snap")] == [7, 6]

    # Without snapshot_interval "<run>@latest" is the newest checkpoint, as before.
    plain, rec = CkptStoreIO(snap_store, run="pl-snap"), _Recorder()
    _trainer(plain, 4, [rec, CkptStoreCallback()]).fit(TinyModule(), _loader(),
                                                       ckpt_path="pl-snap@latest")
    assert rec.start is not None and rec.start[0] == 3 and plain.resumed_step is None
    assert _same(rec.start[1], before.after[3][0])


def test_a_damaged_snapshot_gives_way_to_the_one_before(
    snap_store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, _ = _snapshot_fit(snap_store, tmp_path, "pl-dmg", monkeypatch)
    newest = snapshots_here(snap_store, "pl-dmg")[0]
    assert newest.step == 5
    # One bit of the first tensor of the step-5 snapshot flipped (as a bad page would).
    with open(newest.path, "r+b") as fh:
        parsed = parse_header(fh.read(HEADER_BYTES))
        assert parsed is not None
        fh.seek(parsed[3])
        byte = fh.read(1)[0]
        fh.seek(parsed[3])
        fh.write(bytes([byte ^ 1]))

    io = CkptStoreIO(snap_store, run="pl-dmg", snapshot_interval=1)
    rec = _Recorder()
    _trainer(io, 6, [rec, CkptStoreCallback()]).fit(TinyModule(), _loader(),
                                                    ckpt_path="pl-dmg@latest")
    assert io.resumed_step == 4
    _assert_resumed_at(rec, before, 4)


@pytest.mark.parametrize("interval", [0, -2, 1.5, True, "3"])
def test_a_bad_snapshot_interval_is_a_config_error(
    snap_store: CheckpointStore, interval: Any
) -> None:
    with pytest.raises(ConfigError, match="snapshot_interval"):
        CkptStoreIO(snap_store, run="pl-bad", snapshot_interval=interval)


def test_a_snapshot_budget_needs_an_interval(snap_store: CheckpointStore) -> None:
    with pytest.raises(ConfigError, match=r"snapshot_budget_bytes .*snapshot_interval"):
        CkptStoreIO(snap_store, run="pl-bad", snapshot_budget_bytes=2**20)
    with pytest.raises(ConfigError, match="snapshot_budget_bytes must be a positive int"):
        CkptStoreIO(snap_store, run="pl-bad", snapshot_interval=1, snapshot_budget_bytes=0)
    assert snap_store.list(run="pl-bad") == []


def test_snapshots_without_any_checkpoint_and_without_the_callback(
    snap_store: CheckpointStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # No ModelCheckpoint: the run has snapshots only; "<run>@latest" still resumes.
    io, before = CkptStoreIO(snap_store, run="pl-only", snapshot_interval=2), _Recorder()
    _trainer(io, 4, [before, CkptStoreCallback()]).fit(TinyModule(), _loader())
    assert snap_store.list(run="pl-only") == []
    assert [f.step for f in snapshots_here(snap_store, "pl-only")] == [4, 2]
    rec = _Recorder()
    _trainer(io, 5, [rec, CkptStoreCallback()]).fit(TinyModule(), _loader(),
                                                    ckpt_path="pl-only@latest")
    assert io.resumed_step == 4 and io.resumed_from is None
    _assert_resumed_at(rec, before, 4)

    # Without the callback nothing takes snapshots: said once, at the first save.
    bare = CkptStoreIO(snap_store, run="pl-bare", snapshot_interval=1)
    with caplog.at_level("WARNING", logger="ckptstore.integrations.lightning"):
        mc = ModelCheckpoint(dirpath=tmp_path / "bare", every_n_train_steps=1, save_top_k=-1)
        _trainer(bare, 2, [mc]).fit(
            TinyModule(), _loader())
    assert snapshots_here(snap_store, "pl-bare") == []
    assert sum("CkptStoreCallback" in r.getMessage() for r in caplog.records) == 1


HERE = Path(__file__).parent
#: Steps of the child's run (a checkpoint every 4) and the step it waits after to be killed.
CHILD_STEPS, CHILD_HOLD = 12, 9


@pytest.fixture(scope="module")
def trainers() -> Iterator[multiprocessing.context.BaseContext]:
    """Where the child trainers start: a forkserver that imported torch, Lightning and
    ckptstore's adapter once (seconds per fresh interpreter on the 2-core machine), stopped
    with the module. Each child is still its own process, SIGKILLed for real. When another
    module's forkserver runs already (without this directory on its path), spawned children
    instead: slower, always right."""
    yield from preloaded_children(
        ["torch", "lightning.pytorch", "lightning.pytorch.callbacks",
         "ckptstore.integrations.lightning", "ckptstore.store"], HERE)


def _child(ctx: multiprocessing.context.BaseContext, tmp_path: Path, shm_root: Path,
           run: str, log: Path, hold: int = 0) -> Any:
    import pl_snapshot_trainer

    child = ctx.Process(  # type: ignore[attr-defined]
        target=pl_snapshot_trainer.train,
        args=(str(tmp_path / "store"), str(shm_root), run, str(CHILD_STEPS), str(log),
              str(hold)))
    child.start()
    return child


def _log_lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_sigkilled_fit_resumes_from_its_snapshot_at_most_a_step_behind(
    tmp_path: Path, shm_root: Path, trainers: multiprocessing.context.BaseContext,
) -> None:
    # The uninterrupted run, in a child process too: the same thread count and start-up.
    ref_log = tmp_path / "reference.log"
    proc = _child(trainers, tmp_path / "ref", shm_root / "ref", "reference", ref_log)
    assert finish_child(proc) == 0  # a failing child's traceback is on this test's stderr
    ref = _log_lines(ref_log)
    reference = {int(p[1]): p[2] for p in ref if p[0] in ("start", "done")}
    assert sorted(reference) == list(range(CHILD_STEPS + 1)) and ref[-1] == ["finished"]

    log = tmp_path / "killed.log"
    proc = _child(trainers, tmp_path, shm_root / "node", "killed", log, hold=CHILD_HOLD)
    deadline = time.monotonic() + 300
    # Kill once three steps are logged: somewhere in steps 3 to CHILD_HOLD (the child waits
    # there), between or during snapshots, checkpoints and steps.
    while proc.is_alive() and time.monotonic() < deadline:
        if log.exists() and sum(1 for p in _log_lines(log) if p[0] == "done") >= 3:
            break
        time.sleep(0.01)
    assert proc.is_alive(), proc.exitcode
    proc.kill()  # SIGKILL
    proc.join(60)
    assert proc.exitcode == -9
    killed = _log_lines(log)
    last_done = max(int(p[1]) for p in killed if p[0] == "done")
    assert 3 <= last_done <= CHILD_HOLD

    proc = _child(trainers, tmp_path, shm_root / "node", "killed", log)
    assert finish_child(proc) == 0
    restarted = _log_lines(log)[len(killed):]
    assert restarted[0][0] == "start"
    start = int(restarted[0][1])
    # The snapshot of the last logged step, the one before (its commit was cut off) or the
    # one after (taken, not yet logged); checkpoints are only every 4 steps.
    assert last_done - 1 <= start <= last_done + 1, (start, last_done)
    # The restored weights and optimizer state are those of that step in the uninterrupted
    # run (the steps after it need not be: a plain DataLoader restarts its epoch).
    assert restarted[0][2] == reference[start]
    done = [int(p[1]) for p in restarted if p[0] == "done"]
    assert done == list(range(start + 1, CHILD_STEPS + 1)) and restarted[-1] == ["finished"]
