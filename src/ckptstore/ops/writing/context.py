"""Recording a run's context with its saves (:mod:`ckptstore.capture`).

Called by every save once its PENDING row has a version (:func:`ckptstore.ops.writing.save.
begin_save`, shared by the regular save, the async saver and the DCP coordinator), so every
entry point records the same way. A process captures once per run and configuration: git
and the package lock are read on the first save, later saves of the same run with the same
config cost a dictionary lookup. The catalog then stores the context only when it differs
from the run's newest one (a new process resuming with other code, config or packages).

Recording never fails a save: anything that goes wrong is logged as a warning.
"""

from __future__ import annotations

import logging
import threading
import weakref

from ckptstore.capture import capture_context, config_hash
from ckptstore.core import StoreCore
from ckptstore.records import Checkpoint
from ckptstore.save_options import SaveOptions

__all__ = ["record_run_context"]

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
        doc = captured.document
        code = doc.get("code") or {}
        commit = code.get("commit")
        config = doc.get("config")
        core.catalog.record_context(
            ck.run, ck.version, doc, captured.digest, captured.blobs,
            config=config if isinstance(config, dict) else None,
            code_version=(f"git:{commit}" + ("+dirty" if code.get("dirty") else ""))
            if commit else None,
            data_version=doc.get("data_version"),
        )
        return True
    except Exception as exc:  # recording is best effort: the save itself goes on
        logger.warning("could not record the context of run %s: %s", ck.run, exc)
        return False
