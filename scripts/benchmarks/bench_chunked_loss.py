"""Chunked cross entropy at Llama 3's vocabulary: peak memory of a training step and tokens/s, with and
without `training.loss_chunk_size`.

    python scripts/benchmarks/bench_chunked_loss.py [--flavor debugmodel] [--vocab 128256] [--seq-len 1024] [--batch 1]
                                         [--chunk 256] [--steps 4] [--dtype bfloat16]

A step: forward under bf16 autocast (the default CPU recipe without FSDP), the job's loss (built by
`build_cross_entropy_loss`, as the trainer does), backward, AdamW. Memory: each mode runs in a fresh child
process, and the figure is its peak RSS during the steps minus its RSS before the first step (the model and
the batch): what the step itself needs, activations, logits and gradients included (CPU: process RSS, which
counts everything the process holds). The logits' own size is printed beside it. Time: a third child runs
both losses on one model, alternating step by step, then the loss alone on fixed logits (forward +
backward), alternating too; medians after one warm-up step each.
"""

import argparse
import dataclasses
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an installed copy

_MIB = 2**20


def _setup(a, keep_freed: bool = True):
    from torchtitan.tools.cpu_malloc import keep_freed_memory

    if keep_freed:  # as --training.cpu_keep_freed_memory (timing); not for memory: a kept heap hides the step's peak
        keep_freed_memory()
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.config.job_config import JobConfig
    from torchtitan.models.llama3 import Transformer, llama3_flavors

    torch.manual_seed(0)
    args = dataclasses.replace(llama3_flavors[a.flavor], vocab_size=a.vocab, max_seq_len=max(a.seq_len, 2048))
    model = Transformer(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), generator=torch.Generator().manual_seed(0))
    losses = {}
    for name, chunk in (("plain", a.seq_len), (f"chunked {a.chunk}", a.chunk)):  # seq_len: one chunk
        cfg = JobConfig()
        cfg.training.loss_chunk_size = chunk
        losses[name] = build_cross_entropy_loss(cfg)
    dtype = getattr(torch, a.dtype)

    def step(loss_fn):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return losses, step


def _memory_child(a, name, queue):
    from torchtitan.tools.memory import _current_rss_bytes, _peak_rss_bytes

    torch.set_num_threads(a.threads)
    losses, step = _setup(a, keep_freed=False)
    step(losses[name])  # optimizer state and allocator pools exist from here on: they are the baseline
    before = _current_rss_bytes()
    start_peak = _peak_rss_bytes()
    for _ in range(2):
        step(losses[name])
    # ru_maxrss only grows: a step peak below the process's earlier peak shows as that earlier peak.
    queue.put((name, max(_peak_rss_bytes(), start_peak) - before, _peak_rss_bytes() > start_peak))


def _time_child(a, queue):
    torch.set_num_threads(a.threads)
    losses, step = _setup(a)
    times = {name: [] for name in losses}
    values = {name: [] for name in losses}
    for rep in range(a.steps + 1):
        for name, fn in losses.items():
            t0 = time.perf_counter()
            values[name].append(step(fn))
            if rep:
                times[name].append(time.perf_counter() - t0)
    # The loss alone (forward + backward on fixed logits): the part chunking changes, without the noise
    # of the rest of the step.
    logits = torch.randn(a.batch, a.seq_len, a.vocab, dtype=getattr(torch, a.dtype)).requires_grad_()
    labels = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=torch.Generator().manual_seed(1))
    loss_times = {name: [] for name in losses}
    for rep in range(a.steps + 1):
        for name, fn in losses.items():
            t0 = time.perf_counter()
            fn(logits, labels).backward()
            logits.grad = None
            if rep:
                loss_times[name].append(time.perf_counter() - t0)
    queue.put((times, values, loss_times))


def _child(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, queue))
    p.start()
    out = queue.get()
    p.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    names = ["plain", f"chunked {a.chunk}"]
    memory = {}
    for name in names:
        got, mib, grew = _child(_memory_child, a, name)
        memory[got] = (mib / _MIB, grew)
    times, values, loss_times = _child(_time_child, a)
    tokens = a.batch * a.seq_len
    logits_mib = tokens * a.vocab * torch.finfo(getattr(torch, a.dtype)).bits / 8 / _MIB
    print(f"llama3 {a.flavor}, vocab {a.vocab}, batch {a.batch} x seq {a.seq_len}, {a.dtype} autocast, "
          f"{a.threads} threads, torch {torch.__version__}")
    print(f"logits [tokens x vocab] in {a.dtype}: {logits_mib:,.0f} MiB (float32: {tokens * a.vocab * 4 / _MIB:,.0f} MiB)")
    print("| loss | step peak above baseline (MiB) | step time (s, median) | tokens/s | loss after steps |")
    print("|---|---|---|---|---|")
    for name in names:
        med = statistics.median(times[name])
        mib, grew = memory[name]
        print(f"| {name} | {mib:,.0f}{'' if grew else ' (<= earlier peak)'} | {med:.3f} "
              f"({min(times[name]):.3f}-{max(times[name]):.3f}) | {tokens / med:,.0f} | {values[name][-1]:.4f} |")
    plain, chunked = (statistics.median(times[n]) for n in names)
    loss_plain, loss_chunked = (statistics.median(loss_times[n]) for n in names)
    print(f"the loss alone (forward + backward, s, median): plain {loss_plain:.3f}, chunked {loss_chunked:.3f}")
    print(f"peak memory chunked / plain: {memory[names[1]][0] / memory[names[0]][0]:.2f}; "
          f"tokens/s chunked / plain: {plain / chunked:.3f} (whole step), {loss_plain / loss_chunked:.3f} (the loss alone)")


if __name__ == "__main__":
    main()
