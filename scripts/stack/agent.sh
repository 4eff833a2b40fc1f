#!/usr/bin/env bash
# One node's agent (`ckpt agent`): registers ckptstore's flows on the process work pool ($1,
# default "ckptstore"; idempotent, every node may do it), makes sure the pool has this node's
# work queue, runs a worker on it, records the node's heartbeat and runs its gc. The stack's
# nodes mount one hot volume, so each also runs the pool's default queue (--shared-hot):
# scheduled flows and the single-process trainer's archive runs may land on either node.
# The node is CKPT_HOST; the store is whatever CKPT_* says, the Prefect server is
# PREFECT_API_URL, S3 credentials are AWS_*.
set -euo pipefail
pool="${1:-ckptstore}"
exec ckpt agent --pool "$pool" --shared-hot
