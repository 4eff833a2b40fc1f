"""Remotes: other stores this one pushes checkpoints to and pulls them from.

A remote is a name for another store's config file; opening it opens that store (its
catalog and tiers) exactly as any command given that config file would. The list lives in
the catalog (:mod:`ckptstore.catalog.remotes`), so every host sharing a catalog sees the same
remotes.

A remote must be another store that shares no directory or object prefix with this one: its
config is read and its tiers are compared with ours (:mod:`ckptstore.ops.sharing.overlap`)
*before* its store is opened (opening creates its hot tier), when it is added and again
every time it is opened, since its config file can change after it was added.
Moving checkpoints between the two is :mod:`ckptstore.ops.sharing.push`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptstore.catalog.remotes import RemoteInfo
from ckptstore.config import load_settings
from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, ConfigError, RemoteError
from ckptstore.names import validate_name
from ckptstore.ops.sharing.overlap import check_no_overlap

__all__ = ["RemoteInfo", "add_remote", "list_remotes", "open_remote", "remove_remote",
           "store_id"]


def _config_path(config: str | os.PathLike[str]) -> Path:
    """The config file as an absolute path, readable, or RemoteError."""
    path = Path(config).expanduser()
    try:
        path = path.resolve(strict=True)
    except OSError as exc:
        raise RemoteError(f"remote config {config} cannot be read ({exc.strerror or exc}); "
                          "give the path of the other store's config file") from exc
    if not path.is_file() or not os.access(path, os.R_OK):
        raise RemoteError(f"remote config {path} is not a readable file; give the path of "
                          "the other store's config file")
    return path


def _open(core: StoreCore, path: Path, name: str) -> StoreCore:
    """Open the store ``path`` configures, once its settings show it is another store whose
    tiers overlap none of ``core``'s."""
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        raise RemoteError(f"remote {name!r}: config {path} is not a valid store config: "
                          f"{exc}") from exc
    if settings.resolved_catalog_url == core.settings.resolved_catalog_url:
        raise RemoteError(f"config {path} opens this very store (the same catalog); a remote "
                          "must be another store")
    check_no_overlap(core.settings, settings, name)
    try:
        return StoreCore.open(config=path)
    except RemoteError:
        raise
    except ConfigError as exc:
        raise RemoteError(f"remote {name!r}: config {path} is not a valid store config: "
                          f"{exc}") from exc


def store_id(core: StoreCore) -> str:
    """The id of the store ``core`` opened (recorded by its first open)."""
    identity = core.catalog.store_identity()
    return identity.store_id if identity is not None else ""


def add_remote(core: StoreCore, name: str, config: str | os.PathLike[str]) -> RemoteInfo:
    """Record remote ``name``: the store that ``config`` opens.

    The remote store is opened once to prove the config works (its catalog is reachable and
    at the current schema, its tiers are valid) and that it is not this store; before that,
    its tiers must overlap none of this store's.

    Raises:
        RemoteError: If ``config`` cannot be read or opened, names this very store, a tier
            of it is the same as, inside or above a tier of this store, or a remote called
            ``name`` exists already.
        InvalidNameError: If ``name`` is not a valid name.
    """
    validate_name(name, "remote name")
    if any(r.name == name for r in core.catalog.remotes()):
        # Checked again in the catalog's transaction; this only spares opening the remote.
        raise RemoteError(f"remote {name!r} already exists; remove it first with "
                          f"`ckpt remote rm {name}` or choose another name")
    path = _config_path(config)
    other = _open(core, path, name)
    try:
        if store_id(other) == store_id(core):
            raise RemoteError(f"config {path} opens this very store; a remote must be another "
                              "store")
    finally:
        other.close()
    return core.catalog.add_remote(name, str(path))


def list_remotes(core: StoreCore) -> list[RemoteInfo]:
    """Every remote of the store, by name."""
    return core.catalog.remotes()


def remove_remote(core: StoreCore, name: str) -> None:
    """Forget remote ``name``; nothing is deleted from either store.

    Raises:
        RemoteError: If there is no such remote.
    """
    core.catalog.remove_remote(name)


def open_remote(core: StoreCore, name: str) -> StoreCore:
    """Open the store remote ``name`` names; the caller closes it.

    Raises:
        RemoteError: If the remote is unknown, its config can no longer be read or opened,
            or a tier of it now overlaps a tier of this store.
        StorageError: If its catalog or hot tier cannot be reached.
    """
    info = core.catalog.remote(name)
    try:
        path = _config_path(info.config)
    except RemoteError as exc:
        raise RemoteError(f"remote {name!r}: {exc}") from exc
    try:
        return _open(core, path, name)
    except CkptError as exc:
        exc.add_note(f"while opening remote {name!r} ({path})")
        raise
