"""The :class:`Catalog`: the SQL catalog's public API, assembled from its method groups."""

from __future__ import annotations

from ckptstore.catalog.contexts import ContextsMixin
from ckptstore.catalog.events import EventsMixin
from ckptstore.catalog.identity import StoreIdentityMixin
from ckptstore.catalog.labels import LabelsMixin
from ckptstore.catalog.leases import LeasesMixin
from ckptstore.catalog.lineage import LineageMixin
from ckptstore.catalog.metric_history import HistoryMixin
from ckptstore.catalog.parts import PartsMixin
from ckptstore.catalog.pruning import PruningMixin
from ckptstore.catalog.queries import QueriesMixin
from ckptstore.catalog.remotes import RemotesMixin
from ckptstore.catalog.replicas import ReplicasMixin
from ckptstore.catalog.snapshots import SnapshotsMixin
from ckptstore.catalog.thaws import ThawsMixin

__all__ = ["Catalog"]


class Catalog(
    PartsMixin,
    PruningMixin,
    QueriesMixin,
    LineageMixin,
    LabelsMixin,
    ReplicasMixin,
    LeasesMixin,
    EventsMixin,
    StoreIdentityMixin,
    HistoryMixin,
    ThawsMixin,
    RemotesMixin,
    ContextsMixin,
    SnapshotsMixin,
):
    """The checkpoint catalog on SQLite (embedded) or PostgreSQL (shared).

    Every method is one short transaction and returns plain records from
    :mod:`ckptstore.records` (never ORM objects), so results can cross threads and processes.
    The object is thread-safe; each process opens its own.

    Method groups (each in its own module):
        * runs: :meth:`ensure_run`, :meth:`get_run`, :meth:`runs`;
        * life cycle: :meth:`begin_checkpoint`, :meth:`commit_checkpoint`,
          :meth:`fail_checkpoint`, :meth:`get_any`;
        * pruning and gc: :meth:`mark_deleting`, :meth:`mark_deleted`, :meth:`stale_pending`,
          :meth:`pending_by_writer`;
        * queries: :meth:`get`, :meth:`latest`, :meth:`best`, :meth:`list`, :meth:`usage`;
        * lineage: :meth:`lineage`, :meth:`descendants`, :meth:`add_edge`, :meth:`edges`,
          :meth:`edges_among`, :meth:`run_record`;
        * labels: :meth:`alias`, :meth:`unalias`, :meth:`pin`, :meth:`unpin`,
          :meth:`is_protected`;
        * replicas: :meth:`replicas`, :meth:`set_replica`;
        * leases: :meth:`acquire_lease`, :meth:`release_lease`, :meth:`lease_holder`,
          :meth:`leases`;
        * audit log: :meth:`record_event`, :meth:`events`;
        * store identity: :meth:`store_identity`, :meth:`claim_store_identity`,
          :meth:`set_store_hot_tier`, :meth:`is_empty`;
        * metric history: :meth:`record_history`, :meth:`metric_history`,
          :meth:`metric_history_names`, :meth:`metric_history_runs`,
          :meth:`truncate_history`;
        * parts of checkpoints saved across hosts, hosts, shared manifests:
          :meth:`commit_parted`, :meth:`set_part`, :meth:`complete_parts`, :meth:`parts`,
          :meth:`parts_on`, :meth:`part_ranks`, :meth:`manifest_bytes`,
          :meth:`forget_parts`, :meth:`part_usage`, :meth:`heartbeat`, :meth:`hosts`;
        * thaws of archival copies: :meth:`record_thaw`, :meth:`thaw_ready`,
          :meth:`finish_thaw`, :meth:`get_thaw`, :meth:`thaws`;
        * remotes and arrivals: :meth:`add_remote`, :meth:`remote`, :meth:`remotes`,
          :meth:`remove_remote`, :meth:`forget_failed_arrival`;
        * run contexts (what made a run's checkpoints) and their blobs:
          :meth:`record_context`, :meth:`run_contexts`, :meth:`context_of`,
          :meth:`context_blob`.
        * snapshot areas (one row per run, host and rank, never per snapshot):
          :meth:`record_snapshot_area`, :meth:`snapshot_areas`, :meth:`forget_snapshot_area`.

    Args:
        url: ``sqlite:///path/catalog.db`` (the parent directory is created) or
            ``postgresql+psycopg://user:password@host:5432/db``.
        upgrade: Run ``alembic upgrade head`` on open when the schema is behind (default);
            with False an out-of-date schema raises :class:`~ckptstore.errors.ConfigError`.

    Example:
        >>> cat = Catalog("sqlite:////tmp/ckpt/catalog.db")  # doctest: +SKIP
        >>> ck = cat.begin_checkpoint("run-a", 100, metrics={"loss": 0.5})  # doctest: +SKIP
        >>> cat.commit_checkpoint(ck.id, manifest_digest="b3:...", logical_bytes=10,
        ...                       stored_bytes=8)  # doctest: +SKIP
        >>> cat.get("run-a@latest").step  # doctest: +SKIP
        100
    """
