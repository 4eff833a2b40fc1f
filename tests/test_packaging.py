"""Packaging guards: the wheel ships exactly ckptstore, the core never imports prefect, and
every third-party package the code imports is declared in pyproject.toml."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from source_support import imported_modules

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ckptstore"


def _declared_packages() -> set[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(data["tool"]["setuptools"]["packages"])


def test_every_package_folder_is_declared() -> None:
    declared = _declared_packages()
    missing = []
    for init in PACKAGE.rglob("__init__.py"):
        name = ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        if name not in declared:
            missing.append(name)
    assert not missing, f"add to [tool.setuptools].packages: {sorted(missing)}"


#: What importing the core must not pull in: the orchestration and serving stacks, object
#: storage clients, trainers and zarr (its async runtime) are imported where they are used.
#: (A wall-clock bound here failed on a loaded machine; import speed follows from this.)
HEAVY = ("prefect", "fastapi", "uvicorn", "s3fs", "aiobotocore", "botocore", "boto3",
         "transformers", "lightning", "zarr", "tensorstore", "pandas")


def test_core_import_does_not_import_prefect_or_other_heavy_stacks() -> None:
    code = (
        "import sys, torch; "
        "import ckptstore, ckptstore.hooks, ckptstore.catalog, ckptstore.storage; "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_cli_and_the_flows_do_not_import_dcp_until_a_dcp_checkpoint_is_used() -> None:
    # torch.distributed.checkpoint costs most of a second to import (DTensor's op
    # registry), paid by every `ckpt` command and every flow run that imports it eagerly.
    code = (
        "import sys, ckptstore.cli.app, ckptstore.flows.archive, ckptstore.flows.retention; "
        "from ckptstore import CheckpointStore; "
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_no_bare_top_level_modules_are_loaded() -> None:
    code = (
        "import sys, ckptstore.catalog, ckptstore.flows, ckptstore.tasks, ckptstore.migrations; "
        "bad = [m for m in ('catalog', 'tasks', 'flows', 'migrations') if m in sys.modules]; "
        "print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd="/")


@pytest.mark.slow
def test_wheel_contents(tmp_path: Path) -> None:
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path),
         str(ROOT)],
        check=True, capture_output=True, timeout=300, env=env,
    )
    wheel = next(tmp_path.glob("ckptstore-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"ckptstore"}, tops
    for pkg in _declared_packages():
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    assert "ckptstore/migrations/script.py.mako" in names
    assert any(n.startswith("ckptstore/migrations/versions/") and n.endswith(".py")
               and not n.endswith("__init__.py") for n in names)
    assert "ckptstore/py.typed" in names


# --------------------------------------------------------------------------- dependencies


def _imported_top_levels() -> dict[str, set[str]]:
    """Third-party top-level module -> files importing it: import statements, and the
    string given to ``require(...)`` (how ckptstore.extras imports optional packages)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for name in imported_modules(ast.parse(path.read_text(), filename=str(path))):
            top = name.partition(".")[0]
            if top in sys.stdlib_module_names or top in ("ckptstore", "__future__"):
                continue
            found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared_distributions() -> dict[str, set[str]]:
    """Canonical distribution name -> where pyproject.toml declares it ("core" or extras).

    A requirement's own extras count as declared too: ``aiobotocore[boto3]`` is how the dev
    extra asks for boto3 (at the version aiobotocore matches; see pyproject.toml).
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    declared: dict[str, set[str]] = {}
    for group, requirements in groups.items():
        for requirement in requirements:
            match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", requirement)
            assert match, requirement
            names = [match.group(1)]
            if match.group(1) != "ckptstore" and match.group(2):
                names += match.group(2).split(",")
            for name in names:
                declared.setdefault(_canonical(name.strip()), set()).add(group)
    return declared


@functools.cache
def _installed_distributions() -> dict[str, list[str]]:
    """Top-level module -> distributions providing it. Reading every installed
    distribution's file list costs about a second; it does not change during a test run."""
    return importlib.metadata.packages_distributions()


def _distribution_of(module: str) -> str:
    # Not installed here (an extra left out): its distribution is named like the module.
    names = _installed_distributions().get(module, [module])
    return _canonical(names[0])


def test_every_imported_package_is_declared() -> None:
    declared = _declared_distributions()
    undeclared = {
        module: sorted(files)[:3]
        for module, files in _imported_top_levels().items()
        if _distribution_of(module) not in declared
    }
    assert not undeclared, (
        "imported but not declared in [project.dependencies] or an extra of pyproject.toml: "
        f"{undeclared}"
    )


def test_extras_table_matches_pyproject() -> None:
    """ckptstore.extras names, for each optional module, an extra that really brings it."""
    from ckptstore.extras import EXTRAS

    declared = _declared_distributions()
    wrong = {
        module: extra for module, extra in EXTRAS.items()
        if extra not in declared.get(_distribution_of(module), set())
    }
    assert not wrong, f"pyproject.toml does not declare these in the extra named: {wrong}"


def test_no_private_vendored_modules_are_imported() -> None:
    """Prefect's vendored copies (prefect._vendor.*) are its private business."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "_vendor" in path.read_text():
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders
