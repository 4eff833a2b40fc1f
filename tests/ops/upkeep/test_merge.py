"""Merging checkpoints: values against a float64 reference, dtypes, what is copied, keys,
lineage, bad input that leaves nothing behind, and the memory bound.

Real components throughout: stores on tmp_path (SQLite catalog, hot tier), real saves. The
memory bound is the kernel's RSS high-water mark in a fresh process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.errors import CheckpointNotFoundError, IntegrityError, InvalidNameError
from ckptstore.format.constants import chunk_rel
from ckptstore.records import CheckpointState

RUNS = ("site-a", "site-b", "site-c")
#: The summation error a float32 sum of up to three inputs may add (auto sums float32
#: tensors in float32): about four float32 roundings of the terms' magnitudes.
F32_SUM_EPS = 4 * 2.0**-24
#: The same for a float64 sum (float64 accumulation, or float64 tensors).
F64_SUM_EPS = 3 * 2.0**-53


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    """Small chunks: tensors span several chunks and small ones share packed chunks."""
    opened = CheckpointStore.open(tmp_path / "store", chunk_bytes=64 * 1024)
    try:
        yield opened
    finally:
        opened.close()


def _state(seed: int, *, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model: dict[str, Any] = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        big = torch.randn(96, 300, generator=g)  # 112 KiB in fp32: two chunks
        model[f"{name}.w"] = big.to(dtype) if not dtype.is_complex else torch.complex(
            big, torch.randn(96, 300, generator=g)).to(dtype)
        model[f"{name}.b"] = torch.randn(37, generator=g).to(dtype)  # packed with others
    return {
        "model": model,
        "optimizer": {"state": {0: {"step": torch.tensor(100 + seed),
                                    "exp_avg": torch.randn(50, generator=g)}},
                      "param_groups": [{"lr": 0.1 * (seed + 1), "betas": (0.9, 0.99)}]},
        "counts": torch.arange(10, dtype=torch.int64) * (seed + 1),
        "mask": torch.rand(33, generator=g) > 0.5,
        "site": f"site-{seed}",
        "epoch": seed,
        "none": None,
    }


def _save_inputs(store: CheckpointStore, states: list[dict[str, Any]],
                 samples: tuple[float, ...] = (10.0, 30.0, 60.0)) -> list[str]:
    refs = []
    for run, state, n in zip(RUNS, states, samples, strict=False):
        refs.append(store.save(run, 1, state, metrics={"samples": n}).ref)
    return refs


class Reference:
    """``sum(w_i * x_i)`` in float64 (complex128), computed by numpy term by term, and the
    sum of the terms' magnitudes, which bounds any summation's rounding error."""

    def __init__(self, tensors: list[torch.Tensor], weights: list[float]) -> None:
        total: np.ndarray[Any, Any] | None = None
        scale: np.ndarray[Any, Any] | None = None
        for t, w in zip(tensors, weights, strict=True):
            wide = t.to(torch.complex128 if t.dtype.is_complex else torch.float64).numpy()
            term = wide * w
            total = term if total is None else total + term
            scale = np.abs(term) if scale is None else scale + np.abs(term)
        assert total is not None and scale is not None
        self.total = total
        self.scale = scale

    def part(self, name: str) -> Reference:
        """The real or imaginary part of a complex reference."""
        out = Reference.__new__(Reference)
        out.total = getattr(self.total, name)
        out.scale = self.scale
        return out


def _ulp(values: np.ndarray[Any, Any], dtype: torch.dtype) -> np.ndarray[Any, Any]:
    """The spacing of ``dtype`` at each value (its unit in the last place there)."""
    info = torch.finfo(dtype)
    mag = np.maximum(np.abs(values), info.smallest_normal)
    return np.exp2(np.floor(np.log2(mag))) * info.eps


def _assert_rounded_once(got: torch.Tensor, ref: Reference, accumulation_eps: float) -> None:
    """Every value is the reference rounded once to ``got``'s dtype, up to the summation's own
    error: within half a unit in the last place, plus ``accumulation_eps`` times the sum of
    the terms' magnitudes (the classic bound of a floating-point sum)."""
    values = got.to(torch.float64).numpy()
    slack = 0.5 * _ulp(ref.total, got.dtype) + accumulation_eps * ref.scale + 1e-300
    worst = np.max(np.abs(values - ref.total) / slack)
    assert worst <= 1.0, f"{got.dtype}: off by {worst:.3g} of the allowed error"


# --------------------------------------------------------------------------- values
@pytest.mark.parametrize("accumulate", ["auto", "float32", "float64"])
def test_mean_and_weighted_match_a_float64_reference(
    store: CheckpointStore, accumulate: str
) -> None:
    states = [_state(i) for i in range(3)]
    refs = _save_inputs(store, states)
    mean = store.merge(refs, run="soup", step=1, accumulate=accumulate)
    weighted = store.merge(refs, run="soup", step=2, weights=[2.0, 1.0, 1.0],
                           accumulate=accumulate)
    # float64 sums are exact up to float64 rounding; float32 sums (auto's for these float32
    # tensors) carry ~4 float32 roundings.
    eps = F64_SUM_EPS if accumulate == "float64" else F32_SUM_EPS
    for ck, weights in ((mean, [1 / 3] * 3), (weighted, [0.5, 0.25, 0.25])):
        got = store.load(ck.ref)
        for key in ("float32.w", "float32.b"):
            expected = Reference([s["model"][key] for s in states], weights)
            assert got["model"][key].dtype == torch.float32
            _assert_rounded_once(got["model"][key], expected, eps)
        expected = Reference([s["optimizer"]["state"][0]["exp_avg"] for s in states], weights)
        _assert_rounded_once(got["optimizer"]["state"][0]["exp_avg"], expected, eps)


def test_float32_sums_stay_within_their_error_bound(store: CheckpointStore) -> None:
    """auto sums float32 tensors in float32: within ``gamma(n + 1)`` of ``sum(w_i * |x_i|)``.

    Each term ``w_i * x_i`` carries the weight's rounding to float32 and the product's, and
    each of the ``n - 1`` additions one more: at most ``n + 1`` roundings of ``u = 2**-24``,
    whose relative effect is bounded by ``gamma(k) = k*u / (1 - k*u)`` (Higham, Accuracy and
    Stability of Numerical Algorithms, 3.1). The inputs are built to be hard: magnitudes
    over 24 decades, and pairs of inputs that nearly cancel, so the sum is far smaller
    than its terms and a float32 sum's relative error is large where float64's is not.
    """
    n = 5
    g = torch.Generator().manual_seed(7)
    size = 30_000  # two 64 KiB chunks and a part, in float32
    magnitude = torch.pow(10.0, torch.empty(size).uniform_(-12, 12, generator=g))
    base = torch.randn(size, generator=g, dtype=torch.float64) * magnitude
    states = []
    for i in range(n):
        sign = 1.0 if i % 2 == 0 else -1.0
        wobble = 1 + 1e-6 * torch.randn(size, generator=g, dtype=torch.float64)
        states.append({"w": (sign * base * wobble).to(torch.float32)})
    given = [2.0, 3.0, 1.5, 1.0, 0.5]  # odd inputs (negated) weigh what even ones do
    refs = [store.save(f"in-{i}", 1, state).ref for i, state in enumerate(states)]
    auto = store.load(store.merge(refs, run="soup", step=1, weights=given).ref)["w"]
    forced = store.load(store.merge(refs, run="soup", step=2, weights=given,
                                    accumulate="float32").ref)["w"]
    assert auto.dtype == torch.float32
    assert torch.equal(auto, forced)  # auto is float32 accumulation for float32 tensors

    weights = [w / math.fsum(given) for w in given]
    # Exactly the float32 sum term by term, in input order (each input added once read).
    term_by_term = states[0]["w"].numpy() * np.float32(weights[0])
    for state, w in zip(states[1:], weights[1:], strict=True):
        term_by_term = term_by_term + state["w"].numpy() * np.float32(w)
    assert np.array_equal(auto.numpy(), term_by_term)
    ref = Reference([s["w"] for s in states], weights)
    k, u = n + 1, 2.0**-24
    bound = k * u / (1 - k * u) * ref.scale
    error = np.abs(auto.to(torch.float64).numpy() - ref.total)
    assert np.all(error <= bound), f"worst {np.max(error / bound):.3g} of the bound"
    # The cancellation is real: the sum is far below its terms' magnitudes somewhere, so
    # the bound is relative to those terms, not to the result. (Multiplied, not divided:
    # where the sum is exactly 0 the ratio would overflow.)
    assert np.any(ref.scale > 1e3 * np.abs(ref.total))


def test_every_floating_dtype_keeps_its_dtype_and_is_rounded_once(
    store: CheckpointStore,
) -> None:
    dtypes = (torch.bfloat16, torch.float16, torch.float64, torch.complex64,
              torch.float8_e4m3fn, torch.float8_e5m2)
    states = [_state(i, dtypes=dtypes) for i in range(3)]
    refs = _save_inputs(store, states)
    ck = store.merge(refs, run="soup", step=1, weights=[1.0, 2.0, 5.0])
    got = store.load(ck.ref)["model"]
    weights = [1 / 8, 2 / 8, 5 / 8]
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for key in (f"{name}.w", f"{name}.b"):
            assert got[key].dtype == dtype, key
            expected = Reference([s["model"][key] for s in states], weights)
            if dtype.is_complex:
                for part in ("real", "imag"):
                    _assert_rounded_once(getattr(got[key], part), expected.part(part),
                                         F64_SUM_EPS)
                continue
            # 16- and 8-bit floats are summed in float32 (auto): three float32 roundings.
            eps = F64_SUM_EPS if dtype == torch.float64 else F32_SUM_EPS
            _assert_rounded_once(got[key], expected, eps)


def test_integers_bools_and_plain_values_come_from_the_first_input(
    store: CheckpointStore,
) -> None:
    states = [_state(i) for i in range(3)]
    tied = states[0]["model"]["float32.w"]
    for state in states:  # a tied weight: the same tensor at two paths
        state["model"]["head"] = state["model"]["float32.w"]
    refs = _save_inputs(store, states)
    got = store.load(store.merge(refs[::-1], run="soup", step=1).ref)
    first = states[2]  # the inputs were given last run first
    assert torch.equal(got["counts"], first["counts"]) and got["counts"].dtype == torch.int64
    assert torch.equal(got["mask"], first["mask"]) and got["mask"].dtype == torch.bool
    assert torch.equal(got["optimizer"]["state"][0]["step"], first["optimizer"]["state"][0]["step"])
    assert got["optimizer"]["param_groups"] == first["optimizer"]["param_groups"]
    assert (got["site"], got["epoch"], got["none"]) == ("site-2", 2, None)
    assert got["model"]["head"] is got["model"]["float32.w"]  # still tied
    assert not torch.equal(got["model"]["float32.w"], tied)  # averaged, not copied


def test_keys_select_what_is_merged_and_kept(store: CheckpointStore) -> None:
    states = [_state(i) for i in range(3)]
    # The optimizers differ in shape: only a selection that leaves them out can merge.
    states[1]["optimizer"]["state"][0]["exp_avg"] = torch.zeros(51)
    refs = _save_inputs(store, states)
    with pytest.raises(InvalidNameError, match=r"exp_avg has shape \[50\] in site-a@v1 but "
                                               r"\[51\] in site-b@v1"):
        store.merge(refs, run="soup", step=1)
    ck = store.merge(refs, run="soup", step=1, keys=["model/*"])
    got = store.load(ck.ref)
    assert set(got) == {"model"} and set(got["model"]) == {"float32.w", "float32.b"}
    expected = Reference([s["model"]["float32.w"] for s in states], [1 / 3] * 3)
    _assert_rounded_once(got["model"]["float32.w"], expected, F32_SUM_EPS)
    with pytest.raises(InvalidNameError, match="match nothing"):
        store.merge(refs, run="soup", step=2, keys=["encoder/*"])


def test_inputs_stored_as_deltas_merge_like_full_ones(store: CheckpointStore) -> None:
    base = _state(0)
    store.save("chain", 0, base, delta="xor")
    later = _state(0)
    later["model"]["float32.b"] = later["model"]["float32.b"] + 1
    store.save("chain", 1, later, delta="xor")  # shares most chunks with step 0
    other = store.save("site-b", 1, _state(1))
    chain = store.get("chain@1")
    assert store.manifest(chain.ref).referenced_checkpoints()
    got = store.load(store.merge([chain.ref, other.ref], run="soup", step=1).ref)
    expected = Reference([later["model"]["float32.b"], _state(1)["model"]["float32.b"]],
                          [0.5, 0.5])
    _assert_rounded_once(got["model"]["float32.b"], expected, F32_SUM_EPS)


# --------------------------------------------------------------------------- lineage
def test_lineage_records_every_input_with_its_weight(store: CheckpointStore) -> None:
    states = [_state(i) for i in range(3)]
    refs = _save_inputs(store, states)
    tuned = store.save("site-a", 2, states[0], parent=refs[0], metrics={"samples": 10.0})
    ck = store.merge([tuned.ref, *refs[1:]], run="global", step=5,
                     weights_from_metric="samples", metrics={"round": 1.0}, tags=["fedavg"])
    assert (ck.state, ck.parent_id, ck.metrics, ck.tags) == (
        CheckpointState.COMMITTED, None, {"round": 1.0}, ("fedavg",))
    ids = [store.get(r).id for r in (tuned.ref, *refs[1:])]
    inputs = store.catalog.merge_inputs(ck.id)
    assert [(i.src, i.position) for i in inputs] == [(ids[0], 0), (ids[1], 1), (ids[2], 2)]
    assert [i.weight for i in inputs] == pytest.approx([0.1, 0.3, 0.6])
    # The ancestry is a DAG: every input, and the tuned input's own parent.
    graph = store.catalog.lineage_graph(ck.ref)
    assert {n.ref for n in graph.nodes} == {"site-a@v2", "site-a@v1", "site-b@v1", "site-c@v1"}
    assert {(link.kind, link.dst) for link in graph.links} == {
        ("merged-from", ck.id), ("parent", tuned.id)}
    down = store.catalog.lineage_graph(refs[1], descendants=True)
    assert [n.id for n in down.nodes] == [ck.id]
    (event,) = store.events(ck.id, kind="merged")
    assert event.detail["method"] == "weighted"
    assert event.detail["weights_from_metric"] == "samples"
    assert event.detail["given"] == [10.0, 30.0, 60.0]
    assert [i["ref"] for i in event.detail["inputs"]] == ["site-a@v2", "site-b@v1", "site-c@v1"]
    shown = store.show(ck.ref)["merge"]
    assert [i["ref"] for i in shown["inputs"]] == ["site-a@v2", "site-b@v1", "site-c@v1"]
    # An ordinary checkpoint: it verifies, and archives like any other.
    assert store.verify(ck.ref) == []
    # Asked again, the same merge is the same checkpoint; other weights make a new one.
    again = store.merge([tuned.ref, *refs[1:]], run="global", step=5,
                        weights_from_metric="samples")
    assert again.id == ck.id
    other = store.merge([tuned.ref, *refs[1:]], run="global", step=5)
    assert other.id != ck.id and other.version == 2


# --------------------------------------------------------------------------- bad input
def _nothing_new(store: CheckpointStore, before: set[str]) -> None:
    rows = store.list(state=None)
    assert {ck.id for ck in rows} == before, "a row was left behind"
    assert not (store.hot / "soup").exists() or not any((store.hot / "soup").iterdir())
    assert store.catalog.leases() == []


Bad = Callable[[CheckpointStore, list[str]], Any]

_BAD: list[tuple[str, Bad, type[Exception], str]] = [
    ("single input", lambda s, r: s.merge(r[:1], run="soup", step=1),
     InvalidNameError, "at least two"),
    ("same checkpoint twice", lambda s, r: s.merge([r[0], s.get(r[0]).id], run="soup", step=1),
     InvalidNameError, "same checkpoint"),
    ("missing ref", lambda s, r: s.merge([r[0], "site-z@latest"], run="soup", step=1),
     CheckpointNotFoundError, "site-z"),
    ("nan weight", lambda s, r: s.merge(r, run="soup", step=1, weights=[1, math.nan, 1]),
     InvalidNameError, "finite"),
    ("inf weight", lambda s, r: s.merge(r, run="soup", step=1, weights=[1, math.inf, 1]),
     InvalidNameError, "finite"),
    ("negative weight", lambda s, r: s.merge(r, run="soup", step=1, weights=[2, -1, 1]),
     InvalidNameError, "negative"),
    ("zero sum", lambda s, r: s.merge(r, run="soup", step=1, weights=[0, 0, 0]),
     InvalidNameError, "positive"),
    ("weight count", lambda s, r: s.merge(r, run="soup", step=1, weights=[1, 1]),
     InvalidNameError, "2 weights for 3 inputs"),
    ("weights with mean", lambda s, r: s.merge(r, run="soup", step=1, method="mean",
                                               weights=[1, 1, 1]),
     InvalidNameError, "weighted"),
    ("unknown method", lambda s, r: s.merge(r, run="soup", step=1, method="median"),
     InvalidNameError, "median"),
    ("unknown accumulation", lambda s, r: s.merge(r, run="soup", step=1, accumulate="int8"),
     InvalidNameError, "int8"),
    ("missing metric", lambda s, r: s.merge(r, run="soup", step=1, weights_from_metric="loss"),
     InvalidNameError, "no metric 'loss'"),
    ("bad run name", lambda s, r: s.merge(r, run="../x", step=1), InvalidNameError, "run"),
]


@pytest.mark.parametrize("case", _BAD, ids=[c[0] for c in _BAD])
def test_bad_requests_fail_before_anything_is_written(
    store: CheckpointStore, case: tuple[str, Bad, type[Exception], str]
) -> None:
    _, call, error, words = case
    refs = _save_inputs(store, [_state(i) for i in range(3)])
    before = {ck.id for ck in store.list(state=None)}
    with pytest.raises(error, match=words):
        call(store, refs)
    _nothing_new(store, before)


def _variant(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    state = _state(1)
    change(state)
    return state


_DISAGREE: list[tuple[str, dict[str, Any], str]] = [
    ("shape", _variant(lambda s: s["model"].update({"float32.b": torch.zeros(38)})),
     r"tensor model/float32\.b has shape \[37\] in site-a@v1 but \[38\] in site-b@v1"),
    ("dtype", _variant(lambda s: s["model"].update({"float32.b": torch.zeros(37).double()})),
     r"tensor model/float32\.b is float32 in site-a@v1 but float64 in site-b@v1"),
    ("missing key", _variant(lambda s: s["model"].pop("float32.b")),
     r"tensor model/float32\.b is in site-a@v1 but not in site-b@v1"),
    ("extra key", _variant(lambda s: s["model"].update({"extra": torch.zeros(3)})),
     r"tensor model/extra is in site-b@v1 but not in site-a@v1"),
    ("not averageable", _variant(lambda s: None), "float4_e2m1fn_x2"),
]


@pytest.mark.parametrize("case", _DISAGREE, ids=[c[0] for c in _DISAGREE])
def test_inputs_that_disagree_are_refused_naming_the_first_key(
    store: CheckpointStore, case: tuple[str, dict[str, Any], str]
) -> None:
    name, second, words = case
    first = _state(0)
    if name == "not averageable":
        packed = torch.zeros(8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        first["model"]["fp4"] = second["model"]["fp4"] = packed
    a = store.save("site-a", 1, first)
    b = store.save("site-b", 1, second)
    before = {ck.id for ck in store.list(state=None)}
    with pytest.raises(InvalidNameError, match=words):
        store.merge([a.ref, b.ref], run="soup", step=1)
    _nothing_new(store, before)


def test_a_damaged_input_chunk_fails_naming_it_and_commits_nothing(
    store: CheckpointStore,
) -> None:
    refs = _save_inputs(store, [_state(i) for i in range(3)])
    victim = store.get(refs[1])
    manifest = store.manifest(victim.ref)
    entry = manifest.tensors["model/float32.w"]
    path = store.checkpoint_dir(victim.run, victim.id) / chunk_rel(entry.array, entry.chunk_start)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01  # one bit: the crc32c trailer no longer matches
    path.write_bytes(bytes(data))
    before = {ck.id for ck in store.list(state=None)}
    with pytest.raises(IntegrityError, match=str(path)):
        store.merge(refs, run="soup", step=1)
    rows = [ck for ck in store.list(state=None) if ck.id not in before]
    # What a failed save leaves: its row marked FAILED (never PENDING), no directory.
    assert [ck.state for ck in rows] == [CheckpointState.FAILED]
    assert not store.checkpoint_dir("soup", rows[0].id).exists()
    assert store.catalog.merge_inputs(rows[0].id) == []
    assert store.catalog.leases() == []


# --------------------------------------------------------------------------- memory
_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from ckptstore import CheckpointStore

    def status(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise SystemExit("no " + field)

    store = CheckpointStore.open(sys.argv[1], chunk_bytes=2 * 2**20)
    refs = sys.argv[2:]
    for ref in refs:
        store.manifest(ref)
    # Warm up imports and first-call set-up on a merge of the small tensors only.
    store.merge(refs, run="warm", step=0, keys=["small/*"])
    base = status("VmRSS")
    try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        raise SystemExit("no-reset")
    store.merge(refs, run="soup", step=1)
    print(json.dumps({"extra": status("VmHWM") - base}))
    """
)


def test_merge_memory_is_bounded_by_the_largest_tensor_not_the_state(tmp_path: Path) -> None:
    """Three ~60 MB inputs whose largest tensor is 32 MiB: the merge adds less than that
    tensor times (inputs + 1) to the process's peak RSS (whole states would be 180 MB). With
    2 MiB chunks it holds at most 8 threads x 3 inputs x 2 MiB of buffers."""
    largest = 32 * 2**20
    with CheckpointStore.open(tmp_path / "store", chunk_bytes=2 * 2**20) as store:
        refs = []
        for i, run in enumerate(RUNS):
            g = torch.Generator().manual_seed(i)
            state = {"big": {f"t{k}": torch.randn(largest // 4 >> k, generator=g)
                             for k in range(4)},
                     "small": {f"s{k}": torch.randn(1000, generator=g) for k in range(50)}}
            refs.append(store.save(run, 1, state, codec="none").ref)
            total = sum(t.nbytes for part in state.values() for t in part.values())
        del state
    assert 55 * 2**20 < total < 70 * 2**20
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "store"), *refs],
        capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0 and "no-reset" in proc.stderr:
        pytest.skip("cannot reset VmHWM on this kernel")
    assert proc.returncode == 0, proc.stderr[-2000:]
    extra = json.loads(proc.stdout.strip().splitlines()[-1])["extra"]
    bound = largest * (len(refs) + 1)
    assert extra < bound, f"{extra >> 20} MiB extra; bound {bound >> 20} MiB"
    with CheckpointStore.open(tmp_path / "store") as store:
        merged = store.load("soup@latest", keys=["big/t3"])["big"]["t3"]
        inputs = [store.load(r, keys=["big/t3"])["big"]["t3"] for r in refs]
    _assert_rounded_once(merged, Reference(inputs, [1 / 3] * 3), F32_SUM_EPS)
