"""Recording a run's context with its saves (:mod:`ckptstore.capture`).

Called by every save once its PENDING row has a version (:func:`ckptstore.ops.writing.save.
begin_save`, shared by the regular save, the async saver and the DCP coordinator), so every
entry point records the same way. A process captures once per run and configuration: git
and the package lock are read on the first save, later saves of the same run with the same
config cost a dictionary lookup. The catalog then stores the context only when it differs
from the run's newest one (a new process resuming with other code, config or packages).

Recording never fails a save: anything that goes wrong is logged as a warning.

A checkpoint that leaves for another store (a push, a bundle) takes its context along
(:func:`context_payload`); the receiving store records it with :func:`adopt_context`, so
``ckpt show`` and ``ckpt reproduce`` answer there too.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from ckptstore.capture import capture_context, config_hash, context_digest
from ckptstore.catalog import Catalog
from ckptstore.core import StoreCore
from ckptstore.errors import IntegrityError
from ckptstore.records import Checkpoint
from ckptstore.save_options import SaveOptions

__all__ = ["adopt_context", "context_payload", "record_run_context"]

logger = logging.getLogger(__name__)

# Per store: the (run, config, data version) this process has recorded already.
_RECORDED: weakref.WeakKeyDictionary[StoreCore, set[tuple[str, str, str | None]]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def record_run_context(core: StoreCore, ck: Checkpoint, options: SaveOptions) -> bool:
    """Record the context of the process saving ``ck`` unless it is recorded already.

    Returns:
        Whether a context was captured and handed to the catalog (False when the
        ``capture`` setting is off, when this process recorded it before, or on failure).
    """
    if not core.settings.capture:
        return False
    try:
        key = (ck.run, config_hash(options.config), options.data_version)
        with _LOCK:
            done = _RECORDED.setdefault(core, set())
            if key in done:
                return False
            done.add(key)
        captured = capture_context(config=options.config, data_version=options.data_version,
                                   env_allow=core.settings.capture_env)
        _record(core.catalog, ck.run, ck.version, captured.document, captured.digest,
                captured.blobs)
        return True
    except Exception as exc:  # recording is best effort: the save itself goes on
        logger.warning("could not record the context of run %s: %s", ck.run, exc)
        return False


def _record(catalog: Catalog, run: str, version: int, doc: Mapping[str, Any], digest: str,
            blobs: Mapping[str, bytes]) -> bool:
    """Record ``doc`` and fill the run's config, code and data version columns from it."""
    code = doc.get("code") or {}
    commit = code.get("commit") if isinstance(code, dict) else None
    config = doc.get("config")
    data_version = doc.get("data_version")
    return catalog.record_context(
        run, version, doc, digest, blobs,
        config=config if isinstance(config, dict) else None,
        code_version=(f"git:{commit}" + ("+dirty" if code.get("dirty") else ""))
        if isinstance(commit, str) else None,
        data_version=data_version if isinstance(data_version, str) else None,
    )


def context_payload(catalog: Catalog, ck: Checkpoint
                    ) -> tuple[dict[str, Any], str, dict[str, bytes]] | None:
    """The context ``ck`` was saved under, its digest and the blobs it names (the patch and
    the package lock), each read back checked against its digest; None when ``ck`` was saved
    without one."""
    context = catalog.context_of(ck)
    if context is None:
        return None
    doc = dict(context.document)
    code, env = doc.get("code") or {}, doc.get("environment") or {}
    names = (code.get("patch") if isinstance(code, dict) else None,
             env.get("lock") if isinstance(env, dict) else None)
    blobs = {d: catalog.context_blob(d) for d in names if isinstance(d, str)}
    return doc, context.digest, blobs


def adopt_context(catalog: Catalog, ck: Checkpoint, doc: Mapping[str, Any], digest: str,
                  blobs: Mapping[str, bytes]) -> bool:
    """Record a context that came with ``ck`` from another store, from ``ck``'s version of
    its run on here.

    Returns:
        Whether a new context row was written (False: the run's newest context is this one).

    Raises:
        IntegrityError: If ``digest`` is not the document's own, or a blob does not match
            its digest.
        InvalidNameError: If the document is not JSON.
    """
    if context_digest(doc) != digest:
        raise IntegrityError(f"the run context carried with {ck.ref} does not match its "
                             f"digest {digest}: it was altered on the way")
    return _record(catalog, ck.run, ck.version, doc, digest, blobs)
