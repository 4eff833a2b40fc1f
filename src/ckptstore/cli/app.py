"""The ``ckpt`` command: browse, query and manage a checkpoint store.

Exit codes: 0 success, 1 the operation failed (the message says why and what to do),
2 bad usage (unknown option, missing argument). With ``--json`` every command prints one JSON
document on stdout, a failure included: ``{"error": {"type": ..., "message": ...}}`` with the
same exit code.

This module assembles the command: the root's global options, the command groups of the
sibling modules (queries, labels, cleanup, settings, db, transfer, trust, overview, deltas,
prefetch, remote) and :func:`main`, which turns errors into exit codes.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Sequence
from typing import Annotated

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
    settings,
    transfer,
    trust,
)
from ckptstore.cli.common import State, configure_logging, install_global_options
from ckptstore.cli.output import console, err_console, print_error, print_error_json
from ckptstore.errors import CkptError, ThawPendingError, UsageError
from ckptstore.extras import extra_for, missing_extra

__all__ = ["app", "main"]

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


def version_text() -> str:
    """What ``ckpt --version`` prints: "ckpt" and the installed distribution's version."""
    try:
        version = importlib.metadata.version("ckptstore")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        from ckptstore import __version__ as version
    return f"ckpt {version}"


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
prefetch.register(app)
remote.register(app)
# Last, so that every command registered above gets them.
install_global_options(app)
# After them: `remote add` has a --config option of its own (the remote's config file).
remote.register_remote_group(app)


def _wants_json(args: Sequence[str]) -> bool:
    """Whether ``--json`` is among the options (not after a ``--`` separator)."""
    for arg in args:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def _fail(as_json: bool, kind: str, message: str, code: int) -> int:
    if as_json:
        print_error_json(kind, message)
    else:
        print_error(message)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ckpt``; returns the exit code instead of raising.

    Usage errors exit 2 (click's own, and our :class:`UsageError`: a malformed reference,
    expression, option value or format); our own errors print one line saying what failed
    and what to do (exit 1; exit 75 for a checkpoint still thawing from GLACIER) instead of
    a traceback; a missing optional package names the extra to install.
    With ``--json`` both go to stdout as ``{"error": {"type": ..., "message": ...}}``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = _wants_json(args)
    try:
        command = typer.main.get_command(app)
        result = command.main(args=args, prog_name="ckpt", standalone_mode=False)
    except SystemExit as exc:  # shell completion exits by itself
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except typer.TyperException as exc:  # bad usage: unknown option, missing argument
        if as_json:
            print_error_json(type(exc).__name__, exc.format_message())
        elif callable(show := getattr(exc, "show", None)):
            show()  # usage line, hint and message, as typer prints them
        else:
            err_console.print(f"error: {exc.format_message()}", markup=False, soft_wrap=True)
        return exc.exit_code
    except typer.Abort:
        return _fail(as_json, "Aborted", "aborted", 1)
    except UsageError as exc:  # a malformed reference, expression or option value
        return _fail(as_json, type(exc).__name__, str(exc), 2)
    except ThawPendingError as exc:  # a temporary state, told apart so scripts can retry
        return _fail(as_json, type(exc).__name__, str(exc), prefetch.EXIT_THAW_PENDING)
    except CkptError as exc:
        return _fail(as_json, type(exc).__name__, str(exc), 1)
    except ImportError as exc:  # an optional package that no library module checked for
        if exc.name and extra_for(exc.name):
            err = missing_extra(exc.name, "this command")
            return _fail(as_json, type(err).__name__, str(err), 1)
        raise
    except OSError as exc:  # anything our own layers did not wrap
        return _fail(as_json, type(exc).__name__, str(exc), 1)
    # standalone_mode=False hands back typer.Exit's code (or the command's None).
    return result if isinstance(result, int) else 0


if __name__ == "__main__":  # pragma: no cover
    os._exit(main())
