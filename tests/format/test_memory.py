"""The save path must not copy the state: peak extra memory stays a fraction of it.

Measured in a fresh process with the kernel's RSS high-water mark (Linux), for both the
uncompressed and the LZ4 path (one subprocess, to pay for importing torch once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import json, sys, uuid, torch
    from ckptstore.format import read_checkpoint, read_manifest, write_checkpoint

    def reset_peak():
        # Writing 5 to clear_refs resets the kernel's RSS high-water mark (VmHWM).
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")

    def rss(field):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    root = sys.argv[1]
    state = {f"t{i}": torch.randn(5_000_000) for i in range(10)}  # 200 MB
    state["small"] = [torch.randn(100) for _ in range(200)]
    state["view"] = torch.randn(1000, 100)[:, :10]
    nbytes = 200_000_000
    # Warm up imports on a tiny state, so only the big save counts.
    write_checkpoint(root + "/warm", {"x": torch.ones(10)}, ckpt_id=str(uuid.uuid4()),
                     run="r", step=0)
    result = {}
    for codec in ("none", "lz4"):
        reset_peak()
        before = rss("VmRSS")
        write_checkpoint(root + "/" + codec, state, ckpt_id=str(uuid.uuid4()), run="r", step=0,
                         codec=codec)
        save_extra = rss("VmHWM") - before
        manifest = read_manifest(root + "/" + codec)
        reset_peak()
        before = rss("VmRSS")
        read_checkpoint(root + "/" + codec, manifest, into=state)
        result[codec] = [save_extra / nbytes, (rss("VmHWM") - before) / nbytes]
    print(json.dumps(result))
    """
)


def test_peak_extra_memory_is_bounded(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result = json.loads(proc.stdout)
    print(result)
    # A compressed load decodes through per-thread scratch (a file buffer and a decode
    # buffer of one chunk each, 2 threads, 8 MiB chunks): a fixed 32 MiB whatever the state's
    # size, which on this 200 MB state alone is 0.17 of it. Measured 0.04-0.27 under load.
    scratch = 2 * 2 * 8 * 1024 * 1024 / 200_000_000
    for codec, (save_extra, load_extra) in result.items():
        assert save_extra <= 0.25, (codec, result)
        assert load_extra <= 0.25 + (scratch if codec != "none" else 0.0), (codec, result)
