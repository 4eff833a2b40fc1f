"""CkptStoreTrainer with a real Trainer on CPU: each checkpoint goes to the store once (no
``checkpoint-N`` folder), and the Trainer's own resume works from a store reference,
bit-exactly; with ``snapshot_interval`` it also resumes from a snapshot newer than the last
checkpoint, after a SIGKILL too."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from integrations.trainer_support import TinyData  # noqa: E402
from process_support import finish_child, preloaded_children  # noqa: E402

from ckptstore.errors import CheckpointNotFoundError, ConfigError  # noqa: E402
from ckptstore.integrations.hf import materialize_hf_checkpoint  # noqa: E402
from ckptstore.integrations.hf_trainer import CkptStoreTrainer  # noqa: E402
from ckptstore.ops.writing.snapshot import (  # noqa: E402
    HEADER_BYTES,
    SnapshotWriter,
    parse_header,
    snapshot_dir,
    snapshots_here,
)
from ckptstore.records import CheckpointState  # noqa: E402
from ckptstore.store import CheckpointStore  # noqa: E402

STEPS = 6


class _StopAt(transformers.TrainerCallback):  # type: ignore[misc]
    """Ends training after ``step`` (after its save), like a preemption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def _model() -> Any:
    transformers.set_seed(0)
    # Dropout stays on (BERT's default 0.1): the resume must restore the RNG states too.
    config = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)
    return transformers.BertForSequenceClassification(config)


def _args(out: Path, **extra: Any) -> Any:
    opts: dict[str, Any] = {
        "output_dir": str(out), "max_steps": STEPS, "save_steps": 2, "report_to": [],
        "use_cpu": True, "per_device_train_batch_size": 4, "logging_steps": 1,
        "disable_tqdm": True, **extra,
    }
    return transformers.TrainingArguments(**opts)


def _trainer(store: CheckpointStore, run: str, out: Path, *, callbacks: Any = None,
             async_save: bool = False, snapshot_interval: Any = None,
             snapshot_budget_bytes: Any = None, **extra: Any) -> CkptStoreTrainer:
    return CkptStoreTrainer(
        model=_model(), args=_args(out, **extra), train_dataset=TinyData(),
        eval_dataset=TinyData() if "eval_strategy" in extra else None,
        callbacks=callbacks, store=store, run=run, async_save=async_save,
        snapshot_interval=snapshot_interval, snapshot_budget_bytes=snapshot_budget_bytes,
    )


def _losses(trainer: Any) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """One uninterrupted 6-step run saving at 2, 4 and 6: (base dir, losses, weights)."""
    base = tmp_path_factory.mktemp("hf-trainer")
    with CheckpointStore.open(base / "store") as store:
        trainer = _trainer(store, "full", base / "out")
        trainer.train()
        assert [ck.step for ck in trainer.saved] == [2, 4, 6]
    return base, _losses(trainer), _weights(trainer)


def test_each_save_is_one_store_checkpoint_and_no_folder(
    uninterrupted: tuple[Path, Any, Any],
) -> None:
    base, losses, final = uninterrupted
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    out = base / "out"
    # Written once: the Trainer's output_dir holds no checkpoint folder.
    assert not out.exists() or not [p for p in out.iterdir() if p.name.startswith("checkpoint")]
    with CheckpointStore.open(base / "store") as store:
        cks = store.list(run="full", order_by="step")
        assert [c.step for c in cks] == [2, 4, 6] and all("hf" in c.tags for c in cks)
        assert {"loss", "learning_rate", "grad_norm"} <= set(cks[-1].metrics)
        assert cks[-1].metrics["loss"] == losses[-1][1]
        state = store.load("full@latest")
        assert set(state) >= {"model", "config", "optimizer", "scheduler", "rng_state",
                              "trainer_state", "training_args", "hf"}
        assert state["hf"]["writer"] == "CkptStoreTrainer"
        assert state["trainer_state"]["global_step"] == STEPS
        assert state["config"]["hidden_size"] == 16
        assert all(torch.equal(state["model"][k], final[k]) for k in final)
        rng = state["rng_state"]["rng_state.pth"]
        assert rng["numpy"][0] == "MT19937" and rng["python"][1].shape == (625,)
        # The logged training loss also went to the run's metric history, at each save.
        curve = store.catalog.metric_history("full")
        assert [(p.step_last, p.last) for p in curve] == losses


def test_resume_from_a_store_reference_is_bit_exact(
    uninterrupted: tuple[Path, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, losses, final = uninterrupted
    with CheckpointStore.open(tmp_path / "store") as store:
        # Stopped at step 5, one step after its last checkpoint: that step is lost.
        first = _trainer(store, "part", tmp_path / "out", callbacks=[_StopAt(5)],
                         async_save=True)
        first.train()
        assert [ck.step for ck in first.saved] == [2, 4] and first.state.global_step == 5
        assert store.catalog.metric_history("part")[-1].step_last == 5

        # A new process would build everything again; nothing may be unpickled on the way.
        def no_unpickling(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("torch.load called during a store resume")

        monkeypatch.setattr(torch, "load", no_unpickling)
        resumed = _trainer(store, "part", tmp_path / "out")
        resumed.train(resume_from_checkpoint="part@latest")
        monkeypatch.undo()
        assert resumed.resumed_from is not None and resumed.resumed_from.step == 4
        assert resumed.state.global_step == STEPS
        # Same losses at every step as the uninterrupted run, and the same final weights.
        assert _losses(resumed) == losses
        after = _weights(resumed)
        assert all(torch.equal(after[k], final[k]) for k in final)
        # The first save after the resume records where it came from.
        last = store.get("part@latest")
        assert last.step == STEPS and last.parent_id == resumed.resumed_from.id
        # The curve shows the run's path once: the abandoned step 5 was rewound.
        curve = store.catalog.metric_history("part")
        assert [(p.step_last, p.last) for p in curve] == losses
        assert all(p.count == 1 for p in curve)

        # resume_from_checkpoint=True is the newest checkpoint of the trainer's run.
        again = _trainer(store, "part", tmp_path / "out")
        again.train(resume_from_checkpoint=True)
        assert again.resumed_from is not None and again.resumed_from.step == STEPS


def test_a_store_checkpoint_materializes_for_the_plain_trainer(
    uninterrupted: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    base, losses, final = uninterrupted
    with CheckpointStore.open(base / "store") as store:
        folder = materialize_hf_checkpoint(store, "full@2", tmp_path / "restored")
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json", "config.json"} <= set(os.listdir(folder))
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path / "out"),
                                 train_dataset=TinyData())
    plain.train(resume_from_checkpoint=folder)
    assert _losses(plain) == losses
    after = _weights(plain)
    assert all(torch.equal(after[k], final[k]) for k in final)


def test_save_total_limit_and_best_model_through_retention_and_an_alias(
    tmp_path: Path,
) -> None:
    with CheckpointStore.open(tmp_path / "store") as store:
        trainer = _trainer(
            store, "best", tmp_path / "out", max_steps=8, save_total_limit=1,
            eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
            # "Greater is better" on a falling loss puts the best before the newest
            # checkpoint, the case where the limit and the best interact.
            metric_for_best_model="eval_loss", greater_is_better=True,
        )
        trainer.train()
        assert [ck.step for ck in trainer.saved] == [2, 4, 6, 8]
        evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history
                 if "eval_loss" in e}
        best_step = max(evals, key=lambda s: (evals[s], -s))
        assert best_step != 8
        assert trainer.state.best_model_checkpoint == f"best@{best_step}"
        best = store.get("best.best")
        assert best.step == best_step
        live = {c.step for c in store.list(run="best")}
        # save_total_limit=1: the newest and the best (protected by its alias) remain.
        assert live == {8, best_step}
        gone = [c for c in store.list(run="best", state=None) if c.step not in live]
        assert gone and all(c.state == CheckpointState.DELETED for c in gone)
        # load_best_model_at_end loaded the best weights from the store.
        weights = store.load("best.best", keys=["model/*"])["model"]
        now = trainer.model.state_dict()
        assert all(torch.equal(now[k], weights[k]) for k in weights)


def test_unknown_references_are_clear_errors(tmp_path: Path) -> None:
    with CheckpointStore.open(tmp_path / "store") as store:
        trainer = _trainer(store, "fresh", tmp_path / "out")
        with pytest.raises(CheckpointNotFoundError, match="has no checkpoint in the store"):
            trainer.train(resume_from_checkpoint=True)
        with pytest.raises(CheckpointNotFoundError):
            trainer.train(resume_from_checkpoint="fresh@v7")
        assert store.list(run="fresh") == []


def test_the_trainer_records_the_run_context(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from context_support import assert_full_context, training_repo

    repo = training_repo(tmp_path / "repo", monkeypatch)
    with CheckpointStore.open(tmp_path / "store") as store:
        trainer = _trainer(store, "ctx", tmp_path / "out", max_steps=2)
        trainer.train()
        doc = store.catalog.context_of(store.latest("ctx")).document
    assert_full_context(doc, repo)
    assert doc["config"]["max_steps"] == 2 and doc["config"]["save_steps"] == 2


def test_snapshots_every_step_resume_past_the_last_checkpoint_bit_exact(
    uninterrupted: tuple[Path, Any, Any], tmp_path: Path, shm_root: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, losses, final = uninterrupted
    taken: list[int] = []
    take = SnapshotWriter.take

    def recorded(writer: SnapshotWriter, step: int, flat: Any, **kwargs: Any) -> None:
        taken.append(step)
        take(writer, step, flat, **kwargs)

    monkeypatch.setattr(SnapshotWriter, "take", recorded)
    with CheckpointStore.open(tmp_path / "store", memory_tier_dir=str(shm_root)) as store:
        # Stopped at step 5, one step after its last checkpoint (4): only a snapshot has it.
        first = _trainer(store, "snap", tmp_path / "out", callbacks=[_StopAt(5)],
                         snapshot_interval=1)
        first.train()
        assert taken == [1, 2, 3, 4, 5]
        assert [ck.step for ck in first.saved] == [2, 4] and first.state.global_step == 5
        # The writer is closed; only its two slot files stay, for the next process.
        assert first._snapshots is None
        slots = snapshot_dir(store, "snap")
        assert sorted(p.name for p in slots.iterdir()) == ["slot0.snap", "slot1.snap"]
        assert [f.step for f in snapshots_here(store, "snap")] == [5, 4]

        resumed = _trainer(store, "snap", tmp_path / "out", snapshot_interval=1)
        resumed.train(resume_from_checkpoint=True)
        assert resumed.resumed_step == 5
        assert resumed.resumed_from is not None and resumed.resumed_from.step == 4
        assert taken[5:] == [6]  # the resumed step is not taken again
        # The same losses at every step as the uninterrupted run, and the same final weights.
        assert _losses(resumed) == losses
        after = _weights(resumed)
        assert all(torch.equal(after[k], final[k]) for k in final)
        # Lineage: the next save continues the newest checkpoint's line.
        last = store.get("snap@latest")
        assert last.step == STEPS and last.parent_id == resumed.resumed_from.id
        assert [f.step for f in snapshots_here(store, "snap")] == [6, 5]

        # Without snapshot_interval the trainer resumes from the newest checkpoint, as before.
        plain = _trainer(store, "snap", tmp_path / "out")
        plain.train(resume_from_checkpoint=True)
        assert plain.resumed_step == STEPS and plain.resumed_from is not None
        assert plain.resumed_from.step == STEPS


def test_a_damaged_snapshot_gives_way_to_the_one_before(
    uninterrupted: tuple[Path, Any, Any], tmp_path: Path, shm_root: Path,
) -> None:
    _, losses, final = uninterrupted
    with CheckpointStore.open(tmp_path / "store", memory_tier_dir=str(shm_root)) as store:
        # A checkpoint at step 3; snapshots of steps 4 and 5 in the two slots.
        first = _trainer(store, "dmg", tmp_path / "out", callbacks=[_StopAt(5)],
                         snapshot_interval=1, save_steps=3)
        first.train()
        assert [ck.step for ck in first.saved] == [3]
        newest = snapshots_here(store, "dmg")[0]
        assert newest.step == 5
        # One bit of the first tensor of the step-5 snapshot flipped (as a bad page would).
        with open(newest.path, "r+b") as fh:
            parsed = parse_header(fh.read(HEADER_BYTES))
            assert parsed is not None
            fh.seek(parsed[3])
            byte = fh.read(1)[0]
            fh.seek(parsed[3])
            fh.write(bytes([byte ^ 1]))

        # "<run>@latest" asks for the newest state as True does: the intact snapshot of
        # step 4 is used, never the damaged one.
        resumed = _trainer(store, "dmg", tmp_path / "out", snapshot_interval=1, save_steps=3)
        resumed.train(resume_from_checkpoint="dmg@latest")
        assert resumed.resumed_step == 4
        assert resumed.resumed_from is not None and resumed.resumed_from.step == 3
        assert _losses(resumed) == losses
        after = _weights(resumed)
        assert all(torch.equal(after[k], final[k]) for k in final)


HERE = Path(__file__).parent
#: Steps of the child's run (a checkpoint every 4) and the step it waits after to be killed.
CHILD_STEPS, CHILD_HOLD = 12, 9


@pytest.fixture(scope="module")
def trainers() -> Iterator[multiprocessing.context.BaseContext]:
    """Where the child trainers start: a forkserver that imported torch, transformers' Trainer
    and BERT and ckptstore's adapter once (seconds per fresh interpreter on the 2-core
    machine), stopped with the module. Each child is still its own process, SIGKILLed for real. When
    another module's forkserver runs already (without this directory on its path), spawned
    children instead: slower, always right."""
    # transformers imports lazily: its Trainer and BERT by name.
    yield from preloaded_children(
        ["torch", "transformers", "transformers.trainer",
         "transformers.models.bert.modeling_bert", "ckptstore.integrations.hf_trainer",
         "ckptstore.store"], HERE)


def _child(ctx: multiprocessing.context.BaseContext, tmp_path: Path, shm_root: Path,
           run: str, log: Path, hold: int = 0) -> Any:
    import hf_snapshot_trainer

    child = ctx.Process(  # type: ignore[attr-defined]
        target=hf_snapshot_trainer.train,
        args=(str(tmp_path / "store"), str(shm_root), run, str(CHILD_STEPS), str(log),
              str(hold)))
    child.start()
    return child


def _log_lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_sigkilled_trainer_resumes_from_its_snapshot_at_most_a_step_behind(
    tmp_path: Path, shm_root: Path, trainers: multiprocessing.context.BaseContext,
) -> None:
    # The uninterrupted run, in a child process too: the same thread count and start-up.
    ref_log = tmp_path / "reference.log"
    proc = _child(trainers, tmp_path / "ref", shm_root / "ref", "reference", ref_log)
    assert finish_child(proc) == 0  # a failing child's traceback is on this test's stderr
    ref = _log_lines(ref_log)
    reference = {int(p[1]): p[2] for p in ref if p[0] == "done"}
    assert sorted(reference) == list(range(1, CHILD_STEPS + 1)) and ref[-1][0] == "finished"

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
    # one after (snapshot taken, not yet logged); checkpoints are only every 4 steps.
    assert last_done - 1 <= start <= last_done + 1, (start, last_done)
    done = [(int(p[1]), p[2]) for p in restarted if p[0] == "done"]
    assert [step for step, _ in done] == list(range(start, CHILD_STEPS + 1))
    # Bit-exact: the restored state and every step after it are the uninterrupted run's.
    assert all(reference[step] == digest for step, digest in done)
    assert restarted[-1] == ref[-1]


@pytest.mark.parametrize("interval", [0, -2, 1.5, "1", True])
def test_a_bad_snapshot_interval_is_a_config_error(tmp_path: Path, interval: Any) -> None:
    with CheckpointStore.open(tmp_path / "store") as store, \
            pytest.raises(ConfigError, match="snapshot_interval"):
        _trainer(store, "bad", tmp_path / "out", snapshot_interval=interval)


def test_snapshot_budgets_are_checked(tmp_path: Path, shm_root: Path) -> None:
    with CheckpointStore.open(tmp_path / "store", memory_tier_dir=str(shm_root)) as store:
        with pytest.raises(ConfigError, match="snapshot_budget_bytes"):
            _trainer(store, "bad", tmp_path / "out", snapshot_budget_bytes=2**20)
        with pytest.raises(ConfigError, match="snapshot_budget_bytes must be a positive int"):
            _trainer(store, "bad", tmp_path / "out", snapshot_interval=1,
                     snapshot_budget_bytes=0)
        # Too small for two slots of this state: refused at the first snapshot, with the
        # bytes it needs, before a slot file is made; training stops there.
        small = _trainer(store, "bad", tmp_path / "out", snapshot_interval=1,
                         snapshot_budget_bytes=4096)
        with pytest.raises(ConfigError, match=r"need \d+ bytes .* snapshot_budget_bytes=4096"):
            small.train()
        assert small.state.global_step == 1 and small._snapshots is None
        slots = snapshot_dir(store, "bad")
        assert not slots.exists() or not list(slots.iterdir())
