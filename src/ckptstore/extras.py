"""Optional dependencies: which ``ckptstore[...]`` extra brings which module.

Modules that use an optional package import it through :func:`require`, so a missing package
is one :class:`~ckptstore.errors.MissingExtraError` that names the extra to install (the
``ckpt`` command prints it as one line, exit 1), never a bare ``ModuleNotFoundError``.
The table below must name an extra that pyproject.toml declares (tests/test_packaging.py
checks both).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ckptstore.errors import MissingExtraError

__all__ = ["EXTRAS", "extra_for", "missing_extra", "require"]

#: Top-level module → the extra of pyproject.toml that installs it.
EXTRAS: dict[str, str] = {
    "fastapi": "ui",
    "uvicorn": "ui",
    "jinja2": "ui",
    "markupsafe": "ui",
    "prometheus_client": "metrics",
    "cryptography": "sign",
    "s3fs": "s3",
    "prefect": "flows",
    "croniter": "flows",
    "httpx": "flows",
    "safetensors": "safetensors",
    "tensorboard": "tensorboard",
    "lightning": "lightning",
    "transformers": "hf",
    "accelerate": "hf",
    "psycopg": "postgres",
}


def extra_for(module: str) -> str | None:
    """The extra that installs ``module`` (a dotted name is looked up by its top level)."""
    return EXTRAS.get(module.partition(".")[0])


def missing_extra(module: str, feature: str) -> MissingExtraError:
    """The error for ``feature`` lacking ``module``: one line naming the extra to install.

    Args:
        module: The module that cannot be imported (e.g. ``fastapi``).
        feature: What needs it, as a user knows it (e.g. ``ckpt ui``).

    Returns:
        The error, to raise (``raise missing_extra(...) from exc``).
    """
    extra = extra_for(module)
    top = module.partition(".")[0]
    if extra is None:  # not an extra of ours: name the package itself
        return MissingExtraError(
            f"{feature} needs the {top} package: pip install {top}", extra="", module=top
        )
    return MissingExtraError(
        f"{feature} needs the '{extra}' extra: pip install 'ckptstore[{extra}]' "
        f"({top} cannot be imported)",
        extra=extra,
        module=top,
    )


def require(module: str, feature: str) -> ModuleType:
    """Import an optional module, or raise the error that names its extra.

    Args:
        module: Module to import (``fastapi``, ``prefect.settings``, ...).
        feature: What needs it, as a user knows it (``ckpt ui``, ``signing``).

    Returns:
        The imported module.

    Raises:
        MissingExtraError: If it (or a package it needs) cannot be imported.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        # exc.name is the module that was really missing (fastapi itself, or a dependency of
        # it); the extra to install is still the one that brings ``module``.
        raise missing_extra(module, feature) from exc
