#!/usr/bin/env bash
# The example trainer: a tiny model trained against the stack's store, every checkpoint
# archived through the Prefect server. Arguments go to trainer.py (--run, --steps, ...).
set -euo pipefail
exec python "$(dirname "$0")/trainer.py" "$@"
