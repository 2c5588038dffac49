"""Benchmark: our chunked gated delta rule (models/common/gated_delta_rule.py) against transformers'
`torch_chunk_gated_delta_rule` (the pure-PyTorch path of Qwen3.5), forward + backward, on one linear-attention
layer of the Qwen3.5-0.8B shape (16 key and 16 value heads of 128, chunk 64), inputs in bf16 (both compute in
float32 inside, as transformers does).

Prints tokens/s of each and their ratio (measured in the same run, alternating; on CPU also per second of the
process's CPU time, which a machine shared with other jobs distorts far less than wall time), and the peak
memory of each
at seq 4096 and 16384: every (kernel, seq) runs in a fresh subprocess and reports its resident-set high-water
mark above what the inputs alone took (CPU, Linux: VmHWM reset after a warm-up), or torch.cuda.max_memory_allocated (GPU). Linear memory means the
16384 figure is ~4x the 4096 one.

    python scripts/benchmarks/bench_gated_delta.py [--seq 4096] [--long-seq 16384] [--repeats 3] [--warmup 1] [--device cpu]
"""

import argparse
import json
import subprocess
import sys
import time

import torch

HEADS_K, HEADS_V, DK, DV, CHUNK = 16, 16, 128, 128, 64


def _inputs(seq: int, device: str):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, HEADS_K, DK, generator=gen)
    k = torch.randn(1, seq, HEADS_K, DK, generator=gen)
    v = torch.randn(1, seq, HEADS_V, DV, generator=gen)
    g = -torch.rand(1, seq, HEADS_V, generator=gen)
    beta = torch.rand(1, seq, HEADS_V, generator=gen)
    return [t.to(device=device, dtype=torch.bfloat16).requires_grad_() for t in (q, k, v, g, beta)]


def _step(impl: str, inputs) -> None:
    q, k, v, g, beta = inputs
    if impl == "ours":
        from torchtitan.models.common.gated_delta_rule import chunk_gated_delta_rule, l2norm

        # transformers normalises q/k inside its kernel (use_qk_l2norm_in_kernel); ours does it in the layer.
        o, _ = chunk_gated_delta_rule(l2norm(q.float()), l2norm(k.float()), v, g, beta, chunk_size=CHUNK)
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        o, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True)
    o.float().square().mean().backward()


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(key + ":")))


def _peak_child(impl: str, seq: int, device: str) -> None:
    """Runs in a subprocess: one forward + backward; prints the peak above the inputs as JSON. On CPU the
    resident-set high-water mark (VmHWM) is reset after the imports and a tiny warm-up step, so their own
    peaks do not hide the step's (Linux)."""
    _step(impl, _inputs(64, device))  # imports and first-call allocations
    inputs = _inputs(seq, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        base = _status_kib("VmRSS") * 1024
    _step(impl, inputs)
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else _status_kib("VmHWM") * 1024 - base
    print(json.dumps({"peak": peak}))


def _peak(impl: str, seq: int, device: str) -> int:
    out = subprocess.run([sys.executable, __file__, "--child", impl, "--seq", str(seq), "--device", device],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--long-seq", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each kernel (0: memory only)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--peak-seq", type=int, default=0, help="short sequence of the memory comparison (default --seq)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        _peak_child(a.child, a.seq, a.device)
        return

    if a.repeats > 0:
        _timing(a)
    print("peak memory above the inputs (fresh process each):")
    short_seq = a.peak_seq or a.seq
    for impl in ("ours", "transformers"):
        short, long = _peak(impl, short_seq, a.device), _peak(impl, a.long_seq, a.device)
        print(f"  {impl:13s} seq {short_seq}: {short / 2**20:8.0f} MiB   seq {a.long_seq}: {long / 2**20:8.0f} MiB   "
              f"ratio {long / max(short, 1):.1f}x for {a.long_seq / short_seq:.0f}x the tokens", flush=True)


def _timing(a) -> None:
    inputs = _inputs(a.seq, a.device)
    for _ in range(a.warmup):  # allocator, lazy imports
        for impl in ("ours", "transformers"):
            _step(impl, inputs)
    times = {"ours": [], "transformers": []}
    cpu_times = {"ours": [], "transformers": []}
    for _ in range(a.repeats):  # alternate, so machine load hits both alike
        for impl in times:
            if a.device == "cuda":
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            _step(impl, inputs)
            if a.device == "cuda":
                torch.cuda.synchronize()
            times[impl].append(time.perf_counter() - t0)
            cpu_times[impl].append(time.process_time() - c0)
    tps = {impl: a.seq / min(ts) for impl, ts in times.items()}
    cpu_tps = {impl: a.seq / min(ts) for impl, ts in cpu_times.items()}
    print(f"one Qwen3.5-0.8B DeltaNet layer (heads {HEADS_K}/{HEADS_V} x {DK}/{DV}, chunk {CHUNK}), seq {a.seq}, "
          f"bf16 inputs, forward+backward on {a.device} (best of {a.repeats}, {torch.get_num_threads()} threads):")
    for impl in tps:
        extra = f"   {cpu_tps[impl]:10,.0f} tokens per CPU-second" if a.device == "cpu" else ""
        print(f"  {impl:13s} {tps[impl]:10,.0f} tokens/s{extra}")
    print(f"  ratio ours/transformers: {tps['ours'] / tps['transformers']:.2f}x (wall)"
          + (f", {cpu_tps['ours'] / cpu_tps['transformers']:.2f}x (CPU time)" if a.device == "cpu" else ""), flush=True)


if __name__ == "__main__":
    main()
