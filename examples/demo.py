"""ckptstore end to end on the embedded defaults: what `make demo` runs.

SQLite catalog, a local hot tier and a local "warm" tier standing in for S3, Prefect without a
server. The demo:

1. trains a small model with CheckpointManager (async saves every 50 steps, keep_last=3),
   crashes it on purpose, and runs it again: it resumes from the newest committed checkpoint;
2. lists the catalog and shows one checkpoint;
3. fine-tunes a second run from the best checkpoint (lineage across runs);
4. archives every checkpoint to the warm tier with the real Prefect archive flow;
5. prunes the hot tier (dry run first, then for real): hot copies go, the warm ones stay;
6. loads a checkpoint whose only copy is now on the warm tier (restored transparently);
7. converts the best checkpoint to safetensors and to a .pt file, and imports the .pt back;
8. verifies every replica on every tier, and runs gc.

Run: ``python examples/demo.py [--store DIR]`` (default ./demo-store, recreated each time).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# A loaded 2-core machine can take longer than the default 20 s to start the ephemeral API.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

HERE = Path(__file__).resolve().parent


def banner(text: str) -> None:
    """Print a section header."""
    print(f"\n=== {text} " + "=" * max(0, 70 - len(text)), flush=True)


def ckpt(store: Path, *args: str) -> None:
    """Run the `ckpt` CLI the way a user would, echoing the command."""
    print(f"$ ckpt {' '.join(args)}", flush=True)
    subprocess.run(
        [sys.executable, "-m", "ckptstore", "--config", str(store / "ckptstore.toml"), *args],
        check=True,
    )


def main() -> int:
    """Run the demo; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="demo-store", help="demo directory (recreated)")
    args = parser.parse_args()
    root = Path(args.store).resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    os.environ.setdefault("PREFECT_HOME", str(root / "prefect-home"))
    (root / "ckptstore.toml").write_text(
        f'root = "{root}"\n'
        'codec = "lz4"\n'
        "[tiers]\n"
        f'warm = "{root / "warm"}"   # an S3 URL in production\n'
        "[retention]\n"
        "keep_last = 2\n"
    )
    started = time.perf_counter()

    banner("1. train, crash at step 230, train again (resumes)")
    train = [sys.executable, str(HERE / "train_mlp.py"), "--store", str(root),
             "--steps", "400", "--save-every", "50", "--keep-last", "3"]
    crashed = subprocess.run([*train, "--crash-at", "230"])
    print(f"(first process exited with status {crashed.returncode}: simulated crash)")
    subprocess.run(train, check=True)

    from ckptstore import CheckpointStore

    store = CheckpointStore.open(config=root / "ckptstore.toml")
    try:
        banner("2. the catalog")
        ckpt(root, "ls")
        ckpt(root, "show", "mlp-demo@best:loss")

        banner("3. fine-tune a new run from the best checkpoint (lineage)")
        import torch

        best = store.best("mlp-demo", "loss")
        state = store.load(best.ref)
        with torch.no_grad():
            for tensor in state["model"].values():
                tensor.mul_(0.999)
        child = store.save("mlp-finetune", step=0, state=state, parent=best.ref,
                           metrics={"loss": best.metrics["loss"] * 0.98}, tags=["finetune"])
        print(f"saved {child.ref} with parent {best.ref}")
        ckpt(root, "lineage", child.ref)

        banner("4. archive hot -> warm with the Prefect flow (embedded, no server)")
        from ckptstore.flows.archive import archive_flow

        t0 = time.perf_counter()
        result = archive_flow(store_root=str(root), config=str(root / "ckptstore.toml"))
        print(f"archive flow: {len(result.get('archived', []))} checkpoint(s) archived and "
              f"verified in {time.perf_counter() - t0:.1f}s (includes Prefect's first start)")
        ckpt(root, "ls", "--tier", "warm")

        banner("5. prune the hot tier with keep_last=2 (dry run, then for real)")
        ckpt(root, "prune", "--dry-run")
        ckpt(root, "prune")
        ckpt(root, "du")

        banner("6. load a checkpoint whose only copy is on the warm tier")
        oldest = store.list(run="mlp-demo", order_by="step")[0]
        print(f"{oldest.ref} lives on: {', '.join(store.get(oldest.ref).tiers)}")
        restored = store.load(oldest.ref)
        print(f"loaded {oldest.ref} (step {restored['step']}); now on: "
              f"{', '.join(store.get(oldest.ref).tiers)}")

        banner("7. convert and import")
        out = root / "exports"
        ckpt(root, "convert", best.ref, "--format", "safetensors",
             "--out", str(out / "best.safetensors"))
        ckpt(root, "convert", best.ref, "--format", "pt", "--out", str(out / "best.pt"))
        ckpt(root, "import", str(out / "best.pt"), "--run", "imported", "--step", str(best.step))

        banner("8. verify every replica, then gc")
        ckpt(root, "verify", "--all")
        ckpt(root, "gc")
        ckpt(root, "events", "--limit", "12")
    finally:
        store.close()
    print(f"\ndemo finished in {time.perf_counter() - started:.1f}s; store at {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
