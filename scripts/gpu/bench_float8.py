"""bf16 vs Float8 training throughput and MFU on one GPU (H100/H200 class), with an 8B-shaped model.

    python scripts/gpu/bench_float8.py [--layers 4] [--seq-len 8192] [--batch 1] [--steps 30] [--no-compile]
        [--runs "bf16,float8 rowwise"]

The model has Llama 3 8B's shapes (dim 4096, FFN 14336, 32 heads / 8 KV heads, vocab 128256) with only
--layers blocks so that it and its AdamW state fit one GPU. Each configuration (bf16; float8 tensorwise; float8
rowwise) builds the model the way the trainer does (converters on meta, then per-block compile and compiled
loss), trains --steps steps on random tokens with bf16 parameters, and reports the median step after the
first few (compile and warm-up excluded). MFU is given against the bf16 peak (comparable across rows) and
against the peak of the dtype the run's matmuls use (fp8 for float8). Results are printed as a Markdown table
and, when $OUT is set, written to $OUT/bench_float8.{md,json}.

Exits with a clear message when the GPU has no float8 tensor cores (float8 rows need CUDA capability 8.9+,
rowwise 9.0+); such rows are skipped with the reason.
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an installed copy

from torchtitan.components.loss import cross_entropy_sum
from torchtitan.components.quantization import build_model_converters
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.compile import apply_compile, compile_loss, configure_compile_cache
from torchtitan.distributed.parallel_dims import parallel_dims_from_config
from torchtitan.models.llama3 import Transformer, llama3_flavors
from torchtitan.tools.device_peak import peak_flops
from torchtitan.tools.params import count_params

CONFIGS = {"bf16": None, "float8 tensorwise": "tensorwise", "float8 rowwise": "rowwise"}
WARMUP_STEPS = 5


def _run(recipe: str | None, a: argparse.Namespace, device: torch.device) -> dict:
    args = dataclasses.replace(llama3_flavors["8B"], n_layers=a.layers, max_seq_len=a.seq_len)
    cfg = JobConfig()
    if recipe is not None:
        cfg.model.converters = ["float8"]
        cfg.float8.recipe_name = recipe
    converters = build_model_converters(cfg, parallel_dims_from_config(cfg.parallelism, 1), device)
    with torch.device("meta"):
        model = Transformer(args)
    model.to(torch.bfloat16)
    converters.convert(model)
    _, non_embedding = count_params(model)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    loss_fn = cross_entropy_sum
    if a.compile:
        apply_compile(model)
        loss_fn = compile_loss(cross_entropy_sum)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    gen = torch.Generator(device=device).manual_seed(1)
    times, losses = [], []
    for step in range(a.steps):
        tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq_len + 1), device=device, generator=gen)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        opt.step()
        converters.post_optimizer_hook([model], None)
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    step_s = statistics.median(times)
    tps = a.batch * a.seq_len / step_s
    flops = args.flops_per_token(non_embedding, a.seq_len) * tps
    own_peak = peak_flops(device, converters.matmul_dtype(torch.bfloat16))
    result = {
        "tokens_per_s": tps,
        "step_s": step_s,
        "tflops": flops / 1e12,
        "mfu_vs_bf16_peak_pct": 100 * flops / peak_flops(device, torch.bfloat16),
        "mfu_vs_own_peak_pct": 100 * flops / own_peak,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    del model, opt
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--runs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    a = p.parse_args()
    unknown = set(a.runs.split(",")) - set(CONFIGS)
    if unknown or "bf16" not in a.runs.split(","):
        p.error(f"--runs: {', '.join(sorted(unknown)) or 'bf16 missing'}; give bf16 and any of {', '.join(CONFIGS)}")
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU (float8 tensor cores: H100/H200 class)", file=sys.stderr)
        return 1
    configure_compile_cache()
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    results, skipped = {}, {}
    for label, recipe in CONFIGS.items():
        if label not in a.runs.split(","):
            continue
        try:
            results[label] = _run(recipe, a, device)
        except ValueError as e:  # the converter's one-line reason, e.g. no float8 tensor cores
            skipped[label] = str(e)
        print(f"{label}: {results.get(label, skipped.get(label))}", flush=True)

    base = results.get("bf16", {}).get("tokens_per_s")
    lines = [
        f"{name}, Llama 3 8B shapes with {a.layers} layers, batch {a.batch} x seq {a.seq_len}, bf16 params, "
        f"compile {'on' if a.compile else 'off'}, median of {a.steps - WARMUP_STEPS} steps",
        "",
        "| run | tokens/s | vs bf16 | TFLOP/s | MFU vs bf16 peak | MFU vs own peak | peak mem GiB | loss first→last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | {r['tflops']:.0f} | "
            f"{r['mfu_vs_bf16_peak_pct']:.1f}% | {r['mfu_vs_own_peak_pct']:.1f}% | {r['peak_memory_gib']:.1f} | "
            f"{r['first_loss']:.3f}→{r['last_loss']:.3f} |"
        )
    lines += [f"| {label} | skipped: {why} |" for label, why in skipped.items()]
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "bench_float8.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(os.environ["OUT"], "bench_float8.json"), "w") as f:
            json.dump({"device": name, "args": vars(a), "results": results, "skipped": skipped}, f, indent=1)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
