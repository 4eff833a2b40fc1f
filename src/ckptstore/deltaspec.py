"""The delta mode of a save: what the ``delta`` argument and setting mean (pure values).

``parse_delta`` turns ``False`` / ``"dedup"`` / ``"xor"`` / ``"lossy"`` / a table into a
:class:`DeltaSpec`. The chunk encodings themselves live in :mod:`ckptstore.format.delta`;
this module sits below the format so that reading a config file can validate the setting
without importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import InvalidNameError

__all__ = ["DEFAULT_BLOCK", "DEFAULT_LOSSY_SCOPE", "DeltaSpec", "parse_delta"]

#: Elements per quantization scale.
DEFAULT_BLOCK = 512

#: Tensors stored lossily unless the caller names others: optimizer moments and running
#: statistics of the torch.optim optimizers (Adam/AdamW/Adamax/NAdam/RAdam, SGD momentum,
#: RMSprop, Adadelta).
DEFAULT_LOSSY_SCOPE: tuple[str, ...] = (
    "*exp_avg",
    "*exp_avg_sq",
    "*max_exp_avg_sq",
    "*exp_inf",
    "*momentum_buffer",
    "*square_avg",
    "*acc_delta",
    "*grad_avg",
)

_MODES = ("dedup", "xor", "lossy")


@dataclass(frozen=True)
class DeltaSpec:
    """How a save is encoded relative to its base.

    Attributes:
        mode: ``dedup`` (identical chunks referenced, nothing else), ``xor`` (also changed
            chunks XOR-encoded against the keyframe) or ``lossy`` (as xor, and tensors in
            ``scope`` stored as thresholded, quantized deltas).
        threshold: Lossy: element changes with ``|delta| < threshold`` are dropped.
        quantize: Lossy: bits per quantized delta (8 or 4); None keeps the remaining
            changes exact (only the threshold is lossy).
        scope: Lossy: key patterns (fnmatch, ``*`` crosses ``/``; a pattern also selects
            everything under a matching path) of the tensors that may be stored lossily.
        block: Lossy: elements per quantization scale.
        keyframe_every: xor/lossy: a full keyframe every this many saves (None: the store's
            ``keyframe_every`` setting).
    """

    mode: str = "dedup"
    threshold: float | None = None
    quantize: int | None = None
    scope: tuple[str, ...] = DEFAULT_LOSSY_SCOPE
    block: int = DEFAULT_BLOCK
    keyframe_every: int | None = None

    @property
    def lossy(self) -> bool:
        """Whether tensors in ``scope`` are stored approximately."""
        return self.mode == "lossy"

    @property
    def chained(self) -> bool:
        """Whether changed chunks are encoded against a keyframe (xor or lossy)."""
        return self.mode in ("xor", "lossy")

    @property
    def encoding(self) -> str:
        """Chunk encoding of the lossy group: ``q8``, ``q4`` or ``xor`` (threshold only)."""
        return f"q{self.quantize}" if self.quantize else "xor"

    def to_dict(self) -> dict[str, Any]:
        """JSON form (what :func:`parse_delta` accepts)."""
        doc: dict[str, Any] = {"mode": self.mode}
        if self.lossy:
            doc.update(threshold=self.threshold, quantize=self.quantize,
                       scope=list(self.scope), block=self.block)
        if self.keyframe_every is not None:
            doc["keyframe_every"] = self.keyframe_every
        return doc


def _bad(value: Any, why: str) -> InvalidNameError:
    return InvalidNameError(
        f"invalid delta setting {value!r}: {why}. Use False (full saves), 'dedup' (default), "
        "'xor', or a table such as {threshold = 1e-4, quantize = 8} for lossy deltas of "
        "optimizer moments"
    )


def parse_delta(value: Any) -> DeltaSpec | None:
    """Turn the ``delta`` argument or setting into a :class:`DeltaSpec` (None: full saves).

    Accepted: ``False``/``None``/``"none"``/``"full"`` (no dedup), ``True``/``"dedup"``,
    ``"xor"``, ``"lossy"`` (8-bit, default scope), or a mapping with ``mode`` (or, from a
    DeepSpeed-style ``[compression_config]`` table, ``type``: ``"diff"`` means lossy when
    ``threshold`` or ``quantize`` is given, else xor), ``threshold``, ``quantize`` (8 or 4),
    ``scope`` (list of key patterns), ``block`` and ``keyframe_every``.

    Raises:
        InvalidNameError: On an unknown mode, key or out-of-range value.
    """
    if value is None or value is False:
        return None
    if value is True:
        return DeltaSpec("dedup")
    if isinstance(value, DeltaSpec):
        return value
    if isinstance(value, str):
        name = value.strip().lower()
        if name in ("none", "full", "off"):
            return None
        if name == "lossy":
            return DeltaSpec("lossy", quantize=8)
        if name in _MODES:
            return DeltaSpec(name)
        raise _bad(value, "unknown mode")
    if not isinstance(value, Mapping):
        raise _bad(value, "expected a bool, a mode name or a table")
    known = {"mode", "type", "threshold", "quantize", "scope", "block", "keyframe_every"}
    unknown = sorted(set(map(str, value)) - known)
    if unknown:
        raise _bad(value, f"unknown keys {unknown}; known: {sorted(known)}")
    threshold = _threshold(value.get("threshold"), value)
    quantize = value.get("quantize")
    if quantize is not None and (isinstance(quantize, bool) or quantize not in (8, 4)):
        raise _bad(value, "quantize must be 8 or 4")
    mode = value.get("mode", value.get("type"))
    if mode in (None, "diff"):
        mode = "lossy" if (threshold is not None or quantize is not None) else (
            "xor" if mode == "diff" else "dedup")
    if not isinstance(mode, str):
        raise _bad(value, "mode must be a string")
    mode = mode.lower()
    if mode in ("none", "full", "off"):
        return None
    if mode not in _MODES:
        raise _bad(value, f"mode must be one of {_MODES}")
    if mode != "lossy" and (threshold is not None or quantize is not None):
        raise _bad(value, f"threshold and quantize need mode 'lossy', not {mode!r}")
    if mode == "lossy" and threshold is None and quantize is None:
        quantize = 8
    scope = value.get("scope", DEFAULT_LOSSY_SCOPE)
    if isinstance(scope, str):
        scope = [scope]
    if not isinstance(scope, Sequence) or not scope or not all(
        isinstance(p, str) and p for p in scope
    ):
        raise _bad(value, "scope must be a non-empty list of key patterns")
    block = value.get("block", DEFAULT_BLOCK)
    if isinstance(block, bool) or not isinstance(block, int) or not (
        16 <= block <= 1 << 20 and block % 2 == 0
    ):
        raise _bad(value, "block must be an even int between 16 and 1048576")
    every = value.get("keyframe_every")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise _bad(value, "keyframe_every must be a positive int")
    return DeltaSpec(mode, threshold, quantize, tuple(scope), block, every)


def _threshold(raw: Any, value: Any) -> float | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not (
        math.isfinite(raw) and raw >= 0
    ):
        raise _bad(value, "threshold must be a finite number >= 0")
    return float(raw) if raw > 0 else None
