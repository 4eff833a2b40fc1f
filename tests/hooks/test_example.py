"""examples/train_mlp.py runs and resumes (in process; the crash path is shown by the demo)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ckptstore.store import CheckpointStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"


@pytest.fixture
def example() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("train_mlp_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    level = logging.getLogger().level
    try:
        yield module
    finally:
        torch.set_num_threads(threads)
        logging.getLogger().setLevel(level)


def test_example_trains_then_resumes(
    example: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    assert example.main(["--store", str(root), "--steps", "20", "--save-every", "10",
                         "--keep-last", "2"]) == 0
    first = capsys.readouterr().out
    assert "no checkpoint yet" in first and "save submitted" in first
    assert example.main(["--store", str(root), "--steps", "30", "--save-every", "10",
                         "--keep-last", "2"]) == 0
    second = capsys.readouterr().out
    assert "resumed from mlp-demo@v2 (step 20)" in second
    with CheckpointStore.open(root) as store:
        assert [c.step for c in store.list(run="mlp-demo", order_by="step")] == [20, 30]
        newest = store.latest("mlp-demo")
        assert store.load(newest.id)["step"] == 30
