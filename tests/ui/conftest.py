"""A store with a few related runs, and the catalog browser serving it on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.ui.app import BackgroundUI, start_background


@dataclass(frozen=True)
class UiStore:
    """The filled store and the ids the tests look for."""

    store: CheckpointStore
    base_head: str  # base@v3: the checkpoint `tuned` was fine-tuned from
    tuned_first: str  # tuned@v1
    pruned: str  # base@v1, marked DELETED
    solo: str  # solo@v1, converted from base@v2


@pytest.fixture(scope="session")
def ui_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiStore]:
    root: Path = tmp_path_factory.mktemp("ui") / "store"
    store = CheckpointStore.open(root)
    try:
        store.run("base", experiment="exp", code_version="c0ffee",
                  config={"lr": 0.1, "note": "<script>alert('x')</script>"})
        cks = [
            store.save("base", step, {"w": torch.full((64,), float(step))},
                       metrics={"loss": loss, "acc": 1 - loss / 4}, tags=["nightly"])
            for step, loss in ((10, 3.0), (20, 2.0), (100, 1.5))
        ]
        tuned = [
            store.save("tuned", 1, {"w": torch.zeros(64)}, parent="base@latest",
                       metrics={"loss": 1.2}),
            store.save("tuned", 5, {"w": torch.ones(64)}, metrics={"loss": 0.9}),
        ]
        solo = store.save("solo", 3, {"w": torch.ones(8)})
        store.catalog.add_edge(cks[1].id, solo.id, "converted-from")
        store.alias("tuned@v2", "prod")
        store.catalog.mark_deleting(cks[0].id)
        store.catalog.mark_deleted(cks[0].id)
        yield UiStore(store, cks[2].id, tuned[0].id, cks[0].id, solo.id)
    finally:
        store.close()


@pytest.fixture(scope="module")
def ui_server(ui_store: UiStore) -> Iterator[BackgroundUI]:
    with start_background(ui_store.store) as running:
        yield running
