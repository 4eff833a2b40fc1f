"""Checkpoint references: the one syntax the API, the CLI and flow parameters accept.

Forms:
    ``<uuid>``                       one checkpoint by id
    ``run@latest``                   newest committed version of the run
    ``run@<step>``                   newest committed version saved at that step
    ``run@v<version>``               that version
    ``run@best:<metric>``            lowest value of the metric
    ``run@best:<metric>:max``        highest value of the metric
    ``<alias>``                      a user alias such as ``prod`` (see ``store.alias``)

Steps and versions are written with the ASCII digits 0-9 and must fit the catalog's columns
(a step is at most 2**63 - 1, a version at most 2**31 - 1); a larger number is refused as an
:class:`~ckptstore.errors.InvalidNameError` like any other malformed reference, since no
checkpoint can have it. Parsing is pure; resolving a parsed reference against the catalog is
the catalog's job.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from ckptstore.errors import InvalidNameError, UsageError
from ckptstore.names import validate_metric_name, validate_name
from ckptstore.numeric import MAX_INT32, MAX_INT64, is_decimal, parse_decimal

__all__ = ["MAX_STEP", "MAX_VERSION", "Ref", "parse_ref"]

#: Largest step a checkpoint can have (``checkpoints.step`` is a signed 64-bit column).
MAX_STEP = MAX_INT64
#: Largest version a checkpoint can have (``checkpoints.version`` is a signed 32-bit column).
MAX_VERSION = MAX_INT32

RefKind = Literal["id", "latest", "step", "version", "best", "alias"]


@dataclass(frozen=True)
class Ref:
    """A parsed checkpoint reference.

    Attributes:
        kind: Which form the reference used.
        text: The reference as the user wrote it (for error messages).
        run: Run name, for the ``run@...`` forms.
        id: Checkpoint id, for the uuid form.
        step: Step, for ``run@<step>``.
        version: Version, for ``run@v<version>``.
        metric: Metric name, for ``run@best:...``.
        mode: ``"min"`` or ``"max"``, for ``run@best:...``.
        alias: Alias name, for the alias form.
    """

    kind: RefKind
    text: str
    run: str | None = None
    id: str | None = None
    step: int | None = None
    version: int | None = None
    metric: str | None = None
    mode: Literal["min", "max"] = "min"
    alias: str | None = None


def _as_uuid(text: str) -> str | None:
    try:
        return str(uuid.UUID(text))
    except ValueError:
        return None


def parse_ref(text: object) -> Ref:
    """Parse a checkpoint reference.

    Args:
        text: The reference, e.g. ``"run-a@latest"``.

    Returns:
        The parsed :class:`Ref`.

    Raises:
        UsageError: If the text is not a valid reference (an :class:`InvalidNameError`).

    Example:
        >>> parse_ref("exp1@best:val_loss:max").mode
        'max'
    """
    try:
        return _parse_ref(text)
    except UsageError:
        raise
    except InvalidNameError as exc:  # a bad run or metric name inside it
        raise UsageError(str(exc)) from None


def _parse_ref(text: object) -> Ref:
    if not isinstance(text, str) or not text:
        raise UsageError(f"checkpoint reference must be a non-empty string, got {text!r}")
    if "@" not in text:
        as_id = _as_uuid(text)
        if as_id is not None:
            return Ref(kind="id", text=text, id=as_id)
        return Ref(kind="alias", text=text, alias=validate_name(text, "alias"))
    run, _, sel = text.partition("@")
    validate_name(run)
    if sel == "latest":
        return Ref(kind="latest", text=text, run=run)
    # ASCII digits only: str.isdigit() and int() also take a full-width or Arabic-Indic 3 for 3.
    # Bounded by the catalog's columns (catalog/models.py: step BIGINT, version INTEGER): a
    # larger number can name no checkpoint, and binding it fails in the database driver.
    if is_decimal(sel):
        step = parse_decimal(sel, "step", max_value=MAX_STEP)
        return Ref(kind="step", text=text, run=run, step=step)
    if sel[:1] == "v" and is_decimal(sel[1:]):
        version = parse_decimal(sel[1:], "version", max_value=MAX_VERSION)
        if version < 1:
            raise UsageError(f"cannot parse checkpoint reference {text!r}: versions start at "
                             f"v1 (run@v1 is a run's first checkpoint)")
        return Ref(kind="version", text=text, run=run, version=version)
    if sel.startswith("best:"):
        parts = sel.split(":")
        if len(parts) == 2 or (len(parts) == 3 and parts[2] in ("min", "max")):
            mode: Literal["min", "max"] = "max" if len(parts) == 3 and parts[2] == "max" else "min"
            return Ref(
                kind="best", text=text, run=run, metric=validate_metric_name(parts[1]), mode=mode
            )
    raise UsageError(
        f"cannot parse checkpoint reference {text!r}: use a uuid, an alias, run@latest, "
        "run@<step>, run@v<version>, run@best:<metric> or run@best:<metric>:max"
    )
