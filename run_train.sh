#!/usr/bin/env bash
# Train with torchrun. Environment:
#   CONFIG_FILE  TOML recipe (default: train_configs/debug_model.toml)
#   NGPU         processes on this machine (default: all visible GPUs, or 1 on a CPU-only machine)
#   LOG_RANK     ranks whose output is shown (default: 0)
# Extra arguments are passed to the trainer, e.g. ./run_train.sh --training.steps 20
# Multi-node: scripts/multinode_trainer.slurm.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure_env.sh

CONFIG_FILE=${CONFIG_FILE:-./train_configs/debug_model.toml}
if [ -z "${NGPU:-}" ]; then
    NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)")
fi
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-0}

for a in "$@"; do
    case "$a" in -h|--help) exec "$PYTHON" -m torchtitan.train --help ;; esac
done

# Check the recipe and the layout before starting ranks: a bad option gets one line, not a rank failure
# report from every process.
"$PYTHON" -m torchtitan.preflight --world-size "$NGPU" --job.config_file "$CONFIG_FILE" "$@"

exec "$PYTHON" -m torchtitan.launch --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
    -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"
