"""Tensors stored as the rounding of a wider tensor: the bf16 weights of mixed precision.

Mixed-precision training keeps fp32 master weights and a bf16 (or fp16) copy of the model
that is exactly the master rounded after every optimizer step. Stored as it is, that copy
is a seventh of the state's bytes that carry no information. A save looks, for each bf16 or
fp16 tensor, for an fp32 tensor of the same shape whose rounding equals it bit for bit; when
it finds one, the narrow tensor gets no bytes of its own: its tensor-index entry points at the
wide tensor's elements and says ``cast`` (docs/FORMAT.md, version 3). A load rounds them.

Exactness rules (what a foreign reader relies on):

* rounding is IEEE 754 round-to-nearest, ties to even, overflow to infinity, the same
  conversion as ``Tensor.copy_`` between the dtypes; the writer checks the stored tensor
  equals it bit for bit (signed zeros included), so the load gives the saved bits;
* a tensor holding a NaN is never stored as a cast: NaN payloads are where conversions
  differ between implementations.

Finding the wide tensor costs a rounding and a comparison per candidate (a pass over the
state's fp32 weights), so candidates are tried best first and at most
:data:`MAX_CANDIDATES` per tensor: a candidate of the same shape whose key ends the same way
(``model/h.0.mlp.weight`` and ``master/h.0.mlp.weight``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ckptstore.format.constants import CAST_PAIRS
from ckptstore.format.dtypes import dtype_info

__all__ = [
    "CAST_MIN_ELEMENTS",
    "CAST_PAIRS",
    "MAX_CANDIDATES",
    "cast_into",
    "find_casts",
    "rounds_to",
]

#: Tensors with fewer elements are stored as they are: checking them would cost more than
#: their bytes (step counters, scalars).
CAST_MIN_ELEMENTS = 256
#: Candidates checked per narrow tensor, best key match first.
MAX_CANDIDATES = 2


def _suffix_score(a: str, b: str) -> tuple[int, int]:
    """How alike two keys end: common trailing path components, then characters."""
    pa, pb = a.split("/"), b.split("/")
    parts = 0
    while parts < min(len(pa), len(pb)) and pa[-1 - parts] == pb[-1 - parts]:
        parts += 1
    chars = 0
    while chars < min(len(a), len(b)) and a[-1 - chars] == b[-1 - chars]:
        chars += 1
    return parts, chars


def rounds_to(wide: torch.Tensor, narrow: torch.Tensor) -> bool:
    """Whether ``narrow`` is exactly ``wide`` rounded to its dtype, bit for bit, and NaN-free.

    Both are CPU tensors of the same shape; ``(wide, narrow)`` dtypes are one of
    :data:`CAST_PAIRS`.
    """
    rounded = torch.empty(narrow.shape, dtype=narrow.dtype)
    cast_into(rounded, wide)
    # Compared as integers: -0.0 == 0.0 as floats, but not as bits.
    if not torch.equal(rounded.view(torch.int16), narrow.view(torch.int16)):
        return False
    # NaN-free: a NaN makes the sum NaN (so does +inf beside -inf: stored as itself then,
    # which is only a missed saving). Summing the fp32 tensor is several times faster than
    # isnan() of the bf16 one.
    return not bool(torch.isnan(wide.sum()))


def cast_into(dest: torch.Tensor, wide: torch.Tensor) -> None:
    """Round ``wide``'s elements into ``dest`` (same number of elements, any shapes)."""
    with torch.no_grad():
        dest.view(-1).copy_(wide.reshape(-1))


def find_casts(
    tensors: Mapping[str, torch.Tensor],
    usable: Callable[[str], bool] = lambda key: True,
) -> dict[str, str]:
    """Narrow tensors that are exactly a wide tensor rounded: narrow key -> wide key.

    Args:
        tensors: The flat state (distinct tensors by key), CPU tensors.
        usable: Whether a wide tensor may serve as a source (all by default; a lossy save
            finds no casts at all, since its wide tensors are not stored exactly).

    Returns:
        For each narrow tensor stored as a cast, the key of its wide tensor (never itself a
        narrow tensor; one wide tensor may serve several).
    """
    wide: dict[tuple[int, ...], list[str]] = {}
    for key, t in tensors.items():
        if t.dtype == torch.float32 and t.device.type == "cpu" and usable(key):
            wide.setdefault(tuple(t.shape), []).append(key)
    found: dict[str, str] = {}
    if not wide:
        return found
    for key, t in tensors.items():
        info = dtype_info(t.dtype)
        if (info is None or ("float32", info.name) not in CAST_PAIRS
                or t.numel() < CAST_MIN_ELEMENTS or t.device.type != "cpu"):
            continue
        candidates = wide.get(tuple(t.shape))
        if not candidates:
            continue
        ranked = sorted(candidates, key=lambda other: _suffix_score(key, other), reverse=True)
        for other in ranked[:MAX_CANDIDATES]:
            if rounds_to(tensors[other], t):
                found[key] = other
                break
    return found
