"""CLI command ``ckpt init [PATH]``: create a store (catalog, hot tier, marker), and with
``--config FILE`` a commented config file that selects it.

Every other command refuses a path that holds no store ("no store at PATH"), so a mistyped
``--store`` never becomes a new store; this command and a first save are how one is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptstore.cli.common import State
from ckptstore.cli.output import console, print_json
from ckptstore.errors import ConfigError

__all__ = ["config_template", "init_cmd", "register"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def config_template(root: Path) -> str:
    """A config file selecting the store at ``root``, every other key commented out with its
    default and its ``CKPT_*`` variable (``ckptstore.example.toml`` explains each)."""
    return f'''# ckptstore configuration, written by `ckpt init`. Every key but root is commented
# out and shows its default; ckptstore.example.toml in the source tree explains each one.
# Precedence: explicit argument > CKPT_* environment variable > this file > default.
# Relative paths here are relative to this file's directory. `ckpt config` shows the result.
# Credentials are never read from here (S3 uses the environment / AWS credential chain).

root = {_toml_string(str(root))}          # CKPT_ROOT: catalog.db and the hot tier (<root>/hot)
# catalog_url = "postgresql+psycopg://ckpt@db.internal:5432/ckpt"   # CKPT_CATALOG_URL
# codec = "auto"                # CKPT_CODEC: auto | none | lz4 | zstd-1 | zstd-3
# archive_codec = "zstd-3"      # CKPT_ARCHIVE_CODEC: none | lz4 | zstd-1 | zstd-3
# chunk_bytes = 8388608         # CKPT_CHUNK_BYTES: target chunk size (8 MiB)
# threads = 2                   # CKPT_THREADS
# delta = "dedup"               # CKPT_DELTA: "dedup", false, "xor", or a table
# keyframe_every = 10           # CKPT_KEYFRAME_EVERY
# memory_tier_bytes = 0         # CKPT_MEMORY_TIER_BYTES: /dev/shm copies (0: off)
# save_interval = 1000          # CKPT_SAVE_INTERVAL: CheckpointManager's default interval

[tiers]
# hot = "file:///nvme/ckpt"     # CKPT_HOT: a local path or file:// URL (default <root>/hot)
# warm = "s3://my-bucket/ckpt"  # CKPT_WARM: an s3:// URL or a local path
# cold = "s3://my-cold-bucket/ckpt"   # CKPT_COLD
# cold_storage_class = "GLACIER"      # CKPT_COLD_STORAGE_CLASS

[retention]
# keep_last = 5                 # CKPT_KEEP_LAST: the newest N per run
# keep_every = 10000            # CKPT_KEEP_EVERY: steps that are multiples of K
# keep_best = ["val_loss", "min", 3]  # CKPT_KEEP_BEST=val_loss:min:3
# max_age_days = 30             # CKPT_MAX_AGE_DAYS

[schedules]                     # CKPT_SCHEDULES: cron expressions per flow (`ckpt serve`)
# archive = "*/10 * * * *"
# retention = "0 * * * *"
# verify = "0 3 * * 0"
# gc = "30 3 * * *"
'''


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def init_cmd(
    ctx: typer.Context,
    path: Annotated[str | None, typer.Argument(
        help="Store directory to create (default: --store, the config's root, else ./ckpt).",
        show_default=False)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a store: its catalog, its hot tier and the hot tier's store marker.

    With --config FILE naming a file that does not exist yet, also write FILE: a commented
    config whose root is this store, so that later commands run with it (or from FILE's
    directory, when FILE is ./ckptstore.toml) find the store. An existing store is left as
    it is (exit 0, "already a store").

    JSON: {"root", "catalog", "hot", "created", "config"}.
    """
    from ckptstore.catalog.presence import catalog_is_new
    from ckptstore.config import load_settings
    from ckptstore.redact import mask_url
    from ckptstore.store import CheckpointStore

    state: State = ctx.obj
    root = path if path is not None else state.store
    written: Path | None = None
    if state.config is not None and not Path(state.config).expanduser().exists():
        written = Path(state.config).expanduser().absolute()
        target = Path(root if root is not None else "ckpt").expanduser().absolute()
        _write_config(written, target)
        root = None  # the file now names it
    settings = load_settings(state.config, root=root)
    created = catalog_is_new(settings.resolved_catalog_url)
    with CheckpointStore.open(root, config=state.config, create=True) as store:
        settings = store.settings
    doc = {"root": str(settings.root), "catalog": mask_url(settings.resolved_catalog_url),
           "hot": str(settings.hot_path), "created": created,
           "config": str(written) if written is not None else None}
    if as_json:
        print_json(doc)
        return
    said = "created store" if created else "already a store"
    console.print(f"{said}: {doc['root']} (catalog {doc['catalog']}, hot tier {doc['hot']})",
                  markup=False, highlight=False, soft_wrap=True)
    if written is not None:
        console.print(f"wrote config {written}: run commands with --config {written}"
                      + (" (or from its directory)" if written.name == "ckptstore.toml"
                         else ""), markup=False, highlight=False, soft_wrap=True)


def _write_config(path: Path, root: Path) -> None:
    """Write the commented config file (new files only: an existing one is never replaced)."""
    from ckptstore.durable import write_new_file

    if not path.parent.is_dir():
        raise ConfigError(f"cannot write the config file {path}: {path.parent} is not a "
                          "directory")
    write_new_file(path, config_template(root).encode())


def register(app: typer.Typer) -> None:
    """Add ``init`` to the ``ckpt`` app."""
    app.command("init")(init_cmd)
