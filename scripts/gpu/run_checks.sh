#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one call on a lent single-GPU machine. Each check has its own time limit
# and its output goes to $OUT/checks.log (a line per check's start and exit status on stdout too):
#   phase A, checks that measure no time, side by side:
#     - the unit tests' CUDA-only cases (grouped GEMM, FlexAttention masking, the pinned-host activation tier,
#       the profiler's memory snapshot) and the CPU cases of their files
#     - the memory estimator against CUDA's peak: eager, compiled, compiled + Float8 (check_memory_estimate.py)
#     - the debug model on cuda: bf16 (auto precision), compile, async checkpoints to pinned memory, the
#       recipe's in-loop evaluation at its last step; then a resume from the last checkpoint; then document
#       masking through FlexAttention inside the compiled blocks
#   phase B, timed, one at a time on an otherwise idle GPU:
#     - FlexAttention masking under compile vs the dense path, bf16 (check_flex_masking.py)
#     - bf16 vs Float8 rowwise throughput and MFU on an 8B-shaped model cut to 4 layers (bench_float8.py)
#     - MoE grouped GEMM vs the per-expert loop (bench_moe.py); EP and expert TP over NCCL with >= 2 GPUs
# A machine with no package registry: put the wheels the environment lacks in .whl/ (docs/performance.md names
# them); they are installed into /tmp/site and the checkout is installed editable without dependencies.
# Usage (repo root):  OUT=/tmp/out [CHECKS="name ..."] bash scripts/gpu/run_checks.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-./outputs/gpu_checks}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/checks.log
WORK=${WORK:-/tmp/tt_gpu_checks}  # run folders and checkpoints: not copied back
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
export TORCHTITAN_CACHE_DIR=${TORCHTITAN_CACHE_DIR:-$WORK/cache}

if [ -d .whl ] && ! python3 -c "import torchdata, torchao, datasets, wandb, torchtitan" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
        && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null \
        || { echo "error: installing the carried wheels failed"; exit 1; }
fi
source scripts/ensure_env.sh
set +e  # ensure_env sets -e; a failed check must not end the others
{ nvidia-smi; "$PYTHON" -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"; } \
    > "$OUT/nvidia-smi.txt" 2>&1
tail -1 "$OUT/nvidia-smi.txt"

# check NAME SECONDS CMD...: runs CMD with a time limit, its output appended to the log under a header.
# CHECKS="unit_cuda train_resume ..." runs only the checks named (a rerun of those that failed).
check() {
    local name=$1 limit=$2; shift 2
    if [ -n "${CHECKS:-}" ] && [[ " $CHECKS " != *" $name "* ]]; then return 0; fi
    local start=$SECONDS
    echo "=== $name: start $(date +%T)" >> "$LOG.$name"
    timeout --kill-after 10 "$limit" "$@" >> "$LOG.$name" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG.$name"
}
flush() { for f in "$LOG".*; do [ -e "$f" ] && cat "$f" >> "$LOG" && rm -f "$f"; done; }

debug_runs() {
    local dump=$WORK/debug_cuda
    check train_async_ckpt 240 env NGPU=1 ./run_train.sh --metrics.log_freq 5 --job.dump_folder "$dump" --training.steps 20 --compile.enable \
        --checkpoint.enable --checkpoint.interval 10 --checkpoint.async_mode async_with_pinned_mem
    check train_resume 150 env NGPU=1 ./run_train.sh --metrics.log_freq 5 --job.dump_folder "$dump" --training.steps 30 --compile.enable \
        --checkpoint.enable --checkpoint.interval 10 --checkpoint.async_mode async_with_pinned_mem
    check train_doc_masking 150 env NGPU=1 ./run_train.sh --metrics.log_freq 5 --job.dump_folder "$WORK/doc_masking" --training.steps 10 --compile.enable \
        --training.document_masking --training.document_positions --eval.enable false
}

# ---- phase A
check unit_cuda 300 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/unit/test_moe.py \
    tests/unit/test_document_masking.py tests/unit/test_activation_offload.py tests/unit/test_precision.py \
    tests/unit/test_trainer.py::test_profiler_writes_a_trace_and_memory_snapshot_needs_cuda &
memory_checks() {
    check memory_eager 200 "$PYTHON" scripts/gpu/check_memory_estimate.py --layers 4 --seq-len 8192
    check memory_compile 240 "$PYTHON" scripts/gpu/check_memory_estimate.py --layers 4 --seq-len 8192 --compile
    check memory_compile_float8 240 "$PYTHON" scripts/gpu/check_memory_estimate.py --layers 4 --seq-len 8192 \
        --compile --float8
}
memory_checks &
debug_runs
wait
flush

# ---- phase B (timed: nothing else on the GPU)
check flex_masking 120 "$PYTHON" scripts/gpu/check_flex_masking.py
check float8 300 "$PYTHON" scripts/gpu/bench_float8.py --layers 8 --seq-len 8192 --steps 20
check moe_grouped_gemm 120 "$PYTHON" scripts/gpu/bench_moe.py
NGPUS=$(nvidia-smi -L | wc -l)
if [ "$NGPUS" -ge 2 ]; then
    check moe_ep_nccl 300 "$PYTHON" scripts/benchmarks/bench_moe.py --ngpu "$NGPUS" --ep "$NGPUS" --extra \
        --training.mixed_precision_param=bfloat16
    check moe_etp_nccl 300 "$PYTHON" scripts/benchmarks/bench_moe.py --ngpu "$NGPUS" --tp "$NGPUS" --extra \
        --training.mixed_precision_param=bfloat16
fi
flush

# the figures, for the reply's tail
grep -hE "passed|failed|skipped|SKIPPED|error:" "$LOG" | grep -v "^=" | tail -12
grep -hE "Resumed from|step: *(20|30) |eval/|loss" "$LOG" | grep -vE "^\s*$" | tail -14
grep -hE "^\| |AC |flex|grad |outputs|ok|FAILED|ms|x " "$LOG" | tail -40
