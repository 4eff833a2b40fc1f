"""Bodies of the processes the reliability tests start, kill and race.

Children come from a ``forkserver`` that preloaded torch and ckptstore (see conftest.py), so
a child starts in milliseconds instead of re-importing torch. Each function here runs in its
own process: it applies ``env`` to ``os.environ`` first (the forkserver's environment is the
one from when it started), opens the store itself, and reports through a queue when asked.

The test directory is put on ``sys.path`` before the forkserver starts, so this module is
importable by its plain name in every child (and by the tests).
"""

from __future__ import annotations

import os
import random
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# ---------------------------------------------------------------------- states


def make_state(seed: int, nbytes: int) -> dict[str, Any]:
    """A deterministic training-like state of about ``nbytes`` (so a parent can rebuild it).

    float32 weights, a bfloat16 tensor, int64 counters, a 0-d tensor and plain values.
    """
    gen = torch.Generator().manual_seed(seed)
    n = max(16, nbytes // 4 - 4096)
    return {
        "model": {
            "w": torch.randn(n, generator=gen),
            "emb": torch.randn(1024, generator=gen).to(torch.bfloat16),
            "steps": torch.arange(seed, seed + 512, dtype=torch.int64),
            "scale": torch.tensor(float(seed)),
        },
        "optimizer": {"lr": 0.1 / (seed + 1), "betas": (0.9, 0.999)},
        "seed": seed,
    }


def states_equal(a: Any, b: Any) -> bool:
    """Bit-exact comparison of two states (tensors by bytes, containers by structure)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if not a.numel():
            return True
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        return bool(torch.equal(*as_bytes))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return (
            type(a) is type(b) and len(a) == len(b)
            and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b) and type(a) is type(b)


# ---------------------------------------------------------------------- plumbing


def _apply_env(env: dict[str, str] | None) -> None:
    for name, value in (env or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _open(root: str, open_kwargs: dict[str, Any] | None) -> Any:
    from ckptstore.store import CheckpointStore

    return CheckpointStore.open(root, **(open_kwargs or {}))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _report(queue: Any, item: Any) -> None:
    if queue is not None:
        queue.put(item)


def kill_on_call(obj: Any, method: str, nth: int, *, before: bool = False) -> None:
    """Make ``obj.method`` SIGKILL this process on its ``nth`` call (after it returns, or
    just before it runs with ``before=True``). Used to kill flows at exact steps."""
    original = getattr(obj, method)
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if before and calls[0] >= nth:
            _die()
        result = original(*args, **kwargs)
        if calls[0] >= nth:
            _die()
        return result

    setattr(obj, method, wrapper)


# ---------------------------------------------------------------------- save / kill


def save_once(
    root: str,
    run: str,
    step: int,
    seed: int,
    nbytes: int,
    *,
    env: dict[str, str] | None = None,
    open_kwargs: dict[str, Any] | None = None,
    ready: Any = None,
    queue: Any = None,
) -> None:
    """Save ``make_state(seed, nbytes)`` once; ``CKPT_FAULT_POINT`` in ``env`` may kill us.

    ``ready`` (an Event) is set right before the save starts, so a parent timing a random
    kill measures from the save, not from process start-up. ``queue`` gets
    ``("ok", id, seconds)`` when the save completes.
    """
    _apply_env(env)
    store = _open(root, open_kwargs)
    state = make_state(seed, nbytes)
    if ready is not None:
        ready.set()
    started = time.perf_counter()
    ck = store.save(run, step, state, metrics={"loss": 1.0 / (seed + 1)})
    _report(queue, ("ok", ck.id, time.perf_counter() - started))
    store.close()


# ---------------------------------------------------------------------- flows killed


def archive_and_die(
    root: str,
    open_kwargs: dict[str, Any],
    kill: tuple[str, str, int] | None,
    *,
    env: dict[str, str] | None = None,
    ready: Any = None,
) -> None:
    """Archive hot → warm; ``kill=(target, method, n)`` SIGKILLs on the n-th call of
    ``target.method`` where target is ``"dst"`` (the warm tier) or ``"catalog"``."""
    _apply_env(env)
    from ckptstore.ops.tiering.archive import archive_checkpoints
    from ckptstore.ops.tiering.replicas import tier_of

    store = _open(root, open_kwargs)
    if kill is not None:
        target, method, nth = kill
        obj = tier_of(store, "warm") if target == "dst" else store.catalog
        kill_on_call(obj, method, nth)
    if ready is not None:
        ready.set()
    archive_checkpoints(store, tier="warm", threads=2)
    store.close()


def prune_and_die(
    root: str,
    open_kwargs: dict[str, Any],
    tier: str,
    keep_last: int,
    kill: tuple[str, str, int] | None,
    *,
    env: dict[str, str] | None = None,
    ready: Any = None,
) -> None:
    """Apply retention (keep_last) on ``tier``; ``kill`` as in :func:`archive_and_die`
    (``target`` is ``"tier"`` for the pruned tier or ``"catalog"``)."""
    _apply_env(env)
    from ckptstore.ops.tiering.replicas import tier_of
    from ckptstore.ops.tiering.retention import apply_retention
    from ckptstore.retention import RetentionPolicy

    store = _open(root, open_kwargs)
    if kill is not None:
        target, method, nth = kill
        obj = tier_of(store, tier) if target == "tier" else store.catalog
        kill_on_call(obj, method, nth)
    if ready is not None:
        ready.set()
    apply_retention(store, tier=tier, policy=RetentionPolicy(keep_last=keep_last))
    store.close()


def demote_and_die(
    root: str,
    open_kwargs: dict[str, Any],
    kill: tuple[str, str, int] | None,
    *,
    env: dict[str, str] | None = None,
    ready: Any = None,
) -> None:
    """Move every warm copy to cold (copy → verify → record → delete source)."""
    _apply_env(env)
    from ckptstore.ops.tiering.archive import demote_checkpoints
    from ckptstore.ops.tiering.replicas import tier_of

    store = _open(root, open_kwargs)
    if kill is not None:
        target, method, nth = kill
        obj = {"src": lambda: tier_of(store, "warm"), "dst": lambda: tier_of(store, "cold"),
               "catalog": lambda: store.catalog}[target]()
        kill_on_call(obj, method, nth)
    if ready is not None:
        ready.set()
    demote_checkpoints(store, older_than_days=0, threads=2)
    store.close()


def restore_and_die(
    root: str,
    open_kwargs: dict[str, Any],
    ref: str,
    kill: tuple[str, str, int] | None = None,
    *,
    env: dict[str, str] | None = None,
    ready: Any = None,
) -> None:
    """Restore ``ref`` to the hot tier; ``kill=("hot"|"catalog", method, n)`` or a parent's
    random SIGKILL stops it."""
    _apply_env(env)
    from ckptstore.ops.tiering.replicas import tier_of
    from ckptstore.ops.tiering.restore import restore_checkpoint

    store = _open(root, open_kwargs)
    if kill is not None:
        target, method, nth = kill
        obj = tier_of(store, "hot") if target == "hot" else store.catalog
        kill_on_call(obj, method, nth)
    if ready is not None:
        ready.set()
    restore_checkpoint(store, ref, threads=2)
    store.close()


# ---------------------------------------------------------------------- concurrency


def _loop(
    name: str,
    root: str,
    open_kwargs: dict[str, Any],
    seconds: float,
    seed: int,
    queue: Any,
    start: Any,
    env: dict[str, str] | None,
    body: Callable[[Any, random.Random, dict[str, Any]], None],
) -> None:
    """Run ``body`` repeatedly for ``seconds``; report counters and unexpected errors."""
    _apply_env(env)
    from ckptstore.errors import CkptError

    stats: dict[str, Any] = {"role": name, "pid": os.getpid(), "ops": 0, "errors": [],
                             "expected": {}, "saved": []}
    try:
        store = _open(root, open_kwargs)
        rng = random.Random(seed)
        if start is not None:
            start.wait(timeout=120)
        deadline = time.monotonic() + seconds
        while True:  # at least one round, however loaded the machine is
            try:
                body(store, rng, stats)
                stats["ops"] += 1
            except CkptError as exc:
                # Typed, expected outcomes of racing (a lease held, a copy pruned meanwhile).
                key = type(exc).__name__
                stats["expected"][key] = stats["expected"].get(key, 0) + 1
            if time.monotonic() >= deadline:
                break
        store.close()
    except BaseException:  # everything else is a failure the parent asserts on
        stats["errors"].append(traceback.format_exc())
    queue.put(stats)


def saver(root: str, open_kwargs: dict[str, Any], run: str, seconds: float, seed: int,
          nbytes: int, queue: Any, start: Any = None, env: dict[str, str] | None = None) -> None:
    """Save new checkpoints of ``run`` as fast as possible; record (id, seed) of each."""

    def body(store: Any, rng: random.Random, stats: dict[str, Any]) -> None:
        state_seed = rng.randrange(1, 10**6)
        step = rng.randrange(0, 50)
        ck = store.save(run, step, make_state(state_seed, nbytes),
                        metrics={"loss": rng.random()})
        stats["saved"].append((ck.id, state_seed))

    _loop("saver", root, open_kwargs, seconds, seed, queue, start, env, body)


def pruner(root: str, open_kwargs: dict[str, Any], tiers: list[str], seconds: float, seed: int,
           queue: Any, start: Any = None, env: dict[str, str] | None = None) -> None:
    """Apply keep_last=2 retention to the given tiers in a loop."""
    from ckptstore.ops.tiering.retention import apply_retention
    from ckptstore.retention import RetentionPolicy

    def body(store: Any, rng: random.Random, stats: dict[str, Any]) -> None:
        for tier in tiers:
            report = apply_retention(store, tier=tier, policy=RetentionPolicy(keep_last=2))
            stats.setdefault("pruned", 0)
            stats["pruned"] += len(report.executed)
            for action, why in report.failed:
                # Reported, typed failures (the row stays DELETING for the next run); the
                # parent decides whether they point at a race.
                stats["expected"].setdefault("retention-failed", []).append(
                    f"{action.ref}: {why[:200]}")
        time.sleep(rng.uniform(0.05, 0.3))

    _loop("pruner", root, open_kwargs, seconds, seed, queue, start, env, body)


def archiver(root: str, open_kwargs: dict[str, Any], seconds: float, seed: int, queue: Any,
             start: Any = None, env: dict[str, str] | None = None) -> None:
    """Archive hot → warm in a loop."""
    from ckptstore.ops.tiering.archive import archive_checkpoints

    def body(store: Any, rng: random.Random, stats: dict[str, Any]) -> None:
        report = archive_checkpoints(store, tier="warm", threads=2, raise_errors=False)
        stats.setdefault("archived", 0)
        stats["archived"] += len(report.archived)
        for cid, why in report.failed.items():
            stats["expected"].setdefault("archive-failed", []).append(f"{cid}: {why[:200]}")
        time.sleep(rng.uniform(0.05, 0.3))

    _loop("archiver", root, open_kwargs, seconds, seed, queue, start, env, body)


def restorer(root: str, open_kwargs: dict[str, Any], run: str, seconds: float, seed: int,
             queue: Any, start: Any = None, env: dict[str, str] | None = None) -> None:
    """Load random committed checkpoints (restoring them first when only archived)."""
    from ckptstore.ops.tiering.restore import restore_checkpoint

    def body(store: Any, rng: random.Random, stats: dict[str, Any]) -> None:
        found = store.list(run=run)
        if not found:
            time.sleep(0.05)
            return
        ck = rng.choice(found)
        restore_checkpoint(store, ck.id, threads=2, wait_s=30)
        state = store.load(ck.id)
        stats.setdefault("loaded", []).append((ck.id, int(state["seed"])))

    _loop("restorer", root, open_kwargs, seconds, seed, queue, start, env, body)


def prune_paused(root: str, open_kwargs: dict[str, Any], tier: str, keep_last: int,
                 checked: Any, go: Any, queue: Any) -> None:
    """Retention that pauses after its checks, right before it starts deleting a checkpoint
    (``checked`` set, then waits for ``go``): the window a concurrent restore can hit."""
    from ckptstore.ops.tiering.retention import apply_retention
    from ckptstore.retention import RetentionPolicy

    try:
        store = _open(root, open_kwargs)
        original = store.catalog.mark_deleting

        def paused(*args: Any, **kwargs: Any) -> Any:
            checked.set()
            go.wait(60)
            return original(*args, **kwargs)

        store.catalog.mark_deleting = paused
        report = apply_retention(store, tier=tier, policy=RetentionPolicy(keep_last=keep_last))
        queue.put(("pruner", [a.checkpoint_id for a in report.executed],
                   [why for _, why in report.skipped]))
        store.close()
    except BaseException:
        queue.put(("pruner-error", traceback.format_exc(), []))


def restore_paused(root: str, open_kwargs: dict[str, Any], ref: str, mid: Any, resume: Any,
                   queue: Any, blocked: Any = None) -> None:
    """Restore ``ref`` to hot, pausing after its second file (``mid`` set, waits for
    ``resume``); report "ok" (and check the tensors) or the error type. ``blocked``, when
    given, is set the first time the restore finds a lease it must wait for."""
    from ckptstore.errors import CkptError
    from ckptstore.ops.tiering.replicas import tier_of
    from ckptstore.ops.tiering.restore import restore_checkpoint

    try:
        store = _open(root, open_kwargs)
        if blocked is not None:
            holder_of = store.catalog.lease_holder

            def watched(*args: Any, **kwargs: Any) -> Any:
                holder = holder_of(*args, **kwargs)
                if holder is not None:
                    blocked.set()
                return holder

            store.catalog.lease_holder = watched  # type: ignore[method-assign]
        hot = tier_of(store, "hot")
        original = hot.put_bytes
        calls = [0]

        def slow(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:
                mid.set()
                resume.wait(60)
            return original(*args, **kwargs)

        hot.put_bytes = slow
        try:
            restore_checkpoint(store, ref, threads=1, wait_s=20)
            state = store.load(ref)
            ok = states_equal(state, make_state(int(state["seed"]), NBYTES_RACE))
            queue.put(("restorer", "ok" if ok else "WRONG TENSOR", ""))
        except CkptError as exc:
            queue.put(("restorer", type(exc).__name__, str(exc)[:300]))
        store.close()
    except BaseException:
        queue.put(("restorer-error", traceback.format_exc(), ""))


#: State size of the restore/prune race test (the child checks the tensors it loads).
NBYTES_RACE = 512 * 1024


def same_step_saver(root: str, open_kwargs: dict[str, Any], run: str, step: int, seed: int,
                    nbytes: int, start: Any, queue: Any) -> None:
    """Wait at the barrier, then save ``run`` at ``step`` (racing another process)."""
    try:
        store = _open(root, open_kwargs)
        state = make_state(seed, nbytes)
        start.wait(timeout=120)
        ck = store.save(run, step, state)
        queue.put(("ok", ck.id, ck.version, seed))
        store.close()
    except BaseException:
        queue.put(("error", traceback.format_exc(), 0, seed))


# ---------------------------------------------------------------------- security


def load_everything(root: str, ref: str, env: dict[str, str], queue: Any) -> None:
    """Try every load path on ``ref`` (load, verify, manifest, iter) with ``env`` applied;
    report each outcome as the exception type name or "ok"."""
    _apply_env(env)
    store = _open(root, None)
    outcomes: dict[str, str] = {}
    from ckptstore.format import iter_tensors, read_manifest

    def attempt(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            outcomes[name] = "ok"
        except Exception as exc:  # the parent asserts on the type names
            outcomes[name] = type(exc).__name__

    ck = store.catalog.get(ref)
    directory = store.checkpoint_dir(ck.run, ck.id)
    attempt("load", lambda: store.load(ref))
    attempt("verify", lambda: store.verify(ref))
    attempt("manifest", lambda: store.manifest(ref))
    attempt("read_manifest_nodigest", lambda: read_manifest(directory))
    attempt("iter_tensors", lambda: list(iter_tensors(directory, read_manifest(directory))))
    queue.put(outcomes)


def load_one(root: str, ref: str, queue: Any) -> None:
    """Load ``ref`` once; report the outcome (the parent times us out if we hang)."""
    store = _open(root, None)
    try:
        store.load(ref)
        queue.put("ok")
    except Exception as exc:  # the parent asserts on the type
        queue.put(type(exc).__name__)


def import_file(root: str, path: str, env: dict[str, str], queue: Any) -> None:
    """Import a foreign checkpoint file/folder with ``env`` applied; report the outcome."""
    _apply_env(env)
    from ckptstore.ops.upkeep.convert import import_checkpoint

    store = _open(root, None)
    try:
        ck = import_checkpoint(store, Path(path), run="imported", step=1)
        queue.put(("ok", ck.id))
    except Exception as exc:  # the parent asserts on the type
        queue.put((type(exc).__name__, str(exc)[:300]))


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def parse_hostile(path: str, queue: Any) -> None:
    """Read a hostile manifest; report (error type, CPU s, wall s, peak RSS growth MiB)."""
    from ckptstore.format import read_manifest

    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
    except OSError:
        pass
    base = _status_kib("VmRSS")
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        read_manifest(Path(path))
        outcome = "ok"
    except Exception as exc:  # the parent asserts on the type
        outcome = type(exc).__name__
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    queue.put((outcome, cpu, wall, (_status_kib("VmHWM") - base) / 1024))


def import_bundle_measured(root: str, bundle: str, queue: Any) -> None:
    """Import a (hostile) bundle; report (error type, message, peak RSS growth MiB)."""
    from ckptstore.ops.sharing.bundle import import_bundle
    from ckptstore.store import CheckpointStore

    with CheckpointStore.open(root) as store:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
        except OSError:
            pass
        base = _status_kib("VmRSS")
        try:
            import_bundle(store, bundle)
            outcome, message = "ok", ""
        except Exception as exc:  # the parent asserts on the type
            outcome, message = type(exc).__name__, str(exc)[:300]
        queue.put((outcome, message, (_status_kib("VmHWM") - base) / 1024))
