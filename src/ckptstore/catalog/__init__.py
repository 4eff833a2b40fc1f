"""The SQL catalog of ckptstore (SQLAlchemy 2 + Alembic; SQLite or PostgreSQL).

Records every checkpoint's version, state, lineage, metrics, tags and replicas, plus aliases,
pins, leases and an audit log. The schema is created only by the Alembic revisions in
``ckptstore.migrations`` (see :mod:`ckptstore.catalog.migrate`).

Public names: :class:`Catalog`, :class:`StoreIdentity`, :func:`mask_url`, and the migration helpers
:func:`upgrade`, :func:`current`, :func:`history` (also reachable as ``migrate.*``).
"""

from __future__ import annotations

from ckptstore.catalog import migrate
from ckptstore.catalog.catalog import Catalog
from ckptstore.catalog.engine import mask_url
from ckptstore.catalog.identity import StoreIdentity
from ckptstore.catalog.migrate import current, downgrade, history, upgrade

__all__ = [
    "Catalog",
    "StoreIdentity",
    "current",
    "downgrade",
    "history",
    "mask_url",
    "migrate",
    "upgrade",
]
