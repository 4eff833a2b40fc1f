"""Numbers read from text take ASCII digits only, everywhere (refs, CLI, config, tags, tars).

``int()``, ``float()`` and ``str.isdigit()`` accept any Unicode decimal digit, so before
ckptstore.numeric a full-width ``3`` resolved ``run@<that digit>`` to step 3, a lease tag with
Arabic-Indic digits named a real pid, and a config value in full-width digits was a number.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.app import main
from ckptstore.config import load_settings
from ckptstore.errors import ConfigError, IntegrityError, InvalidNameError
from ckptstore.identity import host, owner_is_dead
from ckptstore.numeric import (
    decimal_or_none,
    float_or_none,
    is_decimal,
    parse_decimal,
    parse_float,
)
from ckptstore.refs import parse_ref

FULL_WIDTH = str.maketrans("0123456789", "".join(chr(0xFF10 + i) for i in range(10)))
ARABIC_INDIC = str.maketrans("0123456789", "".join(chr(0x0660 + i) for i in range(10)))


def full_width(number: int) -> str:
    return str(number).translate(FULL_WIDTH)


def arabic(number: int) -> str:
    return str(number).translate(ARABIC_INDIC)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


@pytest.mark.parametrize("text", [full_width(3), arabic(3), "\u00b2", "3\u0663", " 3", "3\n",
                                  "+3", "-3", "3_0", "", "0x3"])
def test_only_ascii_digits_are_decimal(text: str) -> None:
    assert int("3") == 3 and not is_decimal(text)
    assert decimal_or_none(text) is None
    with pytest.raises(InvalidNameError, match="digits 0-9"):
        parse_decimal(text, "step")


def test_float_parsing_is_ascii_only() -> None:
    assert float(full_width(25)) == 25.0  # what Python does
    assert float_or_none(full_width(25)) is None and float_or_none("2.5e1") == 25.0
    assert float_or_none("1_0") is None and float_or_none(" 1") is None
    with pytest.raises(InvalidNameError):
        parse_float("1" + arabic(5), "loss")
    with pytest.raises(InvalidNameError, match="finite"):
        parse_float("1e999", "loss")


@pytest.mark.parametrize("sel", [full_width(3), arabic(3), "v" + full_width(1),
                                 "v" + arabic(1), "\u00b3"])
def test_refs_refuse_non_ascii_digits(sel: str) -> None:
    with pytest.raises(InvalidNameError, match="cannot parse"):
        parse_ref(f"ud@{sel}")


def test_store_get_does_not_resolve_non_ascii_steps(tmp_store: CheckpointStore) -> None:
    tmp_store.save("ud", 3, {"w": torch.zeros(2)})
    assert tmp_store.get("ud@3").step == 3 and tmp_store.get("ud@v1").version == 1
    for ref in (f"ud@{full_width(3)}", f"ud@v{full_width(1)}", f"ud@{arabic(3)}"):
        with pytest.raises(InvalidNameError):
            tmp_store.get(ref)


def test_cli_numbers_are_ascii_only(store_root: Path, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    with CheckpointStore.open(store_root) as store:
        store.save("ud", 3, {"w": torch.zeros(2)}, metrics={"loss": 1.0})

    def run(*args: str) -> tuple[int, str]:
        code = main(["--store", str(store_root), *args])
        return code, capsys.readouterr().err

    assert run("show", "ud@3")[0] == 0
    code, err = run("show", f"ud@{full_width(3)}")
    assert code == 2 and "cannot parse" in err and "Traceback" not in err
    for option in ("--limit", "--min-step", "--max-step"):
        code, err = run("ls", option, full_width(1))
        assert code == 2 and "digits 0-9" in err, (option, err)
    code, err = run("events", "--limit", arabic(5))
    assert code == 2
    code, err = run("gc", "--older-than", full_width(1))
    assert code == 2
    code, err = run("prune", "--keep-best", f"loss:min:{full_width(2)}", "--dry-run")
    assert code == 2 and "--keep-best" in err
    # A malformed number in a filter is a one-line error, not a traceback.
    for where in (f"loss<{full_width(2)}", "loss<1.2.3", "loss<1e5e5"):
        code, err = run("ls", "--where", where)
        assert code == 2 and err.startswith("error:") and "Traceback" not in err, (where, err)


def test_config_and_env_numbers_are_ascii_only(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'threads = "{full_width(3)}"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="threads"):
        load_settings(cfg)
    cfg.write_text('threads = "3"\nchunk_bytes = 65536\n', encoding="utf-8")
    assert load_settings(cfg).threads == 3
    for var, value in (("CKPT_THREADS", full_width(4)), ("CKPT_KEEP_LAST", arabic(2)),
                       ("CKPT_CHUNK_BYTES", "6\u00b2")):
        monkeypatch.setenv(var, value)
        with pytest.raises(ConfigError, match=var):
            load_settings(cfg)
        monkeypatch.delenv(var)
    cfg.write_text("threads = true\n")  # a bool is not a number either
    with pytest.raises(ConfigError):
        load_settings(cfg)


def test_owner_tags_with_non_ascii_pids_are_not_judged_dead() -> None:
    pid = _dead_pid()
    assert owner_is_dead(f"{host()}:{pid}:tag")
    for digits in (full_width(pid), arabic(pid)):
        assert not owner_is_dead(f"{host()}:{digits}:tag")
        assert not owner_is_dead(f"retention:{host()}:{digits}")


def test_memory_tier_sweep_reads_only_ascii_pids(tmp_path: Path) -> None:
    from ckptstore.ops.writing.memory import memory_tier_for

    shm = tmp_path / "shm"
    with CheckpointStore.open(tmp_path / "s", memory_tier_bytes=2**20,
                              memory_tier_dir=str(shm)) as store:
        tier = memory_tier_for(store)
        assert tier is not None
        store.save("r", 1, {"w": torch.zeros(2)})
        dead = _dead_pid()
        run_dir = tier.path_for("r", "00000000-0000-4000-8000-000000000000").parent
        run_dir.mkdir(parents=True, exist_ok=True)
        odd = run_dir / f".staging-x-{arabic(dead)}"
        plain = run_dir / f".staging-y-{dead}"
        odd.mkdir()
        plain.mkdir()
        removed = tier.sweep()
        assert plain in removed and not plain.exists()
        assert odd not in removed and odd.exists()  # not a pid this process can judge


def test_fault_point_count_is_ascii_only(tmp_path: Path) -> None:
    code = ("from ckptstore.faultpoints import fault_point\n"
            "fault_point('x')\nprint('survived', flush=True)\n")
    env = {**os.environ, "CKPT_FAULT_POINT": "x:2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "survived" in done.stdout  # fires on the 2nd pass
    # A count in other digits is no count: the point fires on the first pass.
    env["CKPT_FAULT_POINT"] = "x:" + full_width(2)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -9 and "survived" not in done.stdout


def test_schedules_are_ascii_only() -> None:
    from ckptstore.flows.schedules import parse_schedule

    assert parse_schedule("every 30s").seconds == 30  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="ASCII"):
        parse_schedule(f"every {full_width(30)}s")


def test_bundle_pax_numbers_are_ascii_only(tmp_store: CheckpointStore, tmp_path: Path) -> None:
    from ckptstore.ops.sharing.bundle import BUNDLE_HEADER, export_bundle, import_bundle

    ck = tmp_store.save("r", 1, {"w": torch.arange(8.0)})
    good = export_bundle(tmp_store, ck.id, tmp_path / "good.tar")
    hostile = tmp_path / "digits.tar"
    with tarfile.open(good) as src, tarfile.open(hostile, "w", format=tarfile.PAX_FORMAT) as out:
        for info in src.getmembers():
            handle = src.extractfile(info)
            data = handle.read() if handle is not None else b""
            if info.name == BUNDLE_HEADER:
                # The same size, written with full-width digits: tarfile reads it as the size.
                info.pax_headers = {"size": full_width(len(data))}
                json.loads(data)
            out.addfile(info, io.BytesIO(data))
    with CheckpointStore.open(tmp_path / "other") as other:
        with pytest.raises(IntegrityError, match="size"):
            import_bundle(other, hostile)
        assert other.list(state=None) == []
