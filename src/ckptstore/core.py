"""StoreCore: the state every operation works on, and nothing else.

A core holds what one open store *is*: its settings, its catalog, its tiers, its metrics
recorder, and the per-store helpers that operations share (the keyframe cache, the async
saver, the memory tier, the flow launcher). Operations in :mod:`ckptstore.ops` take a core as
their first argument; :class:`~ckptstore.store.CheckpointStore` is a core plus thin methods
that call them, so any store can be passed wherever a core is expected.

Call order: construct (or :meth:`StoreCore.open`) → operations, from any thread → :meth:`close`
once. ``close`` closes the per-store services first (the async saver waits for pending
saves, which still need the catalog), then the tiers, the metrics and the catalog.

A catalog and a hot tier are one store only together. Both record the store's id (the
catalog in ``store_meta``, the hot tier in ``.ckptstore.json``, see
:mod:`ckptstore.storage.marker`), and :meth:`StoreCore.open` refuses a pair that disagrees
(:func:`check_store_identity`): one config file then always means one store.

The core knows its helpers only through the small interfaces defined here
(:class:`StoreService`, :class:`FlowLauncher`), so it sits below the operations that
implement them. Flows are reached through the ``ckptstore.launchers`` entry point, which keeps
Prefect (and the flows package) out of every process that never triggers a flow.
"""

from __future__ import annotations

import abc
import importlib.metadata
import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from ckptstore.catalog import Catalog, mask_url
from ckptstore.catalog.presence import catalog_is_new, refuse_files_as_directories, require_store
from ckptstore.config import STORE_DIR_NAME, Settings, load_settings
from ckptstore.errors import CheckpointNotFoundError, ConfigError, StorageError
from ckptstore.extras import missing_extra
from ckptstore.format import KeyframeCache
from ckptstore.identity import host
from ckptstore.names import validate_name
from ckptstore.observability.metrics import Metrics
from ckptstore.records import Checkpoint, ReplicaState
from ckptstore.storage import Tier, build_tiers
from ckptstore.storage.marker import (
    MARKER_NAME,
    StoreMarker,
    read_store_marker,
    write_store_marker,
)

__all__ = [
    "LAUNCHER_GROUP",
    "FlowLauncher",
    "StoreCore",
    "StoreService",
    "check_store_identity",
]

logger = logging.getLogger(__name__)

#: Entry-point group naming the :class:`FlowLauncher` that ``trigger`` uses.
LAUNCHER_GROUP = "ckptstore.launchers"


class StoreService(abc.ABC):
    """A helper that lives as long as its store (the async saver, the memory tier).

    Call order: the operation that first needs it creates it and puts it in its slot on the
    core → operations use it → :meth:`StoreCore.close` calls :meth:`close` exactly once.
    """

    @abc.abstractmethod
    def close(self) -> None:
        """Finish pending work and release resources; may raise the first unreported error."""


class FlowLauncher(abc.ABC):
    """Starts a background flow without waiting for it.

    Call order: :meth:`launch` any number of times, from any thread. Implementations enqueue
    and return at once (an embedded worker, or ``run_deployment(..., timeout=0)``).
    """

    @abc.abstractmethod
    def launch(
        self,
        flow_name: str,
        params: Mapping[str, Any],
        *,
        store_root: str,
        config: str | None,
        idempotency_key: str | None,
        work_queue: str | None = None,
    ) -> None:
        """Enqueue one run of flow ``flow_name`` with ``params`` (plain values only).

        Args:
            flow_name: Short flow name (``archive``, ``retention``, ...).
            params: Flow parameters; never credentials.
            store_root: The store directory the flow reopens the store from.
            config: The store's config file, if any.
            idempotency_key: Runs with the same key are started once.
            work_queue: Run it on this host (its Prefect work queue, served by ``ckpt
                agent`` there; an embedded worker runs only its own host's), for work only
                that host can do: uploading the part of a checkpoint its disk holds.

        Raises:
            ConfigError: For an unknown flow.
        """

    @abc.abstractmethod
    def wait_idle(self, *, store_root: str, config: str | None) -> bool:
        """Wait (bounded) until every flow launched for this store ran; never on its own thread.

        Once the interpreter shuts down a queued flow can no longer run, so a store waits for
        the flows it started when it is closed.

        Returns:
            True when nothing is left; False when the wait timed out (logged).
        """


class StoreCore:
    """Settings, catalog, tiers, metrics and per-store services of one open store.

    Attributes:
        settings: The resolved configuration.
        catalog: The open SQL catalog.
        hot: Root directory of the hot tier.
        metrics: The store's metrics recorder (own Prometheus registry).
        keyframe_cache: The latest xor/lossy keyframe's chunks (None when
            ``delta_cache_bytes`` is 0), so delta saves need not read it back.
        abandoned: Ids of this process's saves that failed while the catalog could not be
            told; ``gc`` fails and removes them.
        flows_launched: Whether this store started a flow (``close`` then waits for them).
        saver: The async saver, created by the first ``save_async``.
        memory_tier: The shared-memory tier when enabled (see
            :func:`ckptstore.ops.writing.memory.memory_tier_for`).
        memory_tier_resolved: Whether :attr:`memory_tier` was already looked up from the
            settings (None then means "off").
        peers: The background replication of parts to neighbour hosts (``replicas = 2``),
            created by the first distributed save that needs it (see
            :mod:`ckptstore.ops.dcp.peers`).
    """

    def __init__(self, settings: Settings, catalog: Catalog) -> None:
        """Wrap an already opened catalog; prefer :meth:`open`."""
        self.settings = settings
        self.catalog = catalog
        self.hot = settings.hot_path
        self.metrics = Metrics()
        self.keyframe_cache = (
            KeyframeCache(settings.delta_cache_bytes) if settings.delta_cache_bytes else None
        )
        self.abandoned: set[str] = set()
        self.saver: StoreService | None = None
        self.memory_tier: StoreService | None = None
        self.memory_tier_resolved = False
        self.peers: StoreService | None = None
        self._launcher: FlowLauncher | None = None
        self.flows_launched = False
        self._tiers: dict[str, Tier] | None = None
        self._closed = False

    # ------------------------------------------------------------------ life cycle
    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str] | None = None,
        *,
        config: str | os.PathLike[str] | None = None,
        catalog_url: str | None = None,
        create: bool = True,
        **overrides: Any,
    ) -> Self:
        """Open (and on first use create) a store.

        Args:
            root: Store directory; holds ``catalog.db`` and ``hot/`` by default.
            config: A TOML config file (default ``$CKPT_CONFIG``).
            catalog_url: Catalog URL (default ``$CKPT_CATALOG_URL`` or the embedded SQLite).
            create: Create the store when there is none yet (the default: a first save
                creates its store). False opens only an existing store and creates nothing
                otherwise: what commands that only read use, so that a mistyped path never
                becomes a new, empty store.
            **overrides: Any other :class:`~ckptstore.config.Settings` field.

        Returns:
            An instance of the class it is called on. The catalog schema is upgraded to the
            newest revision.

        Raises:
            ConfigError: If the configuration is invalid, or the catalog and the hot tier
                belong to different stores (see :func:`check_store_identity`).
            StorageError: If the hot tier cannot be created.
            StoreNotFoundError: If the root (or hot tier) is a file, or, with
                ``create=False``, there is no store yet.
        """
        settings = load_settings(config, root=root, catalog_url=catalog_url, **overrides)
        url = settings.resolved_catalog_url
        hot = settings.hot_path
        if create:
            refuse_files_as_directories(settings)
        else:
            require_store(settings)
        # Refused before anything is created: a new, empty catalog for a hot tier that
        # already belongs to a store (or holds checkpoints of one) elsewhere.
        _refuse_new_catalog_for_used_hot_tier(url, hot)
        catalog = Catalog(url, upgrade=True)  # creates the directory of a new SQLite file
        try:
            check_store_identity(catalog, hot)  # creates the hot tier with its marker
            settings.root.mkdir(parents=True, exist_ok=True)
        except StorageError:
            catalog.close()
            raise
        except OSError as exc:
            catalog.close()
            raise StorageError(
                f"cannot create the store directory {settings.root}: {exc.strerror}; "
                "check the path and its permissions"
            ) from exc
        except BaseException:
            catalog.close()
            raise
        return cls(settings, catalog)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def close(self) -> None:
        """Close the services (waiting for pending async saves), wait for the flows this store
        started, then close the tiers, the metrics and the catalog.

        Raises:
            CkptError: The first async save failure not yet reported (the store is closed
                anyway).
        """
        if self._closed:
            return
        try:
            saver, self.saver = self.saver, None
            if saver is not None:
                saver.close()
        finally:
            self._closed = True
            memory, self.memory_tier = self.memory_tier, None
            if memory is not None:
                memory.close()
            peers, self.peers = self.peers, None
            if peers is not None:
                peers.close()  # waits (bounded) for parts still on their way to a peer
            if self.flows_launched and self._launcher is not None:
                config = str(self.settings.source) if self.settings.source else None
                self._launcher.wait_idle(store_root=str(self.settings.root), config=config)
            for tier in (self._tiers or {}).values():
                tier.close()
            self.metrics.close()
            self.catalog.close()
            if self.keyframe_cache is not None:
                self.keyframe_cache.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ tiers
    @property
    def tiers(self) -> dict[str, Tier]:
        """Configured storage tiers by name: ``hot`` always, ``warm``/``cold`` if set.

        Built once per store, on first use, and closed by :meth:`close`.

        Raises:
            ConfigError: If a tier URL or the storage options are invalid.
        """
        if self._tiers is None:
            self._tiers = build_tiers(self.settings)
        return self._tiers

    def tier(self, name: str) -> Tier:
        """The tier called ``name``.

        Raises:
            ConfigError: If the store has no such tier configured.
        """
        tiers = self.tiers
        if name not in tiers:
            raise ConfigError(
                f"tier {name!r} is not configured (configured: {', '.join(sorted(tiers))}); "
                "set it under [tiers] in the config or CKPT_WARM/CKPT_COLD"
            )
        return tiers[name]

    # ------------------------------------------------------------------ paths
    def checkpoint_dir(self, run: str, ckpt_id: str) -> Path:
        """Directory of a checkpoint on the hot tier."""
        return self.hot / validate_name(run) / ckpt_id

    def locate(self, ckpt_id: str) -> Path:
        """Hot directory of any catalogued checkpoint (used for chunks a delta references)."""
        ck = self.catalog.get_any(ckpt_id)
        return self.checkpoint_dir(ck.run, ck.id)

    def hot_dir_of(self, ck: Checkpoint) -> Path:
        """The hot directory of a checkpoint whose hot copy the catalog lists as PRESENT.

        Raises:
            CheckpointNotFoundError: If the hot tier holds no usable copy.
        """
        replica = ck.replica("hot")
        if replica is None or replica.state != ReplicaState.PRESENT:
            where = ", ".join(f"{r.tier}:{r.state}" for r in ck.replicas) or "nowhere"
            raise CheckpointNotFoundError(
                f"checkpoint {ck.ref} ({ck.id}) has no copy on the hot tier (replicas: {where}); "
                f"restore it first with `ckpt restore {ck.ref}`"
            )
        return self.checkpoint_dir(ck.run, ck.id)

    # ------------------------------------------------------------------ flows
    def launcher(self) -> FlowLauncher:
        """The flow launcher, loaded once from the ``ckptstore.launchers`` entry point.

        Raises:
            ConfigError: If no launcher is installed or it cannot be loaded.
        """
        if self._launcher is None:
            found = importlib.metadata.entry_points(group=LAUNCHER_GROUP, name="default")
            if not found:
                raise ConfigError(
                    "no flow launcher is installed (entry point group "
                    f"{LAUNCHER_GROUP!r}); reinstall ckptstore with the [flows] extra"
                )
            try:
                factory = next(iter(found)).load()
            except ImportError as exc:
                raise missing_extra(exc.name or "prefect", "running flows") from exc
            launcher = factory()
            if not isinstance(launcher, FlowLauncher):
                raise ConfigError(f"entry point {LAUNCHER_GROUP}:default is not a FlowLauncher")
            self._launcher = launcher
        return self._launcher


# ---------------------------------------------------------------------- store identity
def check_store_identity(catalog: Catalog, hot: Path) -> None:
    """Make sure ``catalog`` and the hot tier at ``hot`` belong to the same store.

    The catalog records a store id and, per host (:func:`ckptstore.identity.host`), the hot
    tier it was last opened with there; the hot tier records the store id in
    ``.ckptstore.json``. Each node of a cluster has a hot tier of its own, so only this
    host's record counts. On open:

    * both recorded, same id: the store (a hot tier found at a new path was moved: recorded);
    * both recorded, different ids: refused;
    * only the catalog: the marker is written, unless the catalog's own hot tier still
      exists elsewhere with its marker (then this is another store's catalog: refused);
    * only the hot tier: the catalog adopts its id if the marker names this catalog (a
      catalog from before store ids, or re-created at the same URL), else refused;
    * neither (a new store, or one created before store ids): a new id is recorded in
      both, unless the catalog is empty while the hot tier holds checkpoints (its catalog is
      elsewhere: refused).

    Args:
        catalog: The open catalog.
        hot: The hot tier's root directory (created with its marker when missing).

    Raises:
        ConfigError: If they belong to different stores; the message says which hot tier the
            catalog belongs to (or which catalog the hot tier does) and what to do.
        StorageError: If the marker cannot be read or written.
    """
    here, on = str(hot), host()
    for _attempt in range(3):
        ident = catalog.store_identity(on)
        marker = read_store_marker(hot)
        if ident is not None:
            if marker is None:
                if (ident.hot_tier and ident.hot_tier != here
                        and _marker_id(Path(ident.hot_tier)) == ident.store_id):
                    raise ConfigError(_belongs_elsewhere(catalog, ident.store_id,
                                                         ident.hot_tier, hot))
                marker = write_store_marker(hot, StoreMarker(ident.store_id, catalog.url))
            if marker.store_id != ident.store_id:
                raise ConfigError(_mismatch(catalog, ident.store_id, ident.hot_tier, hot,
                                            marker))
            if ident.hot_tier != here:
                logger.info("store %s: hot tier recorded at %s, now at %s", ident.store_id,
                            ident.hot_tier or "-", here)
                catalog.set_store_hot_tier(here, on)
            return
        if marker is not None:
            if marker.catalog is not None and marker.catalog != catalog.url:
                raise ConfigError(_foreign_hot(catalog.url, hot, marker))
            store_id = marker.store_id
        else:
            if catalog.is_empty() and _holds_checkpoints(hot):
                raise ConfigError(_orphaned_hot(catalog.url, hot))
            store_id = str(uuid.uuid4())
        claimed = catalog.claim_store_identity(store_id, here, on)
        if claimed.store_id == store_id and claimed.hot_tier == here:
            if marker is None:
                written = write_store_marker(hot, StoreMarker(store_id, catalog.url))
                if written.store_id != store_id:  # another catalog's process was faster
                    raise ConfigError(_mismatch(catalog, store_id, here, hot, written))
            logger.info("store %s: recorded its catalog %s and hot tier %s", store_id,
                        catalog.url, here)
            return
        # Another process recorded an identity first: check against that one.
    raise ConfigError(f"the store identity of catalog {catalog.url} keeps changing; retry")


def _refuse_new_catalog_for_used_hot_tier(url: str, hot: Path) -> None:
    """The checks of :func:`check_store_identity` that need no catalog, made before a new
    catalog would be created for nothing (a refused open leaves nothing behind)."""
    if not hot.is_dir():
        return
    marker = read_store_marker(hot)
    masked = mask_url(url)
    if marker is not None:
        if marker.catalog not in (None, masked) and catalog_is_new(url):
            raise ConfigError(_foreign_hot(masked, hot, marker))
    elif _holds_checkpoints(hot) and catalog_is_new(url):
        raise ConfigError(_orphaned_hot(masked, hot))


def _holds_checkpoints(hot: Path) -> bool:
    """Whether the hot tier holds a checkpoint directory (``<run>/<uuid>/`` with a manifest or
    a commit marker): data some catalog knows."""
    try:
        runs = [e for e in os.scandir(hot) if not e.name.startswith(".")
                and e.is_dir(follow_symlinks=False)]
    except OSError:
        return False
    for run in runs:
        try:
            with os.scandir(run.path) as entries:
                for entry in entries:
                    if not entry.is_dir(follow_symlinks=False) or not _is_uuid(entry.name):
                        continue
                    ck_dir = Path(entry.path)
                    if (ck_dir / "manifest.json").exists() or (ck_dir / "COMMITTED").exists():
                        return True
        except OSError:
            continue
    return False


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _marker_id(hot: Path) -> str | None:
    try:
        marker = read_store_marker(hot) if hot.is_dir() else None
    except (ConfigError, StorageError):
        return None
    return marker.store_id if marker is not None else None


def _mismatch(catalog: Catalog, store_id: str, hot_tier: str, hot: Path,
              marker: StoreMarker) -> str:
    where = f", whose catalog is {marker.catalog}" if marker.catalog else ""
    return (
        f"catalog {catalog.url} belongs to store {store_id}, whose hot tier is "
        f"{hot_tier or '(not recorded)'}; but the hot tier {hot} belongs to store "
        f"{marker.store_id}{where}. Use the configuration of one store (its root, "
        "catalog_url and hot together), so that its catalog and hot tier belong together"
    )


def _belongs_elsewhere(catalog: Catalog, store_id: str, hot_tier: str, hot: Path) -> str:
    return (
        f"catalog {catalog.url} belongs to store {store_id}, whose hot tier is {hot_tier} "
        f"(it holds that store's {MARKER_NAME}), not {hot}: open that store's configuration, "
        f"or set hot = {hot_tier!r}. If {hot} is meant to replace {hot_tier} as its hot "
        f"tier, copy {Path(hot_tier) / MARKER_NAME} into {hot} first"
    )


def _foreign_hot(url: str, hot: Path, marker: StoreMarker) -> str:
    return (
        f"the hot tier {hot} belongs to store {marker.store_id}, whose catalog is "
        f"{marker.catalog}, not {url}: set catalog_url (or root) to that catalog. If {url} "
        f"really is that store's catalog (it moved), delete {hot / MARKER_NAME} and open the "
        "store again"
    )


def _orphaned_hot(url: str, hot: Path) -> str:
    return (
        f"the hot tier {hot} holds checkpoints but no store marker ({MARKER_NAME}), and the "
        f"catalog {url} is new and empty: the catalog of those checkpoints is elsewhere. A "
        "configuration without `root` used to keep it in ./ckpt/catalog.db of whatever "
        "directory a command ran in; it now lives with the hot tier. Set root (or "
        "catalog_url) in the configuration to that catalog, or move its catalog.db to "
        f"{hot / STORE_DIR_NAME}/"
    )
