"""What a save records and how it is encoded, as one value: :class:`SaveOptions`.

``CheckpointStore.save`` and ``save_async`` take these as keyword arguments and build the value
once; below them, the save operation, the async saver, the checkpoint manager, the DCP
writer and the framework adapters hand it on whole instead of spelling the options out
again. It is a plain value (no I/O, no checks that need the catalog): the save operation
validates it (:func:`ckptstore.ops.writing.save.check_save`).
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LATEST", "Latest", "SaveOptions", "options_of"]


class Latest(enum.Enum):
    """Type of :data:`LATEST`."""

    LATEST = "latest"


#: ``base=`` default of a save: the run's latest committed checkpoint.
LATEST = Latest.LATEST


@dataclass(frozen=True)
class SaveOptions:
    """Everything a save takes besides the run, the step and the state.

    The value is a snapshot: ``metrics`` and ``tags`` (and a ``delta`` table) are copied when
    it is made, so a caller may change its own dict or list as soon as the save call returns,
    even when the save itself runs later in the background.

    Attributes:
        metrics: Numbers recorded with the checkpoint (checked to be finite by the save).
        tags: Labels for filtering.
        parent: Reference of the checkpoint the run was resumed or fine-tuned from.
        codec: Codec preset (None: the store's ``codec`` setting).
        experiment: Experiment the run is filed under (on the run's first save).
        delta: How the save is encoded against ``base`` (None: the store's ``delta``
            setting); see :meth:`ckptstore.store.CheckpointStore.save`.
        base: The checkpoint to encode against: :data:`LATEST` (the run's latest committed
            one), a reference, or None for a full save.
        config: The run's training configuration, recorded with its context (a mapping or
            an object with ``to_dict()``; made JSON-safe, secrets masked, by
            :mod:`ckptstore.capture`).
        data_version: The data set's version, recorded with the run's context.
    """

    metrics: Mapping[str, Any] | None = None
    tags: tuple[str, ...] = ()
    parent: str | None = None
    codec: str | None = None
    experiment: str | None = None
    delta: Any = None
    base: str | Latest | None = LATEST
    config: Any = None
    data_version: str | None = None

    def __post_init__(self) -> None:
        """Take the snapshot (frozen: set through ``object.__setattr__``)."""
        if self.metrics is not None:
            object.__setattr__(self, "metrics", dict(self.metrics))
        object.__setattr__(self, "tags", tuple(self.tags))
        if isinstance(self.delta, Mapping | list):
            object.__setattr__(self, "delta", copy.deepcopy(self.delta))
        if isinstance(self.config, Mapping):
            try:
                config = copy.deepcopy(dict(self.config))
            except Exception:  # an object that cannot be copied (a module, a lock, ...):
                config = dict(self.config)  # the capture records it as text anyway
            object.__setattr__(self, "config", config)

    @property
    def default_encoding(self) -> bool:
        """Whether ``delta`` and ``base`` are left to the store (the setting, the latest)."""
        return self.delta is None and self.base is LATEST


def options_of(options: SaveOptions | None = None, **fields: Any) -> SaveOptions:
    """The options a call was given: ``options``, or the same as keywords.

    For the entry points that users also call with keywords (the async saver's ``submit``,
    the DCP writer).

    Raises:
        TypeError: For both ``options`` and keywords, or a keyword that is no field.
    """
    if not fields:
        return options if options is not None else SaveOptions()
    if options is not None:
        raise TypeError("pass the save's options either as options= or as keywords, not both")
    return SaveOptions(**fields)
