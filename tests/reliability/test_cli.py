"""The trust-and-repair commands as a user runs them: keygen, sign, verify-signature,
export, import-bundle, doctor (exit codes and output)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptstore.cli.app import main
from ckptstore.store import CheckpointStore


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_sign_export_import_doctor(new_root: Any, tmp_path: Path, w: Any,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    root, other = new_root(), new_root("other")
    with CheckpointStore.open(root) as store:
        ck = store.save("r", 1, w.make_state(1, 64 * 1024))
    keys = tmp_path / "keys"
    code, out, _ = _run(capsys, "keygen", "--out", str(keys), "--name", "alice")
    assert code == 0 and "fingerprint" in out
    code, out, _ = _run(capsys, "keygen", "--out", str(keys), "--name", "alice")
    assert code == 1  # never overwrites
    s = ["--store", str(root)]
    code, out, err = _run(capsys, *s, "verify-signature", "r@latest", "--pubkey",
                          str(keys / "alice.pub"))
    assert code == 1 and "not signed" in out + err
    code, out, _ = _run(capsys, *s, "sign", "r@latest", "--key", str(keys / "alice.key"))
    assert code == 0 and "SIGNATURE" in out
    code, out, _ = _run(capsys, *s, "verify-signature", "r@latest", "--pubkey",
                        str(keys / "alice.pub"), "--deep")
    assert code == 0 and "signature OK" in out
    # The same check as an option of verify: ckpt verify --signature --pubkey P.
    code, out, _ = _run(capsys, *s, "verify", "r@latest", "--signature", "--pubkey",
                        str(keys / "alice.pub"))
    assert code == 0 and "signature valid" in out
    code, _, err = _run(capsys, *s, "verify", "r@latest", "--signature")
    assert code == 2 and "--pubkey" in err  # bad usage
    bundle = tmp_path / "ck.tar"
    code, out, _ = _run(capsys, *s, "export", "r@latest", "--out", str(bundle))
    assert code == 0 and bundle.is_file()
    code, out, _ = _run(capsys, "--store", str(other), "import-bundle", str(bundle),
                        "--require-signature", str(keys / "alice.pub"), "--run", "copy")
    assert code == 0 and ck.id in out
    code, out, _ = _run(capsys, "--store", str(other), "doctor", "--json", "--deep")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["findings"] == []


def test_doctor_exit_codes(new_root: Any, w: Any, capsys: pytest.CaptureFixture[str]) -> None:
    root = new_root()
    with CheckpointStore.open(root) as store:
        ck = store.save("r", 1, w.make_state(1, 64 * 1024))
        shutil.rmtree(store.checkpoint_dir("r", ck.id))
    code, out, _ = _run(capsys, "--store", str(root), "doctor")
    assert code == 1 and "missing-replica" in out and "--fix" in out
    code, out, _ = _run(capsys, "--store", str(root), "doctor", "--fix", "--grace", "0")
    assert code == 0 and "fixed" in out
    code, out, _ = _run(capsys, "--store", str(root), "doctor")
    assert code == 0


def test_hostile_bundle_is_a_one_line_error(new_root: Any, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import io
    import tarfile

    bundle = tmp_path / "evil.tar"
    with tarfile.open(bundle, "w") as tar:
        info = tarfile.TarInfo("../../etc/evil")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    code, out, err = _run(capsys, "--store", str(new_root()), "import-bundle", str(bundle))
    assert code == 1 and "unsafe path" in out + err and "Traceback" not in out + err
