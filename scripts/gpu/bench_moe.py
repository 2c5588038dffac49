"""Grouped GEMM vs. the per-expert loop for the routed experts' SwiGLU, on a CUDA GPU (bf16).

For an MoE layer's shape (default: Qwen3-30B-A3B, 128 experts of 2048 -> 768, 8192 tokens x top-8) it
checks that both kernels agree (forward and gradients) and times forward + backward of each.

    python scripts/gpu/bench_moe.py                       # 30B-A3B layer
    python scripts/gpu/bench_moe.py --experts 256 --dim 7168 --hidden 2048 --tokens 4096   # V3 671B layer
Expert parallel over NCCL: scripts/gpu/run_checks.sh runs scripts/benchmarks/bench_moe.py when it sees >= 2 GPUs.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from torchtitan.components.moe.experts import expert_swiglu, grouped_mm_supported  # noqa: E402


def _time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; grouped GEMM supported for bf16: "
          f"{grouped_mm_supported(dev, torch.bfloat16)}")
    torch.manual_seed(0)
    # Token copies spread over the experts with realistic imbalance (a multinomial draw, some experts empty-ish).
    ids = torch.multinomial(torch.rand(a.experts, device=dev) + 0.1, a.tokens * a.top_k, replacement=True)
    counts = torch.bincount(ids, minlength=a.experts)
    x = torch.randn(a.tokens * a.top_k, a.dim, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(a.experts, a.hidden, a.dim, device=dev, dtype=torch.bfloat16) * 0.02,
          torch.randn(a.experts, a.dim, a.hidden, device=dev, dtype=torch.bfloat16) * 0.02,
          torch.randn(a.experts, a.hidden, a.dim, device=dev, dtype=torch.bfloat16) * 0.02]
    ws = [w.requires_grad_() for w in ws]
    results = {}
    for grouped in (True, False):
        for w in ws:
            w.grad = None
        out = expert_swiglu(x, *ws, counts, use_grouped_mm=grouped)
        out.float().square().mean().backward()
        results[grouped] = (out.detach().float(), [w.grad.float().clone() for w in ws])

        def step(grouped=grouped):
            expert_swiglu(x, *ws, counts, use_grouped_mm=grouped).float().square().mean().backward()

        results[grouped] += (_time_ms(step, a.iters),)
    (o1, g1, t1), (o2, g2, t2) = results[True], results[False]
    rel = max([((o1 - o2).abs().max() / o2.abs().max()).item()]
              + [((x1 - x2).abs().max() / x2.abs().max()).item() for x1, x2 in zip(g1, g2)])
    flops = 6 * 3 * x.shape[0] * a.dim * a.hidden  # fwd+bwd, three projections
    print(f"layer: {a.experts} experts {a.dim}->{a.hidden}, {a.tokens} tokens x top-{a.top_k}")
    print(f"max relative difference grouped vs loop (output and gradients, bf16): {rel:.2e}")
    print(f"grouped GEMM  fwd+bwd {t1:8.2f} ms  {flops / t1 / 1e9:7.1f} TFLOP/s")
    print(f"per-expert    fwd+bwd {t2:8.2f} ms  {flops / t2 / 1e9:7.1f} TFLOP/s")
    print(f"speed-up of grouped GEMM: {t2 / t1:.2f}x")


if __name__ == "__main__":
    main()
