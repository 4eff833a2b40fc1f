"""Format level: XOR and quantized chunk encodings, their manifest records and validation."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from delta_helpers import CHUNK, bits_equal, flat, make_state, states_equal, train_step

from ckptstore.errors import IntegrityError, InvalidNameError, MissingBaseError
from ckptstore.format import (
    BaseRef,
    DeltaSpec,
    Manifest,
    chunk_files,
    parse_delta,
    read_checkpoint,
    read_manifest,
    verify_checkpoint,
    write_checkpoint,
)
from ckptstore.format.layout import LOSSY_SUFFIX, plan_layout


def _write(root: Path, state: Any, **kw: Any) -> tuple[Path, Manifest]:
    ckpt_id = str(uuid.uuid4())
    directory = root / ckpt_id
    kw.setdefault("chunk_bytes", CHUNK)
    write_checkpoint(directory, state, ckpt_id=ckpt_id, run="r", step=0, **kw)
    return directory, read_manifest(directory)


def _chain(tmp_path: Path, spec: DeltaSpec, steps: int = 3) -> list[tuple[Path, Manifest, Any]]:
    """A keyframe plus ``steps`` deltas against it, each after one training step."""
    state = make_state()
    key_dir, key = _write(tmp_path, state, delta=spec)
    out = [(key_dir, key, state)]
    for i in range(1, steps + 1):
        state = train_step(state, seed=i)
        d, m = _write(tmp_path, state, delta=spec, base=BaseRef(key, key_dir), depth=i)
        out.append((d, m, state))
    return out


def _locate(chain: list[tuple[Path, Manifest, Any]]) -> Any:
    return {m.id: d for d, m, _ in chain}.__getitem__


def test_xor_chain_is_bit_exact_and_smaller(tmp_path: Path) -> None:
    chain = _chain(tmp_path, DeltaSpec("xor"))
    _key_dir, key, _ = chain[0]
    assert key.kind == "full" and key.delta is not None and key.delta.depth == 0
    for depth, (d, m, state) in enumerate(chain[1:], start=1):
        assert m.kind == "delta" and m.base_id == key.id
        assert m.delta is not None and m.delta.depth == depth and not m.lossy
        encs = {c.enc for a in m.arrays.values() for c in a.chunks}
        assert "xor" in encs
        # Every delta chunk needs the keyframe's chunk, never another delta's.
        assert m.referenced_checkpoints() == {key.id}
        assert m.stored_bytes < key.stored_bytes
        out = read_checkpoint(d, m, locate=_locate(chain))
        assert states_equal(out, state)
        assert verify_checkpoint(d, m, locate=_locate(chain)) == []


@pytest.mark.parametrize("bits", [8, 4])
def test_lossy_moments_within_recorded_error_and_weights_exact(tmp_path: Path, bits: int) -> None:
    spec = parse_delta({"threshold": 1e-7, "quantize": bits})
    assert spec is not None and spec.lossy
    chain = _chain(tmp_path, spec)
    for d, m, state in chain[1:]:
        assert m.lossy and m.delta is not None
        assert m.delta.quantize == bits and m.delta.scope == spec.scope
        assert m.delta.lossy_elements == 6 * 2 * 64 * 64  # exp_avg + exp_avg_sq of 6 layers
        out = flat(read_checkpoint(d, m, locate=_locate(chain)))
        want = flat(state)
        worst = 0.0
        for key, tensor in want.items():
            if key.endswith(("exp_avg", "exp_avg_sq")):
                worst = max(worst, float((out[key] - tensor).abs().max()))
            else:
                assert bits_equal(out[key], tensor), key  # weights, biases, steps: lossless
        # The recorded bound is the true maximum error, measured on what a load returns.
        assert worst == pytest.approx(m.delta.max_abs_error, rel=1e-6, abs=1e-12)
        assert 0 < m.delta.mean_abs_error <= m.delta.max_abs_error
        assert verify_checkpoint(d, m, locate=_locate(chain)) == []
    # 4-bit deltas are smaller, 8-bit ones more precise; both well below the keyframe.
    key = chain[0][1]
    assert chain[-1][1].stored_bytes < 0.75 * key.stored_bytes


def test_threshold_only_drops_small_changes_exactly(tmp_path: Path) -> None:
    spec = parse_delta({"threshold": 1e-4})
    assert spec is not None and spec.quantize is None
    chain = _chain(tmp_path, spec, steps=1)
    (_, _key, base_state), (d, m, state) = chain
    out = flat(read_checkpoint(d, m, locate=_locate(chain)))
    for name in ("exp_avg", "exp_avg_sq"):
        key_t = f"optimizer/state/0/{name}"
        new, old, got = flat(state)[key_t], flat(base_state)[key_t], out[key_t]
        small = (new - old).abs() < 1e-4
        assert bits_equal(got[small], old[small])  # dropped: the keyframe's exact value
        assert bits_equal(got[~small], new[~small])  # kept: exact
    assert m.delta is not None and m.delta.max_abs_error < 1e-4


@pytest.mark.parametrize("quantize", [8, None])
def test_lossy_chunk_with_every_change_dropped_references_its_base(
    tmp_path: Path, quantize: int | None
) -> None:
    # A threshold above every moment change leaves the reconstruction equal to the keyframe:
    # nothing is written for those chunks, yet the error they carry is still recorded.
    spec = parse_delta({"threshold": 1.0, "quantize": quantize} if quantize else
                       {"threshold": 1.0})
    assert spec is not None
    chain = _chain(tmp_path, spec, steps=1)
    (_, key, base_state), (d, m, state) = chain
    lossy = [a for name, a in m.arrays.items() if name.endswith(LOSSY_SUFFIX)]
    assert lossy and all(c.src == key.id for a in lossy for c in a.chunks)
    assert m.delta is not None and m.delta.max_abs_error > 0
    out = flat(read_checkpoint(d, m, locate=_locate(chain)))
    key_t = "optimizer/state/0/exp_avg"
    assert bits_equal(out[key_t], flat(base_state)[key_t])
    err = (out[key_t].double() - flat(state)[key_t].double()).abs().max().item()
    assert 0 < err <= m.delta.max_abs_error
    assert verify_checkpoint(d, m, locate=_locate(chain)) == []


def test_lossy_chains_do_not_accumulate_error(tmp_path: Path) -> None:
    chain = _chain(tmp_path, DeltaSpec("lossy", quantize=4), steps=5)
    errors = [m.delta.max_abs_error for _, m, _ in chain[1:] if m.delta is not None]
    # Each delta is quantized against the exact keyframe: its error is its own quantization
    # error, not a sum over the chain (moments move ~equally per step here).
    assert max(errors) < 3 * min(errors)


def test_non_finite_values_are_stored_losslessly(tmp_path: Path) -> None:
    state = make_state()
    key_dir, key = _write(tmp_path, state, delta=DeltaSpec("lossy", quantize=8))
    new = train_step(state, seed=1)
    new["optimizer"]["state"][0]["exp_avg"][0, 0] = float("nan")
    new["optimizer"]["state"][1]["exp_avg"][3, 3] = float("inf")
    d, m = _write(tmp_path, new, delta=DeltaSpec("lossy", quantize=8),
                  base=BaseRef(key, key_dir), depth=1)
    out = flat(read_checkpoint(d, m, locate={key.id: key_dir}.__getitem__))
    for i in (0, 1):
        k = f"optimizer/state/{i}/exp_avg"
        assert bits_equal(out[k], flat(new)[k])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_lossy_other_float_dtypes(tmp_path: Path, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(5000, generator=g).to(dtype),
           "opt": {"exp_avg": torch.randn(5000, generator=g).to(dtype)}}
    new = {"w": old["w"] + 1, "opt": {"exp_avg": old["opt"]["exp_avg"] * 1.01}}
    spec = DeltaSpec("lossy", quantize=8)
    kd, km = _write(tmp_path, old, delta=spec, chunk_bytes=4096)
    d, m = _write(tmp_path, new, delta=spec, chunk_bytes=4096, base=BaseRef(km, kd), depth=1)
    out = read_checkpoint(d, m, locate={km.id: kd}.__getitem__)
    assert bits_equal(out["w"], new["w"])
    err = float((out["opt"]["exp_avg"].double() - new["opt"]["exp_avg"].double()).abs().max())
    assert m.delta is not None and err == pytest.approx(m.delta.max_abs_error, rel=1e-6)
    assert verify_checkpoint(d, m, locate={km.id: kd}.__getitem__) == []


def test_xor_of_integer_and_odd_sized_arrays(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    old = {"ids": torch.randint(0, 1 << 40, (3001,), generator=g), "mask": torch.rand(999) > 0.5,
           "h": torch.randn(2047, generator=g).half()}
    new = {"ids": old["ids"] + 1, "mask": ~old["mask"], "h": old["h"] * 2}
    spec = DeltaSpec("xor")
    kd, km = _write(tmp_path, old, delta=spec, chunk_bytes=1000)
    d, m = _write(tmp_path, new, delta=spec, chunk_bytes=1000, base=BaseRef(km, kd), depth=1)
    out = read_checkpoint(d, m, locate={km.id: kd}.__getitem__)
    assert states_equal(out, new)


def test_incompressible_changes_are_written_whole(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    # Unrelated random bits: their XOR does not compress.
    old = {"w": torch.randint(-(2**31), 2**31, (20000,), generator=g, dtype=torch.int32)}
    new = {"w": torch.randint(-(2**31), 2**31, (20000,), generator=g, dtype=torch.int32)}
    kd, km = _write(tmp_path, old, delta=DeltaSpec("xor"), codec="none")
    d, m = _write(tmp_path, new, delta=DeltaSpec("xor"), codec="none", base=BaseRef(km, kd),
                  depth=1)
    assert m.kind == "full" and m.base_id is None
    assert m.delta is not None and m.delta.depth == 0  # effectively a new keyframe
    assert states_equal(read_checkpoint(d, m), new)


def test_missing_or_damaged_keyframe_is_an_error_never_partial(tmp_path: Path) -> None:
    chain = _chain(tmp_path, DeltaSpec("xor"), steps=1)
    (key_dir, key, _), (d, m, _) = chain
    delta_chunk = next((a, c) for a in m.arrays.values() for c in a.chunks if c.enc == "xor")
    base_file = key_dir / delta_chunk[0].chunk_path(delta_chunk[1].i)
    data = bytearray(base_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    base_file.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="crc32c"):
        read_checkpoint(d, m, locate=_locate(chain))
    problems = verify_checkpoint(d, m, locate=_locate(chain))
    assert problems and any("crc32c" in p for p in problems)
    shutil.rmtree(key_dir)
    with pytest.raises(MissingBaseError, match=key.id):
        read_checkpoint(d, m, locate=_locate(chain))


def test_base_chunks_are_read_without_the_base_marker(tmp_path: Path) -> None:
    """A pruned base keeps only chunk files; readers check them against their own manifest."""
    chain = _chain(tmp_path, DeltaSpec("xor"), steps=1)
    (key_dir, _key, _), (d, m, state) = chain
    (key_dir / "COMMITTED").unlink()
    (key_dir / "manifest.json").unlink()
    assert states_equal(read_checkpoint(d, m, locate=_locate(chain)), state)


def test_manifest_round_trip_and_hostile_delta_fields(tmp_path: Path) -> None:
    chain = _chain(tmp_path, DeltaSpec("lossy", quantize=8), steps=1)
    _, m, _ = chain[1]
    assert Manifest.from_json(m.to_json()) == m
    doc = json.loads(m.to_json())
    entry = next(c for a in doc["arrays"].values() for c in a["chunks"] if "enc" in c)

    def broken(change: Any) -> bytes:
        bad = json.loads(m.to_json())
        target = next(c for a in bad["arrays"].values() for c in a["chunks"]
                      if c["i"] == entry["i"] and "enc" in c)
        change(bad, target)
        return json.dumps(bad).encode()

    cases = [
        lambda d, c: c.update(enc="q16"),
        lambda d, c: c.update(base=None),
        lambda d, c: c["base"].update(src=d["id"]),
        lambda d, c: c["base"].update(extra=1),
        lambda d, c: c.pop("base"),
        lambda d, c: d["delta"].update(mode="magic"),
        lambda d, c: d["delta"].update(quantize=3),
        lambda d, c: d["delta"].update(max_abs_error=-1.0),
        lambda d, c: d["delta"].pop("depth"),
    ]
    for change in cases:
        with pytest.raises(IntegrityError):
            Manifest.from_json(broken(change))


def test_full_manifests_keep_their_bytes(tmp_path: Path) -> None:
    """Checkpoints written without a delta mode have no delta field (old digests hold)."""
    _, m = _write(tmp_path, make_state())
    doc = json.loads(m.to_json())
    assert "delta" not in doc
    assert all("enc" not in c for a in doc["arrays"].values() for c in a["chunks"])


def test_layout_groups_small_and_lossy_tensors() -> None:
    state = flat(make_state())
    plain = plan_layout(state, CHUNK)
    assert list(plain) == ["float32", "float32_small"]
    assert all(m.numel * 4 * 16 < CHUNK for m in plain["float32_small"].members)
    lossy = plan_layout(state, CHUNK, lossy_scope=DeltaSpec("lossy").scope)
    assert list(lossy) == ["float32", "float32_small", "float32_lossy"]
    assert {m.key.rsplit("/", 1)[-1] for m in lossy["float32_lossy"].members} == {
        "exp_avg", "exp_avg_sq"}
    # A small state stays one array per dtype.
    assert list(plan_layout({"a": torch.ones(3), "b": torch.ones(1000)}, CHUNK)) == ["float32"]


def test_chunk_files_and_refs_include_delta_bases(tmp_path: Path) -> None:
    chain = _chain(tmp_path, DeltaSpec("xor"), steps=1)
    (_, key, _), (d, m, _) = chain
    refs = m.chunk_refs()
    assert any(owner == key.id for owner, _, _ in refs)
    own = [f for f in chunk_files(m) if "/c/" in f]
    encoded = [a.chunk_path(c.i) for a in m.arrays.values() for c in a.chunks
               if c.src is None]
    assert sorted(own) == sorted(encoded)
    assert all((d / f).is_file() for f in chunk_files(m))


@pytest.mark.parametrize(
    "value",
    ["zip", {"mode": "lossy", "quantize": 16}, {"threshold": -1}, {"scope": []},
     {"mode": "xor", "quantize": 8}, {"unknown": 1}, {"block": 7}, 3.5,
     {"keyframe_every": 0}],
)
def test_parse_delta_rejects_bad_settings(value: Any) -> None:
    with pytest.raises(InvalidNameError):
        parse_delta(value)


def test_parse_delta_accepts_compression_config_and_shorthands() -> None:
    assert parse_delta(False) is None and parse_delta("full") is None
    assert parse_delta(True) == DeltaSpec("dedup") == parse_delta("dedup")
    table = parse_delta({"type": "diff", "threshold": 1e-4, "quantize": 8})
    assert table is not None and (table.mode, table.threshold, table.quantize) == ("lossy", 1e-4, 8)
    assert parse_delta({"type": "diff"}) == DeltaSpec("xor")
    scoped = parse_delta({"quantize": 4, "scope": ["optimizer/*", "model/*"]})
    assert scoped is not None and scoped.scope == ("optimizer/*", "model/*")
