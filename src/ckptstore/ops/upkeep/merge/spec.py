"""What a merge computes, decided before anything is read: method, weights, accumulation.

Pure values and checks, no I/O: the operation (:mod:`ckptstore.ops.upkeep.merge.run`)
resolves the inputs and reads metrics, this module says whether the request makes sense and
what each tensor becomes.

Rules, each a choice documented in the README:

* ``mean`` gives every input the weight ``1/n``; ``weighted`` takes one weight per input,
  normalised to sum to 1 (``2,1,1`` is ``0.5,0.25,0.25``). The result is
  ``sum(w_i * x_i)``: a convex combination of the inputs.
* Weights must be finite and non-negative, and sum to a positive number. Negative weights
  are refused: they extrapolate away from an input (task arithmetic) instead of averaging,
  can leave the inputs' range (an optimizer's second moment turning negative), and a sign
  typo would otherwise go unnoticed. A zero weight is allowed: that input is a recorded
  parent that contributes nothing (a site that trained on no samples this round).
* Accumulation (``accumulate``): ``auto`` sums float32 and float64 tensors in their own
  dtype, 16- and 8-bit floats in float32, and complex32 / complex64 / complex128 in
  complex64 / complex128 / complex128. A float32 sum of ``n`` weighted inputs is within
  about ``n + 1`` float32 roundings of the exact one (``(n + 1) * 2**-24`` times
  ``sum(w_i * |x_i|)``, the precision fp32 weights are commonly averaged at), and costs
  about a third of a float64 sum: widening every element to float64 and back made summing the
  bulk of a merge's CPU time. 16- and 8-bit floats are summed in float32 because it
  carries 13 more mantissa bits than float16 and 16 more than bfloat16, so the rounding to
  the output dtype dominates. ``float32`` or ``float64`` forces one width for every tensor
  (``float32`` on 64-bit inputs loses precision and is refused; ``float64`` buys float32
  tensors the last few bits at that cost). The output keeps each tensor's own dtype.
* Integer and bool tensors are taken from the first input, as are non-tensor values.
  ``float8_e8m0fnu`` (exponent-only scales) and ``float4_e2m1fn_x2`` (two values per byte)
  cannot hold an average: merging a state that holds them is refused unless ``keys``
  leaves them out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckptstore.errors import InvalidNameError

__all__ = [
    "ACCUMULATE",
    "METHODS",
    "MergeSpec",
    "accumulation_dtype",
    "merge_spec",
]

#: Merge methods.
METHODS = ("mean", "weighted")
#: Accumulation settings.
ACCUMULATE = ("auto", "float32", "float64")

_NARROW_FLOATS = frozenset({
    torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz,
    torch.float8_e5m2, torch.float8_e5m2fnuz,
})
_WIDE_FLOATS = frozenset({torch.float32, torch.float64})
_COMPLEX = {torch.complex32: torch.complex64, torch.complex64: torch.complex128,
            torch.complex128: torch.complex128}
#: Floating dtypes whose values an average cannot be stored in.
_NOT_AVERAGEABLE = frozenset({torch.float8_e8m0fnu, torch.float4_e2m1fn_x2})


@dataclass(frozen=True)
class MergeSpec:
    """A checked merge request.

    Attributes:
        method: ``mean`` or ``weighted``.
        weights: One weight per input, normalised to sum to 1.
        given: The weights as given (before normalising); the metric values with
            ``metric``; ``1.0`` each for ``mean``.
        accumulate: ``auto``, ``float32`` or ``float64``.
        keys: fnmatch patterns selecting what the output holds (None: everything).
        metric: The metric the weights were taken from, if any.
    """

    method: str
    weights: tuple[float, ...]
    given: tuple[float, ...]
    accumulate: str = "auto"
    keys: tuple[str, ...] | None = None
    metric: str | None = None

    def record(self) -> dict[str, object]:
        """The JSON the catalog keeps of this merge (the ``merged`` event's detail)."""
        return {
            "method": self.method,
            "weights": list(self.weights),
            "given": list(self.given),
            "accumulate": self.accumulate,
            "keys": list(self.keys) if self.keys is not None else None,
            "weights_from_metric": self.metric,
        }


def merge_spec(
    n_inputs: int,
    *,
    method: str = "mean",
    weights: Sequence[float] | None = None,
    accumulate: str = "auto",
    keys: Sequence[str] | None = None,
    metric: str | None = None,
) -> MergeSpec:
    """Check a merge request and normalise its weights.

    Args:
        n_inputs: Number of inputs (distinct checkpoints).
        method: ``mean`` or ``weighted``.
        weights: One weight per input (``weighted`` only): the given weights, or the
            values of ``metric``.
        accumulate: ``auto``, ``float32`` or ``float64``.
        keys: fnmatch patterns selecting the parts of the state to merge.
        metric: Name of the metric ``weights`` were read from.

    Returns:
        The checked spec.

    Raises:
        InvalidNameError: For fewer than two inputs, an unknown method or accumulation,
            weights with ``mean`` or none with ``weighted``, a count that differs from the
            inputs', or weights that are not finite, negative, or do not sum to a positive
            number.
    """
    if n_inputs < 2:
        raise InvalidNameError(
            f"a merge needs at least two checkpoints, got {n_inputs}; name every input "
            "(ckpt merge A B ...)"
        )
    if method not in METHODS:
        raise InvalidNameError(f"unknown merge method {method!r}; use one of {', '.join(METHODS)}")
    if accumulate not in ACCUMULATE:
        raise InvalidNameError(
            f"unknown accumulation {accumulate!r}; use one of {', '.join(ACCUMULATE)}"
        )
    patterns = _check_keys(keys)
    if method == "mean":
        if weights is not None:
            raise InvalidNameError(
                "weights are for --method weighted; a mean weighs every input equally"
            )
        return MergeSpec("mean", (1.0 / n_inputs,) * n_inputs, (1.0,) * n_inputs,
                         accumulate, patterns)
    if weights is None:
        raise InvalidNameError(
            "a weighted merge needs one weight per input (--weights W,W,... or "
            "--weights-from-metric NAME)"
        )
    given = tuple(weights)
    if len(given) != n_inputs:
        raise InvalidNameError(
            f"{len(given)} weights for {n_inputs} inputs; give exactly one weight per input"
        )
    source = f"metric {metric!r} of input" if metric else "weight"
    for i, w in enumerate(given):
        if isinstance(w, bool) or not isinstance(w, int | float):
            raise InvalidNameError(f"{source} {i + 1} is {w!r}, not a number")
        if not math.isfinite(w):
            raise InvalidNameError(f"{source} {i + 1} is {w}; weights must be finite numbers")
        if w < 0:
            raise InvalidNameError(
                f"{source} {i + 1} is {w}: negative weights are refused (a merge averages; "
                "it does not extrapolate away from an input)"
            )
    total = math.fsum(float(w) for w in given)
    if not total > 0 or not math.isfinite(total):
        raise InvalidNameError(
            f"the weights {list(given)} sum to {total}; they must sum to a positive, finite "
            "number"
        )
    normalised = tuple(float(w) / total for w in given)
    return MergeSpec("weighted", normalised, tuple(float(w) for w in given), accumulate,
                     patterns, metric)


def _check_keys(keys: Sequence[str] | None) -> tuple[str, ...] | None:
    if keys is None:
        return None
    if isinstance(keys, str):
        keys = [keys]
    patterns = tuple(keys)
    if not patterns or any(not isinstance(p, str) or not p for p in patterns):
        raise InvalidNameError(
            "keys must be non-empty fnmatch patterns such as 'model/*'; omit keys to merge "
            "the whole state"
        )
    return patterns


def accumulation_dtype(dtype: torch.dtype, accumulate: str, key: str) -> torch.dtype | None:
    """The dtype a tensor of ``dtype`` is summed in, or None when it is not averaged.

    Args:
        dtype: The tensor's dtype (the same in every input).
        accumulate: ``auto``, ``float32`` or ``float64``.
        key: The tensor's key, for the error message.

    Returns:
        The accumulation dtype; None for integer and bool tensors (taken from the first
        input).

    Raises:
        InvalidNameError: For a dtype that cannot hold an average, or ``float32``
            accumulation of a 64-bit tensor.
    """
    if dtype in _NOT_AVERAGEABLE:
        raise InvalidNameError(
            f"tensor {key!r} has dtype {str(dtype).removeprefix('torch.')}, which cannot hold "
            "an average; leave it out with keys (e.g. --keys 'model/*')"
        )
    if dtype in _COMPLEX:
        wide = _COMPLEX[dtype]
        if accumulate == "float32":
            if dtype == torch.complex128:
                raise _narrowing(key, dtype)
            return torch.complex64
        return torch.complex128 if accumulate == "float64" else wide
    if dtype in _WIDE_FLOATS:
        if accumulate == "float32" and dtype == torch.float64:
            raise _narrowing(key, dtype)
        # auto: each in its own dtype (the module docstring bounds float32's error).
        return torch.float64 if accumulate == "float64" else dtype
    if dtype in _NARROW_FLOATS:
        return torch.float64 if accumulate == "float64" else torch.float32
    if dtype.is_floating_point:  # a float dtype of a newer torch: sum it wide
        return torch.float64
    return None


def _narrowing(key: str, dtype: torch.dtype) -> InvalidNameError:
    return InvalidNameError(
        f"tensor {key!r} is {str(dtype).removeprefix('torch.')}: float32 accumulation would "
        "lose its precision; use accumulate 'auto' or 'float64'"
    )
