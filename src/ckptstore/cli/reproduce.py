"""CLI commands that hand a run's context back: ``reproduce`` and ``runs`` (with ``diff``).

* ``ckpt reproduce REF --dir D`` writes the recipe (:func:`ckptstore.ops.reading.reproduce.
  write_recipe`); ``--check`` lists every difference between the recorded context and this
  checkout and environment (exit 1 when there is one); ``--check-lock FILE`` compares only
  the installed distributions with a lock (what the recipe runs).
* ``ckpt runs`` lists runs; ``ckpt runs diff A B`` compares two runs' (or checkpoints')
  config, code and environment.

The operations are imported inside the commands: the help texts and the catalog-only
commands must not pay for modules they do not use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from ckptstore.cli.common import open_store
from ckptstore.cli.output import console, print_json, print_table
from ckptstore.errors import InvalidNameError

__all__ = ["context_rows", "register", "reproduce_cmd", "runs_diff_cmd"]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def context_rows(section: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The "how to reproduce" rows of ``ckpt show`` (a :func:`how_to_reproduce` dict)."""
    if not section:
        return [("how to reproduce", "no context recorded (saved before contexts were "
                                     "recorded, or with capture = false)")]
    commit = section.get("commit") or "-"
    if section.get("branch"):
        commit += f" ({section['branch']})"
    rows = [("commit", commit)]
    if section.get("remote"):
        rows.append(("remote", section["remote"]))
    dirty = "no"
    if section.get("dirty"):
        dirty = f"yes, change of {section.get('change_bytes', 0)} bytes recorded" \
            if section.get("change") else "yes, change not recorded (see notes)"
    rows.append(("dirty", dirty))
    rows.append(("command", " ".join(section.get("command") or []) or "-"))
    rows.append(("cwd", section.get("cwd") or "-"))
    if section.get("config"):
        rows.append(("config", json.dumps(section["config"], sort_keys=True)))
    if section.get("data_version"):
        rows.append(("data version", str(section["data_version"])))
    env = f"python {section.get('python')}, torch {section.get('torch') or '-'}"
    if section.get("cuda"):
        env += f", CUDA {section['cuda']}, cuDNN {section.get('cudnn')}"
    env += f", {section.get('packages') or 0} packages locked; {section.get('platform')}"
    rows.append(("environment", env))
    rows.append(("world size", str(section.get("world_size"))))
    for note in section.get("notes") or []:
        rows.append(("note", note))
    return rows


def reproduce_cmd(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="Checkpoint reference.")],
    directory: Annotated[
        Path | None, typer.Option("--dir", "-d", help="Write the recipe into this directory.")
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="List every difference between the recorded "
                                           "context and this checkout and environment.")
    ] = False,
    check_lock: Annotated[
        Path | None, typer.Option("--check-lock", help="Compare the installed distributions "
                                                        "with this lock (requirements file).")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--compare-config",
                                  help="With --check: also compare the config with this "
                                       "JSON file.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Hand back how a checkpoint was made: a recipe that resumes it, or what differs now.

    With --dir: writes reproduce.sh (check out the commit, apply the recorded change,
    check the environment against requirements.txt, restore the checkpoint, run the
    recorded command with CKPT_RESUME naming the checkpoint), change.patch,
    requirements.txt and context.json. With --check / --check-lock: exit 1 when anything
    differs. JSON: {"files": [...]} or {"differences": [{"field", "a" (recorded),
    "b" (now)}]}.
    """
    from ckptstore.ops.reading.reproduce import (
        check_against,
        lock_versions,
        write_recipe,
    )

    if (directory is not None) + (check_lock is not None) + check != 1:
        raise typer.BadParameter("give exactly one of --dir, --check, --check-lock")
    if check_lock is not None:
        from ckptstore.capture import distribution_lock

        try:
            wanted = lock_versions(check_lock.read_bytes())
        except OSError as exc:
            raise InvalidNameError(f"cannot read the lock {check_lock}: {exc}") from exc
        have = lock_versions(distribution_lock())
        diffs = [{"field": f"package.{n}", "a": wanted.get(n), "b": have.get(n)}
                 for n in sorted(set(wanted) | set(have)) if wanted.get(n) != have.get(n)]
        _report(diffs, as_json, "the environment matches the lock")
        return
    with open_store(ctx) as store:
        if directory is not None:
            files = write_recipe(store, ref, directory)
            if as_json:
                print_json({"files": [str(f) for f in files]})
            else:
                for f in files:
                    console.print(str(f), markup=False)
                console.print(f"run: sh {directory / 'reproduce.sh'} [CHECKOUT]", markup=False)
            return
        from ckptstore.ops.reading.reproduce import context_for

        _, recorded = context_for(store, ref)
        given = None
        if config is not None:
            try:
                given = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise InvalidNameError(f"cannot read the config {config}: {exc}") from exc
        diffs = [d.as_dict() for d in check_against(store, recorded, config=given)]
    _report(diffs, as_json, "this checkout and environment match the recorded context")


def _report(diffs: list[dict[str, Any]], as_json: bool, same: str) -> None:
    if as_json:
        print_json({"differences": diffs})
    elif not diffs:
        console.print(same, markup=False)
    else:
        print_table(["field", "recorded", "now"],
                    ((d["field"], _text(d["a"]), _text(d["b"])) for d in diffs))
    if diffs:
        raise typer.Exit(1)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else json.dumps(value)


def runs_diff_cmd(
    ctx: typer.Context,
    a: Annotated[str, typer.Argument(help="A run name or checkpoint reference.")],
    b: Annotated[str, typer.Argument(help="Another run name or checkpoint reference.")],
    as_json: JsonOpt = False,
) -> None:
    """Config, code and environment differences between two runs (or checkpoints).

    A run name compares the run's newest context. JSON: {"a": ref, "b": ref,
    "differences": [{"field", "a", "b"}]}. Exit 0 whether or not they differ.
    """
    from ckptstore.ops.reading.reproduce import context_for, diff_contexts

    with open_store(ctx) as store:
        _, ca = context_for(store, a)
        _, cb = context_for(store, b)
        diffs = [d.as_dict() for d in diff_contexts(store, ca.document, cb.document)]
    if as_json:
        print_json({"a": a, "b": b, "differences": diffs})
        return
    if not diffs:
        console.print(f"{a} and {b} were made under the same context", markup=False)
        return
    print_table(["field", a, b], ((d["field"], _text(d["a"]), _text(d["b"])) for d in diffs))


def register(app: typer.Typer) -> None:
    """Add ``reproduce`` to ``ckpt`` (``runs diff`` is registered with ``runs``, by
    :mod:`ckptstore.cli.queries`)."""
    app.command("reproduce")(reproduce_cmd)
