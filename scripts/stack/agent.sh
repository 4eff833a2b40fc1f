#!/usr/bin/env bash
# One node's agent: register ckptstore's flows on the process work pool ($1, default
# "ckptstore"; idempotent, every node may do it), then run that pool's flow runs on this node.
# The node is CKPT_HOST (recorded in catalog leases and writer tags); the store is whatever
# CKPT_* says, the Prefect server is PREFECT_API_URL, S3 credentials are AWS_*.
set -euo pipefail
pool="${1:-ckptstore}"
ckpt serve --pool "$pool"
# The one line a `ckpt agent` command will replace.
exec prefect worker start --pool "$pool" --type process --name "${CKPT_HOST:-$(hostname)}"
