#!/usr/bin/env bash
# The read-only catalog browser. It binds a loopback address only (it has no authentication);
# extra arguments go to `ckpt ui` (e.g. --port 8788).
set -euo pipefail
exec ckpt ui "$@"
