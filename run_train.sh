#!/usr/bin/env bash
# Train with torchrun. Environment:
#   CONFIG_FILE  TOML recipe (default: train_configs/debug_model.toml)
#   NGPU         processes on this machine (default: all visible GPUs, or 1 on a CPU-only machine)
#   LOG_RANK     ranks whose output is shown (default: 0)
#   MAX_RESTARTS restart a failed run up to this many times, each resuming from the last complete checkpoint
#                (default: 0); SAME_FAILURE_LIMIT: stop once this many attempts in a row failed the same way (3)
# Extra arguments are passed to the trainer, e.g. ./run_train.sh --training.steps 20
# Multi-node: scripts/slurm/multinode_trainer.slurm.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure_env.sh

CONFIG_FILE=${CONFIG_FILE:-./train_configs/debug_model.toml}
if [ -z "${NGPU:-}" ]; then
    NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)")
fi
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-0}

# --help after any arguments (and the recipe) shows the options they select, e.g. --model.name qwen3_moe brings [moe].
for a in "$@"; do
    case "$a" in -h|--help) exec "$PYTHON" -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@" ;; esac
done

# Check the recipe and the layout before starting ranks: a bad option gets one line, not a rank failure
# report from every process.
"$PYTHON" -m torchtitan.preflight --world-size "$NGPU" --job.config_file "$CONFIG_FILE" "$@"

# One attempt = torchtitan.launch (torchrun; a rank's user error comes back as its one line). Restarts are
# counted by torchtitan.tools.restart around it, which can tell a repeated failure from a new one; with
# --checkpoint.enable every attempt resumes from the last complete checkpoint.
exec "$PYTHON" -m torchtitan.tools.restart --max-restarts "${MAX_RESTARTS:-0}" \
    --same-failure-limit "${SAME_FAILURE_LIMIT:-3}" -- \
    "$PYTHON" -m torchtitan.launch --nproc_per_node="$NGPU" --max-restarts 0 \
    --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
    -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"
