"""Configuration: explicit argument > environment (``CKPT_*``) > config file > default.

The config file is the one given explicitly (``--config``, ``open(config=...)``), else the
one ``$CKPT_CONFIG`` names, else ``./ckptstore.toml`` when it exists (:func:`discover_config`).
Every setting has a ``CKPT_*`` variable (:data:`ENV_VARS`); ``ckptstore.example.toml``
documents every key, and ``ckpt config`` prints the resolved settings and where each came from
(:func:`resolve_settings`).

The config file is TOML. Keys may sit at the top level or under a ``[ckptstore]`` table::

    root = "./ckpt"                       # store directory (catalog.db and hot/ live here)
    catalog_url = "postgresql+psycopg://postgres@127.0.0.1:5432/ckpt"
    codec = "auto"                        # per array: Blosc-LZ4 where a float array shrinks

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

Where a store lives: one config file means one store, from whatever directory it is used.

* Relative paths in a config file (``root``, ``hot``/``save_dir``, local ``warm``/``cold``
  tiers, ``memory_tier_dir``, a ``sqlite:///`` catalog URL) are relative to the directory of
  the config file, not to the current directory. Relative paths from ``CKPT_*`` variables and
  arguments are relative to the current directory.
* Without ``root``, the store root sits with the hot tier: ``<hot>/.ckptstore/`` (so the
  embedded catalog is ``<hot>/.ckptstore/catalog.db``). A hidden directory inside the hot tier
  cannot collide with a run (run names never start with a dot), and two hot tiers never share
  a catalog. With neither ``root`` nor ``hot``, the root is ``ckpt/`` next to the config file
  (``./ckpt`` of the current directory when there is no config file at all).
* The hot tier records which store it belongs to in ``<hot>/.ckptstore.json``, the catalog
  records the same store id; a store refuses a catalog that belongs to another store's hot
  tier (:meth:`ckptstore.core.StoreCore.open`).

Before this rule a config with ``save_dir`` but no ``root`` kept its catalog in ``./ckpt`` of
whatever directory a command ran in; such a store is found again by setting ``root`` to that
directory (or moving its ``catalog.db`` to ``<hot>/.ckptstore/``). Opening the new location
with an empty catalog is refused while the hot tier holds checkpoints, so nothing is lost.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ckptstore.cronspec import check_schedule
from ckptstore.deltaspec import parse_delta
from ckptstore.errors import ConfigError, InvalidNameError
from ckptstore.numeric import MAX_INT64, decimal_or_none, float_or_none
from ckptstore.redact import redact_setting

__all__ = [
    "CODECS",
    "CONFIG_ENV",
    "DEFAULT_CONFIG_NAME",
    "ENV_ENTRY_VARS",
    "ENV_VARS",
    "SCHEDULABLE_FLOWS",
    "STORE_DIR_NAME",
    "Origin",
    "ResolvedSettings",
    "Settings",
    "discover_config",
    "load_settings",
    "resolve_settings",
]

logger = logging.getLogger(__name__)

#: The codec presets a setting or a ``--codec`` option may name.
CODECS = ("auto", "none", "lz4", "zstd-1", "zstd-3")
_CODECS = CODECS
# Re-encoding an archived copy picks one codec for every array.
_ARCHIVE_CODECS = _CODECS[1:]

#: Name of the store root inside the hot tier when no ``root`` is configured.
STORE_DIR_NAME = ".ckptstore"
# Settings that hold local paths (or URLs that may be local paths).
_PATH_FIELDS = ("hot", "warm", "cold", "memory_tier_dir", "decrypt_key")


@dataclass(frozen=True)
class Settings:
    """Resolved configuration of one store.

    Attributes:
        root: Store directory; the embedded catalog and the default hot tier live here.
            Default: ``<hot>/.ckptstore`` when a hot tier is configured, else ``ckpt`` next
            to the config file, else ``./ckpt`` (see the module docstring).
        catalog_url: SQLAlchemy URL of the catalog; default ``sqlite:///<root>/catalog.db``.
        hot: Hot tier location (local path or ``file://`` URL); default ``<root>/hot``.
        warm: Warm tier URL (``s3://bucket/prefix`` or a local path), optional.
        cold: Cold tier URL, optional.
        cold_storage_class: S3 storage class used when writing to the cold tier.
        cold_restore_tier: Retrieval tier of the S3 restore requests that thaw a copy in an
            archival class (``Expedited``, ``Standard`` or ``Bulk``; see docs/PREFETCH.md).
        cold_restore_days: Days a thawed object stays readable before S3 archives it again.
        storage_options: Options for fsspec/s3fs (``endpoint_url``, ...); no credentials.
        codec: Codec preset for saves on the hot tier: ``auto`` (the default) chooses per
            array (fp32 raw, bf16/fp16 Blosc-LZ4 when it shrinks them), or one of ``none``,
            ``lz4``, ``zstd-1``, ``zstd-3`` for every array.
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
        sync: What the ``sync`` flow pushes when it is started without parameters (a
            ``[schedules]`` entry, ``ckpt serve``): a table of ``remote`` (one remote; default
            every remote), ``runs`` (default every run), ``best`` (only each run's best by
            this metric), ``mode`` (``min``/``max``) and ``tag`` (docs/REMOTES.md).
        decrypt_key: X25519 private key file that opens encrypted copies (``ckpt pull``,
            ``import-bundle``, and restores from an encrypted tier) when no ``--key`` is given
            (docs/SHARING.md).
        encrypt_to: Recipients' X25519 public key files (``[tiers] encrypt_to``; in
            ``CKPT_ENCRYPT_TO`` separated by commas or ``os.pathsep``). When set, archive and
            demote write the warm and cold tiers as sealed (encrypted) copies only
            (:mod:`ckptstore.ops.tiering.sealed_tier`, docs/SHARING.md). Each file is checked
            when the settings load. A cold tier in an archival class (GLACIER,
            DEEP_ARCHIVE) holds sealed copies too: they are thawed object by object
            before a restore (:mod:`ckptstore.ops.tiering.thaw`).
        capture: Record each run's context (git commit and uncommitted change, command,
            environment, config) on its first save and when it changes
            (:mod:`ckptstore.capture`); ``false`` (``CKPT_CAPTURE=0``) records none.
        capture_env: Names of environment variables recorded with the context (none by
            default: nothing else of the environment is stored).
        source: The config file this came from, if any.
    """

    root: Path = Path("./ckpt")
    catalog_url: str | None = None
    hot: str | None = None
    warm: str | None = None
    cold: str | None = None
    cold_storage_class: str | None = "GLACIER"
    cold_restore_tier: str = "Standard"
    cold_restore_days: int = 7
    storage_options: dict[str, Any] = field(default_factory=dict)
    codec: str = "auto"
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
    sync: dict[str, Any] = field(default_factory=dict)
    decrypt_key: str | None = None
    encrypt_to: tuple[str, ...] = ()
    capture: bool = True
    capture_env: tuple[str, ...] = ()
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


#: Environment variable naming the config file (see :func:`discover_config`).
CONFIG_ENV = "CKPT_CONFIG"
#: Config file used when neither ``--config`` nor ``$CKPT_CONFIG`` names one.
DEFAULT_CONFIG_NAME = "ckptstore.toml"

#: The environment variable of every setting. Table settings take a JSON object
#: (``CKPT_STORAGE_OPTIONS='{"endpoint_url": "http://minio:9000"}'``), ``CKPT_KEEP_BEST``
#: takes ``METRIC:min|max:N`` and ``CKPT_DELTA`` a mode name, ``true``/``false`` or a JSON
#: object. ``source`` is not a setting: ``$CKPT_CONFIG`` chooses the file.
ENV_VARS: dict[str, str] = {
    "root": "CKPT_ROOT",
    "catalog_url": "CKPT_CATALOG_URL",
    "hot": "CKPT_HOT",
    "warm": "CKPT_WARM",
    "cold": "CKPT_COLD",
    "cold_storage_class": "CKPT_COLD_STORAGE_CLASS",
    "cold_restore_tier": "CKPT_COLD_RESTORE_TIER",
    "cold_restore_days": "CKPT_COLD_RESTORE_DAYS",
    "storage_options": "CKPT_STORAGE_OPTIONS",
    "codec": "CKPT_CODEC",
    "archive_codec": "CKPT_ARCHIVE_CODEC",
    "chunk_bytes": "CKPT_CHUNK_BYTES",
    "threads": "CKPT_THREADS",
    "keep_last": "CKPT_KEEP_LAST",
    "keep_every": "CKPT_KEEP_EVERY",
    "keep_best": "CKPT_KEEP_BEST",
    "max_age_days": "CKPT_MAX_AGE_DAYS",
    "save_interval": "CKPT_SAVE_INTERVAL",
    "cold_after_days": "CKPT_COLD_AFTER_DAYS",
    "schedules": "CKPT_SCHEDULES",
    "staging_budget_bytes": "CKPT_STAGING_BUDGET_BYTES",
    "memory_tier_bytes": "CKPT_MEMORY_TIER_BYTES",
    "memory_tier_dir": "CKPT_MEMORY_TIER_DIR",
    "delta": "CKPT_DELTA",
    "keyframe_every": "CKPT_KEYFRAME_EVERY",
    "delta_cache_bytes": "CKPT_DELTA_CACHE_BYTES",
    "replicas": "CKPT_REPLICAS",
    "host_timeout_s": "CKPT_HOST_TIMEOUT_S",
    "sync": "CKPT_SYNC",
    "decrypt_key": "CKPT_DECRYPT_KEY",
    "encrypt_to": "CKPT_ENCRYPT_TO",
    "capture": "CKPT_CAPTURE",
    "capture_env": "CKPT_CAPTURE_ENV",
}
#: Variables that set one entry of a table setting (applied after the table's own variable).
ENV_ENTRY_VARS: dict[str, tuple[str, str]] = {
    "CKPT_S3_ENDPOINT_URL": ("storage_options", "endpoint_url"),
}

_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_RESTORE_TIERS = ("Expedited", "Standard", "Bulk")
_INT_FIELDS = {"chunk_bytes", "threads", "keep_last", "keep_every", "save_interval",
               "staging_budget_bytes", "keyframe_every", "memory_tier_bytes",
               "delta_cache_bytes", "replicas", "cold_restore_days"}
_FLOAT_FIELDS = {"max_age_days", "cold_after_days", "host_timeout_s"}


def _flatten_file(data: dict[str, Any], source: Path) -> dict[str, Any]:
    """Map the file's sections and DeepSpeed-style keys onto Settings field names."""
    if "ckptstore" in data and isinstance(data["ckptstore"], dict):
        data = {**data, **data.pop("ckptstore")}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "tiers" and isinstance(value, dict):
            for tkey, tval in value.items():
                if tkey not in _TIER_KEYS:
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


#: The flows a ``[schedules]`` entry may name (the others run on request only).
SCHEDULABLE_FLOWS = ("archive", "demote", "gc", "retention", "sync", "verify")
#: S3 storage classes the cold tier may write with.
_STORAGE_CLASSES = ("STANDARD", "REDUCED_REDUNDANCY", "STANDARD_IA", "ONEZONE_IA",
                    "INTELLIGENT_TIERING", "GLACIER", "GLACIER_IR", "DEEP_ARCHIVE")
_TIER_KEYS = ("hot", "warm", "cold", "cold_storage_class", "cold_restore_tier",
              "cold_restore_days", "encrypt_to")
_RETENTION_KEYS = ("keep_last", "keep_every", "keep_best", "max_age_days")


def _key_label(name: str, origin: str) -> str:
    """The key as the user wrote it: ``tiers.warm`` in a file, ``warm`` elsewhere."""
    if origin.startswith("$") or origin == "argument":
        return name
    if name in _TIER_KEYS:
        return f"tiers.{name}"
    if name in _RETENTION_KEYS:
        return f"retention.{name}"
    return name


def _coerce(name: str, value: Any, origin: str) -> Any:
    try:
        return _checked(name, value)
    except (TypeError, ValueError, OverflowError) as exc:
        shown = redact_setting(value, name)
        raise ConfigError(f"{origin}: invalid value for {_key_label(name, origin)}: "
                          f"{shown!r} ({exc})") from exc


def _checked(name: str, value: Any) -> Any:
    """``value`` as the setting ``name`` holds it (raises ValueError/TypeError saying what is
    allowed)."""
    if value is None:
        return None
    if name == "root":
        if not isinstance(value, str | os.PathLike) or not os.fspath(value):
            raise ValueError("must be a directory path (a string)")
        return Path(value).expanduser()
    if name in _INT_FIELDS:
        number = _as_int(value)
        if name in ("chunk_bytes", "threads", "keyframe_every",
                    "cold_restore_days") and number == 0:
            raise ValueError("must be positive")
        if name == "replicas" and number not in (1, 2):
            raise ValueError("must be 1 (own host) or 2 (also a neighbour host)")
        return number
    if name in _FLOAT_FIELDS:
        return _as_float(value)
    if name == "keep_best":
        if not isinstance(value, list | tuple) or len(value) != 3:
            raise ValueError('must be [metric, "min" or "max", count], e.g. '
                             '["val_loss", "min", 3]')
        metric, mode, count = value
        if not isinstance(metric, str) or not metric:
            raise ValueError("the metric must be a non-empty string")
        if mode not in ("min", "max"):
            raise ValueError("mode must be 'min' or 'max'")
        return (metric, str(mode), _as_int(count))
    if name == "storage_options":
        if not isinstance(value, dict):
            raise ValueError("must be a table")
        return dict(value)
    if name == "schedules":
        return _schedules_value(value)
    if name == "delta":
        return _delta_value(value)
    if name == "sync":
        return _sync_value(value)
    if name == "capture":
        return _bool_value(value)
    if name == "capture_env":
        return _name_list(value)
    if name == "encrypt_to":
        return _path_list(value)
    if name in ("hot", "warm", "cold"):
        return _tier_url(name, value)
    if name == "memory_tier_dir":
        if not isinstance(value, str) or not value or "://" in value:
            raise ValueError("must be a local directory path")
        return value
    if name == "catalog_url":
        if not isinstance(value, str) or not value.startswith(("sqlite://", "postgresql")):
            raise ValueError("must be sqlite:///path/to/catalog.db or "
                             "postgresql+psycopg://user@host:5432/db")
        return value
    if name == "cold_storage_class":
        if value not in _STORAGE_CLASSES:
            raise ValueError(f"must be one of {', '.join(_STORAGE_CLASSES)}")
        return str(value)
    if name == "cold_restore_tier":
        # The three retrieval tiers S3 RestoreObject accepts, in S3's own spelling.
        if value not in _RESTORE_TIERS:
            raise ValueError(f"must be one of {', '.join(_RESTORE_TIERS)}")
        return str(value)
    if name == "codec" or name == "archive_codec":
        allowed = _CODECS if name == "codec" else _ARCHIVE_CODECS
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return str(value)
    if not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def _tier_url(name: str, value: Any) -> str:
    """A tier location: a local path, ``file://`` or ``s3://bucket/prefix``."""
    schemes = "a local path, a file:// URL or an s3://bucket/prefix URL"
    if name != "hot" and value == "":
        return ""  # an empty warm or cold tier means none (``CKPT_WARM=`` turns it off)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be {schemes} (a string)")
    scheme, sep, rest = value.partition("://")
    if not sep:
        return value
    if scheme == "file" and rest:
        return value
    if scheme == "s3" and rest.split("/", 1)[0]:
        return value
    if scheme in ("file", "s3"):
        raise ValueError(f"names no {'path' if scheme == 'file' else 'bucket'}; must be "
                         f"{schemes}")
    raise ValueError(f"unsupported scheme {scheme + '://'!r}; must be {schemes}")


def _schedules_value(value: Any) -> dict[str, str]:
    """The ``[schedules]`` table checked: schedulable flows, each a valid schedule."""
    if not isinstance(value, dict):
        raise ValueError("must be a table of flow name = schedule")
    out: dict[str, str] = {}
    for flow, text in value.items():
        if flow not in SCHEDULABLE_FLOWS:
            raise ValueError(f"schedule for {flow!r} cannot be served (that flow runs on "
                             f"request only, or is unknown); schedulable flows: "
                             f"{', '.join(SCHEDULABLE_FLOWS)}")
        try:
            out[flow] = check_schedule(text)
        except ValueError as exc:
            raise ValueError(f"{flow} = {text!r}: {exc}") from None
    return out


def _as_int(value: Any) -> int:
    """A non-negative int from TOML (an int) or the environment (ASCII digits only)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("must be a non-negative integer")
    number = decimal_or_none(value.strip()) if isinstance(value, str) else value
    if number is None or not 0 <= number <= MAX_INT64:
        raise ValueError(f"must be a non-negative integer written with the digits 0-9, "
                         f"at most {MAX_INT64}")
    return number


def _as_float(value: Any) -> float:
    """A finite, non-negative number from TOML or the environment (ASCII notation only)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("must be a number")
    number = float_or_none(value.strip()) if isinstance(value, str) else float(value)
    if number is None or not math.isfinite(number) or number < 0:
        raise ValueError("must be a finite number >= 0 written with the digits 0-9")
    return number


def _bool_value(value: Any) -> bool:
    """A bool from TOML, or ``true``/``false``/``1``/``0`` from the environment."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "0", "1"):
        return value.strip().lower() in ("true", "1")
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _name_list(value: Any) -> tuple[str, ...]:
    """A list of names from TOML, or a comma-separated list from the environment."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ValueError("must be a list of names (comma-separated in the environment)")
    return tuple(i.strip() for i in items if i.strip())


def _path_list(value: Any) -> tuple[str, ...]:
    """Key file paths: a TOML list (or one string), or in the environment one string
    separated by commas or ``os.pathsep``."""
    if isinstance(value, str):
        items: Any = value.replace(os.pathsep, ",").split(",")
    else:
        items = value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ValueError('must be a list of public key files, e.g. ["keys/ops.pub"]')
    return tuple(i.strip() for i in items if i.strip())


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


@dataclass(frozen=True)
class Origin:
    """Where a resolved setting came from.

    Attributes:
        kind: ``"argument"`` (an explicit value: ``open()`` keyword, ``--store``),
            ``"env"``, ``"file"`` or ``"default"``.
        detail: The variable, the config file, or how a default was derived.
    """

    kind: Literal["argument", "env", "file", "default"]
    detail: str = ""


@dataclass(frozen=True)
class ResolvedSettings:
    """Settings together with where each of them came from (``ckpt config`` prints this).

    Attributes:
        settings: The resolved settings.
        origins: Field name -> :class:`Origin`, for every field but ``source``.
        config: The config file read, if any.
        config_found_by: How the file was chosen: ``"argument"``, ``"$CKPT_CONFIG"``,
            ``"./ckptstore.toml"``, or ``""`` when no file was read.
    """

    settings: Settings
    origins: dict[str, Origin]
    config: Path | None
    config_found_by: str


def discover_config(config: str | os.PathLike[str] | None = None) -> tuple[Path | None, str]:
    """The config file to read: ``config``, else ``$CKPT_CONFIG``, else ``./ckptstore.toml``.

    Args:
        config: An explicit path (``--config``, ``open(config=...)``).

    Returns:
        ``(path or None, how it was found)``; see :attr:`ResolvedSettings.config_found_by`.
    """
    # Absolute, so the flows a store starts find the same file from any directory.
    if config is not None and os.fspath(config) != "":
        return Path(config).expanduser().absolute(), "argument"
    from_env = os.environ.get(CONFIG_ENV)
    if from_env:
        return Path(from_env).expanduser().absolute(), f"${CONFIG_ENV}"
    local = Path(DEFAULT_CONFIG_NAME)
    if local.is_file():
        return local.resolve(), f"./{DEFAULT_CONFIG_NAME}"
    return None, ""


def load_settings(config: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Resolve settings from explicit overrides, ``CKPT_*`` variables and a TOML file.

    Args:
        config: Path of a TOML config file; default ``$CKPT_CONFIG``, else
            ``./ckptstore.toml`` when it exists (:func:`discover_config`).
        **overrides: Explicit values (highest precedence); ``None`` values are ignored.

    Returns:
        The resolved :class:`Settings`.

    Raises:
        ConfigError: If the file is missing or malformed, or a value is invalid.
    """
    return resolve_settings(config, **overrides).settings


def resolve_settings(
    config: str | os.PathLike[str] | None = None, **overrides: Any
) -> ResolvedSettings:
    """Like :func:`load_settings`, and also say where every setting came from.

    Precedence: explicit argument > environment (``CKPT_*``, :data:`ENV_VARS`) > config file >
    default. Table settings merge their entries across the sources in the same order.

    Raises:
        ConfigError: If the file is missing or malformed, or a value is invalid.
    """
    values: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    source, found_by = discover_config(config)
    if source is not None:
        try:
            data = tomllib.loads(source.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            how = "" if found_by == "argument" else f" (named by {found_by})"
            raise ConfigError(f"config file {source}{how} does not exist") from exc
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {source}: {exc}") from exc
        base = source.parent.resolve()
        for key, value in _flatten_file(data, source).items():
            values[key] = _relative_to(base, key, _coerce(key, value, str(source)))
            origins[key] = Origin("file", str(source))
    for name, env in ENV_VARS.items():
        if env in os.environ:
            value = _coerce(name, _from_env(name, env, os.environ[env]), f"${env}")
            if name in _TABLE_FIELDS and name in values:
                value = {**values[name], **value}
            values[name] = value
            origins[name] = Origin("env", f"${env}")
    for env, (name, entry) in ENV_ENTRY_VARS.items():
        if env in os.environ:
            values[name] = {**values.get(name, {}), entry: os.environ[env]}
            origins[name] = Origin("env", f"${env}")
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in _FIELDS or key == "source":
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = _coerce(key, value, "argument")
        origins[key] = Origin("argument")
    if "root" in values:
        # Absolute, so the flows a store starts reopen the same store from any directory.
        values["root"] = Path(values["root"]).expanduser().resolve()
    else:
        if values.get("hot"):
            # One config, one store: the root (and the embedded catalog) go with the hot tier.
            values["root"] = _local_path(values["hot"], "hot") / STORE_DIR_NAME
            origins["root"] = Origin("default", f"{STORE_DIR_NAME} inside the hot tier")
        elif source is not None:
            values["root"] = source.parent.resolve() / "ckpt"
            origins["root"] = Origin("default", "ckpt/ next to the config file")
    if source is not None:
        values["source"] = source
    _check_encryption(values, origins)
    # In the order of the Settings fields, for reports.
    origins = {name: origins.get(name, Origin("default")) for name in _FIELDS if name != "source"}
    logger.debug("settings resolved from %s", source or "defaults/environment")
    return ResolvedSettings(Settings(**values), origins, source, found_by)


def _check_encryption(values: dict[str, Any], origins: dict[str, Origin]) -> None:
    """Refuse an ``encrypt_to`` that cannot work, before anything is written with it.

    Each file must be an X25519 public key (an Ed25519 signing key, a private key or a
    missing file is a ConfigError naming it, from :mod:`ckptstore.keyfiles`). Any cold
    storage class goes with it: a sealed copy in GLACIER or DEEP_ARCHIVE is thawed by the
    objects under its prefix, which are known without decrypting (ops/tiering/thaw.py).
    """
    paths = values.get("encrypt_to") or ()
    if not paths:
        return
    from ckptstore.keyfiles import load_encryption_key

    origin = origins.get("encrypt_to", Origin("default"))
    where = origin.detail or origin.kind
    label = _key_label("encrypt_to", where)
    for path in paths:
        try:
            load_encryption_key(path)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {label}: {exc}") from None


def _sync_value(value: Any) -> dict[str, Any]:
    """The ``sync`` table checked: known keys, each of its type (raises ValueError)."""
    if not isinstance(value, dict):
        raise ValueError("must be a table of remote, runs, best, mode, tag")
    out: dict[str, Any] = {}
    for key, entry in value.items():
        if key in ("remote", "best", "tag"):
            if not isinstance(entry, str) or not entry:
                raise ValueError(f"{key} must be a non-empty string")
            out[key] = entry
        elif key == "mode":
            if entry not in ("min", "max"):
                raise ValueError("mode must be 'min' or 'max'")
            out[key] = entry
        elif key == "runs":
            if not isinstance(entry, list) or not all(isinstance(r, str) and r for r in entry):
                raise ValueError("runs must be a list of run names")
            out[key] = list(entry)
        else:
            raise ValueError(f"unknown key {key!r}; known: remote, runs, best, mode, tag")
    return out


_TABLE_FIELDS = ("storage_options", "schedules", "sync")


def _from_env(name: str, env: str, text: str) -> Any:
    """The raw value of a setting written as an environment variable's text."""
    stripped = text.strip()
    if name in _TABLE_FIELDS or (name == "delta" and stripped.startswith("{")):
        try:
            value = json.loads(stripped)
        except ValueError as exc:
            raise ConfigError(f"${env}: must be a JSON object, e.g. {_ENV_EXAMPLES[name]} "
                              f"({exc})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"${env}: must be a JSON object, e.g. {_ENV_EXAMPLES[name]}")
        return value
    if name == "keep_best":
        parts = stripped.split(":")
        if len(parts) != 3:
            raise ConfigError(f"${env}: write METRIC:min|max:N, e.g. val_loss:min:3; "
                              f"got {text!r}")
        return parts
    return text


_ENV_EXAMPLES = {
    "storage_options": '{"endpoint_url": "http://127.0.0.1:9000"}',
    "schedules": '{"archive": "*/10 * * * *"}',
    "sync": '{"runs": ["resnet"], "best": "val_loss"}',
    "delta": '{"threshold": 1e-4, "quantize": 8}',
}


def _relative_to(base: Path, name: str, value: Any) -> Any:
    """A config file's relative path made absolute against the file's directory ``base``."""
    if value is None:
        return value
    if name == "root":
        path = Path(value).expanduser()
        return path if path.is_absolute() else (base / path).resolve()
    if name == "encrypt_to":
        return tuple(_relative_to(base, "decrypt_key", path) for path in value)
    if name in _PATH_FIELDS:
        text = str(value)
        prefix = "file://" if text.startswith("file://") else ""
        rest = text[len(prefix):]
        if "://" in rest or not rest:
            return value  # s3:// and other remote URLs
        path = Path(rest).expanduser()
        return value if path.is_absolute() else prefix + str((base / path).resolve())
    if name == "catalog_url" and isinstance(value, str) and value.startswith("sqlite:///"):
        rest = value[len("sqlite:///"):]
        path_text, sep, query = rest.partition("?")
        if path_text and not path_text.startswith("/") and path_text != ":memory:":
            return f"sqlite:///{(base / path_text).resolve()}{sep}{query}"
    return value
