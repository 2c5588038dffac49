"""Speed and memory of the CPU allocator settings (tools/cpu_malloc.py): a small Llama trained for many steps
alternating two sequence lengths, each setting in its own process, RSS read after every step.

    python scripts/benchmarks/bench_cpu_malloc.py [--steps 300] [--modes plain,default,glibc_kept,keep,huge_pages]
        [--dim 128] [--vocab 16384]

Shapes: the llama3 `Transformer` (dim `--dim`, 2 layers, vocabulary `--vocab`), float32, batch 1, the step's
sequence length alternating between `--seq-len` and half of it (so the [tokens x vocab] logits, 64 and 32 MiB
by default, are above glibc's 32 MiB mmap ceiling as at real sizes), the framework's loss, AdamW (auto) and
gradient clipping. Settings: `plain` = glibc as it starts; `default` = the trainer's, `glibc_kept`: torch's
large CPU tensors on transparent huge pages (`--training.cpu_huge_pages`) and glibc keeping freed blocks within
the bound of `--training.cpu_keep_freed_memory` / `--training.cpu_kept_heap_growth` (`KeptHeap.before` before
every step, with the step's sequence length, and `KeptHeap.after_step` after it, as the trainer calls them);
`mimalloc` = `--training.cpu_allocator mimalloc` (preloaded with the trainer's environment,
`cpu_malloc.preload_environment`: MIMALLOC_PURGE_DELAY unless set; huge pages); `keep` = freed blocks kept
without bound; `huge_pages` = huge pages alone.
With `--together` the settings' processes run at the same time, so that on a shared machine they share its
load (their speeds are then comparable with each other only). Per setting: median step time per shape (the first 10 steps excluded), peak RSS (the process's high-water
mark), and the highest RSS after a step over the first third of the steps and over the rest (flat: the second is not above the
first by more than the noise), and the ratio of each to plain's.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout, not an installed copy


def run_one(mode: str, a: argparse.Namespace) -> dict:
    """Train in this process with allocator setting `mode`; per-step seconds and RSS after each step."""
    import os

    if mode in ("huge_pages", "glibc_kept", "mimalloc"):  # before torch's first CPU tensor, as torchtitan/train.py does
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    import torch

    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.optim.optimizer import build_optimizers
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from torchtitan.tools import cpu_malloc
    from torchtitan.tools.memory import _current_rss_bytes, _peak_rss_bytes

    bound = None
    if mode == "keep":
        cpu_malloc.keep_freed_memory()
    elif mode == "glibc_kept":
        bound = cpu_malloc.keep_freed_memory_bounded(JobConfig().training.cpu_kept_heap_growth)
    torch.manual_seed(0)
    args = TransformerModelArgs(dim=a.dim, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=a.vocab,
                                max_seq_len=a.seq_len)
    model = Transformer(args)
    model.init_weights()
    cfg = JobConfig()
    cfg.training.seq_len = a.seq_len
    loss_fn = build_cross_entropy_loss(cfg)
    opt = build_optimizers([model], cfg.optimizer)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(0)
    times, rss = [], []
    for step in range(a.steps):
        seq = a.seq_len if step % 2 == 0 else a.seq_len // 2
        tokens = torch.randint(0, a.vocab, (1, seq + 1), generator=g)
        t0 = time.perf_counter()
        if bound is not None:  # as the trainer calls it before each step
            bound.before(seq)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        if bound is not None:
            bound.after_step()
        times.append(time.perf_counter() - t0)  # a trim's cost counts in its step
        rss.append(_current_rss_bytes())
    return {"times": times, "rss": rss, "peak": _peak_rss_bytes(), "allocator": cpu_malloc.describe(),
            "trims": bound.trims + bound.shape_trims if bound is not None else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--modes", default="plain,default,mimalloc")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--together", action="store_true",
                   help="run the settings' processes at the same time (a loaded machine: they share its load)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run this mode in this process, print JSON
    a = p.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one, a)))
        return
    import os

    from torchtitan.tools import cpu_malloc

    load_start = os.getloadavg()[0]
    results, running = {}, {}
    for mode in a.modes.split(","):
        if mode == "default":  # the trainer's choice, run as its setting
            mode = "glibc_kept"
        mimalloc = cpu_malloc.wanted_allocator("mimalloc", accelerator=False) if mode == "mimalloc" else None
        env = cpu_malloc.preload_environment(mimalloc, dict(os.environ))
        cmd = [sys.executable, __file__, "--one", mode, "--steps", str(a.steps), "--dim", str(a.dim),
               "--vocab", str(a.vocab), "--seq-len", str(a.seq_len)]
        running[mode] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        if not a.together:
            running[mode].wait()
    for mode, proc in running.items():
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"setting {mode} failed (exit {proc.returncode})")
        results[mode] = json.loads(out.strip().splitlines()[-1])
    import torch

    from torchtitan.tools.precision import cpu_model_name

    print(f"llama3 dim {a.dim}, 2 layers, vocab {a.vocab}, float32, batch 1 x seq {a.seq_len} / {a.seq_len // 2} "
          f"alternating, {a.steps} steps; {torch.get_num_threads()} threads, {cpu_model_name()}, torch {torch.__version__}; "
          f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print("| setting | step s long (median) | step s short (median) | peak RSS MiB | max RSS first third MiB | "
          "max RSS last two thirds MiB | trims | peak / plain | tokens/s / plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = results.get("plain")
    for mode, r in results.items():
        long_s = statistics.median(r["times"][10::2])
        short_s = statistics.median(r["times"][11::2])
        total = sum(r["times"][10:])
        cut = a.steps // 3  # 100 of 300: the last two thirds must stay flat
        first, rest = max(r["rss"][:cut]), max(r["rss"][cut:])
        peak_ratio = r["peak"] / base["peak"] if base else float("nan")
        speed = sum(base["times"][10:]) / total if base else float("nan")
        print(f"| {mode} ({r['allocator']}) | {long_s:.3f} | {short_s:.3f} | {r['peak'] / 2**20:,.0f} | {first / 2**20:,.0f} | "
              f"{rest / 2**20:,.0f} | {r['trims']} | {peak_ratio:.3f}x | {speed:.3f}x |")


if __name__ == "__main__":
    main()
