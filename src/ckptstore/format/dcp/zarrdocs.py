"""``zarr.json`` documents for the DCP layout, made by zarr itself and reused as templates.

Creating an array through zarr costs milliseconds, and a DCP checkpoint has hundreds of
arrays, so zarr writes one document per (dtype, codec) into memory once and every array's
document is that template with its shape, chunk shape and attributes filled in. A test
checks that plain ``zarr.open_group`` reads every array back bit-exactly.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

from ckptstore.format.codecs import codec_spec, zarr_codecs
from ckptstore.format.constants import (
    DCP_ARRAY_GROUP,
    DCP_LAYOUT,
    DCP_PACK_GROUP,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ZARR_JSON,
)
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.manifest.dcpindex import DcpIndex

__all__ = ["array_doc", "dcp_documents", "group_doc", "root_doc"]

logger = logging.getLogger(__name__)

_TEMPLATES: dict[tuple[str, str], dict[str, Any]] = {}
_LOCK = threading.Lock()


def _template(dtype: str, codec: str) -> dict[str, Any]:
    key = (dtype, codec)
    with _LOCK:
        found = _TEMPLATES.get(key)
        if found is None:
            found = _TEMPLATES[key] = _make_template(dtype, codec)
        return found


def _make_template(dtype: str, codec: str) -> dict[str, Any]:
    import zarr
    from zarr.codecs import BytesCodec
    from zarr.storage import MemoryStore

    info = dtype_by_name(dtype)
    assert info is not None
    store_dict: dict[str, Any] = {}
    zarr.create_array(
        store=MemoryStore(store_dict),
        name="t",
        shape=(1,),
        chunks=(1,),
        dtype=info.zarr_dtype,
        compressors=zarr_codecs(codec_spec(codec), info.itemsize),
        serializer=BytesCodec(),
        filters=None,
        fill_value=0,
        chunk_key_encoding={"name": "default", "separator": "."},
    )
    doc: dict[str, Any] = json.loads(store_dict[f"t/{ZARR_JSON}"].to_bytes())
    return doc


def array_doc(dtype: str, codec: str, shape: Sequence[int], chunk_shape: Sequence[int]) -> bytes:
    """The ``zarr.json`` of one array.

    Args:
        dtype: Torch dtype name; dtypes numpy lacks (bfloat16, float8) are stored as the
            same-width unsigned int with ``{"torch_dtype": name}`` in the attributes.
        codec: Codec preset of its chunks.
        shape: Array shape.
        chunk_shape: Chunk shape.
    """
    doc = copy.deepcopy(_template(dtype, codec))
    doc["shape"] = list(shape)
    doc["chunk_grid"]["configuration"]["chunk_shape"] = list(chunk_shape)
    info = dtype_by_name(dtype)
    assert info is not None
    doc["attributes"] = {} if info.native else {"torch_dtype": info.name}
    return json.dumps(doc, indent=2).encode()


def group_doc(attributes: dict[str, Any] | None = None) -> bytes:
    """The ``zarr.json`` of a group."""
    doc = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": attributes or {},
    }
    return json.dumps(doc, indent=2).encode()


def root_doc(ckpt_id: str, format_version: int = FORMAT_VERSION) -> bytes:
    """The checkpoint's root group document, as the regular format writes it plus the layout."""
    return group_doc(
        {
            "ckptstore": {
                "format_version": format_version,
                "id": ckpt_id,
                "manifest": MANIFEST_NAME,
                "layout": DCP_LAYOUT,
            }
        }
    )


def dcp_documents(
    ckpt_id: str, index: DcpIndex, format_version: int = FORMAT_VERSION
) -> dict[str, bytes]:
    """Every ``zarr.json`` of a DCP checkpoint (relative path -> bytes), from its index.

    The ranks write the array documents and the coordinator the group ones, all through the
    functions above, so the bytes (and the digests the manifest records) are these.
    """
    docs = {
        ZARR_JSON: root_doc(ckpt_id, format_version),
        f"{DCP_ARRAY_GROUP}/{ZARR_JSON}": group_doc(),
        f"{DCP_PACK_GROUP}/{ZARR_JSON}": group_doc(),
    }
    # Groups between the root and the arrays (the per-rank layout's dcp_ranks/r<k>).
    for path in index.arrays:
        parts = path.split("/")
        for i in range(1, len(parts)):
            docs.setdefault(f"{'/'.join(parts[:i])}/{ZARR_JSON}", group_doc())
    for path, array in index.arrays.items():
        docs[f"{path}/{ZARR_JSON}"] = array_doc(array.dtype, index.codec, array.shape,
                                                array.chunk_shape)
    return docs
