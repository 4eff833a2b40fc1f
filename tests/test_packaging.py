"""Packaging guards: the wheel ships exactly ckptstore, and the core never imports prefect."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {
    "ckptstore": ROOT / "src" / "ckptstore",
    "ckptstore.catalog": ROOT / "catalog",
    "ckptstore.tasks": ROOT / "tasks",
    "ckptstore.flows": ROOT / "flows",
    "ckptstore.migrations": ROOT / "migrations",
}


def _declared_packages() -> set[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(data["tool"]["setuptools"]["packages"])


def test_every_package_folder_is_declared() -> None:
    declared = _declared_packages()
    missing = []
    for base_name, base in MAPPED.items():
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            name = ".".join([base_name, *rel.parts]) if rel.parts else base_name
            if name not in declared:
                missing.append(name)
    assert not missing, f"add to [tool.setuptools].packages: {sorted(missing)}"


def test_core_import_does_not_import_prefect_and_is_fast() -> None:
    code = (
        "import sys, time; import torch; t = time.perf_counter(); "
        "import ckptstore, ckptstore.hooks, ckptstore.catalog, ckptstore.storage; "
        "dt = time.perf_counter() - t; "
        "assert 'prefect' not in sys.modules, 'core imported prefect'; print(dt)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    seconds = float(out.stdout.strip().splitlines()[-1])
    # Generous bound for a shared 2-core CI box; typical is ~0.5 s beyond torch.
    assert seconds < 3.0


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
