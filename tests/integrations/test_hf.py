"""Hugging Face adapter with a real Trainer on CPU: ingest each checkpoint-N folder, write it
back, and resume bit-exactly from a store reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from integrations.trainer_support import TinyData  # noqa: E402

from ckptstore.errors import ConflictError, UnsafeObjectError  # noqa: E402
from ckptstore.integrations.hf import (  # noqa: E402
    CkptStoreCallback,
    materialize_hf_checkpoint,
    metrics_from_log_history,
    read_trainer_folder,
)
from ckptstore.store import CheckpointStore  # noqa: E402


def _trainer(out: Path, steps: int = 4) -> Any:
    transformers.set_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, save_steps=2, report_to=[], use_cpu=True,
        per_device_train_batch_size=4, logging_steps=1, disable_tqdm=True,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=TinyData())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """One 4-step training run with the callback, saving at steps 2 and 4."""
    base = tmp_path_factory.mktemp("hf")
    store = CheckpointStore.open(base / "store")
    try:
        trainer = _trainer(base / "out")
        callback = CkptStoreCallback(store, run="bert")
        trainer.add_callback(callback)
        trainer.train()
        assert [ck.step for ck in callback.saved] == [2, 4]
        callback.close()
    finally:
        store.close()
    final = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return base, final


def test_each_saved_folder_becomes_one_checkpoint(trained: tuple[Path, Any]) -> None:
    base, final = trained
    with CheckpointStore.open(base / "store") as store:
        cks = store.list(run="bert", order_by="created_at")
        assert [ck.step for ck in cks] == [2, 4] and all("hf" in ck.tags for ck in cks)
        assert {"loss", "learning_rate", "grad_norm"} <= set(cks[1].metrics)
        assert [e.kind for e in store.events(cks[1].id)].count("imported") == 1
        state = store.load("bert@4")
        assert set(state) >= {"model", "config", "optimizer", "scheduler", "rng_state",
                              "trainer_state", "files", "hf"}
        assert state["trainer_state"]["global_step"] == 4
        assert state["config"]["hidden_size"] == 16
        # The weights are plain tensors (queryable, partially loadable) ...
        assert all(torch.equal(state["model"][k], final[k]) for k in state["model"])
        weights = store.load("bert@4", keys=["model/*"])
        assert set(weights) == {"model"}
        # ... unknown files are kept byte for byte, never unpickled.
        folder = base / "out" / "checkpoint-4"
        kept = state["files"]["training_args.bin"].numpy().tobytes()
        assert kept == (folder / "training_args.bin").read_bytes()


def test_resume_from_a_store_reference_is_bit_exact(
    trained: tuple[Path, Any], tmp_path: Path
) -> None:
    base, final = trained
    with CheckpointStore.open(base / "store") as store:
        path = materialize_hf_checkpoint(store, "bert@2", tmp_path / "restored")
        assert Path(path).name == "checkpoint-2"
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                "trainer_state.json", "config.json"} <= set(os.listdir(path))
        with pytest.raises(ConflictError):
            materialize_hf_checkpoint(store, "bert@2", tmp_path / "restored")
    resumed = _trainer(tmp_path / "out2")
    resumed.train(resume_from_checkpoint=path)
    assert resumed.state.global_step == 4
    after = resumed.model.state_dict()
    assert all(torch.equal(after[k], final[k]) for k in final)


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def test_unsafe_optimizer_file_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(folder / "model.safetensors"))
    torch.save({"state": {}, "hook": _Evil()}, folder / "optimizer.pt")
    with pytest.raises(UnsafeObjectError):
        read_trainer_folder(folder)


def test_metrics_take_the_newest_value_up_to_the_step() -> None:
    history = [{"loss": 2.0, "step": 1}, {"loss": 1.5, "lr": 0.1, "step": 2},
               {"eval_loss": float("nan"), "step": 2}, {"loss": 1.0, "step": 3}]
    assert metrics_from_log_history(history, 2) == {"loss": 1.5, "lr": 0.1}


def test_the_callback_records_the_run_context(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from context_support import assert_full_context, training_repo

    repo = training_repo(tmp_path / "repo", monkeypatch)
    with CheckpointStore.open(tmp_path / "store") as store:
        trainer = _trainer(tmp_path / "out", steps=2)
        callback = CkptStoreCallback(store, run="bert-ctx")
        trainer.add_callback(callback)
        trainer.train()
        callback.close()
        doc = store.catalog.context_of(store.latest("bert-ctx")).document
    assert_full_context(doc, repo)
    # The TrainingArguments are the config; the hub token is never stored.
    assert doc["config"]["max_steps"] == 2 and doc["config"]["learning_rate"] == 5e-05
    assert doc["config"]["hub_token"] in (None, "***", "<HUB_TOKEN>")
