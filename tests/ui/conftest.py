"""A store with a few related runs, and the catalog browser serving it on 127.0.0.1."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class CurveStore:
    """Runs trained through CheckpointManager + LossMonitor, with their curves recorded."""

    store: CheckpointStore
    steps: int  # logged steps of alpha
    alert_steps: tuple[int, ...]  # alpha's loss alerts


def _loss(step: int, scale: float) -> float:
    return scale * 2.0 / math.sqrt(step) + 0.01 * math.sin(step)


@pytest.fixture(scope="session")
def curve_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CurveStore]:
    """alpha: 20,000 steps (a spike at 12,000, a NaN at 15,000), a checkpoint every 4,000;
    beta: 6,000 steps; gamma: 3,000 steps; delta: checkpoints only, no curve."""
    from ckptstore.hooks import CheckpointManager, LossMonitor

    root: Path = tmp_path_factory.mktemp("curves") / "store"
    store = CheckpointStore.open(root)
    spike, nan = 12_000, 15_000

    def state() -> dict[str, torch.Tensor]:
        return {"w": torch.ones(8)}

    try:
        for run, steps, scale in (("alpha", 20_000, 1.0), ("beta", 6_000, 1.2),
                                  ("gamma", 3_000, 0.8)):
            with CheckpointManager(store, run, save_interval=4_000 if run == "alpha" else 2_000,
                                   async_save=False, handle_sigterm=False,
                                   history_points=1_000) as mgr:
                monitor = LossMonitor(window_size=50, threshold=0.5, action="alert",
                                      manager=mgr)
                for step in range(1, steps + 1):
                    loss = _loss(step, scale)
                    if run == "alpha" and step == spike:
                        loss = 40.0
                    elif run == "alpha" and step == nan:
                        loss = float("nan")
                    monitor.update(step, loss)
                    mgr.step(step, state, metrics={"loss": loss})
        store.save("delta", 1, state())
        yield CurveStore(store, 20_000, (spike, nan))
    finally:
        store.close()


@pytest.fixture(scope="module")
def curve_server(curve_store: CurveStore) -> Iterator[BackgroundUI]:
    with start_background(curve_store.store) as running:
        yield running


def _screenshot_painted(page: Any, path: Path, *, full_page: bool = False) -> None:
    """Screenshot ``page`` once the compositor has produced a frame of its current content.

    Right after a navigation (and on a cold browser) Chromium may not have a frame to capture
    yet and answers "Unable to capture screenshot"; two animation frames guarantee that one
    was painted after the page settled.
    """
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    page.screenshot(path=str(path), full_page=full_page)


@pytest.fixture
def screenshot_painted() -> Callable[..., None]:
    """:func:`_screenshot_painted`: ``screenshot_painted(page, path, full_page=...)``."""
    return _screenshot_painted
