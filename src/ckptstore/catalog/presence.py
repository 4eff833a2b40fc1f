"""Whether a store exists where the settings point, checked without creating anything.

Commands that only read (``ckpt ls``, ``show``, ``config``, ...) ask here first, so a mistyped
``--store`` path is reported ("no store at PATH") instead of becoming a new, empty store. Only
the catalog is looked at: a SQLite file's presence, or a server catalog's schema revision.
This module imports neither the format layer nor torch, so the quick commands stay quick.
"""

from __future__ import annotations

from pathlib import Path

from ckptstore.catalog.engine import mask_url, parse_catalog_url
from ckptstore.config import Settings
from ckptstore.errors import StoreNotFoundError

__all__ = ["catalog_is_new", "refuse_files_as_directories", "require_store"]


def catalog_is_new(url: str) -> bool:
    """Whether the catalog at ``url`` has no schema yet (opening it would create one)."""
    parsed = parse_catalog_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if not database or database == ":memory:":
            return True
        path = Path(database)
        return not path.is_file() or path.stat().st_size == 0
    from ckptstore.catalog import migrate

    return migrate.current(url) is None


def refuse_files_as_directories(settings: Settings) -> None:
    """A store's root and hot tier are directories: a file given as either is refused in
    words, before anything tries to create a directory inside it.

    Raises:
        StoreNotFoundError: If the root, the hot tier or a directory above them is a file.
    """
    checks = [("store directory", settings.root)]
    if settings.hot_remote is None:
        checks.append(("hot tier directory", settings.hot_path))
    for what, path in checks:
        for candidate in (path, *path.parents):
            if not candidate.exists():
                continue
            if not candidate.is_dir():
                inside = "" if candidate == path else f" (it would have to hold {path})"
                raise StoreNotFoundError(
                    f"{candidate} is a file, not a {what}{inside}; give the store's "
                    "directory (--store DIR), or a path where a new store may be created"
                )
            break


def require_store(settings: Settings, *, connect: bool = True) -> None:
    """Raise unless a store exists where ``settings`` point; creates nothing.

    Args:
        settings: The resolved settings.
        connect: False checks an embedded (SQLite) catalog only and never contacts a
            catalog server: ``ckpt config`` reports settings, it needs no database.

    Raises:
        StoreNotFoundError: If the root or hot tier is a file, or the catalog does not exist
            (an embedded catalog's file is missing, a server catalog has no schema).
    """
    refuse_files_as_directories(settings)
    url = settings.resolved_catalog_url
    if not connect and parse_catalog_url(url).get_backend_name() != "sqlite":
        return
    if catalog_is_new(url):
        root = settings.root.absolute()
        where = str(root) if settings.catalog_url is None else f"{root} (catalog {mask_url(url)})"
        raise StoreNotFoundError(
            f"no store at {where} (create one with `ckpt init {root}`, "
            "or by saving to it)"
        )
