"""Progress of the long operations: the library tells a callback the total before the work
(what a bar needs for its ETA), and the CLI draws the bar on a terminal's stderr only."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import torch
from cli_support import FilledStore

from ckptstore.progress import ProgressWithTotal
from ckptstore.store import CheckpointStore


class Recorder:
    """A progress callback that keeps what it was told, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, amount: int, /) -> None:
        self.calls.append(("advance", amount))

    def set_total(self, total: int, /) -> None:
        self.calls.append(("total", total))

    @property
    def done(self) -> int:
        return sum(n for kind, n in self.calls if kind == "advance")

    @property
    def totals(self) -> list[int]:
        return [n for kind, n in self.calls if kind == "total"]

    def told_total_first(self) -> bool:
        return bool(self.calls) and self.calls[0][0] == "total" and self.totals[0] > 0


def test_recorder_is_what_the_library_checks_for() -> None:
    assert isinstance(Recorder(), ProgressWithTotal)
    assert not isinstance([].append, ProgressWithTotal)


def test_archive_import_export_compact_doctor_announce_totals(filled: FilledStore) -> None:
    from ckptstore.ops.sharing.bundle import export_bundle, import_bundle
    from ckptstore.ops.tiering.archive import archive_checkpoints
    from ckptstore.ops.upkeep.compact import compact_checkpoint
    from ckptstore.ops.upkeep.convert import import_checkpoint
    from ckptstore.ops.upkeep.doctor import doctor

    with CheckpointStore.open(config=filled.config) as store:
        progress = Recorder()
        report = archive_checkpoints(store, tier="warm", progress=progress)
        assert progress.told_total_first() and progress.done == report.bytes
        # Re-estimated after each checkpoint, ending at what was really written.
        assert len(progress.totals) == len(report.archived) + 1
        assert progress.totals[-1] == report.bytes

        torch.save({"w": torch.arange(1000.0), "b": torch.ones(24)}, filled.work / "s.pt")
        progress = Recorder()
        import_checkpoint(store, filled.work / "s.pt", run="imp", step=1, progress=progress)
        assert progress.told_total_first() and progress.totals == [1024 * 4]
        assert progress.done == 1024 * 4

        progress = Recorder()
        bundle = export_bundle(store, "base@latest", filled.work / "b.tar", progress=progress)
        assert progress.told_total_first() and progress.done == progress.totals[0]

        other = filled.work / "other"
        with CheckpointStore.open(other) as target:
            progress = Recorder()
            import_bundle(target, bundle, progress=progress)
            assert progress.told_total_first() and progress.done == progress.totals[0]

        progress = Recorder()
        source = store.get("delta@latest")
        compact_checkpoint(store, "delta@latest", progress=progress)
        assert progress.totals == [source.logical_bytes] and progress.done == source.logical_bytes

        progress = Recorder()
        found = doctor(store, progress=progress)
        replicas = found.checked["replicas"]
        assert progress.told_total_first() and progress.totals == [replicas]
        assert progress.done == replicas  # one unit per copy checked


def _with_tty_stderr(*args: str) -> tuple[int, str, str]:
    """Run ``ckpt ARGS`` with stderr on a pseudo-terminal (stdout a pipe, as in `| jq`)."""
    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "100"}
    proc = subprocess.Popen([sys.executable, "-m", "ckptstore", *args], stdout=subprocess.PIPE,
                            stderr=follower, env=env, text=True)
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out, _ = proc.communicate(timeout=120)
    os.close(leader)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def test_bar_on_a_terminal_and_never_with_json(filled: FilledStore, tmp_path: Path) -> None:
    code, out, err = _with_tty_stderr("export", "base@latest", "--out", str(tmp_path / "a.tar"),
                                      "--store", str(filled.root))
    assert code == 0, err
    assert "exporting base@v3" in err  # the bar, drawn on the terminal
    assert out.startswith("wrote ")
    code, out, err = _with_tty_stderr("export", "base@latest", "--out", str(tmp_path / "b.tar"),
                                      "--store", str(filled.root), "--json")
    assert code == 0, err
    assert json.loads(out)["bytes"] > 0 and "exporting" not in err
