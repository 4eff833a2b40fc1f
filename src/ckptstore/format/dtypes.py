"""Torch dtypes the format can store, and how each maps onto a Zarr v3 data type.

Dtypes numpy (and therefore Zarr) knows are stored natively so other Zarr readers see real
values. The rest (bfloat16, the float8/float4 family, complex32) are stored as the unsigned
integer of the same width, bit for bit, and the array carries ``{"torch_dtype": name}`` in
its attributes so a reader can reinterpret them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEVICE_TYPES",
    "NUMPY_NATIVE_DTYPES",
    "TORCH_DTYPE_ATTRS",
    "DtypeInfo",
    "dtype_by_name",
    "dtype_info",
    "supported_dtype_names",
]



@dataclass(frozen=True, slots=True)
class DtypeInfo:
    """How one torch dtype is stored.

    Attributes:
        name: Torch dtype name without the ``torch.`` prefix; also the array name.
        itemsize: Bytes per element.
        zarr_dtype: Numpy/Zarr data type name used for the array on disk.
        native: Whether ``zarr_dtype`` represents the same values (not only the same bits).
    """

    name: str
    itemsize: int
    zarr_dtype: str
    native: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype (imports torch: reading a manifest does not need it)."""
        return _torch_dtype(self.name)


# Dtypes with a numpy equivalent holding the same values, and their widths in bytes.
_NATIVE_WIDTHS = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4,
    "uint64": 8, "int64": 8, "float16": 2, "float32": 4, "float64": 8, "complex64": 8,
    "complex128": 16,
}
NUMPY_NATIVE_DTYPES = tuple(_NATIVE_WIDTHS)

# Dtypes numpy lacks, stored as same-width unsigned ints. The widths are the format's (so a
# manifest is read without importing torch); tests/format/test_zarrmeta.py checks them
# against torch's itemsize.
_BITS_ONLY_WIDTHS = {
    "bfloat16": 2,
    "complex32": 4,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}

_UINT_BY_WIDTH = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}

_BY_NAME = {
    **{name: DtypeInfo(name, width, name, True) for name, width in _NATIVE_WIDTHS.items()},
    **{name: DtypeInfo(name, width, _UINT_BY_WIDTH[width], False)
       for name, width in _BITS_ONLY_WIDTHS.items()},
}


# Every attribute of the torch module that is a dtype, aliases included (``float``, ``long``):
# the names a ``dtype`` leaf of a state's tree may hold (format/tree.py). Written out so a
# manifest is validated without importing torch; tests/format/test_zarrmeta.py checks the set
# equals torch's.
TORCH_DTYPE_ATTRS = frozenset({
    "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble",
    "cfloat", "chalf", "complex128", "complex32", "complex64", "double", "float", "float16",
    "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu", "half", "int", "int1", "int16", "int2", "int3",
    "int32", "int4", "int5", "int6", "int64", "int7", "int8", "long", "qint32", "qint8",
    "quint2x4", "quint4x2", "quint8", "short", "uint1", "uint16", "uint2", "uint3", "uint32",
    "uint4", "uint5", "uint6", "uint64", "uint7", "uint8",
})

# The device types ``torch.device`` accepts (a ``device`` leaf is ``type`` or ``type:index``).
DEVICE_TYPES = frozenset({
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
    "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
})


@cache
def _torch_dtype(name: str) -> torch.dtype:
    # Cached: readers ask for it per chunk and per tensor.
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


@cache
def _by_torch_dtype() -> dict[torch.dtype, DtypeInfo]:
    return {info.torch_dtype: info for info in _BY_NAME.values()}


def supported_dtype_names() -> tuple[str, ...]:
    """Return the names of every torch dtype the format stores (all are in torch >= 2.10,
    the oldest torch this package supports)."""
    return tuple(_BY_NAME)


def dtype_info(dtype: torch.dtype) -> DtypeInfo | None:
    """Return the storage description of ``dtype``, or None if it cannot be stored."""
    return _by_torch_dtype().get(dtype)


def dtype_by_name(name: str) -> DtypeInfo | None:
    """Return the storage description for a dtype name read from a manifest, or None."""
    return _BY_NAME.get(name)
