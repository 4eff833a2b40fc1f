"""Business operations on a store, grouped by concern.

Plain functions of a :class:`~ckptstore.core.StoreCore` and plain values; Prefect tasks and
flows in ckptstore.tasks/flows only orchestrate them, and nothing here imports prefect. The
groups only point down (an import-linter contract in ``pyproject.toml``):

* ``upkeep``: verify, doctor, compact, diff, convert, metric history;
* ``reading``: load, progressive restore, prefetch, sweeps, show views;
* ``sharing`` | ``dcp``: remotes, push/pull/sync, bundles, signatures | distributed saves;
* ``tiering``: replicas, parts, archive, restore, thaw, re-encoded copies, gc, retention;
* ``writing``: the save transaction, async saves, staging, deltas, the memory tier;
* ``leases``, ``trigger``: catalog leases and flow parameters, used by every group.
"""
