"""Subprocess for the kill-point tests: push REF from the store of one config file to another.

Usage: python push_worker.py SRC_CONFIG DST_CONFIG REF [--self-contained]
``CKPT_FAULT_POINT`` (see src/ckptstore/faultpoints.py) decides where it dies.
"""

from __future__ import annotations

import sys

from ckptstore.core import StoreCore
from ckptstore.ops.sharing.push import push_checkpoints


def main() -> None:
    src_config, dst_config, ref = sys.argv[1:4]
    with StoreCore.open(config=src_config) as src, StoreCore.open(config=dst_config) as dst:
        report = push_checkpoints(src, dst, [ref], remote="dst",
                                  self_contained="--self-contained" in sys.argv)
    print(report.summary())


if __name__ == "__main__":
    main()
