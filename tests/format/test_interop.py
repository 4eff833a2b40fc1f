"""Exact or loud: foreign Zarr v3 readers get the saved bytes of every array, or refuse it.

Every checkpoint kind is saved through a real store: full (every codec), dedup, xor and lossy
deltas, DCP, their plain copies on a local warm tier (which reference the base's chunks) and
re-encoded archive copies (self-contained). Then a separate process that imports neither
torch nor ckptstore (``interop_reader.py``, with ckptstore's zarr codec entry points hidden)
reads every array with zarr-python and with tensorstore. Each verdict must be ``ok`` (the
bytes packed from the saved tensors) or ``refused``; ``mismatch`` (zeros, garbage) is the
failure this suite exists for. Which arrays must refuse is derived from the manifest: an
array with delta-encoded chunks, or with chunks whose files live in another checkpoint's
directory.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore import CheckpointStore
from ckptstore.format import Manifest, flatten_state, read_manifest
from ckptstore.format.dtypes import dtype_by_name, supported_dtype_names
from ckptstore.ops.tiering.archive import archive_checkpoints

pytest.importorskip("tensorstore", reason="the interop suite needs the dev extra (tensorstore)")

CHUNK = 256 * 1024
READER = Path(__file__).with_name("interop_reader.py")


def _random(gen: torch.Generator, name: str, n: int) -> torch.Tensor:
    dt = getattr(torch, name)
    if dt == torch.bool:
        return torch.rand(n, generator=gen) > 0.5
    # Random bits: NaN payloads, -0.0 and subnormals included, all of them must survive.
    raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dt)


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "dtypes": {name: _random(gen, name, 37) for name in supported_dtype_names()},
        "shapes": {
            "scalar": torch.tensor(3.5),
            "scalar_int": torch.tensor(-7, dtype=torch.int64),
            "empty": torch.empty(0, 4),
            "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
            "strided": torch.randn(30, 20, generator=gen)[::2, 1::3],
            "transposed": torch.randn(9, 5, generator=gen).t(),
        },
        # 1 MiB and more: arrays of their own, one of them a non-contiguous view.
        "big": torch.randn(512, 512, generator=gen),
        "big_bf16": torch.randn(1024, 512, generator=gen).to(torch.bfloat16),
        "big_view": torch.randn(600, 600, generator=gen)[:, :480],
        "mixed": _mixed(gen),
        "step": seed,
    }


def _mixed(gen: torch.Generator) -> dict[str, Any]:
    """Mixed precision: bf16 and fp16 tensors that are exactly fp32 ones rounded, which a
    save stores as casts (format version 3) of a packed and of a per-tensor array; with a
    -0.0, a tie and a value beyond fp16's range (rounded to infinity)."""
    small = torch.randn(40, 16, generator=gen)
    small[0, 0] = -0.0
    small[0, 1] = 1.0 + 2.0**-8  # halfway between two bf16 values: to the even one
    large = torch.randn(1024, 300, generator=gen)
    half = torch.randn(300, generator=gen) * 1e3
    half[0] = 1e6
    return {
        "master": {"small": small, "large": large, "half": half},
        "model": {"small": small.to(torch.bfloat16), "large": large.to(torch.bfloat16),
                  "half": half.to(torch.float16)},
    }


def _changed(state: dict[str, Any]) -> dict[str, Any]:
    """The next step: one large tensor moves a little, the rest stays (dedup material)."""
    out = dict(state)
    moved = state["big"].clone()
    moved[::7] += 0.5
    out["big"] = moved
    out["step"] = state["step"] + 1
    return out


def _optimizer_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 256, generator=gen)},
        "optim": {"exp_avg": torch.randn(512, 512, generator=gen) * 1e-3,
                  "exp_avg_sq": torch.rand(512, 512, generator=gen) * 1e-6},
    }


def _next_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(99)
    return {
        "model": {"w": state["model"]["w"]},
        "optim": {k: v + torch.randn(v.shape, generator=gen) * 1e-4
                  for k, v in state["optim"].items()},
    }


def _dcp_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": torch.randn(600, 500, generator=gen),
            "half": torch.randn(64, 33, generator=gen).to(torch.bfloat16),
            "f8": _random(gen, "float8_e4m3fn", 16),
            "ids": torch.arange(10, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
            "strided": torch.randn(40, 30, generator=gen)[:, ::3],
        }
    }


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


@dataclass
class Copy:
    """One copy of one checkpoint, and what every array of it must read as."""

    kind: str
    directory: Path
    manifest: Manifest
    truth: dict[str, torch.Tensor]  # flatten key (or DCP fqn) -> the tensor it must hold
    expected: dict[str, bytes | None] = field(default_factory=dict)  # None: must refuse


def _flat_expectations(copy: Copy) -> None:
    manifest = copy.manifest
    for name, array in manifest.arrays.items():
        foreign = any(
            c.src is not None and not (copy.directory / array.chunk_path(c.i)).is_file()
            for c in array.chunks
        )
        if foreign or any(c.enc != "raw" for c in array.chunks):
            copy.expected[name] = None
            continue
        buf = bytearray(array.length * array.itemsize)
        for t in manifest.tensors.values():
            if t.array == name and t.cast:
                # Read by the foreign rounding of the array's elements (interop_reader.py).
                copy.expected[f"{name}::{t.torch_dtype}:{t.offset}:{t.numel}"] = _bytes(
                    copy.truth[t.key])
            elif t.array == name:
                data = _bytes(copy.truth[t.key])
                start = t.offset * array.itemsize
                buf[start : start + len(data)] = data
        copy.expected[name] = bytes(buf)


def _dcp_expectations(copy: Copy) -> None:
    index = copy.manifest.dcp
    assert index is not None
    for path, info in index.arrays.items():
        itemsize = dtype_by_name(info.dtype).itemsize  # type: ignore[union-attr]
        buf = bytearray(int(torch.tensor(info.shape).prod()) * itemsize)
        for fqn, item in index.tensors.items():
            for piece in item.pieces:
                if piece.array != path:
                    continue
                data = _bytes(copy.truth[fqn])  # one rank: every piece is a whole tensor
                start = 0 if piece.at is None else piece.at * itemsize
                buf[start : start + len(data)] = data
        copy.expected[path] = bytes(buf)


def _truth(state: Any) -> dict[str, torch.Tensor]:
    return dict(flatten_state(state).tensors)


def _dcp_save(store: CheckpointStore, run: str, state: dict[str, Any]) -> Any:
    writer = store.dcp_writer(run, 0, pack_below=8 * 1024, codec="lz4")
    with writer, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer.checkpoint


def _build(root: Path) -> list[Copy]:
    copies: list[Copy] = []
    plain_warm, reencoded_warm = root / "warm", root / "warm-reencoded"

    def hot(store: CheckpointStore, kind: str, ck: Any, truth: dict[str, torch.Tensor]) -> None:
        directory = store.checkpoint_dir(ck.run, ck.id)
        copies.append(Copy(kind, directory, read_manifest(directory), truth))

    with CheckpointStore.open(root / "a", warm=str(plain_warm), chunk_bytes=CHUNK) as store:
        for codec in ("none", "lz4", "zstd-3", "auto"):
            state = _state(1)
            ck = store.save(f"full-{codec}", 0, state, codec=codec, delta=False)
            hot(store, f"full {codec}", ck, _truth(state))
        s0, s1 = _state(2), _changed(_state(2))
        store.save("dedup", 0, s0)
        ck = store.save("dedup", 1, s1, delta="dedup")
        hot(store, "dedup", ck, _truth(s1))
        dedup_id = ck.id
        x0, x1 = _state(3), _changed(_state(3))
        store.save("xor", 0, x0, delta="xor")
        ck = store.save("xor", 1, x1, delta="xor")
        hot(store, "xor", ck, _truth(x1))
        lossy = {"threshold": 1e-5, "quantize": 8}
        o0 = _optimizer_state(4)
        store.save("lossy", 0, o0, delta=lossy)
        ck = store.save("lossy", 1, _next_optimizer_state(o0), delta=lossy)
        # What a lossy checkpoint holds is its reconstruction, which store.load returns.
        lossy_id, lossy_truth = ck.id, _truth(store.load(ck.id))
        hot(store, "lossy", ck, lossy_truth)
        d = _dcp_state(5)
        ck = _dcp_save(store, "dcp", d)
        directory = store.checkpoint_dir(ck.run, ck.id)
        copies.append(Copy("dcp", directory, read_manifest(directory),
                           {f"model.{k}": v for k, v in d["model"].items()}))
        archive_checkpoints(store, tier="warm")
        for kind, ck_id, truth in [("dedup", dedup_id, _truth(s1)),
                                   ("lossy", lossy_id, lossy_truth)]:
            directory = plain_warm / kind / ck_id
            copies.append(Copy(f"{kind} on warm (plain copy)", directory,
                               read_manifest(directory), truth))

    with CheckpointStore.open(root / "b", warm=str(reencoded_warm), chunk_bytes=CHUNK,
                              codec="lz4") as store:
        r0, r1 = _state(6), _changed(_state(6))
        store.save("dedup", 0, r0)
        dedup = store.save("dedup", 1, r1, delta="dedup")
        store.save("xor", 0, r0, delta="xor")
        xor = store.save("xor", 1, r1, delta="xor")
        archive_checkpoints(store, tier="warm", reencode="zstd-3")
        for ck in (dedup, xor):
            directory = reencoded_warm / ck.run / ck.id
            copies.append(Copy(f"{ck.run} archived re-encoded", directory,
                               read_manifest(directory), _truth(r1)))
    for copy in copies:
        (_dcp_expectations if copy.manifest.dcp is not None else _flat_expectations)(copy)
    return copies


@pytest.fixture(scope="module")
def interop(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[Copy], dict[str, Any]]:
    root = tmp_path_factory.mktemp("interop")
    copies = _build(root)
    expected = {
        f"{copy.directory}::{name}": base64.b64encode(data or b"").decode()
        for copy in copies
        for name, data in copy.expected.items()
    }
    (root / "expected.json").write_text(json.dumps(expected))
    # -I: no user site, no PYTHONPATH (nothing of the test process leaks in).
    done = subprocess.run(
        [sys.executable, "-I", str(READER), str(root / "expected.json"), str(root / "out.json")],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return copies, json.loads((root / "out.json").read_text())


def test_the_reader_process_is_foreign(interop: tuple[list[Copy], dict[str, Any]]) -> None:
    _copies, out = interop
    assert out["imported"] == []


KINDS = [
    "full none", "full lz4", "full zstd-3", "full auto", "dedup", "xor", "lossy", "dcp",
    "dedup on warm (plain copy)", "lossy on warm (plain copy)",
    "dedup archived re-encoded", "xor archived re-encoded",
]


@pytest.mark.parametrize("kind", KINDS)
def test_every_array_is_exact_or_refused(interop: tuple[list[Copy], dict[str, Any]],
                                         kind: str) -> None:
    copies, out = interop
    (copy,) = [c for c in copies if c.kind == kind]
    assert copy.expected, "no arrays"
    wrong = []
    for name, data in copy.expected.items():
        want = "refused" if data is None else "ok"
        for reader, verdict in out["results"][f"{copy.directory}::{name}"].items():
            if verdict["verdict"] != want:
                wrong.append(f"{reader} {name}: {verdict} (expected {want})")
    assert wrong == [], "\n".join(wrong)


def test_each_kind_is_as_self_contained_as_it_should_be(
    interop: tuple[list[Copy], dict[str, Any]],
) -> None:
    """The expectations above are not vacuous: what is readable and what refuses."""
    copies, _out = interop
    by_kind = {c.kind: c for c in copies}

    def refused(kind: str) -> set[str]:
        return {n for n, d in by_kind[kind].expected.items() if d is None}

    readable = ["full none", "full lz4", "full zstd-3", "full auto", "dedup", "dcp",
                "dedup archived re-encoded", "xor archived re-encoded"]
    assert all(refused(kind) == set() for kind in readable)
    # On hot the dedup checkpoint shares chunks with its base through hard links.
    dedup = by_kind["dedup"].manifest
    assert any(c.src for a in dedup.arrays.values() for c in a.chunks)
    # XOR and quantized chunks, and a plain copy's chunks that stay with their owner, refuse.
    assert refused("xor") and refused("lossy")
    assert refused("dedup on warm (plain copy)") and refused("lossy on warm (plain copy)")
    # Re-encoded copies have no chunk of another checkpoint.
    for kind in ("dedup archived re-encoded", "xor archived re-encoded"):
        assert not by_kind[kind].manifest.referenced_checkpoints()
    # Every dtype reached the readers, in arrays of its own zarr data type.
    full = by_kind["full none"].manifest
    stored = {t.torch_dtype for t in full.tensors.values()}
    assert stored >= set(supported_dtype_names())


def test_zarr_with_ckptstore_installed_explains_the_refusal(
    interop: tuple[list[Copy], dict[str, Any]],
) -> None:
    """With ckptstore's entry points visible, zarr-python refuses at open and says why and
    what to do (``ckpt compact``)."""
    import zarr

    copies, _out = interop
    for kind, needs in [("xor", "deltas against checkpoint"),
                        ("dedup on warm (plain copy)", "live in the directory of checkpoint")]:
        (copy,) = [c for c in copies if c.kind == kind]
        name = next(n for n, d in copy.expected.items() if d is None)
        with pytest.raises(Exception, match=needs) as info:
            zarr.open_group(str(copy.directory), mode="r")[name][...]
        assert "ckpt compact" in str(info.value) and copy.manifest.id in str(info.value)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("lossy", "dcp",
                                                                 "lossy on warm (plain copy)")])
def test_mixed_precision_copies_are_stored_as_casts_foreign_readers_round(
        interop: tuple[list[Copy], dict[str, Any]], kind: str) -> None:
    copies, out = interop
    (copy,) = [c for c in copies if c.kind == kind]
    casts = {k: t for k, t in copy.manifest.tensors.items() if t.cast}
    assert sorted(casts) == ["mixed/model/half", "mixed/model/large", "mixed/model/small"]
    assert copy.manifest.format_version == 3
    assert {t.torch_dtype for t in casts.values()} == {"bfloat16", "float16"}
    # Each is read through its array: by the rounding where the array opens, else refused
    # with it (a delta's array).
    for t in casts.values():
        name = f"{t.array}::{t.torch_dtype}:{t.offset}:{t.numel}"
        if copy.expected[t.array] is None:
            assert name not in copy.expected
            continue
        assert {r: v["verdict"] for r, v in out["results"][f"{copy.directory}::{name}"].items()
                } == {"zarr": "ok", "tensorstore": "ok"}


def test_lossy_saves_store_no_casts(interop: tuple[list[Copy], dict[str, Any]]) -> None:
    # A cast of a lossily stored tensor would not round to the saved bf16 tensor.
    copies, _ = interop
    (copy,) = [c for c in copies if c.kind == "lossy"]
    assert not any(t.cast for t in copy.manifest.tensors.values())
    assert copy.manifest.format_version == 2
