#!/usr/bin/env bash
# Times the dry run of the Llama 3.1 recipes at 64, 256 and 512 ranks (one process, fake process group,
# default ranks = the first rank of every pipeline stage). Figures in docs/planning.md.
#   PYTHONPATH=$PWD scripts/planning/time_dry_runs.sh
set -u
run() {  # recipe world extra-args...
  local recipe=$1 world=$2; shift 2
  local t0=$(date +%s.%N)
  local out; out=$(python3 -m torchtitan.dry_run --world-size "$world" --job.config_file "train_configs/$recipe.toml" "$@" 2>&1)
  local t1=$(date +%s.%N)
  printf '%-12s %4s ranks %-48s %6.1f s  %s\n' "$recipe" "$world" "$*" "$(echo "$t1 - $t0" | bc)" \
    "$(echo "$out" | head -1 | sed 's/.*ranks (\(.*\)),.*/\1/')"
  echo "$out" | grep -E '^ +[0-9]+ ' | head -2 | sed 's/^/      /'
}
for w in 64 256 512; do
  run llama3_8b "$w"
  run llama3_70b "$w"
  run llama3_405b "$w" --parallelism.pipeline_parallel_degree 8 --training.local_batch_size 8
done
