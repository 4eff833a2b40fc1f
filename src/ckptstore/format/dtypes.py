"""Torch dtypes the format can store, and how each maps onto a Zarr v3 data type.

Dtypes numpy (and therefore Zarr) knows are stored natively so other Zarr readers see real
values. The rest (bfloat16, the float8/float4 family, complex32) are stored as the unsigned
integer of the same width, bit for bit, and the array carries ``{"torch_dtype": name}`` in
its attributes so a reader can reinterpret them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = [
    "NUMPY_NATIVE_DTYPES",
    "DtypeInfo",
    "dtype_by_name",
    "dtype_info",
    "supported_dtype_names",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DtypeInfo:
    """How one torch dtype is stored.

    Attributes:
        name: Torch dtype name without the ``torch.`` prefix; also the array name.
        torch_dtype: The torch dtype.
        itemsize: Bytes per element.
        zarr_dtype: Numpy/Zarr data type name used for the array on disk.
        native: Whether ``zarr_dtype`` represents the same values (not only the same bits).
    """

    name: str
    torch_dtype: torch.dtype
    itemsize: int
    zarr_dtype: str
    native: bool


# Dtypes with a numpy equivalent holding the same values.
NUMPY_NATIVE_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)

# Dtypes numpy lacks; stored as same-width unsigned ints. Looked up with getattr because
# older torch builds lack some of them.
_BITS_ONLY = (
    "bfloat16",
    "complex32",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)

_UINT_BY_WIDTH = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def _build_table() -> dict[str, DtypeInfo]:
    table: dict[str, DtypeInfo] = {}
    for name in NUMPY_NATIVE_DTYPES:
        dt = getattr(torch, name)
        table[name] = DtypeInfo(name, dt, dt.itemsize, name, True)
    for name in _BITS_ONLY:
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            continue
        table[name] = DtypeInfo(name, dt, dt.itemsize, _UINT_BY_WIDTH[dt.itemsize], False)
    return table


_BY_NAME = _build_table()
_BY_DTYPE = {info.torch_dtype: info for info in _BY_NAME.values()}


def supported_dtype_names() -> tuple[str, ...]:
    """Return the names of every torch dtype this build can store."""
    return tuple(_BY_NAME)


def dtype_info(dtype: torch.dtype) -> DtypeInfo | None:
    """Return the storage description of ``dtype``, or None if it cannot be stored."""
    return _BY_DTYPE.get(dtype)


def dtype_by_name(name: str) -> DtypeInfo | None:
    """Return the storage description for a dtype name read from a manifest, or None."""
    return _BY_NAME.get(name)
