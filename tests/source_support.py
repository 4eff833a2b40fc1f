"""Which modules a source file of ours names, read from its syntax tree (nothing imported).

Shared by the checks on what the package uses: its declared dependencies
(tests/test_packaging.py) and the modules the type check skips
(tests/test_typecheck_config.py).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

__all__ = ["attribute_chains", "imported_modules"]


def imported_modules(tree: ast.AST) -> Iterator[str]:
    """Every absolute module path the code imports: ``import a.b`` as ``a.b``, ``from a
    import b`` as ``a`` and ``a.b`` (``b`` may be a module), and the string given to
    ``require(...)`` (how ckptstore.extras imports optional packages)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "require" and node.args
              and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            yield node.args[0].value


def attribute_chains(tree: ast.AST) -> Iterator[str]:
    """Every dotted name the code reads (``torch.fx.symbolic_trace``), which a type checker
    resolves through the package that ``torch`` names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = [node.attr]
            value = node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                yield ".".join([value.id, *reversed(parts)])
