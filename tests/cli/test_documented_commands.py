"""Every ``ckpt ...`` command line that README.md, the examples, or ckptstore's own help and
messages show a user exists: its subcommand path, options and arguments parse."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

from ckptstore.cli.commands import click_command

ROOT = Path(__file__).resolve().parents[2]
_INLINE = re.compile(r"`(ckpt [^`]+)`")
_LINE = re.compile(r"^\s*(?:\$\s+)?(ckpt [^\n`]+)$", re.MULTILINE)


def _split(text: str) -> list[str]:
    """``ckpt a; ckpt b  # comment`` -> ``["ckpt a", "ckpt b"]`` (also ``ckpt a  |  code``)."""
    text = text.split("  #")[0]
    parts = [p.strip() for chunk in text.split(";") for p in chunk.split("  |  ")]
    # A command whose name is filled in at run time (f"ckpt {args}") is checked where its
    # parts are written, not here.
    return [p for p in parts if p.startswith("ckpt ") and p.split()[1] != _FIELD]


def _from_text(text: str) -> set[str]:
    found = set()
    for match in [*_INLINE.findall(text), *_LINE.findall(text)]:
        found.update(_split(match))
    return found


_FIELD = "1"  # what an f-string's field reads as


def _strings(path: Path) -> list[str]:
    """The string literals of a module (docstrings, messages); an f-string's fields read
    as ``1``, which parses as a reference, a number or a path."""
    texts = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            texts.append("".join(v.value if isinstance(v, ast.Constant) else _FIELD
                                 for v in node.values))
    return texts


def _demo_calls(path: Path) -> set[str]:
    """examples/demo.py runs the CLI through ``ckpt(root, *args)``: its calls, with
    ``"1"`` for computed arguments (a step, a reference, a path: all parse as "1")."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "ckpt" and len(node.args) > 1):
            args = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str)
                    else "1" for a in node.args[1:]]
            found.add(shlex.join(["ckpt", *args]))
    return found


def documented() -> dict[str, str]:
    """Command line -> where it is shown."""
    where: dict[str, str] = {}
    sources = [ROOT / "README.md", *sorted((ROOT / "examples").glob("*.py"))]
    sources += sorted((ROOT / "src" / "ckptstore").rglob("*.py"))
    for path in sources:
        texts = [path.read_text()] if path.suffix == ".md" else _strings(path)
        lines = set().union(*(_from_text(text) for text in texts))
        if path.name == "demo.py":
            lines |= _demo_calls(path)
        for line in lines:
            where.setdefault(line, str(path.relative_to(ROOT)))
    return where


DOCUMENTED = documented()


_EAGER = {"--version", "--install-completion", "--show-completion", "--help"}


def _parse(line: str) -> None:
    """Resolve the subcommand path and parse its arguments as ``ckpt`` would, without
    running anything; raises typer's usage error for anything unknown or missing."""
    command: Any = click_command()
    args = shlex.split(line)[1:]
    if args and args[0] in _EAGER:
        # Options that act while parsing (print, install, exit): only check they exist.
        assert args[0] in {o for p in command.params for o in getattr(p, "opts", [])}, line
        return
    ctx = command.make_context("ckpt", args)
    while hasattr(command, "commands"):
        _name, command, args = command.resolve_command(ctx, [*_protected(ctx), *ctx.args])
        ctx = command.make_context(_name, args, parent=ctx)


def _protected(ctx: Any) -> list[str]:
    """A group's subcommand name and what follows it, as parsing left them (click names the
    attribute protected_args, the copy of click inside typer _protected_args)."""
    found = getattr(ctx, "protected_args", None)
    return list(found if found is not None else getattr(ctx, "_protected_args", []))


def test_the_docs_show_commands() -> None:
    # Guards the extraction itself: a README rewrite must not leave this test checking none.
    assert any(w == "README.md" for w in DOCUMENTED.values())
    assert any(w.startswith("examples/") for w in DOCUMENTED.values())
    assert "ckpt ls --run pl-demo --store /tmp/pl-store" in DOCUMENTED


def _names_a_command(line: str) -> bool:
    """Whether the line only names a command (``ckpt show``, ``ckpt db current``), as prose
    does, rather than showing a full command line."""
    command: Any = click_command()
    for word in shlex.split(line)[1:]:
        command = getattr(command, "commands", {}).get(word)
        if command is None:
            return False
    return True


@pytest.mark.parametrize("line", sorted(DOCUMENTED))
def test_documented_command_exists(line: str) -> None:
    try:
        _parse(line)
    except typer.TyperException as exc:
        if not _names_a_command(line):  # a mention needs no arguments; a command line does
            pytest.fail(f"{DOCUMENTED[line]} shows `{line}`: {exc.format_message()}")
