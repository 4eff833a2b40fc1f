"""Bodies of the processes started by test_concurrency.py (children of a forkserver that
preloaded this module, or spawned ones).

The test puts this directory on ``sys.path`` before starting processes; the children
inherit it and import this module by its plain name.
"""

from __future__ import annotations

import os
import time
from typing import Any


def save_many(
    url: str, run: str, count: int, race_names: list[str], barrier: Any, results: Any
) -> None:
    """Race to create the same runs, then begin + commit ``count`` checkpoints on ``run``.

    Reports the versions this process got.
    """
    try:
        from ckptstore.catalog import Catalog

        cat = Catalog(url, upgrade=False)
        barrier.wait(timeout=120)
        # Every process creates the same runs at the same moment (ensure_run's get-or-create
        # race), then all of them save into one run (version allocation race).
        for name in race_names:
            cat.ensure_run(name, experiment="shared-exp", config={"pid": os.getpid()})
        versions = []
        for i in range(count):
            ck = cat.begin_checkpoint(run, i, metrics={"loss": 1.0 / (i + 1)})
            cat.commit_checkpoint(
                ck.id, manifest_digest=f"d{ck.id}", logical_bytes=2, stored_bytes=1
            )
            versions.append(ck.version)
        cat.close()
        results.put(("ok", os.getpid(), versions))
    except BaseException as e:  # report everything: the parent asserts on it
        results.put(("error", os.getpid(), repr(e)))


def begin_and_hang(url: str, run: str, results: Any) -> None:
    """Begin a checkpoint, report its id, then wait to be killed before committing."""
    from ckptstore.catalog import Catalog

    cat = Catalog(url, upgrade=False)
    ck = cat.begin_checkpoint(run, 7, writer=None)
    results.put((ck.id, ck.writer))
    time.sleep(600)


def open_catalog(url: str, barrier: Any, results: Any) -> None:
    """Open (and so upgrade) a catalog at the same moment as other processes."""
    try:
        from ckptstore.catalog import Catalog

        barrier.wait(timeout=120)
        cat = Catalog(url)
        cat.ensure_run(f"opener-{os.getpid()}")
        cat.close()
        results.put(("ok", os.getpid(), None))
    except BaseException as e:
        results.put(("error", os.getpid(), repr(e)))
