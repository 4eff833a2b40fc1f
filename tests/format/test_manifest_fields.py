"""The format's own data in manifest.extra: typed fields in Python, the same JSON on disk."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from ckptstore.errors import IntegrityError, InvalidNameError
from ckptstore.format import FileEntry, Manifest, chunk_files
from ckptstore.format.constants import FILES_KEY, REENCODED_FROM_KEY

DIGEST = "ab" * 32


def _reparsed(manifest: Manifest, **extra: Any) -> bytes:
    """The manifest's JSON with ``extra`` replaced (as an older or hostile writer wrote it)."""
    doc = json.loads(manifest.to_json())
    doc["extra"] = extra
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def test_typed_fields_are_written_under_their_extra_keys(save: Any) -> None:
    _, manifest = save({"w": torch.ones(4)}, extra={"note": "kept"})
    files = (FileEntry("other/a", 12, 7), FileEntry("other/zarr.json", 3, None))
    typed = dataclasses.replace(manifest, files=files, reencoded_from=DIGEST)
    data = typed.to_json()
    extra = json.loads(data)["extra"]
    assert extra == {"note": "kept", FILES_KEY: [["other/a", 12, 7], ["other/zarr.json", 3, None]],
                     REENCODED_FROM_KEY: DIGEST}
    again = Manifest.from_json(data)
    assert again == typed and again.to_json() == data
    assert again.extra == {"note": "kept"}
    assert again.files == files and again.reencoded_from == DIGEST
    assert chunk_files(again)[-6:-4] == ["other/a", "other/zarr.json"]


@pytest.mark.parametrize("empty", [{FILES_KEY: None}, {FILES_KEY: []}, {REENCODED_FROM_KEY: ""},
                                   {"dcp": None}])
def test_keys_holding_nothing_stay_metadata_and_keep_their_bytes(save: Any,
                                                                 empty: dict[str, Any]) -> None:
    _, manifest = save({"w": torch.ones(4)})
    data = _reparsed(manifest, **empty)
    again = Manifest.from_json(data)
    assert again.extra == empty
    assert again.files == () and again.reencoded_from is None and again.dcp is None
    assert again.to_json() == data


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({REENCODED_FROM_KEY: "not-a-digest"}, "reencoded_from"),
        ({REENCODED_FROM_KEY: 1}, "reencoded_from"),
        ({FILES_KEY: "x"}, "files must be a list"),
        ({FILES_KEY: [["../escape", 1, None]]}, "not allowed"),
        ({FILES_KEY: [["SIGNATURE", 1, None]]}, "not allowed"),
        ({"dcp": "yes"}, "DCP index"),
        ({"dcp": {"version": 1}}, "invalid DCP index"),
    ],
)
def test_format_keys_are_checked_when_read(save: Any, extra: dict[str, Any],
                                           message: str) -> None:
    _, manifest = save({"w": torch.ones(4)})
    with pytest.raises(IntegrityError, match=message):
        Manifest.from_json(_reparsed(manifest, **extra))


@pytest.mark.parametrize("key", ["dcp", FILES_KEY, REENCODED_FROM_KEY])
def test_callers_cannot_write_format_keys(save: Any, key: str) -> None:
    with pytest.raises(InvalidNameError, match="reserved"):
        save({"w": torch.ones(2)}, extra={key: "mine"})
    _, manifest = save({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="fields"):
        dataclasses.replace(manifest, extra={key: "mine"})
