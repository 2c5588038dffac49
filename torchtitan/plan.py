"""Layout planner: which parallel layout, AC mode and batch split to train a model with on N devices.

    python -m torchtitan.plan --model llama3 --flavor 8B --devices 8 --device-type H100-80GB \
        --seq-len 8192 --global-batch-size 16 [--top 3] [--mfu 0.5] [--memory-headroom 0.1] [--float8 [--float8-all-gather]] [--async-tp] [--compile]
        [--memory-budget-gib 40 [--offload-bandwidth-gbps 20] [--host-gib 1024]]

Prints the fastest layouts that fit, each with its predicted throughput, where the time goes, its peak
memory, and the TOML to paste into a recipe. See docs/planning.md for the model and its assumptions.
"""

import argparse
import sys


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m torchtitan.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3")
    ap.add_argument("--flavor", default=None, help="a registered size (or give --hf-config)")
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--device-type", default="H100-80GB")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--global-batch-size", type=int, required=True, help="sequences per optimizer step")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: the flavor's")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--mfu", type=float, default=None, help="fraction of the bf16 peak large matmuls reach (default: the device's measured GEMM efficiency, planning/hardware.py)")
    ap.add_argument("--parallelisms", default=None,
                    help="use exactly these model-parallel dimensions, comma-separated from tp,pp,cp (data parallel "
                         "over the rest); 'none' = data parallel only; default: any")
    ap.add_argument("--memory-headroom", type=float, default=0.0,
                    help="fraction of the device's memory a layout must leave free, e.g. 0.1 for room the estimator "
                         "does not model on your device (see scripts/gpu/check_memory_estimate.py); default 0")
    ap.add_argument("--memory-budget-gib", "--memory.budget_gib", type=float, default=0.0,
                    help="per-rank peak budget in GiB (the trainer's --memory.budget_gib): every layout must stay "
                         "within it, and each is also judged with the memory-budget planner's choice of keep, op, "
                         "full or offload per block (docs/memory_budget.md); the recipe carries the budget. 0 = none")
    ap.add_argument("--offload-bandwidth-gbps", "--memory.offload_bandwidth_gbps", type=float, default=0.0,
                    help="GB/s each way of the activation offload tier (default: pinned host memory over PCIe, "
                         "planning/memory_budget.py OFFLOAD_BANDWIDTH_CUDA)")
    ap.add_argument("--host-gib", "--memory.host_gib", type=float, default=0.0,
                    help="host RAM of one node in GiB: a layout whose budget plan pins more offloaded activations "
                         "per node (per GPU x GPUs per node) is skipped; 0 = unchecked (the target is another "
                         "machine), the plans then name what they need")
    ap.add_argument("--hf-config", default=None,
                    help="a Hugging Face folder (or config.json) giving the shape instead of --flavor")
    ap.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                    help="set a field of the model args (repeatable), e.g. --override n_layers=40")
    ap.add_argument("--float8", action="store_true", help="train with tensorwise Float8 linears")
    ap.add_argument("--float8-all-gather", action="store_true", help="FSDP all-gathers Float8 weights in float8")
    ap.add_argument("--async-tp", action="store_true", help="train with async tensor parallel (needs compile)")
    ap.add_argument("--compile", action="store_true",
                    help="train with torch.compile (--float8 and --async-tp imply it: their recipes turn it on)")
    a = ap.parse_args(argv)
    if not a.flavor and not a.hf_config:
        ap.error("give --flavor or --hf-config")
    a.flavor = a.flavor or f"({a.hf_config})"
    import dataclasses

    from torchtitan.errors import USER_ERRORS
    from torchtitan.planning.hardware import get_device, memory_limit
    from torchtitan.planning.memory import ModelShape
    from torchtitan.planning.memory_budget import OFFLOAD_BANDWIDTH_CUDA
    from torchtitan.planning.planner import Features, explain, parse_model_parallel, plan_layouts
    from torchtitan.planning.held_out_error import (
        HELD_OUT_MEDIAN_ERROR,
        HELD_OUT_MEMORY_RANGE,
        HELD_OUT_RATIO_RANGE,
        interval,
        memory_interval_line,
    )
    from torchtitan.planning.published import published_here
    from torchtitan.protocols.model_shape import model_args_for
    from torchtitan.protocols.train_spec import get_train_spec

    try:
        device = get_device(a.device_type)
        args = model_args_for(get_train_spec(a.model), a.flavor, a.hf_config, a.override)
        if a.vocab_size:
            args = dataclasses.replace(args, vocab_size=a.vocab_size)
        shape = ModelShape.from_args(args)
        if shape is None or shape.hybrid:
            raise ValueError(
                f"the planner's formulas are for dense decoder blocks; model {a.model!r} declares no such shape "
                f"(BaseModelArgs.transformer_shape) or has blocks of other kinds (MoE, linear or gated attention)"
            )
        if a.devices < 1 or a.seq_len < 1 or a.global_batch_size < 1:
            raise ValueError("--devices, --seq-len and --global-batch-size must be positive")
        model_parallel = parse_model_parallel(a.parallelisms)
        features = Features(float8=a.float8, float8_all_gather=a.float8_all_gather, async_tp=a.async_tp,
                            compile=a.compile)
        limit = memory_limit(device, a.memory_headroom)
        if a.memory_budget_gib < 0:
            raise ValueError(f"--memory-budget-gib {a.memory_budget_gib:g} must be 0 (no budget) or a positive "
                             f"number of GiB")
        if a.host_gib < 0:
            raise ValueError(f"--host-gib {a.host_gib:g} must be 0 (unchecked) or a positive number of GiB")
        if a.offload_bandwidth_gbps < 0:
            raise ValueError(f"--offload-bandwidth-gbps {a.offload_bandwidth_gbps:g} must be positive (or 0: the "
                             f"default)")
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = plan_layouts(shape, device, a.devices, a.seq_len, a.global_batch_size,
                          a.mfu, features=features, model_parallel=model_parallel,
                          memory_headroom=a.memory_headroom, budget_bytes=a.memory_budget_gib * 2**30,
                          offload_bandwidth=(a.offload_bandwidth_gbps or OFFLOAD_BANDWIDTH_CUDA) * 1e9,
                          host_bytes=a.host_gib * 2**30)
    dropped = ", ".join(f"{n} {why}" for why, n in result.dropped.items())
    print(f"{a.model} {a.flavor} on {a.devices} x {device.name}, seq {a.seq_len}, global batch "
          f"{a.global_batch_size}: {len(result.ranked)} layouts fit"
          + (f" within {limit / 2**30:.1f} GiB ({100 * a.memory_headroom:.0f}% of memory kept free)"
             if a.memory_headroom else "")
          + (f" within a budget of {a.memory_budget_gib:g} GiB per rank" if a.memory_budget_gib else "")
          + (f" and {a.host_gib:g} GiB of host memory per node" if a.host_gib else "")
          + f" ({dropped})\n")
    if not result.ranked:
        print("error: no layout fits; add devices, shorten --seq-len or lower --global-batch-size"
              + (" or --memory-headroom" if a.memory_headroom else "")
              + (" or raise --memory-budget-gib" if a.memory_budget_gib else "")
              + (" or --host-gib" if a.host_gib else ""), file=sys.stderr)
        return 1
    best = result.ranked[0].time.total
    lo, hi = HELD_OUT_RATIO_RANGE
    print(f"Intervals: where published figures lay for predictions of runs the model was not fitted on (held-out "
          f"predicted / published {lo:.2f}-{hi:.2f}, median error {100 * HELD_OUT_MEDIAN_ERROR:.1f}%; "
          f"docs/planning.md){' - with --mfu the fit no longer applies' if a.mfu else ''}; peak memory estimated / "
          f"published {_ratio_range(HELD_OUT_MEMORY_RANGE[False])} without PP, "
          f"{_ratio_range(HELD_OUT_MEMORY_RANGE[True])} with (--memory-headroom "
          f"{1 - HELD_OUT_MEMORY_RANGE[False][0]:.2f}, {1 - HELD_OUT_MEMORY_RANGE[True][0]:.2f} with PP, keeps the "
          f"upper ends within memory)\n")
    for i, c in enumerate(result.ranked[: a.top], 1):
        slower = 100 * (c.time.total / best - 1)
        # Times equal to 3 significant digits rank the simpler layout first (planner.plan_layouts).
        lead = "fastest" if i == 1 else f"{slower:.1f}% slower than #1" if slower >= 0.05 else "ties #1"
        low, high = interval(c.tokens_per_s_per_device)
        print(f"#{i} ({lead}; {low:,.0f}-{high:,.0f} tokens/s/device): "
              f"{explain(c, a.seq_len, a.global_batch_size, device)}")
        print("  " + memory_interval_line(c.memory, c.layout.pp > 1, device.memory_bytes))
        print("  " + c.layout.toml(a.seq_len, a.global_batch_size, features).replace("\n", "\n  ") + "\n")
    for line in published_here(shape, device.name, a.devices, a.seq_len, a.global_batch_size, features,
                               result.ranked):
        print(line)
    return 0


def _ratio_range(r: tuple[float, float]) -> str:
    return f"{r[0]:.2f}-{r[1]:.2f}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
