"""Records built from catalog rows (catalog/loading.py) are whole :class:`Checkpoint` values.

The loader fills a record's ``__dict__`` in one step instead of running the frozen
dataclass's ``__init__`` (a third of building a listing's records): every field must be set
all the same, and the record must be the one the constructor would build.
"""

from __future__ import annotations

import dataclasses

import pytest

from ckptstore.catalog import Catalog
from ckptstore.records import Checkpoint


def test_loaded_records_set_every_field_as_the_constructor_does(catalog: Catalog) -> None:
    catalog.ensure_run("a", experiment="e")
    ck = catalog.begin_checkpoint("a", 1, metrics={"loss": 0.5}, tags=["x"])
    catalog.commit_checkpoint(ck.id, manifest_digest="b3:" + "0" * 64, logical_bytes=3,
                              stored_bytes=2)
    catalog.alias(ck.id, "best")
    names = {field.name for field in dataclasses.fields(Checkpoint)}
    for record in (catalog.get(ck.id), *catalog.list(run="a"), *catalog.lineage(ck.id)):
        assert set(vars(record)) == names
        rebuilt = Checkpoint(**vars(record))
        assert record == rebuilt and repr(record) == repr(rebuilt)
        assert record.aliases == ("best",) and record.tags == ("x",)
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.step = 2  # type: ignore[misc]
