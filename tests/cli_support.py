"""Helpers of the CLI tests (tests/cli): small real stores, and ``ckpt`` results."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ckptstore.store import CheckpointStore

__all__ = ["Ckpt", "FilledStore", "Result", "make_filled_store"]


@dataclass
class Result:
    """What one ``ckpt`` invocation did."""

    code: int
    out: str
    err: str


Ckpt = Callable[..., Result]


@dataclass
class FilledStore:
    """A store with a few runs, and a config file selecting it with a local warm tier."""

    root: Path
    config: Path
    work: Path


def make_filled_store(base: Path, catalog_template: Path) -> FilledStore:
    """Runs ``base`` (steps 10, 20, 100 with a loss), ``tuned`` (derived from base@latest)
    and ``delta`` (step 1 is stored as an xor delta of step 0, so it compacts)."""
    root = base / "store"
    root.mkdir(parents=True)
    shutil.copyfile(catalog_template, root / "catalog.db")
    config = base / "ckptstore.toml"
    config.write_text(f'root = "{root}"\n[tiers]\nwarm = "{base / "warm"}"\n')
    with CheckpointStore.open(config=config) as store:
        store.run("base", experiment="exp", config={"lr": 0.1}, code_version="c0ffee")
        for step, loss in [(10, 3.0), (20, 2.0), (100, 1.5)]:
            store.save("base", step=step, state={"w": torch.ones(256) * step},
                       metrics={"loss": loss}, tags=["warm"] if step == 10 else ())
        store.save("tuned", step=1, state={"w": torch.zeros(256)}, parent="base@latest")
        store.save("delta", 0, {"a": torch.arange(4096.0)}, delta="xor")
        store.save("delta", 1, {"a": torch.arange(4096.0) * 2}, delta="xor")
    work = base / "work"
    work.mkdir()
    return FilledStore(root=root, config=config, work=work)
