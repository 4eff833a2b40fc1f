"""Store level: delta=/base= on save, keyframes, lossy records, compact, diff and the CLI."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from delta_helpers import flat, make_state, states_equal, train_step

from ckptstore import CheckpointStore
from ckptstore.cli.app import main
from ckptstore.config import load_settings
from ckptstore.errors import (
    CheckpointNotFoundError,
    ConfigError,
    InvalidNameError,
    MissingBaseError,
)
from ckptstore.format.delta import DEFAULT_LOSSY_SCOPE
from ckptstore.ops.upkeep.compact import compact_checkpoint
from ckptstore.ops.upkeep.diff import diff_checkpoints


def _frozen_run(store: CheckpointStore, n: int, **kw: object) -> list[tuple[str, dict]]:
    """``n`` saves of a model whose first 4 of 6 layers are frozen."""
    state = make_state()
    out = []
    for i in range(n):
        ck = store.save("ft", i, state, **kw)  # type: ignore[arg-type]
        out.append((ck.id, state))
        state = train_step(state, trainable=lambda layer: layer >= 4, seed=i + 1)
    return out


def test_dedup_is_the_default_and_costs_only_the_trainable_part(store: CheckpointStore) -> None:
    saved = _frozen_run(store, 3)
    first = store.get(saved[0][0])
    for ckpt_id, state in saved[1:]:
        ck = store.get(ckpt_id)
        manifest = store.manifest(ck.id)
        assert manifest.kind == "delta" and manifest.delta is not None
        assert manifest.delta.mode == "dedup"
        # Chunk references are tracked per chunk: the catalog records no whole-base pin.
        assert ck.kind == "full" and ck.base_id is None
        assert ck.stored_bytes < 0.45 * first.stored_bytes
        assert states_equal(store.load(ck.id), state)


def test_full_saves_on_request(store: CheckpointStore) -> None:
    saved = _frozen_run(store, 2, delta=False)
    assert not store.manifest(saved[1][0]).referenced_checkpoints()
    state = saved[1][1]
    ck = store.save("ft", 9, state, base=None)
    assert not store.manifest(ck.id).referenced_checkpoints()
    again = store.save("other", 0, state, base=ck.id)  # explicit base, another run
    manifest = store.manifest(again.id)
    assert manifest.referenced_checkpoints() == {ck.id} and again.stored_bytes == 0
    with pytest.raises(CheckpointNotFoundError):
        store.save("ft", 10, state, base="ft@v99")
    with pytest.raises(InvalidNameError):
        store.save("ft", 10, state, delta="zip")


def test_xor_chain_with_keyframes(store: CheckpointStore) -> None:
    state = make_state()
    cks, states = [], []
    for i in range(9):
        cks.append(store.save("run", i, state, delta="xor"))
        states.append(state)
        state = train_step(state, seed=i + 1)
    depths = []
    for ck, want in zip(cks, states, strict=True):
        manifest = store.manifest(ck.id)
        assert manifest.delta is not None
        depths.append(manifest.delta.depth)
        assert states_equal(store.load(ck.id), want)
    assert depths == [0, 1, 2, 3, 0, 1, 2, 3, 0]  # keyframe_every = 4 (fixture)
    for ck, depth in zip(cks, depths, strict=True):
        keyframe = cks[cks.index(ck) - depth]
        if depth:
            assert (ck.kind, ck.base_id) == ("delta", keyframe.id)
            assert ck.stored_bytes < keyframe.stored_bytes
        else:
            assert (ck.kind, ck.base_id) == ("full", None)


def test_chain_restarts_on_mode_change_or_missing_keyframe(store: CheckpointStore) -> None:
    state = make_state()
    store.save("run", 0, state)  # dedup
    first = store.save("run", 1, train_step(state, seed=1), delta="xor")
    assert store.manifest(first.id).kind == "full"  # a dedup base cannot start a chain
    second = store.save("run", 2, train_step(state, seed=2), delta="xor")
    assert second.base_id == first.id
    shutil.rmtree(store.checkpoint_dir("run", first.id))
    with pytest.raises(MissingBaseError, match=first.id):
        store.load(second.id)  # never a partial result
    # The next save notices the keyframe is unusable and writes a new one.
    third = store.save("run", 3, train_step(state, seed=3), delta="xor")
    assert third.base_id is None and store.manifest(third.id).kind == "full"


def test_lossy_is_recorded_and_reported(store: CheckpointStore,
                                        caplog: pytest.LogCaptureFixture,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    spec = {"threshold": 1e-8, "quantize": 8}
    state = make_state()
    key = store.save("run", 0, state, delta=spec)
    new = train_step(state, seed=1)
    ck = store.save("run", 1, new, delta=spec)
    assert not key.lossy
    assert ck.lossy and ck.kind == "delta" and ck.base_id == key.id
    manifest = store.manifest(ck.id)
    assert manifest.lossy and manifest.delta is not None
    bound = manifest.delta.max_abs_error
    assert 0 < bound < 1e-4
    with caplog.at_level(logging.WARNING, logger="ckptstore.ops.reading.load"):
        out = flat(store.load(ck.id))
    assert any("approximate" in r.getMessage() for r in caplog.records)
    for key_name, tensor in flat(new).items():
        err = float((out[key_name] - tensor).abs().max())
        if key_name.endswith(("exp_avg", "exp_avg_sq")):
            assert err <= bound
        else:
            assert err == 0.0
    # The catalog holds the measured bound and the scope, not only a flag.
    record = store.get(ck.id)
    assert record.error_bound == bound
    assert record.lossy_scope == manifest.delta.scope == DEFAULT_LOSSY_SCOPE
    shown = store.show(ck.id)["checkpoint"]
    assert shown["lossy"] is True and shown["error_bound"] == bound
    assert shown["lossy_scope"] == list(DEFAULT_LOSSY_SCOPE)
    assert (store.get(key.id).error_bound, store.get(key.id).lossy_scope) == (None, ())
    root = str(store.settings.root)
    capsys.readouterr()
    assert main(["--store", root, "show", ck.ref]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"max abs error {bound}" in text and "*exp_avg_sq" in text


def test_weights_are_lossy_only_when_named(store: CheckpointStore) -> None:
    spec = {"quantize": 8, "scope": ["model/*.weight"]}
    state = make_state()
    store.save("run", 0, state, delta=spec)
    new = train_step(state, seed=1)
    ck = store.save("run", 1, new, delta=spec)
    assert ck.lossy and ck.lossy_scope == ("model/*.weight",) and ck.error_bound is not None
    out, want = flat(store.load(ck.id)), flat(new)
    approximate = set()
    for key_name, tensor in want.items():
        err = float((out[key_name] - tensor).abs().max())
        assert err <= ck.error_bound
        if err:
            approximate.add(key_name)
    # The named weights moved by quantization; biases and the moments stayed exact.
    assert approximate and all(k.startswith("model/") and k.endswith(".weight")
                               for k in approximate)


def test_a_lossy_save_with_nothing_approximate_is_not_recorded_lossy(
    store: CheckpointStore,
) -> None:
    # Every moment chunk holds a NaN, so every one is stored exactly: the plan was lossy,
    # the checkpoint is not, and the catalog says what was written.
    spec = {"quantize": 8}
    state = make_state()
    store.save("run", 0, state, delta=spec)
    new = train_step(state, seed=1)
    for moments in new["optimizer"]["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            moments[name].view(-1)[::512] = float("nan")
    ck = store.save("run", 1, new, delta=spec)
    assert (ck.lossy, ck.error_bound, ck.lossy_scope) == (False, None, ())
    assert states_equal(store.load(ck.id), new)


def test_compact_makes_a_self_contained_version(store: CheckpointStore) -> None:
    state = make_state()
    store.save("run", 0, state, delta="xor")
    new = train_step(state, seed=1)
    delta = store.save("run", 1, new, delta="xor")
    compacted = compact_checkpoint(store, delta.id)
    assert compacted.id != delta.id and (compacted.run, compacted.step) == ("run", 1)
    assert compacted.version == delta.version + 1
    assert not store.manifest(compacted.id).referenced_checkpoints()
    assert (delta.id, compacted.id, "converted-from") in store.catalog.edges(delta.id)
    assert states_equal(store.load(compacted.id), new)
    assert compact_checkpoint(store, delta.id).id == compacted.id  # idempotent
    assert compact_checkpoint(store, compacted.id).id == compacted.id  # already full
    assert [e.kind for e in store.events(compacted.id)].count("compacted") == 1


def test_diff_reports_changed_tensors(store: CheckpointStore) -> None:
    saved = _frozen_run(store, 2)
    (a_id, a), (_b_id, b) = saved
    b = dict(b)
    b["extra"] = torch.ones(3)
    c = store.save("ft", 5, b)
    report = diff_checkpoints(store, a_id, c.id)
    rows = {t.key: t for t in report.tensors}
    fa, fb = flat(a), flat(b)
    for key, row in rows.items():
        if key == "extra":
            assert row.status == "added"
            continue
        layer = int(key.split("/")[-2]) if key.startswith("optimizer") else int(
            key.split("/")[1][5])
        if layer < 4:
            assert row.status == "same" and row.elements_changed == 0
        else:
            assert row.status == "changed"
            assert row.elements_changed == int((fa[key] != fb[key]).sum())
            assert row.max_abs_change == pytest.approx(float((fa[key] - fb[key]).abs().max()))
            assert row.chunks_changed is not None and 1 <= row.chunks_changed <= row.chunks
    summary = report.summary()
    assert summary["tensors"]["same"] > 0 and summary["elements_changed"] > 0
    removed = diff_checkpoints(store, c.id, a_id)
    assert {t.key for t in removed.tensors if t.status == "removed"} == {"extra"}


def test_cli_diff_and_compact(store: CheckpointStore, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import typer

    from ckptstore.cli.app import app

    command = typer.main.get_command(app)
    state = make_state()
    store.save("run", 0, state, delta="xor")
    store.save("run", 1, train_step(state, seed=1), delta="xor")
    root = str(store.settings.root)
    store.close()

    def ckpt(*args: str) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            command.main(args=["--store", root, *args], prog_name="ckpt")
        assert done.value.code == 0
        return capsys.readouterr().out

    out = ckpt("diff", "run@v1", "run@v2")
    assert "changed" in out and "exp_avg" in out
    report = json.loads(ckpt("diff", "run@v1", "run@v2", "--json"))
    assert report["summary"]["elements_changed"] > 0
    compacted = json.loads(ckpt("compact", "run@v2", "--json"))
    assert compacted["ref"] == "run@v3" and compacted["kind"] == "full"


def test_delta_settings_in_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('keyframe_every = 5\n[delta]\nmode = "lossy"\nquantize = 4\n')
    settings = load_settings(cfg)
    assert settings.delta == {"mode": "lossy", "quantize": 4} and settings.keyframe_every == 5
    cfg.write_text('delta = false\n')
    assert load_settings(cfg).delta is False
    cfg.write_text('delta = "zip"\n')
    with pytest.raises(ConfigError, match="delta"):
        load_settings(cfg)
