"""A missing optional extra is one line naming it (exit 1), from the CLI and the API alike.

The cases run in a fresh interpreter whose import system refuses every optional package (a
meta-path finder raising ModuleNotFoundError, as if none were installed): the test process
itself has them imported already. One interpreter runs all the cases, one after the other,
as importing torch costs seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_support import FilledStore

from ckptstore.extras import EXTRAS

# markupsafe is also what alembic's templates (mako) need, so the core always has it.
BLOCKED = sorted(set(EXTRAS) - {"markupsafe"})

# argv[1]: the modules to refuse (comma-separated); stdin: the jobs, as JSON: {"argv": [...]}
# runs `ckpt ARGV`, {"python": CODE} runs CODE; stdout: one {"code", "out", "err"} per job.
RUNNER = r"""
import contextlib, importlib.abc, io, json, sys, traceback

class Refuse(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Refuse(set(sys.argv[1].split(","))))
from ckptstore.cli.app import main
from ckptstore.errors import MissingExtraError

results = []
for job in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if "argv" in job:
                code = main(job["argv"])
            else:
                try:
                    exec(job["python"])
                    code = 0
                except MissingExtraError as exc:
                    print(exc, file=sys.stderr)
                    code = 1
        except BaseException:  # what the test must catch: a traceback
            traceback.print_exc()
            code = 99
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps(results))
"""


def run_without_extras(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run the jobs in an interpreter where no optional package can be imported."""
    done = subprocess.run([sys.executable, "-c", RUNNER, ",".join(BLOCKED)],
                          input=json.dumps(jobs), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


def assert_one_line_naming(result: dict[str, Any], extra: str) -> None:
    output = (result["out"] + result["err"]).strip()
    assert result["code"] == 1, output
    assert "Traceback" not in output and "ModuleNotFoundError" not in output, output
    assert len(output.splitlines()) == 1, output
    assert f"pip install 'ckptstore[{extra}]'" in output, output


CLI_CASES = [
    ("ui", ["ui"]),
    ("ui", ["report", "--html", "{work}/r.html"]),
    ("sign", ["keygen", "--out", "{work}/keys"]),
    ("sign", ["keygen", "--encryption", "--out", "{work}/keys"]),
    ("sign", ["export", "base@latest", "--out", "{work}/e.tar", "--encrypt-to",
              "{work}/missing.pub"]),
    ("sign", ["sign", "base@latest", "--key", "{work}/missing.key"]),
    ("sign", ["verify-signature", "base@latest", "--pubkey", "{work}/missing.pub"]),
    ("sign", ["import-bundle", "{work}/b.tar", "--require-signature", "{work}/missing.pub"]),
    ("flows", ["serve"]),
    ("flows", ["serve", "--pool", "ckpt"]),
    ("safetensors", ["import", "{work}/w.safetensors", "--run", "st", "--step", "1"]),
    ("s3", ["archive", "--config", "{work}/s3.toml"]),
]
API_CASES = [
    ("metrics", "from ckptstore.observability.metrics import Metrics; Metrics(prometheus=True)"),
    ("tensorboard", "from ckptstore.observability.tensorboard import TensorBoardSink; "
                    "TensorBoardSink('{work}/tb')"),
    ("flows", "from ckptstore.flows.schedules import parse_schedule; parse_schedule('0 3 * * *')"),
    ("flows", "from ckptstore.flows import get_flow; get_flow('archive')"),
    (
        "sign",
        "from ckptstore.ops.sharing.signing import generate_keypair; generate_keypair('{work}/k')",
    ),
    ("ui", "import ckptstore.ui.app"),
    ("safetensors", "from pathlib import Path; from ckptstore.convert.readers import "
                    "read_source; read_source(Path('{work}/w.safetensors'), 'safetensors')"),
    ("lightning", "import ckptstore.integrations.lightning"),
    ("hf", "import ckptstore.integrations.hf"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, catalog_template: Path
            ) -> dict[str, dict[str, Any]]:
    """Every case's result, keyed by its text; one interpreter for all of them."""
    from cli_support import make_filled_store
    from safetensors.torch import save_file

    fs: FilledStore = make_filled_store(tmp_path_factory.mktemp("extras"), catalog_template)
    save_file({"w": torch.ones(4)}, str(fs.work / "w.safetensors"))
    (fs.work / "s3.toml").write_text(f'root = "{fs.root}"\n[tiers]\nwarm = "s3://bucket/ckpt"\n')
    jobs: dict[str, dict[str, Any]] = {}
    for _, args in CLI_CASES:
        argv = [a.replace("{work}", str(fs.work)) for a in args]
        if "--config" not in argv:
            argv += ["--store", str(fs.root)]
        jobs[" ".join(args)] = {"argv": argv}
        if args[0] not in ("ui", "serve"):  # servers print no result, so take no --json
            jobs[" ".join(args) + " --json"] = {"argv": [*argv, "--json"]}
    for _, code in API_CASES:
        jobs[code] = {"python": code.replace("{work}", str(fs.work))}
    jobs["ls --json"] = {"argv": ["ls", "--store", str(fs.root), "--json"]}
    return dict(zip(jobs, run_without_extras(list(jobs.values())), strict=True))


@pytest.mark.parametrize(("extra", "args"), CLI_CASES, ids=lambda v: " ".join(v)[:40])
def test_cli_names_the_missing_extra(results: dict[str, dict[str, Any]], extra: str,
                                     args: list[str]) -> None:
    key = " ".join(args)
    assert_one_line_naming(results[key], extra)
    if key + " --json" in results:  # the same message as the JSON error object
        result = results[key + " --json"]
        assert result["code"] == 1
        error = json.loads(result["out"])["error"]
        assert error["type"] == "MissingExtraError"
        assert f"ckptstore[{extra}]" in error["message"]


@pytest.mark.parametrize(("extra", "code"), API_CASES, ids=[c for _, c in API_CASES])
def test_api_raises_the_same_error(results: dict[str, dict[str, Any]], extra: str,
                                   code: str) -> None:
    assert_one_line_naming(results[code], extra)


def test_core_commands_need_no_extra(results: dict[str, dict[str, Any]]) -> None:
    """With every optional package missing, the core commands still work."""
    result = results["ls --json"]
    assert result["code"] == 0, result["err"]
    assert len(json.loads(result["out"])) == 6
