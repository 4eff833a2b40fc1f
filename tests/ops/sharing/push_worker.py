"""The pusher of the kill-point tests: push REF from the store of one config file to another.

Usage: python push_worker.py SRC_CONFIG DST_CONFIG REF [--self-contained]
``CKPT_FAULT_POINT`` (see src/ckptstore/faultpoints.py) decides where it dies.

test_push_crash.py runs :func:`push_killed` in a child of a forkserver that preloaded torch
and ckptstore (importing them costs seconds per process on the 2-core machine).
"""

from __future__ import annotations

import os
import sys

from ckptstore.core import StoreCore
from ckptstore.ops.sharing.push import push_checkpoints


def push(src_config: str, dst_config: str, ref: str, *, self_contained: bool = False) -> None:
    """Push ``ref`` from the store of ``src_config`` to the store of ``dst_config``."""
    with StoreCore.open(config=src_config) as src, StoreCore.open(config=dst_config) as dst:
        report = push_checkpoints(src, dst, [ref], remote="dst", self_contained=self_contained)
    print(report.summary())


def push_killed(src_config: str, dst_config: str, ref: str, point: str,
                self_contained: bool = False) -> None:
    """:func:`push` in a child process, killed (SIGKILL) at the fault point ``point``."""
    os.environ["CKPT_FAULT_POINT"] = point
    push(src_config, dst_config, ref, self_contained=self_contained)


def main() -> None:
    src_config, dst_config, ref = sys.argv[1:4]
    push(src_config, dst_config, ref, self_contained="--self-contained" in sys.argv)


if __name__ == "__main__":
    main()
