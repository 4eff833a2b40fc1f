"""Configuration: explicit argument > environment (``CKPT_*``) > config file > default.

The config file is TOML. Keys may sit at the top level or under a ``[ckptstore]`` table::

    root = "./ckpt"                       # store directory (catalog.db and hot/ live here)
    catalog_url = "postgresql+psycopg://postgres@127.0.0.1:5432/ckpt"
    codec = "lz4"

    [tiers]
    hot = "file:///nvme/ckpt"
    warm = "s3://bucket/ckpt"
    cold = "s3://bucket-cold/ckpt"
    cold_storage_class = "GLACIER"

    [storage_options]                     # passed to s3fs; never put credentials here
    endpoint_url = "http://127.0.0.1:9000"

    [retention]
    keep_last = 5
    keep_every = 1000
    keep_best = ["val_loss", "min", 3]
    max_age_days = 30

    [delta]                               # default "dedup"; false, "xor" or a table
    mode = "lossy"                        # 8-bit deltas of optimizer moments, every
    threshold = 1e-4                      # change below 1e-4 dropped; a full keyframe
    quantize = 8                          # every keyframe_every (10) saves

DeepSpeed-style config keys are accepted at the top level too: ``save_dir`` (hot),
``archive_dir`` (warm), ``keep_last`` and ``save_interval``, and a ``[compression_config]``
table (``type = "diff"``, ``threshold``, ``quantize``) is read as ``delta``. Credentials
are never read from here: S3 uses the environment / AWS credential chain.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptstore.deltaspec import parse_delta
from ckptstore.errors import ConfigError, InvalidNameError

__all__ = ["Settings", "load_settings"]

logger = logging.getLogger(__name__)

_CODECS = ("none", "lz4", "zstd-1", "zstd-3")


@dataclass(frozen=True)
class Settings:
    """Resolved configuration of one store.

    Attributes:
        root: Store directory; the embedded catalog and the default hot tier live here.
        catalog_url: SQLAlchemy URL of the catalog; default ``sqlite:///<root>/catalog.db``.
        hot: Hot tier location (local path or ``file://`` URL); default ``<root>/hot``.
        warm: Warm tier URL (``s3://bucket/prefix`` or a local path), optional.
        cold: Cold tier URL, optional.
        cold_storage_class: S3 storage class used when writing to the cold tier.
        storage_options: Options for fsspec/s3fs (``endpoint_url``, ...); no credentials.
        codec: Codec preset for saves on the hot tier.
        archive_codec: Codec preset the archive flow re-encodes with (None keeps the hot one).
        chunk_bytes: Target chunk size in bytes.
        threads: Writer/reader threads.
        keep_last: Retention: keep the newest N checkpoints per run.
        keep_every: Retention: keep every checkpoint whose step is a multiple of K.
        keep_best: Retention: (metric, "min"|"max", N).
        max_age_days: Retention: delete checkpoints older than this (others rules still apply).
        save_interval: Default save interval in steps for CheckpointManager.
        cold_after_days: Archive flow demotes warm replicas older than this to the cold tier.
        schedules: Cron schedules per flow name (``archive``, ``retention``, ``verify``, ``gc``).
        staging_budget_bytes: Host memory allowed for async-save staging.
        memory_tier_bytes: Shared memory (``/dev/shm``) for the memory tier: the newest
            checkpoints are also kept there so a restarted process on the same host loads
            without disk reads. 0 (the default) turns the tier off.
        memory_tier_dir: Parent directory of the memory tier (default ``/dev/shm/ckptstore``).
        delta: Default delta mode of saves: ``"dedup"`` (identical chunks referenced),
            ``False`` (full saves), ``"xor"``, or a table for lossy deltas (see
            :func:`ckptstore.format.delta.parse_delta`).
        keyframe_every: xor/lossy deltas: a full keyframe every this many saves.
        delta_cache_bytes: xor/lossy deltas: host memory for the latest keyframe's chunks,
            so a delta save encodes against them without reading the keyframe back (a
            larger keyframe is cached in part). 0 turns the cache off.
        replicas: Copies of each host's part of a multi-host distributed checkpoint kept on
            node-local hot tiers: 1 (its own host only) or 2 (also on a neighbour host, sent
            over the process group after the commit; see docs/MULTINODE.md).
        host_timeout_s: A host whose agent or saver has not been heard from for this long
            counts as gone (``ckpt doctor`` reports the parts it holds).
        source: The config file this came from, if any.
    """

    root: Path = Path("./ckpt")
    catalog_url: str | None = None
    hot: str | None = None
    warm: str | None = None
    cold: str | None = None
    cold_storage_class: str | None = "GLACIER"
    storage_options: dict[str, Any] = field(default_factory=dict)
    codec: str = "lz4"
    archive_codec: str | None = None
    chunk_bytes: int = 8 * 1024 * 1024
    threads: int = 2
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: tuple[str, str, int] | None = None
    max_age_days: float | None = None
    save_interval: int | None = None
    cold_after_days: float | None = None
    schedules: dict[str, str] = field(default_factory=dict)
    staging_budget_bytes: int = 4 * 1024**3
    memory_tier_bytes: int = 0
    memory_tier_dir: str | None = None
    delta: bool | str | dict[str, Any] = "dedup"
    keyframe_every: int = 10
    delta_cache_bytes: int = 1024**3
    replicas: int = 1
    host_timeout_s: float = 600.0
    source: Path | None = None

    @property
    def resolved_catalog_url(self) -> str:
        """The catalog URL, defaulting to the embedded SQLite file under ``root``."""
        if self.catalog_url:
            return self.catalog_url
        return f"sqlite:///{(self.root / 'catalog.db').resolve()}"

    @property
    def hot_remote(self) -> str | None:
        """The hot tier's ``s3://`` URL when it is object storage (nodes without local disk,
        distributed saves only), else None."""
        return self.hot if self.hot is not None and self.hot.startswith("s3://") else None

    @property
    def hot_path(self) -> Path:
        """The hot tier as a local path (``<root>/hot`` scratch space when it is remote)."""
        if self.hot is None or self.hot_remote is not None:
            return (self.root / "hot").resolve()
        return _local_path(self.hot, "hot")

    def tier_urls(self) -> dict[str, str]:
        """Configured tiers by name (``hot`` always present)."""
        tiers = {"hot": self.hot_remote or str(self.hot_path)}
        if self.warm:
            tiers["warm"] = self.warm
        if self.cold:
            tiers["cold"] = self.cold
        return tiers


def _local_path(url: str, what: str) -> Path:
    if url.startswith("file://"):
        return Path(url[len("file://") :]).resolve()
    if "://" in url:
        raise ConfigError(f"the {what} tier must be a local path or file:// URL, got {url!r}")
    return Path(url).expanduser().resolve()


_ENV: dict[str, str] = {
    "CKPT_ROOT": "root",
    "CKPT_CATALOG_URL": "catalog_url",
    "CKPT_HOT": "hot",
    "CKPT_WARM": "warm",
    "CKPT_COLD": "cold",
    "CKPT_CODEC": "codec",
    "CKPT_ARCHIVE_CODEC": "archive_codec",
    "CKPT_CHUNK_BYTES": "chunk_bytes",
    "CKPT_THREADS": "threads",
    "CKPT_KEEP_LAST": "keep_last",
    "CKPT_SAVE_INTERVAL": "save_interval",
    "CKPT_STAGING_BUDGET_BYTES": "staging_budget_bytes",
    "CKPT_MEMORY_TIER_BYTES": "memory_tier_bytes",
    "CKPT_MEMORY_TIER_DIR": "memory_tier_dir",
    "CKPT_DELTA": "delta",
    "CKPT_KEYFRAME_EVERY": "keyframe_every",
    "CKPT_DELTA_CACHE_BYTES": "delta_cache_bytes",
    "CKPT_REPLICAS": "replicas",
    "CKPT_HOST_TIMEOUT_S": "host_timeout_s",
    "CKPT_S3_ENDPOINT_URL": "storage_options.endpoint_url",
}

_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_INT_FIELDS = {"chunk_bytes", "threads", "keep_last", "keep_every", "save_interval",
               "staging_budget_bytes", "keyframe_every", "memory_tier_bytes",
               "delta_cache_bytes", "replicas"}
_FLOAT_FIELDS = {"max_age_days", "cold_after_days", "host_timeout_s"}


def _flatten_file(data: dict[str, Any], source: Path) -> dict[str, Any]:
    """Map the file's sections and DeepSpeed-style keys onto Settings field names."""
    if "ckptstore" in data and isinstance(data["ckptstore"], dict):
        data = {**data, **data.pop("ckptstore")}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "tiers" and isinstance(value, dict):
            for tkey, tval in value.items():
                if tkey not in ("hot", "warm", "cold", "cold_storage_class"):
                    raise ConfigError(f"{source}: unknown key tiers.{tkey}")
                out[tkey] = tval
        elif key == "retention" and isinstance(value, dict):
            for rkey, rval in value.items():
                if rkey not in ("keep_last", "keep_every", "keep_best", "max_age_days"):
                    raise ConfigError(f"{source}: unknown key retention.{rkey}")
                out[rkey] = rval
        elif key == "save_dir":
            out["hot"] = value
        elif key == "archive_dir":
            out["warm"] = value
        elif key == "compression_config":
            # The DeepSpeed-style name of the delta table; an explicit ``delta`` wins.
            out.setdefault("delta", value)
        elif key == "delta":
            out["delta"] = value
        elif key in _FIELDS and key != "source":
            out[key] = value
        else:
            raise ConfigError(
                f"{source}: unknown configuration key {key!r}; known keys: "
                + ", ".join(sorted(k for k in _FIELDS if k != "source"))
            )
    return out


def _coerce(name: str, value: Any, origin: str) -> Any:
    try:
        if value is None:
            return None
        if name == "root":
            return Path(value).expanduser()
        if name in _INT_FIELDS:
            number = int(value)
            if number < 0 or (
                name in ("chunk_bytes", "threads", "keyframe_every") and number == 0
            ):
                raise ValueError("must be positive")
            if name == "replicas" and number not in (1, 2):
                raise ValueError("must be 1 (own host) or 2 (also a neighbour host)")
            return number
        if name in _FLOAT_FIELDS:
            return float(value)
        if name == "keep_best":
            metric, mode, count = value
            if mode not in ("min", "max"):
                raise ValueError("mode must be 'min' or 'max'")
            return (str(metric), str(mode), int(count))
        if name in ("storage_options", "schedules"):
            if not isinstance(value, dict):
                raise ValueError("must be a table")
            return dict(value)
        if name == "delta":
            return _delta_value(value)
        if name == "codec" or name == "archive_codec":
            if value not in _CODECS:
                raise ValueError(f"must be one of {', '.join(_CODECS)}")
            return str(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{origin}: invalid value for {name}: {value!r} ({exc})") from exc


def _delta_value(value: Any) -> bool | str | dict[str, Any]:
    """Validate a ``delta`` setting; environment strings ``true``/``false`` become bools."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "0", "1"):
        value = value.strip().lower() in ("true", "1")
    if not isinstance(value, bool | str | dict):
        raise ValueError("must be a bool, a mode name or a table")
    try:
        parse_delta(value)
    except InvalidNameError as exc:
        raise ValueError(str(exc)) from None
    return dict(value) if isinstance(value, dict) else value


def load_settings(config: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Resolve settings from explicit overrides, ``CKPT_*`` variables and a TOML file.

    Args:
        config: Path of a TOML config file; default ``$CKPT_CONFIG`` if set.
        **overrides: Explicit values (highest precedence); ``None`` values are ignored.

    Returns:
        The resolved :class:`Settings`.

    Raises:
        ConfigError: If the file is missing or malformed, or a value is invalid.
    """
    values: dict[str, Any] = {}
    path_text = config if config is not None else os.environ.get("CKPT_CONFIG")
    source: Path | None = None
    if path_text:
        source = Path(path_text).expanduser()
        try:
            data = tomllib.loads(source.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {source} does not exist") from exc
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {source}: {exc}") from exc
        for key, value in _flatten_file(data, source).items():
            values[key] = _coerce(key, value, str(source))
        if "root" in values and not values["root"].is_absolute():
            values["root"] = (source.parent / values["root"]).resolve()
    for env, name in _ENV.items():
        if env in os.environ:
            if name.startswith("storage_options."):
                opts = dict(values.get("storage_options", {}))
                opts[name.split(".", 1)[1]] = os.environ[env]
                values["storage_options"] = opts
            else:
                values[name] = _coerce(name, os.environ[env], f"${env}")
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = _coerce(key, value, "argument")
    if source is not None:
        values["source"] = source
    logger.debug("settings resolved from %s", source or "defaults/environment")
    return Settings(**values)
