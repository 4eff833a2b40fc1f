"""Turn a training state into tensors + a JSON skeleton, and back.

Supported containers: ``dict`` and ``collections.OrderedDict`` (insertion order and key types
kept; keys may be str, int, float, bool or None), ``list`` and ``tuple``. Supported leaves:
dense strided ``torch.Tensor`` / ``nn.Parameter`` of any dtype in
:mod:`ckptstore.format.dtypes`, ``numpy.ndarray`` of bool/int/uint/float/complex dtype
(stored as a tensor, returned as an ndarray in native byte order), numpy scalars of those
kinds (returned as the same numpy scalar type), ``int`` (any size), ``float`` (nan, inf and
-0.0 bit-exact), ``str``, ``bool``, ``None``, ``bytes``, ``torch.Size``, ``torch.dtype`` and
``torch.device``.

Everything else is refused with :class:`~ckptstore.errors.UnsafeObjectError` naming the key
path, because storing it would need pickle: custom classes, sets, lambdas, subclasses of the
supported types (``IntEnum``, ``defaultdict``, namedtuples: convert with ``._asdict()``),
sparse/quantized/meta tensors and tensor subclasses such as DTensor.

Tensor identity: the same tensor object, or two tensors viewing exactly the same memory with
the same shape, strides and dtype (tied weights in a ``state_dict``), is stored once; every
later occurrence refers to the first key and loads as the very same tensor object.
``requires_grad`` is not stored: loaded tensors are plain CPU tensors.
"""

from __future__ import annotations

import base64
import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptstore.errors import IntegrityError, InvalidNameError, UnsafeObjectError
from ckptstore.format.constants import MAX_TREE_DEPTH
from ckptstore.format.dtypes import dtype_info
from ckptstore.format.keys import join_key, render_path
from ckptstore.format.tree import decode_scalar, encode_scalar

__all__ = ["FlatState", "as_flat", "flatten_state", "rebuild_state", "unflatten_state"]

logger = logging.getLogger(__name__)

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_NUMPY_KINDS = frozenset("biufc")


@dataclass(frozen=True)
class FlatState:
    """A flattened state.

    Attributes:
        tensors: Tensor key -> tensor, in first-occurrence (flatten) order. ndarray leaves
            appear here as tensors sharing their memory.
        tree: The JSON-able skeleton (see :mod:`ckptstore.format.tree`).
    """

    tensors: dict[str, torch.Tensor]
    tree: Any


@dataclass
class _Flattener:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    by_id: dict[int, str] = field(default_factory=dict)
    by_view: dict[tuple[Any, ...], str] = field(default_factory=dict)
    # Keeps originals alive so id() values cannot be recycled during the walk.
    keepalive: list[Any] = field(default_factory=list)
    subclass: Callable[[torch.Tensor, str], torch.Tensor] | None = None

    def visit(self, obj: Any, path: str, depth: int) -> Any:
        kind = type(obj)
        if obj is None or kind is bool or kind is str:
            return obj
        if kind is int or kind is float:
            return encode_scalar(obj)
        if kind is bytes:
            return {"t": "bytes", "v": base64.b64encode(obj).decode("ascii")}
        if kind is torch.Size:
            return {"t": "size", "v": [int(d) for d in obj]}
        if kind is torch.dtype:
            return {"t": "dtype", "v": str(obj).removeprefix("torch.")}
        if kind is torch.device:
            return {"t": "device", "v": str(obj)}
        if isinstance(obj, torch.Tensor):
            return {"t": "tensor", "key": self.tensor(obj, path)}
        if kind is np.ndarray or kind is np.memmap:
            return {"t": "ndarray", "key": self.ndarray(obj, path)}
        if isinstance(obj, np.generic):
            return self.np_scalar(obj, path)
        if kind in (dict, OrderedDict, list, tuple):
            if depth >= MAX_TREE_DEPTH:
                raise UnsafeObjectError(
                    f"state at {render_path(path)} is nested deeper than {MAX_TREE_DEPTH} "
                    "containers (or contains itself); flatten it first"
                )
            return self.container(obj, path, depth)
        raise UnsafeObjectError(
            f"cannot store {kind.__module__}.{kind.__qualname__} at {render_path(path)}: "
            "only tensors, ndarrays, numbers, str, bytes, None, torch.Size/dtype/device and "
            "dict/OrderedDict/list/tuple of them are stored without pickle; convert it "
            "(e.g. to a dict) or drop it from the state"
        )

    def container(self, obj: Any, path: str, depth: int) -> Any:
        if isinstance(obj, list | tuple):
            tag = "list" if isinstance(obj, list) else "tuple"
            items = [self.visit(v, join_key(path, i), depth + 1) for i, v in enumerate(obj)]
            return {"t": tag, "v": items}
        keys: list[Any] = []
        values: list[Any] = []
        for key, value in obj.items():
            if not (key is None or type(key) in (bool, int, float, str)):
                raise UnsafeObjectError(
                    f"dict key {key!r} of type {type(key).__name__} under {render_path(path)} "
                    "is not storable; use str, int, float, bool or None keys"
                )
            keys.append(key if key is None or type(key) in (bool, str) else encode_scalar(key))
            values.append(self.visit(value, join_key(path, key), depth + 1))
        return {"t": "odict" if type(obj) is OrderedDict else "dict", "k": keys, "v": values}

    def tensor(self, t: torch.Tensor, path: str) -> str:
        if self.subclass is not None and type(t) not in _TENSOR_TYPES:
            t = self.subclass(t, path)
        where = render_path(path)
        if type(t) not in _TENSOR_TYPES:
            raise UnsafeObjectError(
                f"tensor subclass {type(t).__qualname__} at {where} is not storable; "
                "convert it to a plain tensor first (e.g. DTensor.full_tensor())"
            )
        if t.layout != torch.strided:
            raise UnsafeObjectError(
                f"tensor at {where} has layout {t.layout}; only dense tensors are stored "
                "(call .to_dense())"
            )
        if t.is_quantized:
            raise UnsafeObjectError(
                f"quantized tensor at {where} is not storable; dequantize it first"
            )
        if t.device.type == "meta":
            raise UnsafeObjectError(f"meta tensor at {where} has no data to store")
        if dtype_info(t.dtype) is None:
            raise UnsafeObjectError(f"tensor at {where} has unsupported dtype {t.dtype}")
        known = self.by_id.get(id(t))
        if known is not None:
            return known
        view = None
        if t.numel() > 0:
            view = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
                t.dtype,
                t.device,
            )
            known = self.by_view.get(view)
            if known is not None:
                self.by_id[id(t)] = known
                return known
        if path in self.tensors:
            raise InvalidNameError(
                f"two leaves render to the same key {where} (e.g. keys 1 and '1' in one "
                "dict); rename one of them"
            )
        self.tensors[path] = t
        self.by_id[id(t)] = path
        self.keepalive.append(t)
        if view is not None:
            self.by_view[view] = path
        return path

    def ndarray(self, arr: np.ndarray[Any, Any], path: str) -> str:
        known = self.by_id.get(id(arr))
        if known is not None:
            return known
        if arr.dtype.kind not in _NUMPY_KINDS or arr.dtype.fields is not None:
            raise UnsafeObjectError(
                f"ndarray at {render_path(path)} has dtype {arr.dtype}; only bool, int, "
                "uint, float and complex arrays are stored"
            )
        native = arr
        if not native.dtype.isnative:
            native = native.astype(native.dtype.newbyteorder("="))
        # torch.from_numpy needs C order and warns on read-only memory: copy only then.
        native = np.require(native, requirements=["C", "W"])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tensor = torch.from_numpy(native)
        except TypeError as exc:
            raise UnsafeObjectError(
                f"ndarray at {render_path(path)} has dtype {arr.dtype}, which torch lacks"
            ) from exc
        self.keepalive.append(arr)
        key = self.tensor(tensor, path)
        self.by_id[id(arr)] = key
        return key

    def np_scalar(self, value: np.generic, path: str) -> Any:
        dtype = value.dtype
        if dtype.kind not in _NUMPY_KINDS or dtype.itemsize > 16:
            raise UnsafeObjectError(
                f"numpy scalar of dtype {dtype} at {render_path(path)} is not storable"
            )
        return {"t": "np", "dtype": dtype.str, "v": value.tobytes().hex()}


def flatten_state(
    state: Any, *, subclass: Callable[[torch.Tensor, str], torch.Tensor] | None = None
) -> FlatState:
    """Split ``state`` into its tensors and a JSON skeleton.

    Tensor keys follow :mod:`ckptstore.format.keys`. Tensors are returned as given (no copy,
    any device); the writer takes care of getting their bytes.

    Args:
        state: The state.
        subclass: Called as ``subclass(tensor, key)`` for a tensor subclass (a DTensor, say):
            the plain tensor it returns is stored in its place, in the same walk (a snapshot
            of a sharded state stores each DTensor's local shard); what it returns unchanged
            is refused as without it.

    Raises:
        UnsafeObjectError: If the state holds something that would need pickle; the message
            names its key path.
        InvalidNameError: If two leaves render to the same key.
    """
    flattener = _Flattener(subclass=subclass)
    tree = flattener.visit(state, "", 0)
    return FlatState(tensors=flattener.tensors, tree=tree)


def as_flat(state: Any) -> FlatState:
    """``state`` flattened, or ``state`` itself when it already is a :class:`FlatState`.

    A save flattens its state once, where it first needs to refuse what cannot be stored,
    and hands the result down (async staging, the writer, the memory tier); each of them
    calls this instead of walking the state again.

    Raises:
        UnsafeObjectError: As :func:`flatten_state`.
        InvalidNameError: As :func:`flatten_state`.
    """
    return state if isinstance(state, FlatState) else flatten_state(state)


def unflatten_state(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild a state from its skeleton and its tensors.

    A key referenced twice (tied weights) yields the same object both times; ndarray leaves
    come back as ``tensor.numpy()`` (sharing memory with the tensor).

    Raises:
        IntegrityError: If the tree is malformed or references a tensor not in ``tensors``.
    """
    return rebuild_state(tree, tensors, {})


def rebuild_state(
    tree: Any, tensors: Mapping[str, torch.Tensor], arrays: dict[str, np.ndarray[Any, Any]]
) -> Any:
    """Like :func:`unflatten_state`, with ``arrays`` supplying ndarray leaves by key.

    The reader passes the caller's own ndarrays here when it loaded into them in place.
    """
    try:
        return _build(tree, tensors, arrays)
    except (KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(f"cannot rebuild the state from its tree: {exc}") from exc


def _build(node: Any, tensors: Mapping[str, torch.Tensor], arrays: dict[str, Any]) -> Any:
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if not isinstance(node, dict):
        raise ValueError(f"unexpected tree node of type {type(node).__name__}")
    tag = node["t"]
    if tag in ("list", "tuple"):
        items = [_build(child, tensors, arrays) for child in node["v"]]
        return items if tag == "list" else tuple(items)
    if tag in ("dict", "odict"):
        pairs = (
            (decode_scalar(k), _build(v, tensors, arrays))
            for k, v in zip(node["k"], node["v"], strict=True)
        )
        return dict(pairs) if tag == "dict" else OrderedDict(pairs)
    if tag == "tensor":
        key = node["key"]
        if key not in tensors:
            raise KeyError(f"tensor {render_path(key)} is missing")
        return tensors[key]
    if tag == "ndarray":
        key = node["key"]
        if key not in arrays:
            if key not in tensors:
                raise KeyError(f"tensor {render_path(key)} is missing")
            arrays[key] = tensors[key].detach().cpu().numpy()
        return arrays[key]
    if tag in ("int", "float"):
        return decode_scalar(node)
    if tag == "bytes":
        return base64.b64decode(node["v"], validate=True)
    if tag == "size":
        return torch.Size(int(d) for d in node["v"])
    if tag == "dtype":
        dtype = getattr(torch, node["v"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{node['v']!r} is not a torch dtype")
        return dtype
    if tag == "device":
        return torch.device(node["v"])
    if tag == "np":
        return np.frombuffer(bytes.fromhex(node["v"]), dtype=np.dtype(node["dtype"]))[0]
    raise ValueError(f"unknown tree node tag {tag!r}")
