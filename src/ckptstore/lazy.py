"""Names a package exports but loads on first use (PEP 562 module ``__getattr__``).

The package roots (``ckptstore``, ``ckptstore.format``, ``ckptstore.format.dcp``) list their
public names in ``__all__`` and import them for type checkers only; at run time each name is
imported from its home module when first read. The catalog-only commands (``ckpt ls``,
``ckpt show``) import these packages without paying for torch or zarr
(tests/cli/test_startup.py).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports each name from its home.

    Args:
        package: The package's ``__name__``.
        homes: Exported name -> the module that defines it.

    Returns:
        The function to bind as the package's ``__getattr__``; a name it loads is stored in
        the package, so the next read is a plain attribute.
    """

    def __getattr__(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
