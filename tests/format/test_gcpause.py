"""The collector is paused during a save (catalog work included), a load or a manifest parse,
then restored exactly."""

from __future__ import annotations

import gc
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.errors import InvalidNameError
from ckptstore.format import read_checkpoint, read_manifest, write_checkpoint
from ckptstore.format.gcpause import gc_paused
from ckptstore.format.manifest import parse as parse_module


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_save_and_load_pause_the_collector_and_restore_it(tmp_path: Path) -> None:
    seen: list[bool] = []
    state = {"w": torch.arange(10.0)}
    gc.enable()
    ckpt_id = str(uuid.uuid4())
    write_checkpoint(tmp_path / "c", state, ckpt_id=ckpt_id, run="r", step=0,
                     progress=lambda _n: seen.append(gc.isenabled()))
    assert seen and not any(seen)
    assert gc.isenabled()
    out = read_checkpoint(tmp_path / "c", read_manifest(tmp_path / "c"))
    assert torch.equal(out["w"], state["w"]) and gc.isenabled()


def test_a_store_save_pauses_the_collector_over_its_catalog_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore import CheckpointStore
    from ckptstore.ops.writing import save as save_module

    seen: list[bool] = []
    real = save_module.plan_save

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "plan_save", spy)
    gc.enable()
    with CheckpointStore.open(tmp_path / "s") as store:
        store.save("r", 1, {"w": torch.zeros(3)})
    assert seen == [False]
    assert gc.isenabled()


def test_a_caller_that_disabled_the_collector_keeps_it_disabled() -> None:
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_concurrent_pauses_reenable_only_after_the_last() -> None:
    gc.enable()
    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(5)
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    t.join(5)
    assert gc.isenabled()


def test_an_error_inside_still_restores_the_collector(tmp_path: Path) -> None:
    gc.enable()
    with pytest.raises(InvalidNameError):
        write_checkpoint(tmp_path / "x", {"w": torch.zeros(2)}, ckpt_id="bad id!", run="r",
                         step=0)
    assert gc.isenabled()


def test_parsing_a_manifest_runs_no_collection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a fresh process the first full collection after importing torch fell inside the
    # parse of a large manifest (~50 ms, ten times the parse): with a threshold of one
    # allocation, any collection a parse allowed would show here.
    state = {f"layer.{i}.weight": torch.zeros(4, 4) for i in range(200)}
    write_checkpoint(tmp_path / "c", state, ckpt_id=str(uuid.uuid4()), run="r", step=0)
    data = (tmp_path / "c" / "manifest.json").read_bytes()
    inside: list[bool] = [False]
    during: list[int] = []
    real = parse_module._parse

    def timed_parse(doc: object) -> object:
        inside[0] = True
        try:
            return real(doc)
        finally:
            inside[0] = False

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and inside[0]:
            during.append(info["generation"])

    monkeypatch.setattr(parse_module, "_parse", timed_parse)
    threshold = gc.get_threshold()
    gc.enable()
    gc.callbacks.append(on_gc)
    try:
        gc.set_threshold(1)
        fields = parse_module.parse_manifest(data)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_gc)
    assert len(fields["tensors"]) == 200
    assert during == []
    assert gc.isenabled()
