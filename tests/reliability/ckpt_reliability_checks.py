"""Post-condition checks shared by the reliability tests ("nothing was lost")."""

from __future__ import annotations

import multiprocessing.context
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ckpt_reliability_workers as workers
import pytest

from ckptstore.errors import CheckpointNotFoundError, IncompleteCheckpointError
from ckptstore.records import CheckpointState, ReplicaState
from ckptstore.store import CheckpointStore
from ckptstore.testing.invariants import check_invariants

#: checkpoint id -> (state seed, state bytes) of everything that must load bit-exactly.
Expected = dict[str, tuple[int, int]]

#: ``CKPT_RELIABILITY_FULL=1`` (``make reliability``) runs the full matrix.
FULL = os.environ.get("CKPT_RELIABILITY_FULL", "") == "1"


def start_child(
    ctx: multiprocessing.context.BaseContext, target: Callable[..., Any], *args: Any,
    **kwargs: Any,
) -> Any:
    """Start ``target(*args, **kwargs)`` in a child process and return the Process."""
    proc = ctx.Process(target=target, args=args, kwargs=kwargs, daemon=True)  # type: ignore[attr-defined]
    proc.start()
    return proc


def join(proc: Any, timeout: float = 180.0) -> int:
    """Wait for a child; SIGKILL it if it overruns (then fail). Returns the exit code."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        pytest.fail(f"child {proc.pid} did not finish within {timeout:.0f}s")
    return int(proc.exitcode)


def assert_loads_bit_exact(store: CheckpointStore, expected: Expected) -> None:
    """Every expected checkpoint is COMMITTED and loads bit-identical to what was saved."""
    for ckpt_id, (seed, nbytes) in expected.items():
        ck = store.catalog.get(ckpt_id)
        assert ck.state == CheckpointState.COMMITTED, f"{ckpt_id} is {ck.state}"
        if ck.replica("hot") is None or ck.replica("hot").state != ReplicaState.PRESENT:
            from ckptstore.ops.tiering.restore import restore_checkpoint

            restore_checkpoint(store, ckpt_id, threads=2)
        loaded = store.load(ckpt_id)
        assert workers.states_equal(loaded, workers.make_state(seed, nbytes)), (
            f"checkpoint {ckpt_id} (seed {seed}) does not load bit-exactly"
        )


def assert_invisible(store: CheckpointStore, ckpt_id: str) -> None:
    """A killed save is not listed, not latest, and refuses to load by id."""
    listed = {ck.id for ck in store.list()}
    assert ckpt_id not in listed
    for run in {ck.run for ck in store.list(state=None)}:
        try:
            assert store.latest(run).id != ckpt_id
        except CheckpointNotFoundError:
            pass
    try:
        store.load(ckpt_id)
    except (IncompleteCheckpointError, CheckpointNotFoundError):
        return
    raise AssertionError(f"the killed checkpoint {ckpt_id} loaded")


def staging_left(store: CheckpointStore) -> list[str]:
    """Hot directories without a commit marker, and PENDING rows of dead local writers."""
    problems: list[str] = []
    rows = {ck.id: ck for ck in store.catalog.list(state=None)}
    if store.hot.is_dir():
        for run_dir in store.hot.iterdir():
            if not run_dir.is_dir() or run_dir.name.startswith("."):
                continue
            for ck_dir in run_dir.iterdir():
                if not ck_dir.is_dir() or (ck_dir / "COMMITTED").is_file():
                    continue
                ck = rows.get(ck_dir.name)
                hot = ck.replica("hot") if ck is not None else None
                if ck is not None and (ck.state == CheckpointState.DELETING or (
                        hot is not None and hot.state == ReplicaState.DELETING)):
                    continue  # an interrupted delete: `ckpt prune` finishes it
                problems.append(f"staging directory left: {ck_dir}")
    host = socket.gethostname()
    for ck in store.catalog.list(state=CheckpointState.PENDING):
        w_host, _, pid = (ck.writer or "").rpartition(":")
        if w_host == host and pid.isdigit() and not _alive(int(pid)):
            problems.append(f"PENDING row of dead writer: {ck.id} ({ck.writer})")
    return problems


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def assert_sound(store: CheckpointStore, *, deep: bool = True) -> None:
    """The store-wide invariants hold (every committed copy reads back, no orphans)."""
    problems = check_invariants(store, deep=deep)
    assert problems == [], "\n".join(problems)


def remote_claims(store: CheckpointStore, tier: str) -> list[str]:
    """PRESENT replicas on ``tier`` whose marker or manifest is not there (remote tiers)."""
    from ckptstore.ops.tiering.replicas import manifest_on, tier_of
    from ckptstore.storage.transfer import owned_files

    target = tier_of(store, tier)
    problems: list[str] = []
    for ck in store.catalog.list(state=None):
        replica = ck.replica(tier)
        if replica is None or replica.state != ReplicaState.PRESENT:
            continue
        try:
            manifest = manifest_on(target, ck, use_cache=False)
        except Exception as exc:  # any failure means the claim is false
            problems.append(f"{ck.ref} on {tier}: {type(exc).__name__}: {exc}")
            continue
        have = set(target.list_prefix(target.prefix_for(ck.run, ck.id)))
        for rel in owned_files(manifest):
            if target.key_for(ck.run, ck.id, rel) not in have:
                problems.append(f"{ck.ref} on {tier}: {rel} missing")
    return problems


def present_copies(store: CheckpointStore) -> list[str]:
    """COMMITTED checkpoints with zero PRESENT, verified replicas."""
    out = []
    for ck in store.catalog.list():
        good = [r for r in ck.replicas
                if r.state == ReplicaState.PRESENT and r.verified_at is not None]
        if not good:
            out.append(f"{ck.ref} ({ck.id}) has no verified copy: {ck.replicas}")
    return out


def dir_snapshot(root: Path) -> set[str]:
    """Relative paths of everything under ``root`` (to prove nothing was written)."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


