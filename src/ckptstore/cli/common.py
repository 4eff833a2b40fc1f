"""Shared pieces of the CLI: global options, opening the store, progress bars, filters."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from ckptstore.config import Settings, load_settings
from ckptstore.errors import InvalidNameError
from ckptstore.numeric import MAX_INT64, decimal_or_none, float_or_none, parse_float
from ckptstore.store import CheckpointStore

__all__ = [
    "State",
    "ascii_float",
    "ascii_int",
    "open_store",
    "parse_where",
    "progress_bar",
    "spinner",
]


@dataclass
class State:
    """Global options given before the command name."""

    store: str | None = None
    config: str | None = None

    def settings(self) -> Settings:
        """Resolve the settings these options select."""
        return load_settings(self.config, root=self.store)


@contextmanager
def open_store(ctx: typer.Context) -> Iterator[CheckpointStore]:
    """Open the store selected by the global options and close it afterwards."""
    state: State = ctx.obj
    store = CheckpointStore.open(state.store, config=state.config)
    try:
        yield store
    finally:
        store.close()


_WHERE = re.compile(
    r"^\s*([A-Za-z_][A-Za-z0-9_./-]*)\s*(<=|>=|==|!=|<|>)\s*([-+0-9.eE]+|nan|inf)\s*\Z",
    re.ASCII,
)


def ascii_int(text: str | int) -> int:
    """Parser of integer options: ASCII digits only (click's INT reads a full-width 3 as 3).

    Raises:
        ValueError: Reported by click as a usage error (exit 2).
    """
    if isinstance(text, int):  # the option's default, passed through as it is
        return text
    value = decimal_or_none(text.strip(), MAX_INT64)
    if value is None:
        raise ValueError(f"{text!r} is not a non-negative integer written with the digits "
                         f"0-9 (at most {MAX_INT64})")
    return value


def ascii_float(text: str | float) -> float:
    """Parser of number options: ASCII notation only (click's FLOAT reads a full-width 3)."""
    if isinstance(text, int | float):  # the option's default
        return float(text)
    value = float_or_none(text.strip())
    if value is None:
        raise ValueError(f"{text!r} is not a number written with the digits 0-9 (e.g. 2.5)")
    return value


def parse_where(text: str) -> tuple[str, tuple[str, float]]:
    """Parse a metric filter such as ``loss<2.0`` into ``("loss", ("<", 2.0))``.

    Raises:
        InvalidNameError: If the text is not ``<metric><op><number>``.
    """
    match = _WHERE.match(text)
    if not match:
        raise InvalidNameError(
            f"cannot parse --where {text!r}: write <metric><op><number> with op one of "
            "< <= > >= == !=, e.g. --where 'loss<2.0'"
        )
    return match.group(1), (match.group(2), parse_float(match.group(3), f"--where {text!r}",
                                                        finite=False))


@contextmanager
def progress_bar(
    description: str, total: int | None, *, enabled: bool = True
) -> Iterator[Callable[[int], None]]:
    """A rich transfer bar; quiet when stdout is not a terminal or ``enabled`` is False.

    Yields:
        A callback taking a number of bytes just processed.
    """
    if not enabled or not sys.stderr.isatty():
        yield lambda _n: None
        return
    columns: list[Any] = [
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, transient=True, console=Console(stderr=True)) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


@contextmanager
def spinner(description: str, *, enabled: bool = True) -> Iterator[None]:
    """A live "working..." line for steps without a byte count (verify, prune).

    Quiet when stderr is not a terminal or ``enabled`` is False (``--json``).
    """
    if not enabled or not sys.stderr.isatty():
        yield
        return
    with Console(stderr=True).status(description):
        yield
