"""Whether two stores' tiers overlap: the rule that keeps a remote from destroying this store.

Two stores that share a directory or an object prefix each believe they own what lies there:
a push whose destination is the source's own directory "cleans up" the source, one store's gc
removes the other's committed checkpoints as orphans. So no tier of a remote may be the same
as, inside, or above any tier of this store. Local tiers are compared after resolving
symlinks and ``..`` (a tier that does not exist yet is resolved as far as it exists); S3 tiers
by bucket and key prefix (endpoints are not compared: two spellings of one endpoint must not
let an overlap through, and two buckets of one name on different endpoints are rare enough to
refuse).

The rule is checked from the remote's *settings*, before its store is opened: opening a store
creates its hot tier and marker, which must not land inside this store either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ckptstore.errors import RemoteError

__all__ = ["Location", "check_no_overlap", "location", "overlap"]


class TierUrls(Protocol):
    """What :class:`ckptstore.config.Settings` offers here."""

    def tier_urls(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class Location:
    """Where a tier lives, normalised for comparison.

    Attributes:
        scheme: ``file`` or ``s3``.
        parts: Path components (``file``: of the resolved absolute path; ``s3``: the bucket,
            then the key prefix's components).
    """

    scheme: str
    parts: tuple[str, ...]

    def __str__(self) -> str:
        if self.scheme == "s3":
            return "s3://" + "/".join(self.parts)
        return "/" + "/".join(self.parts)


def location(url: str) -> Location:
    """The :class:`Location` of a tier URL (a path, ``file://`` or ``s3://bucket/prefix``)."""
    if url.startswith("s3://"):
        parts = tuple(p for p in url[len("s3://"):].split("/") if p not in ("", "."))
        return Location("s3", parts)
    text = url[len("file://"):] if url.startswith("file://") else url
    # realpath: symlinks and ``..`` resolved as far as the path exists.
    resolved = Path(os.path.realpath(Path(text).expanduser()))
    return Location("file", resolved.parts[1:])


def overlap(a: Location, b: Location) -> str | None:
    """How ``a`` relates to ``b``: ``"the same as"``, ``"inside"``, ``"above"`` or None."""
    if a.scheme != b.scheme:
        return None
    if a.parts == b.parts:
        return "the same as"
    if a.parts[: len(b.parts)] == b.parts:
        return "inside"
    if b.parts[: len(a.parts)] == a.parts:
        return "above"
    return None


def check_no_overlap(mine: TierUrls, theirs: TierUrls, remote: str) -> None:
    """Refuse a remote any of whose tiers overlaps a tier of this store.

    Args:
        mine: This store's settings.
        theirs: The remote's settings.
        remote: The remote's name, for the message.

    Raises:
        RemoteError: Naming both tiers and how they overlap.
    """
    ours = {name: location(url) for name, url in mine.tier_urls().items()}
    for name, url in theirs.tier_urls().items():
        there = location(url)
        for my_name, here in ours.items():
            how = overlap(there, here)
            if how is not None:
                raise RemoteError(
                    f"remote {remote!r}: its {name} tier ({there}) is {how} this store's "
                    f"{my_name} tier ({here}); two stores must never share a directory or "
                    "an object prefix (each would take the other's files for its own). "
                    "Point the remote's tiers elsewhere"
                )
