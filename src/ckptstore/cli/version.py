"""What ``ckpt --version`` prints, without importing anything heavy."""

from __future__ import annotations

import importlib.metadata

__all__ = ["version_text"]


def version_text() -> str:
    """``"ckpt <version>"``: the installed distribution's version (the package's own when
    run from a source tree)."""
    try:
        version = importlib.metadata.version("ckptstore")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        from ckptstore import __version__ as version
    return f"ckpt {version}"
