"""The ``zarr.json`` documents the writer builds are byte for byte the ones zarr writes.

:mod:`ckptstore.format.zarrmeta` builds the documents without importing zarr; these tests
have zarr write every array instead and compare, so a zarr release that writes its
documents differently fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec
from zarr.storage import MemoryStore

from ckptstore.format.codecs import ARRAY_CODECS, CodecSpec, codec_spec
from ckptstore.format.constants import MANIFEST_NAME, ZARR_JSON
from ckptstore.format.dcp.zarrdocs import array_doc
from ckptstore.format.dtypes import dtype_by_name, supported_dtype_names
from ckptstore.format.zarrmeta import ArrayMeta, build_metadata


def zarr_codecs(spec: CodecSpec, itemsize: int) -> list[Any]:
    """zarr's own bytes-to-bytes codecs for a preset: Blosc (bit-shuffle) if any, crc32c."""
    codecs: list[Any] = []
    if spec.cname is not None:
        codecs.append(BloscCodec(cname=spec.cname, clevel=spec.clevel,  # type: ignore[arg-type]
                                 shuffle="bitshuffle", typesize=itemsize, blocksize=0))
    codecs.append(Crc32cCodec())
    return codecs


def _zarr_documents(ckpt_id: str, arrays: list[ArrayMeta]) -> dict[str, bytes]:
    """What zarr itself writes for the group and every array, one ``create_array`` each."""
    store_dict: dict[str, Any] = {}
    store = MemoryStore(store_dict)
    zarr.open_group(store=store, mode="w", attributes={"ckptstore": {
        "format_version": 2, "id": ckpt_id, "manifest": MANIFEST_NAME}})
    for meta in arrays:
        attributes: dict[str, Any] = {} if meta.info.native else {"torch_dtype": meta.info.name}
        if meta.tensor is not None:
            attributes.update(tensor=meta.tensor, shape=list(meta.shape or ()),
                              torch_dtype=meta.info.name)
        zarr.create_array(
            store=store, name=meta.name, shape=(meta.length,), chunks=(meta.chunk_len,),
            dtype=meta.info.zarr_dtype, compressors=zarr_codecs(meta.spec, meta.info.itemsize),
            serializer=BytesCodec(), filters=None, fill_value=0, attributes=attributes,
        )
    return {k: v.to_bytes() for k, v in store_dict.items() if k.endswith(ZARR_JSON)}


def _metas() -> list[ArrayMeta]:
    metas: list[ArrayMeta] = []
    for i, name in enumerate(supported_dtype_names()):
        info = dtype_by_name(name)
        assert info is not None
        for codec in ARRAY_CODECS:
            spec = codec_spec(codec)
            metas.append(ArrayMeta(f"{name}_{codec}", 1000 + i, 256, info, spec))
            metas.append(ArrayMeta(f"tensors/layer.{i}.{codec}.w", 4096, 1024, info, spec,
                                   f"layer.{i}.{codec}.w", (64, 64)))
    metas.append(ArrayMeta("tensors/empty", 0, 1, info, codec_spec("none"), "empty", (0, 3)))
    metas.append(ArrayMeta("tensors/scalar", 1, 1, info, codec_spec("none"), "scalar", ()))
    return metas


def test_documents_equal_zarrs_own_for_every_dtype_and_codec() -> None:
    ckpt_id = "0f0e0d0c-0b0a-4908-8706-050403020100"
    metas = _metas()
    assert build_metadata(ckpt_id, metas) == _zarr_documents(ckpt_id, metas)


def test_a_group_only_checkpoint_has_just_the_root_document() -> None:
    docs = build_metadata("0f0e0d0c-0b0a-4908-8706-050403020100", [])
    assert list(docs) == [ZARR_JSON]


def test_dcp_documents_equal_zarrs_own_with_the_dot_separator() -> None:
    for name in supported_dtype_names():
        info = dtype_by_name(name)
        assert info is not None
        for codec in ARRAY_CODECS:
            spec = codec_spec(codec)
            store_dict: dict[str, Any] = {}
            zarr.create_array(
                store=MemoryStore(store_dict), name="t", shape=(6, 40), chunks=(3, 40),
                dtype=info.zarr_dtype, compressors=zarr_codecs(spec, info.itemsize),
                serializer=BytesCodec(), filters=None, fill_value=0,
                chunk_key_encoding={"name": "default", "separator": "."},
                attributes={} if info.native else {"torch_dtype": name},
            )
            assert array_doc(name, codec, (6, 40), (3, 40)) == store_dict[
                f"t/{ZARR_JSON}"].to_bytes(), (name, codec)


def test_the_formats_dtype_table_matches_torch() -> None:
    """The widths are written out so manifests are read without torch: each one must be
    torch's, and a stored dtype maps back to its own entry."""
    import torch

    from ckptstore.format.dtypes import dtype_info

    for name in supported_dtype_names():
        info = dtype_by_name(name)
        assert info is not None
        dtype = getattr(torch, name)
        assert info.torch_dtype is dtype
        assert info.itemsize == dtype.itemsize, name
        assert dtype_info(dtype) is info
        if not info.native:
            assert info.zarr_dtype == f"uint{8 * dtype.itemsize}"
    assert dtype_info(torch.float32) is not None
    assert dtype_by_name("float33") is None


def test_the_tree_validators_name_sets_match_torch() -> None:
    """A state's ``dtype`` and ``device`` leaves are validated from written-out names (no
    torch import to read a manifest): the dtype names are exactly torch's dtype attributes,
    and torch parses every listed device type (with and without an index)."""
    import warnings

    import torch

    from ckptstore.format.dtypes import DEVICE_TYPES, TORCH_DTYPE_ATTRS

    assert {
        k for k, v in vars(torch).items() if isinstance(v, torch.dtype)} == TORCH_DTYPE_ATTRS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates some of the types it still parses
        for kind in DEVICE_TYPES:
            assert torch.device(kind).type == kind
            assert torch.device(f"{kind}:3").index == 3
    with pytest.raises(RuntimeError):
        torch.device("nodevice")
