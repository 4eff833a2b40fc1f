"""Read checkpoint arrays the way a foreign Zarr v3 reader would; run as a separate process.

Usage: ``python interop_reader.py EXPECTED.json RESULT.json``

``EXPECTED.json`` maps ``"<checkpoint dir>::<array path>"`` to the base64 of the exact bytes
the array must hold (its elements, little-endian, in C order). A name with a fourth part,
``"...::<dtype>:<offset>:<numel>"``, is a tensor stored as a cast (docs/FORMAT.md, version 3):
elements ``[offset, offset + numel)`` of the float32 array rounded to ``dtype`` as the format
defines it, done here with numpy alone. For every entry this script
opens the array with zarr-python and with tensorstore, reads it whole, and records one
verdict per reader: ``ok`` (the exact bytes), ``refused`` (the reader raised: a loud
refusal) or ``mismatch`` (it returned other bytes: zeros from a missing chunk, garbage from a
codec it misread). It must never import torch or ckptstore: a foreign machine has neither.
zarr-python discovers codecs through entry points, so the ones ckptstore registers are hidden
from it here, exactly as on a machine without ckptstore.
"""

from __future__ import annotations

import base64
import importlib.metadata
import json
import sys
from typing import Any


def _hide_ckptstore_entry_points() -> None:
    # Entry points are read from the installed distributions: without ckptstore's, zarr
    # sees no codec of ours, as on a machine where ckptstore is not installed.
    original = importlib.metadata.distributions

    def distributions(**params: Any) -> Any:
        return (
            d for d in original(**params)
            if (d.metadata["Name"] or "").lower() != "ckptstore"
        )

    importlib.metadata.distributions = distributions  # type: ignore[assignment]


def _zarr_bytes(directory: str, array: str) -> bytes:
    import numpy as np
    import zarr

    group = zarr.open_group(directory, mode="r")
    data = np.ascontiguousarray(group[array][...])
    return bytes(data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes())


def _tensorstore_bytes(directory: str, array: str) -> bytes:
    import numpy as np
    import tensorstore as ts

    store = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{directory}/{array}"}},
        read=True,
    ).result()
    data = np.ascontiguousarray(store.read().result())
    return bytes(data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes())


def _rounded(data: bytes, cast: str) -> bytes:
    """Elements of float32 ``data`` rounded as docs/FORMAT.md's casts say."""
    import numpy as np

    dtype, offset, numel = cast.split(":")
    start = int(offset)
    wide = np.frombuffer(data, dtype="<f4")[start : start + int(numel)]
    if dtype == "float16":
        return bytes(wide.astype("<f2").tobytes())
    # bfloat16: the upper half of the bits after adding 0x7FFF plus the lowest kept bit
    # (round to nearest, ties to even; the format stores no NaN as a cast).
    bits = wide.view("<u4").astype(np.uint64)
    return bytes(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes())


def _verdict(read: Any, directory: str, array: str, expected: bytes,
             cast: str = "") -> dict[str, str]:
    try:
        got = read(directory, array)
        if cast:
            got = _rounded(got, cast)
    except Exception as exc:  # any failure to open or read is a refusal
        return {"verdict": "refused", "why": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if got == expected:
        return {"verdict": "ok"}
    zeros = not any(got)
    return {
        "verdict": "mismatch",
        "why": f"{len(got)} bytes, expected {len(expected)}" + (" (all zeros)" if zeros else ""),
    }


def main(argv: list[str]) -> int:
    """Read every expected array with both readers; write the verdicts."""
    expected_path, result_path = argv[1], argv[2]
    _hide_ckptstore_entry_points()
    with open(expected_path, encoding="utf-8") as fh:
        expected: dict[str, str] = json.load(fh)
    results: dict[str, dict[str, dict[str, str]]] = {}
    for name, b64 in expected.items():
        directory, _, rest = name.partition("::")
        array, _, cast = rest.partition("::")
        want = base64.b64decode(b64)
        results[name] = {
            "zarr": _verdict(_zarr_bytes, directory, array, want, cast),
            "tensorstore": _verdict(_tensorstore_bytes, directory, array, want, cast),
        }
    leaked = sorted(m for m in ("torch", "ckptstore") if m in sys.modules)
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump({"results": results, "imported": leaked}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
