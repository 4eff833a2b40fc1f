"""``ckpt merge site-a@latest site-b@latest --run global --step 10``: average checkpoints.

Usage errors (exit 2) are caught here, before the store is opened: an unknown ``--method`` or
``--accumulate``, weights that are not numbers, a weight count that differs from the
inputs', weights with ``--method mean`` or none with ``--method weighted``. What only the
store can judge (a missing input, one named twice, a single input, NaN or negative weights,
inputs that do not agree, a damaged chunk) is an operation failure (exit 1).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ckptstore.cli.common import ascii_int, open_store, progress_bar
from ckptstore.cli.output import (
    LS_COLUMNS,
    checkpoint_json,
    checkpoint_row,
    console,
    print_json,
    print_table,
)
from ckptstore.numeric import float_or_none

__all__ = ["merge_cmd", "merge_rows", "parse_weights", "register"]


def parse_weights(text: str) -> list[float]:
    """``"2,1,1"`` -> ``[2.0, 1.0, 1.0]``; NaN and inf parse (the store refuses them).

    Raises:
        typer.BadParameter: If an item is not a number (exit 2).
    """
    weights = []
    for item in text.split(","):
        value = float_or_none(item.strip())
        if value is None:
            raise typer.BadParameter(
                f"{item.strip()!r} is not a number; give one number per input, e.g. 2,1,1",
                param_hint="--weights",
            )
        weights.append(value)
    return weights


def merge_cmd(
    ctx: typer.Context,
    refs: Annotated[list[str], typer.Argument(help="Two or more checkpoint references.")],
    run: Annotated[str, typer.Option("--run", "-r", help="Run of the merged checkpoint.")],
    step: Annotated[int, typer.Option(parser=ascii_int, help="Its step.")],
    method: Annotated[
        str | None,
        typer.Option(help="mean (equal weights) or weighted; default weighted when weights "
                          "are given, else mean."),
    ] = None,
    weights: Annotated[
        str | None,
        typer.Option(metavar="W,W,...", help="One weight per input, normalised to sum to 1."),
    ] = None,
    weights_from_metric: Annotated[
        str | None,
        typer.Option(metavar="METRIC",
                     help="Weigh each input by this recorded metric (FedAvg: samples)."),
    ] = None,
    keys: Annotated[
        list[str] | None,
        typer.Option(help="Merge and keep only these parts (fnmatch, repeatable), e.g. "
                          "'model/*'."),
    ] = None,
    accumulate: Annotated[
        str, typer.Option(help="auto (32/64-bit floats in their own dtype, float32 for "
                               "16/8-bit ones), float32 or float64.")
    ] = "auto",
    codec: Annotated[str | None, typer.Option(help="Codec preset (default from config).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Average checkpoints (model soup, FedAvg) into a new checkpoint of --run at --step.

    Floating-point tensors are averaged chunk by chunk (memory: a chunk per input,
    never a state) and keep their dtype; integer and bool tensors and other values come from the
    first input. The result lists every input as a parent (merged-from, with its weight:
    `ckpt lineage`, `ckpt show`). Running it again returns the same checkpoint.

    JSON: {"checkpoint": the record (keys as in `ckpt ls --json`), "merge": method,
    accumulate, keys, weights_from_metric, inputs (id, ref, state, weight, position)}.
    """
    # Here, not at the top: `ckpt` answers its catalog-only commands without importing torch.
    from ckptstore.ops.reading.show import merge_record
    from ckptstore.ops.upkeep.merge.spec import ACCUMULATE, METHODS

    if method is not None and method not in METHODS:
        raise typer.BadParameter(f"{method!r} is not one of {', '.join(METHODS)}",
                                 param_hint="--method")
    if accumulate not in ACCUMULATE:
        raise typer.BadParameter(f"{accumulate!r} is not one of {', '.join(ACCUMULATE)}",
                                 param_hint="--accumulate")
    if weights is not None and weights_from_metric is not None:
        raise typer.BadParameter("give --weights or --weights-from-metric, not both",
                                 param_hint="--weights")
    given = parse_weights(weights) if weights is not None else None
    if given is not None and len(given) != len(refs):
        raise typer.BadParameter(f"{len(given)} weights for {len(refs)} inputs; give one per "
                                 "input", param_hint="--weights")
    weighted = given is not None or weights_from_metric is not None
    if method == "mean" and weighted:
        raise typer.BadParameter("weights go with --method weighted (a mean weighs every "
                                 "input equally)", param_hint="--method")
    if method == "weighted" and not weighted:
        raise typer.BadParameter("--method weighted needs --weights W,W,... or "
                                 "--weights-from-metric NAME", param_hint="--method")
    with open_store(ctx) as store, progress_bar(f"merging into {run}",
                                                enabled=not as_json) as advance:
        merged = store.merge(refs, run=run, step=step, method=method, weights=given,
                             weights_from_metric=weights_from_metric, keys=keys,
                             accumulate=accumulate, codec=codec, progress=advance)
        record = merge_record(store, merged)
    if as_json:
        print_json({"checkpoint": checkpoint_json(merged), "merge": record})
        return
    print_table(LS_COLUMNS, [checkpoint_row(merged)], no_wrap=("checkpoint", "step", "stored"))
    if record is not None:
        for name, value in merge_rows(record):
            console.print(f"{name}: {value}", markup=False, highlight=False)


def merge_rows(record: dict[str, Any]) -> list[tuple[str, str]]:
    """``(field, value)`` rows describing a merge, for ``ckpt merge`` and ``ckpt show``."""
    inputs = ", ".join(
        f"{i['ref']} (weight {i['weight']:.4g})" if i.get("weight") is not None else str(i["ref"])
        for i in record["inputs"]
    )
    how = str(record.get("method") or "?")
    if record.get("weights_from_metric"):
        how += f" by metric {record['weights_from_metric']}"
    how += f", accumulated in {record.get('accumulate') or 'auto'}"
    if record.get("keys"):
        how += f", keys {' '.join(record['keys'])}"
    return [("merged from", inputs), ("merge", how)]


def register(app: typer.Typer) -> None:
    """Add ``merge`` to the ``ckpt`` command."""
    app.command("merge")(merge_cmd)
