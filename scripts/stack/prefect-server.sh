#!/usr/bin/env bash
# The Prefect server the agents register deployments on and trainers trigger flow runs on.
# Reads Prefect's own settings only: PREFECT_SERVER_API_HOST / PREFECT_SERVER_API_PORT (where
# it listens), PREFECT_API_DATABASE_CONNECTION_URL (its database; SQLite under PREFECT_HOME
# when unset) and PREFECT_SERVER_ANALYTICS_ENABLED (off unless set, like in every process
# ckptstore starts: see src/ckptstore/observability/prefect_env.py).
set -euo pipefail
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
exec prefect server start
