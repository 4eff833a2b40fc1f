"""Shared pieces of the CLI: global options, opening the store, progress bars, filters."""

from __future__ import annotations

import builtins
import functools
import inspect
import logging
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckptstore.config import Settings, load_settings
from ckptstore.errors import InvalidNameError, UsageError
from ckptstore.numeric import MAX_INT64, decimal_or_none, float_or_none, parse_float
from ckptstore.redact import RedactingFormatter

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from ckptstore.catalog import Catalog
    from ckptstore.core import StoreCore
    from ckptstore.records import Checkpoint, Event, RunInfo, UsageRow
    from ckptstore.store import CheckpointStore

# Imports of the store (zarr, torch) and of Prefect happen inside the commands that need
# them: `ckpt --version`, `--help`, tab completion and the catalog queries (`ls`, `runs`,
# `du`, `events`, `lineage`, `config`) never pay for them (tests/cli/test_startup.py).

__all__ = [
    "State",
    "ascii_float",
    "ascii_int",
    "check_usage",
    "configure_logging",
    "install_global_options",
    "open_catalog",
    "open_store",
    "parse_where",
    "progress_bar",
    "quiet_logger",
    "spinner",
    "with_global_options",
]


@dataclass
class State:
    """The global options (``--store``, ``--config``, ``--verbose``), given before or after
    the command name; a value given after it wins."""

    store: str | None = None
    config: str | None = None
    verbose: bool = False

    def settings(self) -> Settings:
        """Resolve the settings these options select."""
        return load_settings(self.config, root=self.store)


_LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def configure_logging(verbose: bool) -> None:
    """Log at INFO with ``--verbose``, else WARNING (to stderr, never into ``--json``)."""
    level = logging.INFO if verbose else logging.WARNING
    root = logging.getLogger()
    before = list(root.handlers)
    logging.basicConfig(level=level, format=_LOG_FORMAT)
    for handler in root.handlers:
        if handler not in before:
            # Log lines quote drivers' and backends' messages: never a credential on stderr.
            handler.setFormatter(RedactingFormatter(_LOG_FORMAT))
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from ckptstore.observability import configure_logging as configure_library_logging

    configure_library_logging(level=level)


_AFTER = " Also accepted before the command name; given in both places, this one wins."
#: The global options as a subcommand declares them (``ckpt ls --store S``). The root
#: declares the same flags in ckptstore.cli.app's callback (``ckpt --store S ls``).
_GLOBAL_PARAMETERS = [
    inspect.Parameter(
        "global_store", inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation=Annotated[str | None, typer.Option(
            "--store", "-s", help="Store directory (default ./ckpt)." + _AFTER)],
    ),
    inspect.Parameter(
        "global_config", inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation=Annotated[str | None, typer.Option(
            "--config", "-c",
            help="TOML config file (default $CKPT_CONFIG, else ./ckptstore.toml)." + _AFTER)],
    ),
    inspect.Parameter(
        "global_verbose", inspect.Parameter.KEYWORD_ONLY, default=False,
        annotation=Annotated[bool, typer.Option(
            "--verbose", "-v", help="Log progress." + _AFTER)],
    ),
]
_CONTEXT = inspect.Parameter("global_ctx", inspect.Parameter.KEYWORD_ONLY,
                             annotation=typer.Context)


def with_global_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Let a command take the global options after its name too.

    Returns a wrapper whose signature adds ``--store``, ``--config`` and ``--verbose`` (and a
    context, if the command has none), which typer turns into options of the subcommand. The
    root callback has already built the :class:`State` from the options before the name;
    those after it overwrite its values, so the subcommand's value wins.
    """
    # Evaluated annotations: typer reads the wrapper's __signature__ as it is.
    signature = inspect.signature(func, eval_str=True)
    ctx_name = next((p.name for p in signature.parameters.values()
                     if p.annotation is typer.Context), None)
    extra = list(_GLOBAL_PARAMETERS) + ([_CONTEXT] if ctx_name is None else [])

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_usage(func, kwargs)
        store = kwargs.pop("global_store", None)
        config = kwargs.pop("global_config", None)
        verbose = kwargs.pop("global_verbose", False)
        ctx = kwargs.pop("global_ctx") if ctx_name is None else kwargs[ctx_name]
        state = ctx.ensure_object(State)
        if store is not None:
            state.store = store
        if config is not None:
            state.config = config
        if verbose and not state.verbose:
            state.verbose = True
            configure_logging(True)
        return func(*args, **kwargs)

    params = list(signature.parameters.values())
    wrapper.__signature__ = signature.replace(parameters=params + extra)  # type: ignore[attr-defined]
    return wrapper


#: Parameters that hold checkpoint references, by their name in every command.
_REF_PARAMS = ("ref", "refs", "a", "b", "parent")
#: Parameters that hold names of one kind, by their name in every command.
_NAME_PARAMS = {"run": "run name", "tag": "tag", "best": "metric"}
#: ``name`` parameters: what they name, by command function.
_NAME_OF = {"alias_cmd": "alias", "keygen_cmd": "key name", "remote_add_cmd": "remote name",
            "remote_rm_cmd": "remote name"}


def check_usage(func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Check the values a command was given that can be checked without a store.

    References, run names, tags, aliases, codec names: a malformed one is bad usage
    (:class:`UsageError`, exit 2), told apart from a well-formed request that then fails
    (a run that does not exist, exit 1). Checked before anything is opened.

    Raises:
        UsageError: Naming the value and what is allowed.
    """
    from ckptstore.config import CODECS
    from ckptstore.names import validate_metric_name, validate_name
    from ckptstore.refs import parse_ref

    def each(value: Any) -> list[Any]:
        if value is None:
            return []
        return list(value) if isinstance(value, list | tuple) else [value]

    try:
        for param in _REF_PARAMS:
            for value in each(kwargs.get(param)):
                parse_ref(value)
        for param, what in _NAME_PARAMS.items():
            for value in each(kwargs.get(param)):
                if what == "metric":
                    validate_metric_name(value)
                else:
                    validate_name(value, what)
        named = _NAME_OF.get(func.__name__)
        if named is not None and kwargs.get("name") is not None:  # keygen's is optional
            validate_name(kwargs["name"], named)
    except InvalidNameError as exc:
        raise UsageError(str(exc)) from None
    codec = kwargs.get("codec")
    if isinstance(codec, str) and codec not in CODECS:
        raise UsageError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    if kwargs.get("pool") == "":
        raise UsageError("work pool name is empty; pass --pool NAME")


def install_global_options(app: typer.Typer) -> None:
    """Wrap every command of ``app`` (and of its sub-apps) with :func:`with_global_options`."""
    for info in app.registered_commands:
        if info.callback is not None:
            info.callback = with_global_options(info.callback)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            install_global_options(group.typer_instance)


def open_store(ctx: typer.Context, *, create: bool = False) -> CheckpointStore:
    """Open the store selected by the global options (use it as ``with open_store(ctx) as
    store``: it closes on leaving).

    Args:
        ctx: The command's context (its :class:`State`).
        create: Create the store when there is none: only for the commands that bring
            checkpoints in (``import``, ``import-bundle``) and ``init``. Every other command
            fails with "no store at PATH" instead, so a mistyped path creates nothing.
    """
    from ckptstore.store import CheckpointStore

    state: State = ctx.obj
    return CheckpointStore.open(state.store, config=state.config, create=create)


def open_core(ctx: typer.Context) -> StoreCore:
    """Open the existing store selected by the global options without its operations (the
    catalog, the settings, the tiers; ``with open_core(ctx) as core``): for the commands that
    only read the catalog and manifests, such as ``ckpt show``; it imports neither torch nor
    zarr."""
    from ckptstore.core import StoreCore

    state: State = ctx.obj
    return StoreCore.open(state.store, config=state.config, create=False)


class CatalogView:
    """What the catalog queries need of a store, without the store: its settings and its
    catalog, and the store's query methods, which only read the catalog.

    Opening it imports neither the format layer (zarr, torch) nor the tiers, so ``ckpt ls``
    answers in about the time the catalog takes.
    """

    def __init__(self, settings: Settings, catalog: Catalog) -> None:
        self.settings = settings
        self.catalog = catalog

    def list(self, **filters: Any) -> builtins.list[Checkpoint]:
        """As :meth:`CheckpointStore.list`."""
        return self.catalog.list(**filters)

    def get(self, ref: str) -> Checkpoint:
        """As :meth:`CheckpointStore.get`."""
        return self.catalog.get(ref)

    def runs(self) -> builtins.list[RunInfo]:
        """As :meth:`CheckpointStore.runs`."""
        return self.catalog.runs()

    def usage(self) -> builtins.list[UsageRow]:
        """As :meth:`CheckpointStore.usage`."""
        return self.catalog.usage()

    def events(self, ref: str | None = None, **kw: Any) -> builtins.list[Event]:
        """As :meth:`CheckpointStore.events`."""
        return self.catalog.events(ref, **kw)


@contextmanager
def open_catalog(ctx: typer.Context) -> Iterator[CatalogView]:
    """Open only the catalog of the store selected by the global options (an existing store:
    "no store at PATH" otherwise), for the commands that only query it."""
    from ckptstore.catalog import Catalog
    from ckptstore.catalog.presence import require_store

    state: State = ctx.obj
    settings = state.settings()
    require_store(settings)
    catalog = Catalog(settings.resolved_catalog_url)
    try:
        yield CatalogView(settings, catalog)
    finally:
        catalog.close()


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
        UsageError: If the text is not ``<metric><op><number>``.
    """
    match = _WHERE.match(text)
    if not match:
        raise UsageError(
            f"cannot parse --where {text!r}: write <metric><op><number> with op one of "
            "< <= > >= == !=, e.g. --where 'loss<2.0'"
        )
    try:
        value = parse_float(match.group(3), f"--where {text!r}", finite=False)
    except InvalidNameError as exc:
        raise UsageError(str(exc)) from None
    return match.group(1), (match.group(2), value)


class _Bar:
    """A progress callback (see :mod:`ckptstore.progress`) that drives one rich task."""

    def __init__(self, progress: Progress | None, task: TaskID | None) -> None:
        self._progress = progress
        self._task = task

    def __call__(self, amount: int, /) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, amount)

    def set_total(self, total: int, /) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, total=total)


@contextmanager
def progress_bar(
    description: str, total: int | None = None, *, enabled: bool = True, unit: str = "bytes"
) -> Iterator[_Bar]:
    """A rich progress bar with rate and ETA, on stderr.

    Quiet (a callback that does nothing) when stderr is not a terminal or ``enabled`` is
    False (``--json``), so piped and JSON output stay clean.

    Args:
        description: What is going on ("archiving").
        total: Units the operation takes, if the caller knows; the library may announce it
            through ``set_total`` instead.
        enabled: False turns the bar off.
        unit: ``bytes`` (sizes and transfer rate) or ``items`` (a count: N/M).

    Yields:
        A callback taking the units just done, with a ``set_total(total)`` method.
    """
    if not enabled or not sys.stderr.isatty():
        yield _Bar(None, None)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns: list[Any] = ["[progress.description]{task.description}", BarColumn()]
    if unit == "bytes":
        columns += [DownloadColumn(), TransferSpeedColumn()]
    else:
        columns += [MofNCompleteColumn()]
    columns.append(TimeRemainingColumn())
    with Progress(*columns, transient=True, console=Console(stderr=True)) as progress:
        task = progress.add_task(description, total=total)
        yield _Bar(progress, task)


@contextmanager
def quiet_logger(name: str, *, unless: bool = False) -> Iterator[None]:
    """Hold back the warnings of logger ``name`` (errors still show) while a command prints
    the same findings in its own report; ``unless`` (``--verbose``) keeps them."""
    logger = logging.getLogger(name)
    before = logger.level
    if not unless:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


@contextmanager
def spinner(description: str, *, enabled: bool = True) -> Iterator[None]:
    """A live "working..." line for steps without a byte count (verify, prune).

    Quiet when stderr is not a terminal or ``enabled`` is False (``--json``).
    """
    if not enabled or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(description):
        yield
