"""Lightning adapter with a real Trainer on CPU: saves, top-k removals, async ordering,
resume from a store reference, and what Lightning puts in a checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.fabric.utilities.data import AttributeDict  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from ckptstore.errors import CheckpointNotFoundError, UnsafeObjectError  # noqa: E402
from ckptstore.integrations.lightning import (  # noqa: E402
    CkptStoreCallback,
    CkptStoreIO,
    alias_for_path,
    lightning_state,
    read_pointer,
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
