"""The ``ckpt`` command: browse, query and manage a checkpoint store.

Exit codes: 0 success, 1 the operation failed (the message says why and what to do),
2 bad usage (unknown option, missing argument). With ``--json`` every command prints one JSON
document on stdout, a failure included: ``{"error": {"type": ..., "message": ...}}`` with the
same exit code.

This module is the entry point: :func:`main` runs the command and turns errors into exit
codes. The command itself (the root's global options and every command group) is assembled
in :mod:`ckptstore.cli.commands`, imported on first use, so that ``ckpt --version`` answers
without importing typer or any command module.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptstore.cli.commands import app

__all__ = ["app", "main"]


def __getattr__(name: str) -> Any:
    # The typer app is built on first use (ckptstore.cli.commands): `ckpt --version` answers
    # before typer and the command modules are imported.
    if name == "app":
        from ckptstore.cli.commands import app as built

        return built
    raise AttributeError(f"module 'ckptstore.cli.app' has no attribute {name!r}")


def _version_only(args: Sequence[str]) -> bool:
    return list(args) == ["--version"]


def _wants_json(args: Sequence[str]) -> bool:
    """Whether ``--json`` is among the options (not after a ``--`` separator)."""
    for arg in args:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


def _fail(as_json: bool, kind: str, message: str, code: int) -> int:
    from ckptstore.cli.output import print_error, print_error_json

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
    if _version_only(args):
        from ckptstore.cli.version import version_text

        print(version_text())
        return 0
    import typer

    from ckptstore.cli.commands import click_command
    from ckptstore.cli.output import err_console, print_error_json
    from ckptstore.cli.prefetch import EXIT_THAW_PENDING
    from ckptstore.errors import CkptError, ThawPendingError, UsageError
    from ckptstore.extras import extra_for, missing_extra

    as_json = _wants_json(args)
    try:
        result = click_command().main(args=args, prog_name="ckpt", standalone_mode=False)
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
        return _fail(as_json, type(exc).__name__, str(exc), EXIT_THAW_PENDING)
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
