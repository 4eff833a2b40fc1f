"""``zarr.json`` documents for the DCP layout.

Every array's document is the template of its dtype and codec chain
(:func:`ckptstore.format.zarrmeta.array_template`, chunk key separator ``.``) with its shape,
chunk shape and attributes filled in. A test checks that plain ``zarr.open_group`` reads
every array back bit-exactly.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptstore.format.codecs import codec_spec
from ckptstore.format.constants import (
    DCP_ARRAY_GROUP,
    DCP_LAYOUT,
    DCP_PACK_GROUP,
    DCP_RANK_GROUP,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ZARR_JSON,
)
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.manifest.dcpindex import DcpIndex
from ckptstore.format.zarrmeta import array_template

if TYPE_CHECKING:
    from ckptstore.format.manifest import Manifest

__all__ = ["array_doc", "dcp_documents", "group_doc", "root_doc", "shared_docs"]

logger = logging.getLogger(__name__)


def array_doc(dtype: str, codec: str, shape: Sequence[int], chunk_shape: Sequence[int]) -> bytes:
    """The ``zarr.json`` of one array.

    Args:
        dtype: Torch dtype name; dtypes numpy lacks (bfloat16, float8) are stored as the
            same-width unsigned int with ``{"torch_dtype": name}`` in the attributes.
        codec: Codec preset of its chunks.
        shape: Array shape.
        chunk_shape: Chunk shape.
    """
    info = dtype_by_name(dtype)
    assert info is not None
    doc = array_template(info, codec_spec(codec), separator=".")
    doc["shape"] = list(shape)
    doc["chunk_grid"]["configuration"]["chunk_shape"] = list(chunk_shape)
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


def shared_docs(manifest: Manifest) -> dict[str, bytes]:
    """The documents every copy of a DCP checkpoint holds besides its data: the root and
    group ``zarr.json`` files, derived from the manifest (so a host that holds only its own
    part regenerates exactly the bytes the coordinator wrote).
    """
    assert manifest.dcp is not None
    docs = {
        f"{DCP_ARRAY_GROUP}/{ZARR_JSON}": group_doc(),
        f"{DCP_PACK_GROUP}/{ZARR_JSON}": group_doc(),
    }
    if any(path.startswith(DCP_RANK_GROUP + "/") for path in manifest.dcp.arrays):
        docs[f"{DCP_RANK_GROUP}/{ZARR_JSON}"] = group_doc()
    docs[ZARR_JSON] = root_doc(manifest.id)
    return docs
