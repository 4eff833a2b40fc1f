"""The type check's skipped modules stay outside what our code uses.

pyproject.toml tells mypy not to follow some of our dependencies' modules (``follow_imports =
"skip"``), so that a fresh clone's type check does not analyse thousands of modules no code of
ours reaches. A skipped module's names are ``Any`` to mypy: if our code started to use one,
its use would no longer be checked. These tests fail first.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

from source_support import attribute_chains, imported_modules

ROOT = Path(__file__).resolve().parent.parent
#: Checked code: the package and the stack's scripts (scripts/typecheck.sh).
CHECKED = [ROOT / "src" / "ckptstore", ROOT / "scripts" / "stack"]
#: Skipped although imported: the test harness's few calls into moto (see pyproject.toml).
IMPORTED_ON_PURPOSE = {"moto", "moto.*"}


def skipped_patterns() -> list[str]:
    """The module patterns of pyproject.toml's ``follow_imports = "skip"`` overrides."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns: list[str] = []
    for override in config["tool"]["mypy"].get("overrides", []):
        if override.get("follow_imports") == "skip":
            modules = override["module"]
            patterns += [modules] if isinstance(modules, str) else modules
    return patterns


def dotted_names(source: str) -> Iterator[str]:
    """Every module path a source names: its imports and its attribute chains."""
    tree = ast.parse(source)
    yield from imported_modules(tree)
    yield from attribute_chains(tree)


def matches(name: str, pattern: str) -> bool:
    """Whether mypy's override ``pattern`` (``a.b`` or ``a.b.*``) covers module ``name``
    or a name inside it."""
    base = pattern.removesuffix(".*")
    return name == base or name.startswith(base + ".")


def uses_of(patterns: list[str], source: str) -> list[str]:
    return sorted({n for n in dotted_names(source) for p in patterns if matches(n, p)})


def test_the_scan_finds_each_way_of_reaching_a_module() -> None:
    patterns = ["torch.fx.*", "torch.jit.*", "transformers.models.*"]
    source = (
        "import torch.fx\n"
        "from torch import fx\n"
        "from transformers.models.bert import BertModel\n"
        "def f():\n    return torch.fx.symbolic_trace\n"
        "import torch.nn\nfrom transformers import Trainer\n"
        "require('torch.jit', 'scripting')\n"
    )
    assert uses_of(patterns, source) == [
        "torch.fx", "torch.fx.symbolic_trace", "torch.jit", "transformers.models.bert",
        "transformers.models.bert.BertModel",
    ]


def test_the_skip_list_is_read_from_pyproject() -> None:
    patterns = skipped_patterns()
    assert set(patterns) >= IMPORTED_ON_PURPOSE
    assert "transformers.models.*" in patterns and "torch._dynamo.*" in patterns


def test_no_checked_module_uses_a_skipped_module() -> None:
    patterns = [p for p in skipped_patterns() if p not in IMPORTED_ON_PURPOSE]
    found = {
        str(path.relative_to(ROOT)): uses
        for folder in CHECKED
        for path in sorted(folder.rglob("*.py"))
        if (uses := uses_of(patterns, path.read_text()))
    }
    assert not found, (
        f"these modules use what pyproject.toml tells mypy to skip, so their use is not "
        f"type-checked: {found}; remove the pattern from the mypy overrides"
    )
