#!/usr/bin/env bash
# Installs what is missing, then runs the whole test suite (unit, multi-process, end-to-end).
# Extra arguments go to pytest, e.g. scripts/run_tests.sh -m "not distributed and not e2e".
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_env.sh test
scripts/slurm/ensure_slurm.sh  # on CI as root: Slurm for the slurm-marked test (it skips without)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
# --durations: every run ends with its 10 slowest tests, so a test that starts to crawl shows up at once.
exec "$PYTHON" -m pytest -q --durations=10 "$@"
