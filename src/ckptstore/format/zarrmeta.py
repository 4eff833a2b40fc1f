"""Zarr v3 metadata documents (``zarr.json``) for the group and its packed arrays.

The documents are produced by zarr itself, into an in-memory store, so they are exactly what
zarr would write; the writer then puts the bytes on disk with its own exclusive-create and
fsync discipline (zarr's local store neither refuses to overwrite nor fsyncs).
"""

from __future__ import annotations

import logging
from typing import Any

from ckptstore.errors import CkptError
from ckptstore.format.codecs import CodecSpec, zarr_codecs
from ckptstore.format.constants import FORMAT_VERSION, MANIFEST_NAME, ZARR_JSON
from ckptstore.format.dtypes import DtypeInfo

__all__ = ["ArrayMeta", "build_metadata"]

logger = logging.getLogger(__name__)

#: (array name, element count, chunk length, dtype info) for one packed array.
ArrayMeta = tuple[str, int, int, DtypeInfo]


def build_metadata(ckpt_id: str, arrays: list[ArrayMeta], spec: CodecSpec) -> dict[str, bytes]:
    """Return relative path -> ``zarr.json`` bytes for the group and each array.

    Args:
        ckpt_id: Checkpoint id, recorded in the group attributes.
        arrays: The packed arrays.
        spec: Codec preset of the chunks.
    """
    import zarr
    from zarr.codecs import BytesCodec
    from zarr.storage import MemoryStore

    store_dict: dict[str, Any] = {}
    store = MemoryStore(store_dict)
    zarr.open_group(
        store=store,
        mode="w",
        attributes={
            "ckptstore": {
                "format_version": FORMAT_VERSION,
                "id": ckpt_id,
                "manifest": MANIFEST_NAME,
            }
        },
    )
    for name, length, chunk_len, info in arrays:
        attributes: dict[str, Any] = {} if info.native else {"torch_dtype": info.name}
        zarr.create_array(
            store=store,
            name=name,
            shape=(length,),
            chunks=(chunk_len,),
            dtype=info.zarr_dtype,
            compressors=zarr_codecs(spec, info.itemsize),
            serializer=BytesCodec(),
            filters=None,
            fill_value=0,
            attributes=attributes,
        )
    docs = {key: value.to_bytes() for key, value in store_dict.items() if key.endswith(ZARR_JSON)}
    expected = 1 + len(arrays)
    if len(docs) != expected:  # zarr changed what it writes: refuse rather than guess
        raise CkptError(f"zarr wrote {sorted(docs)}; expected {expected} zarr.json documents")
    return docs
