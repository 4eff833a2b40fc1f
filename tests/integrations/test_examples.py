"""examples/train_lightning.py and examples/train_hf.py train, then resume from the store."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ckptstore.store import CheckpointStore

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def load_example() -> Iterator[Callable[[str], ModuleType]]:
    threads = torch.get_num_threads()
    level = logging.getLogger().level

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    try:
        yield load
    finally:
        torch.set_num_threads(threads)
        logging.getLogger().setLevel(level)


def test_lightning_example_trains_and_resumes(
    load_example: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    pytest.importorskip("lightning.pytorch")
    example = load_example("train_lightning.py")
    root = tmp_path / "store"
    assert example.main(["--store", str(root), "--steps", "20", "--save-every", "10"]) == 0
    assert example.main(["--store", str(root), "--steps", "30", "--save-every", "10",
                         "--resume", "pl-demo@latest", "--async-save"]) == 0
    with CheckpointStore.open(root) as store:
        assert [ck.step for ck in store.list(run="pl-demo", order_by="created_at")] == [10, 20, 30]


def test_hf_example_trains_and_resumes(
    load_example: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    example = load_example("train_hf.py")
    root = tmp_path / "store"
    assert example.main(["--store", str(root), "--steps", "4", "--save-every", "2"]) == 0
    assert example.main(["--store", str(root), "--steps", "6", "--save-every", "2",
                         "--resume", "bert-demo@latest"]) == 0
    with CheckpointStore.open(root) as store:
        # save_total_limit=2 through the store's retention: step 2 was pruned after step 6.
        assert [ck.step for ck in store.list(run="bert-demo", order_by="created_at")] == [4, 6]
        history = store.list(run="bert-demo", state=None, order_by="created_at")
        assert [ck.step for ck in history] == [2, 4, 6]
        last = store.get("bert-demo@latest")
        assert last.parent_id == store.list(run="bert-demo", order_by="step")[0].id
        assert sum(p.count for p in store.catalog.metric_history("bert-demo")) == 6
