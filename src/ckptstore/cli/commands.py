"""The ``ckpt`` command's typer app: the root's global options and the command groups of
the sibling modules (queries, labels, cleanup, settings, db, transfer, trust, overview,
deltas, prefetch, remote, init). :mod:`ckptstore.cli.app` runs it (``main``); importing this
module costs typer and the command modules, which ``ckpt --version`` does without.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Annotated

import typer

from ckptstore.cli import (
    cleanup,
    db,
    deltas,
    init,
    labels,
    lineage,
    merge,
    overview,
    prefetch,
    queries,
    remote,
    reproduce,
    settings,
    transfer,
    trust,
)
from ckptstore.cli.common import State, configure_logging, install_global_options
from ckptstore.cli.output import console
from ckptstore.cli.version import version_text

if TYPE_CHECKING:
    from typer._click.core import Command  # typer's own click, what get_command returns

__all__ = ["app", "click_command"]

app = typer.Typer(
    name="ckpt",
    help=(
        "Manage PyTorch checkpoints: list, inspect, archive, prune, restore, convert.\n\n"
        "The store is chosen by --store PATH (a directory holding catalog.db and hot/), "
        "--config FILE (TOML; else $CKPT_CONFIG, else ./ckptstore.toml), and the CKPT_* "
        "variables ($CKPT_ROOT, $CKPT_CATALOG_URL, ...); default ./ckpt. `ckpt config` "
        "shows what was resolved. References: a uuid, run@latest, run@<step>, run@v<version>, "
        "run@best:<metric>[:max] or an alias. The global options (--store, --config, "
        "--verbose) go before or after the command name. Every command that prints a result "
        "takes --json.\n\n"
        "Exit codes: 0 done; 1 error (one line says what failed and what to do); 2 bad usage; "
        f"{prefetch.EXIT_THAW_PENDING} the checkpoint's only copy is in GLACIER and is "
        "thawing: retry later, or wait with `ckpt thaw REF --wait`."
    ),
    no_args_is_help=True,
    # --install-completion / --show-completion: tab completion for bash, zsh, fish, pwsh.
    add_completion=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        console.print(version_text(), markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    store: Annotated[
        str | None, typer.Option("--store", "-s", help="Store directory (default ./ckpt).")
    ] = None,
    config: Annotated[
        str | None,
        typer.Option("--config", "-c",
                     help="TOML config file (default $CKPT_CONFIG, else ./ckptstore.toml)."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log progress.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True,
                     help="Print the version (ckpt <version>) and exit."),
    ] = False,
) -> None:
    configure_logging(verbose)
    ctx.obj = State(store=store, config=config, verbose=verbose)


init.register(app)
queries.register(app)
labels.register(app)
cleanup.register(app)
settings.register(app)
db.register(app)
transfer.register(app)
trust.register(app)
overview.register(app)
deltas.register(app)
lineage.register(app)
merge.register(app)
reproduce.register(app)
prefetch.register(app)
remote.register(app)
# Last, so that every command registered above gets them.
install_global_options(app)
# After them: `remote add` has a --config option of its own (the remote's config file).
remote.register_remote_group(app)


@functools.cache
def click_command() -> Command:
    """The click command that runs ``app``, built once per process.

    typer builds it by reading every command function's signature and type hints (a tenth of
    a second for this tree); a process that runs several commands, such as a test session or
    a script calling :func:`ckptstore.cli.app.main` in a loop, pays that once. The command
    holds no state between invocations: each one gets a fresh click context.
    """
    return typer.main.get_command(app)

