"""The Zarr v3 codecs ckptstore declares where a plain reader must not read an array alone.

A copy of a checkpoint is *self-contained* when every chunk of an array is a plain chunk file
in the copy's own directory: any Zarr v3 reader then returns the exact bytes. Two things
break that, and the array's ``zarr.json`` then names one of these codecs first in its
bytes-to-bytes chain (docs/FORMAT.md, "Exact or loud"):

* ``ckptstore.chunk_ref`` — some chunks live in another checkpoint's directory on this tier
  (deduplicated chunks of a copy on S3, where there are no hard links);
* ``ckptstore.delta`` — some chunks are stored as deltas (XOR or quantized) against a base
  checkpoint's chunks.

A reader that does not know these names (tensorstore, zarr-python without ckptstore) refuses
to open the array: never zeros from a missing chunk, never garbage from a delta. With
ckptstore installed, zarr-python finds the classes here through the ``zarr.codecs`` entry
points and refuses at open with an error that says which checkpoints the array needs and
that ``ckpt compact`` makes the checkpoint self-contained. They never encode or decode: a
ckptstore load reads such arrays itself, from the manifest. The documents that declare them
are made by :mod:`ckptstore.format.zarrmeta`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptstore.errors import MissingBaseError
from ckptstore.format.constants import CHUNK_REF_CODEC, DELTA_CODEC

__all__ = ["ChunkRefCodec", "DeltaCodec"]


def _refusal(name: str, config: dict[str, Any]) -> MissingBaseError:
    checkpoint = config.get("checkpoint", "?")
    needs = ", ".join(str(n) for n in config.get("needs", [])) or "another checkpoint"
    if name == DELTA_CODEC:
        why = f"holds chunks stored as deltas against checkpoint {needs}"
    else:
        why = f"reads chunks that live in the directory of checkpoint {needs} on this tier"
    return MissingBaseError(
        f"this array of checkpoint {checkpoint} {why}, so a Zarr reader cannot return its "
        f"values alone: load it with ckptstore (store.load), or run `ckpt compact "
        f"{checkpoint}` to write a self-contained checkpoint"
    )


def _make(name: str) -> type:
    """A zarr-python codec class for ``name`` that refuses every array declaring it."""
    from zarr.abc.codec import BytesBytesCodec

    @dataclass(frozen=True)
    class _Refusing(BytesBytesCodec):  # type: ignore[misc]
        configuration: dict[str, Any]

        is_fixed_size = False

        @classmethod
        def from_dict(cls, data: dict[str, Any]) -> _Refusing:
            config = data.get("configuration") or {}
            return cls(configuration=dict(config) if isinstance(config, dict) else {})

        def to_dict(self) -> dict[str, Any]:
            return {"name": name, "configuration": dict(self.configuration)}

        def validate(self, *, shape: Any, dtype: Any, chunk_grid: Any) -> None:
            # Called when zarr opens the array: refuse before any chunk is read.
            raise _refusal(name, self.configuration)

        def compute_encoded_size(self, input_byte_length: int, chunk_spec: Any) -> int:
            raise _refusal(name, self.configuration)

        async def _decode_single(self, chunk_bytes: Any, chunk_spec: Any) -> Any:
            raise _refusal(name, self.configuration)

        async def _encode_single(self, chunk_bytes: Any, chunk_spec: Any) -> Any:
            raise _refusal(name, self.configuration)

    _Refusing.__name__ = _Refusing.__qualname__ = (
        "ChunkRefCodec" if name == CHUNK_REF_CODEC else "DeltaCodec"
    )
    return _Refusing


#: zarr-python codec for :data:`~ckptstore.format.constants.CHUNK_REF_CODEC` (entry point).
ChunkRefCodec = _make(CHUNK_REF_CODEC)
#: zarr-python codec for :data:`~ckptstore.format.constants.DELTA_CODEC` (entry point).
DeltaCodec = _make(DELTA_CODEC)
