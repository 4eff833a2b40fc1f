"""Progressive restore, planning: split a checkpoint's tensors into priority groups.

Pure: works on a manifest only. :func:`plan_groups` gives each group its tensor keys, the
fewest subtree patterns that select exactly them (so each group is read with one
:func:`ckptstore.format.read_checkpoint` call) and its size; the loading itself is in
:mod:`ckptstore.ops.reading.progressive`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ckptstore.errors import InvalidNameError
from ckptstore.format import Manifest
from ckptstore.format.keys import key_matches
from ckptstore.format.tree import iter_tensor_refs

__all__ = ["GroupPlan", "Order", "plan_groups"]

#: Priority order: each item is one group, given as one fnmatch pattern or several.
Order = Sequence[str | Sequence[str]]

_GLOB_SPECIAL = re.compile(r"([*?\[])")


@dataclass(frozen=True)
class GroupPlan:
    """One priority group.

    Attributes:
        index: Position in load order.
        patterns: The caller's patterns for it (empty for the final "everything else" group).
        paths: Paths of the tensors it loads, in state order.
        keys: Their tensor keys (a tied tensor's key is that of its first occurrence).
        select: Patterns that select exactly those paths (given to ``read_checkpoint``).
        nbytes: Logical bytes of its tensors.
    """

    index: int
    patterns: tuple[str, ...]
    paths: tuple[str, ...]
    keys: tuple[str, ...]
    select: tuple[str, ...]
    nbytes: int


def _escape(path: str) -> str:
    return _GLOB_SPECIAL.sub(r"[\1]", path)


def _prefixes(path: str) -> list[str]:
    """``"a/b/c"`` -> ``["a", "a/b", "a/b/c"]`` (components never hold a raw ``/``)."""
    out = []
    end = path.find("/")
    while end != -1:
        out.append(path[:end])
        end = path.find("/", end + 1)
    out.append(path)
    return out


def _cover(group: Sequence[list[str]], total: Counter[str]) -> tuple[str, ...]:
    """The fewest subtree patterns selecting exactly one group's paths among all tensor paths.

    ``group`` holds each path's prefixes (:func:`_prefixes`). ``read_checkpoint`` matches
    every pattern against every node, so thousands of exact keys would cost seconds; whole
    subtrees keep the list short for the usual groups.
    """
    inside: Counter[str] = Counter()
    for prefixes in group:
        inside.update(prefixes)
    chosen: dict[str, None] = {}
    for prefixes in group:
        for prefix in prefixes:
            if inside[prefix] == total[prefix]:
                chosen.setdefault(prefix)
                break
    return tuple(_escape(p) for p in chosen)


def _matches(path: str, pattern: str) -> bool:
    """:func:`~ckptstore.format.keys.key_matches` for one pattern, fast for literal ones."""
    if _GLOB_SPECIAL.search(pattern) is None:
        return path == pattern or path.startswith(pattern + "/")
    return key_matches(path, [pattern])


def plan_groups(manifest: Manifest, order: Order, *, strict: bool = True) -> list[GroupPlan]:
    """Split a checkpoint's tensors into priority groups.

    A tensor belongs to the first group with a pattern matching its path (fnmatch, with
    ``"model"`` meaning everything under ``model/`` too, as for ``load(keys=...)``); tensors
    no group claims form a last group. Groups left empty are dropped.

    Args:
        manifest: The checkpoint's manifest.
        order: Groups in load order; each a pattern or a sequence of patterns.
        strict: Raise when a pattern matches no tensor (a typo would silently reorder).

    Returns:
        The non-empty groups in load order.

    Raises:
        InvalidNameError: If ``order`` is malformed, or (``strict``) a pattern matches nothing.
    """
    groups: list[tuple[str, ...]] = []
    for item in order:
        patterns = (item,) if isinstance(item, str) else tuple(item)
        if not patterns or not all(isinstance(p, str) for p in patterns):
            raise InvalidNameError(
                f"each item of order must be a pattern or a list of patterns, got {item!r}"
            )
        groups.append(patterns)
    refs = [(path, key, _prefixes(path)) for path, _tag, key in iter_tensor_refs(manifest.tree)]
    total: Counter[str] = Counter()
    for _path, _key, prefixes in refs:
        total.update(prefixes)
    members: list[list[tuple[str, str, list[str]]]] = [[] for _ in range(len(groups) + 1)]
    used: set[str] = set()
    for ref in refs:
        for index, patterns in enumerate(groups):
            hits = [p for p in patterns if _matches(ref[0], p)]
            if hits:
                used.update(hits)
                members[index].append(ref)
                break
        else:
            members[-1].append(ref)
    unused = [p for patterns in groups for p in patterns if p not in used]
    if strict and unused:
        some = ", ".join(path for path, _k, _p in refs[:8]) or "(none)"
        raise InvalidNameError(
            f"order patterns {unused} match no tensor of checkpoint {manifest.id}; tensor paths "
            f"look like: {some} (pass strict=False to allow patterns that match nothing)"
        )
    plans: list[GroupPlan] = []
    for index, group in enumerate(members):
        if not group:
            continue
        keys = tuple(dict.fromkeys(key for _path, key, _p in group))
        plans.append(
            GroupPlan(
                index=len(plans),
                patterns=groups[index] if index < len(groups) else (),
                paths=tuple(path for path, _key, _p in group),
                keys=keys,
                select=_cover([p for _path, _key, p in group], total),
                nbytes=sum(manifest.tensors[k].numel * _itemsize(manifest, k) for k in keys),
            )
        )
    return plans


def _itemsize(manifest: Manifest, key: str) -> int:
    return manifest.arrays[manifest.tensors[key].array].itemsize
