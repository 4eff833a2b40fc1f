"""The catalog's record of how approximate a checkpoint is, read from its manifest.

Shared by every path that commits a checkpoint to a catalog (a save, a push or pull, a
bundle import). It reads the manifest only, so pushing and importing never import torch
(tests/cli/test_startup.py).
"""

from __future__ import annotations

from typing import Any

from ckptstore.format.manifest import Manifest

__all__ = ["lossy_record"]


def lossy_record(manifest: Manifest) -> dict[str, Any]:
    """The commit arguments ``lossy``, ``error_bound`` and ``lossy_scope`` of a checkpoint.

    Taken from the manifest at commit, not from the plan: only the writer knows the measured
    error, and a lossy save whose chunks all had to be stored exactly is not lossy at all.
    """
    info = manifest.delta
    if info is None or not info.lossy:
        return {"lossy": False}
    return {"lossy": True, "error_bound": info.max_abs_error, "lossy_scope": info.scope}
