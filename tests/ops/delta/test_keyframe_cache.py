"""The in-memory keyframe cache: delta saves take base chunks from it, and it never changes a
byte of what is stored."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from delta_helpers import CHUNK, make_state, states_equal, train_step

from ckptstore import CheckpointStore
from ckptstore.errors import ConfigError
from ckptstore.format import KeyframeCache

LOSSY = {"threshold": 1e-6, "quantize": 8}


def _chain(root: Path, delta: Any, *, cache_bytes: int, saves: int = 4) -> tuple[
        CheckpointStore, list[str], list[dict[str, Any]]]:
    store = CheckpointStore.open(root, chunk_bytes=CHUNK, keyframe_every=10,
                                 delta_cache_bytes=cache_bytes)
    state = make_state(1)
    ids, states = [], []
    for step in range(saves):
        ids.append(store.save("r", step, state, delta=delta).id)
        states.append(state)
        state = train_step(state, seed=step)
    return store, ids, states


def _chunks(store: CheckpointStore, ckpt_id: str) -> list[tuple[str, int, str, str, int]]:
    manifest = store.manifest(ckpt_id)
    return [(name, c.i, c.blake3, c.enc, c.nbytes)
            for name, array in sorted(manifest.arrays.items()) for c in array.chunks]


@pytest.mark.parametrize("delta", ["xor", LOSSY], ids=["xor", "lossy8"])
def test_cached_and_uncached_saves_store_the_same_bytes(tmp_path: Path, delta: Any) -> None:
    cached, ids_c, states = _chain(tmp_path / "cached", delta, cache_bytes=1 << 30)
    plain, ids_p, _ = _chain(tmp_path / "plain", delta, cache_bytes=0)
    try:
        assert cached.keyframe_cache is not None and plain.keyframe_cache is None
        assert cached.keyframe_cache.ckpt_id == ids_c[0]
        for a, b in zip(ids_c, ids_p, strict=True):
            assert _chunks(cached, a) == _chunks(plain, b)
        assert any(enc != "raw" for *_, enc, _ in _chunks(cached, ids_c[-1]))
        for ckpt_id, state in zip(ids_c, states, strict=True):
            loaded = cached.load(ckpt_id)
            if delta == "xor":
                assert states_equal(loaded, state)
    finally:
        cached.close()
        plain.close()


def test_a_delta_uses_the_cache_instead_of_the_keyframe_on_disk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the keyframe's chunk files unreadable, a cached save still delta-encodes;
    without the cache, the same save falls back to whole chunks (and says so)."""
    outcome = {}
    for name, cache_bytes in (("cached", 1 << 30), ("plain", 0)):
        store, ids, states = _chain(tmp_path / name, "xor", cache_bytes=cache_bytes, saves=1)
        try:
            key_dir = store.checkpoint_dir("r", ids[0])
            for chunk in key_dir.glob("*/c/*"):
                chunk.write_bytes(b"\0" * chunk.stat().st_size)  # damaged on disk
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="ckptstore.format.chunkwriter"):
                ck = store.save("r", 1, train_step(states[0]), delta="xor")
            encs = {enc for *_, enc, _ in _chunks(store, ck.id)}
            outcome[name] = (encs, "cannot read base chunk" in caplog.text)
        finally:
            store.close()
    assert outcome["cached"] == ({"raw", "xor"}, False)
    assert outcome["plain"][1] is True and "xor" not in outcome["plain"][0]


def test_a_small_budget_caches_part_of_the_keyframe(tmp_path: Path) -> None:
    store, ids, states = _chain(tmp_path / "s", "xor", cache_bytes=3 * CHUNK)
    try:
        cache = store.keyframe_cache
        assert cache is not None and 0 < cache.used_bytes <= 3 * CHUNK
        for ckpt_id, state in zip(ids, states, strict=True):
            assert states_equal(store.load(ckpt_id), state)
    finally:
        store.close()


def test_dedup_saves_leave_the_cache_alone_and_close_releases_it(tmp_path: Path) -> None:
    store, ids, _ = _chain(tmp_path / "s", "xor", cache_bytes=1 << 30, saves=2)
    cache = store.keyframe_cache
    assert cache is not None
    store.save("r", 10, make_state(7))  # the default mode, dedup: no keyframe
    assert cache.ckpt_id == ids[0]
    store.close()
    assert cache.ckpt_id is None and cache.used_bytes == 0


def test_cache_hands_out_only_the_chunk_it_was_given() -> None:
    cache = KeyframeCache(1 << 20)
    data = np.arange(64, dtype=np.uint8)
    assert not cache.put("k", "float32", 0, [data], "d0")  # not begun
    cache.begin("k")
    assert cache.put("k", "float32", 0, [data[:32], data[32:]], "d0")
    assert not cache.put("other", "float32", 1, [data], "d1")
    got = cache.get("k", "float32", 0, "d0", 64)
    assert got is not None and bytes(got) == bytes(data)
    assert cache.get("k", "float32", 0, "another digest", 64) is None
    assert cache.get("k", "float32", 0, "d0", 65) is None
    assert cache.get("other", "float32", 0, "d0", 64) is None
    cache.begin("k2")  # a new keyframe drops the old one's chunks
    assert cache.get("k", "float32", 0, "d0", 64) is None and cache.used_bytes == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        KeyframeCache(-1)


def test_cache_budget_setting_is_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_DELTA_CACHE_BYTES", "-5")
    with pytest.raises(ConfigError, match="delta_cache_bytes"):
        CheckpointStore.open(tmp_path / "s")
    monkeypatch.setenv("CKPT_DELTA_CACHE_BYTES", "0")
    with CheckpointStore.open(tmp_path / "s") as store:
        assert store.settings.delta_cache_bytes == 0 and store.keyframe_cache is None
