"""MFU where matmuls dominate: a 1B-shaped Llama slice trained a few steps, with a per-op time breakdown,
the framework's step against a bare PyTorch loop on the same model and kernels, before and after tuning.

    python scripts/benchmarks/bench_mfu.py [--layers 2] [--seq-len 2048] [--batch 1] [--steps 2] [--dtype bfloat16]
        [--run-steps 10000] [--tuned]

The shape: Llama 3.2 1B's block (dim 2048, 16 heads, 8 kv heads, FFN 8192) and its
vocabulary (128256), `--layers` blocks, the llama3 `Transformer` built from `TransformerModelArgs` (the
flavor machinery's args; any shape a flavor can name). Parameters in `--dtype` (bfloat16: this CPU
multiplies bf16 natively; no autocast then), one model and optimizer shared by every variant:
- framework, before: torchtitan's loss (`build_cross_entropy_loss`, one chunk: the plain loss), its
  optimizer builder with foreach AdamW, its gradient clipping: the defaults before the auto chunked loss;
- bare PyTorch: the same model, F.cross_entropy on float32 logits, torch.optim.AdamW (foreach),
  torch.nn.utils.clip_grad_norm_;
- framework, eager defaults: the shipped defaults with compile off: `training.loss_chunk_size -1` (auto:
  chunked at this vocabulary) and `optimizer.implementation auto` (fused AdamW where torch has it);
- framework, defaults: what `--compile.auto` (the default) chooses for a run of `--run-steps` steps (default:
  the trainer's default `training.steps`, 10,000) of this shape, by its rule (distributed/compile_auto.py) with
  this step's FLOPs and the measured peak: with its blocks compiled (regional compile; the warm-up step
  compiles) when it says on, else the eager defaults above. It runs after the eager variants (compiling the
  blocks changes the shared model); the line above the table quotes the rule's figures;
- framework, tuned (`--tuned`, last): the compiled defaults with freed memory kept without the default's
  bound: under mimalloc nothing purged (MIMALLOC_PURGE_DELAY -1, set in the running process), under glibc no
  trim (with `--malloc huge_pages|plain`: kept from then on, set mid-process by mallopt).
Variants alternate step by step after one warm-up step each; medians. The CPU allocator is the process's, so
every variant runs with the one `--malloc` names: `default` (the trainer's: `glibc_kept`), `mimalloc`
(`--training.cpu_allocator mimalloc`: the script restarts itself with the trainer's preload environment,
`cpu_malloc.preload_environment`; torch's large tensors on transparent huge pages),
`glibc_kept` (huge pages, and glibc keeping freed blocks within the bound of `--training.cpu_keep_freed_memory`,
`KeptHeap.before` / `after_step` around every step as the trainer calls them, settled afresh for each phase as
a new run would), `huge_pages` (huge pages alone), `plain` (glibc as it starts) or `keep` (kept without bound); compare
them by separate runs with `--only defaults`. MFU = model FLOPs (the llama3
args' `flops_per_token`: 6 x non-embedding params + attention) / step time / the measured peak (the best
large bf16 GEMM, torchtitan.tools.device_peak). Memory: peak RSS of the process (CPU). The breakdown: one
profiled step per variant, self CPU time by op kind.
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an installed copy

KINDS = ("matmul", "attention", "norms/RoPE/activations/other", "loss", "optimizer")


def _kind(event, optimizer_ranges) -> str:
    name = event.name
    if any(r.time_range.start <= event.time_range.start and event.time_range.end <= r.time_range.end
           and r.thread == event.thread for r in optimizer_ranges) or "adam" in name or "_foreach" in name:
        return "optimizer"
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if any(k in name for k in ("log_softmax", "nll_loss", "aten::softmax", "_softmax", "logsumexp", "scatter_add")):
        return "loss"
    return "norms/RoPE/activations/other"


TOP_OPS: dict[str, dict[str, float]] = {}
"""Per variant: self CPU seconds of each op outside the matmuls (what is left to cut), filled by breakdown."""


def breakdown(step, name: str = "") -> dict[str, float]:
    """Self CPU seconds of one step by op kind (and, in TOP_OPS[name], by op for the non-matmul ones)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            step(profiled=record_function)
    events = [e for e in prof.events() if not e.name.startswith("<") and e.name != "step"]
    optimizer_ranges = [e for e in events if e.name == "optimizer"]
    out = dict.fromkeys(KINDS, 0.0)
    for e in events:
        if e.name in ("optimizer", "loss"):
            continue
        kind = _kind(e, optimizer_ranges)
        out[kind] += e.self_cpu_time_total / 1e6
        if kind != "matmul":
            ops = TOP_OPS.setdefault(name, {})
            ops[f"{e.name} ({kind})"] = ops.get(f"{e.name} ({kind})", 0.0) + e.self_cpu_time_total / 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=2048, help="model width (heads of 128); smaller only to try the script")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--run-steps", type=int, default=None,
                   help="the run length compile.auto judges (default: the trainer's default training.steps)")
    p.add_argument("--skip-before", action="store_true", help="leave out the `before` variant (shorter run)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the profiled step per variant (shorter run)")
    p.add_argument("--tuned", action="store_true",
                   help="last, the compiled defaults with freed memory kept without the default bound")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--only", choices=["before", "defaults"], help="run this framework variant alone")
    p.add_argument("--malloc", default="default",
                   choices=["default", "mimalloc", "glibc_kept", "huge_pages", "plain", "keep"],
                   help="the CPU allocator setting of the process (default: the trainer's; tools/cpu_malloc.py)")
    a = p.parse_args()
    import os

    from torchtitan.tools import cpu_malloc  # torch-free: before torch's first CPU tensor

    load_start = os.getloadavg()[0]
    if a.malloc == "default":
        a.malloc = "glibc_kept"  # the trainer's default (--training.cpu_allocator glibc, kept heap bounded)
    if a.malloc == "mimalloc":
        wanted = cpu_malloc.wanted_allocator("mimalloc", accelerator=False)
        if cpu_malloc.loaded_allocator() is None:  # preloading needs a new process image
            sys.stdout.flush()
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
                      cpu_malloc.preload_environment(wanted, dict(os.environ)))
    if a.malloc in ("mimalloc", "glibc_kept", "huge_pages"):  # before torch's first CPU tensor, as train.py does
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    import torch
    import torch.nn.functional as F

    from torchtitan.components.loss import AUTO_CHUNK, build_cross_entropy_loss
    from torchtitan.components.optim.optimizer import build_optimizers
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from torchtitan.tools.device_peak import peak_flops
    from torchtitan.tools.memory import _peak_rss_bytes
    from torchtitan.tools.params import count_params
    from torchtitan.tools.precision import cpu_model_name

    dtype = getattr(torch, a.dtype)
    growth = JobConfig().training.cpu_kept_heap_growth
    heap = {"bound": None, "trims": 0}  # the trainer's kept-heap bound, checked after every step

    def settle() -> None:  # a new phase starts as a new run: the bound measures its working set afresh
        if heap["bound"] is not None:
            heap["trims"] += heap["bound"].trims
        heap["bound"] = cpu_malloc.KeptHeap(growth) if a.malloc == "glibc_kept" else None

    if a.malloc == "keep":
        cpu_malloc.keep_freed_memory()  # kept without bound, for every variant
    elif a.malloc == "glibc_kept":
        cpu_malloc.keep_freed_memory_bounded(growth)
        settle()

    args = TransformerModelArgs(dim=a.dim, n_layers=a.layers, n_heads=a.dim // 128, n_kv_heads=max(1, a.dim // 256),
                                vocab_size=a.vocab,
                                ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000, max_seq_len=a.seq_len)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    model.to(dtype)
    ffn = model.layers["0"].feed_forward.w1.weight.shape[0]
    _, non_embedding = count_params(model)
    flops_per_step = args.flops_per_token(non_embedding, a.seq_len) * a.batch * a.seq_len
    tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    cfg = JobConfig()
    cfg.optimizer.lr = 1e-5
    cfg.training.seq_len = a.seq_len
    default_loss = build_cross_entropy_loss(cfg)  # -1: auto, chunked at this vocabulary
    cfg.training.loss_chunk_size = a.seq_len  # one chunk: the plain loss, the default before auto
    plain_loss = build_cross_entropy_loss(cfg)
    container = build_optimizers([model], cfg.optimizer)  # implementation auto, the default
    (adamw,) = container.optimizers
    auto_fused = adamw.defaults["fused"]
    params = list(model.parameters())

    def set_fused(fused: bool) -> None:
        for g in adamw.param_groups:
            g["foreach"], g["fused"] = not fused, fused

    def framework(loss_fn, fused):
        def step(profiled=None):
            set_fused(fused)
            logits = model(inputs)
            with (profiled("loss") if profiled else contextlib.nullcontext()):
                loss = loss_fn(logits, labels) / labels.numel()
            loss.backward()
            clip_grad_norm_(params, 1.0)
            with (profiled("optimizer") if profiled else contextlib.nullcontext()):
                container.step()
            container.zero_grad()
        return step

    def bare(profiled=None):
        set_fused(False)
        logits = model(inputs)
        with (profiled("loss") if profiled else contextlib.nullcontext()):
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        with (profiled("optimizer") if profiled else contextlib.nullcontext()):
            adamw.step()
        adamw.zero_grad(set_to_none=True)

    kernel = "fused" if auto_fused else "foreach"
    peak = peak_flops(torch.device("cpu"), dtype)
    from torchtitan.distributed.compile_auto import choose

    if a.run_steps is not None:
        cfg.training.steps = a.run_steps
    auto = choose(cfg, step_flops=flops_per_step, peak_flops=peak, device_type="cpu", world_size=1,
                  cached=False)  # cold: the estimate a first run of these shapes makes
    variants = {
        "framework, before (plain loss, foreach AdamW)": framework(plain_loss, False),
        "bare PyTorch (same kernels)": bare,
        f"framework, eager defaults (auto: chunked loss {AUTO_CHUNK}, {kernel} AdamW)": framework(default_loss, auto_fused),
    }
    if a.skip_before:
        variants = {n: v for n, v in variants.items() if not n.startswith("framework, before ")}
    if a.only:  # one variant alone: its own peak RSS (alternating variants share one heap)
        keep = "framework, before " if a.only == "before" else "framework, eager defaults "
        variants = {n: v for n, v in variants.items() if n.startswith(keep)}
    times = {name: [] for name in variants}

    def timed(name: str, step) -> None:
        t0 = time.perf_counter()
        if heap["bound"] is not None:
            heap["bound"].before((a.batch, a.seq_len))  # as the trainer calls it: one shape, so it keeps all
        step()
        if heap["bound"] is not None:
            heap["bound"].after_step()  # a trim's cost counts in its step
        times[name].append(time.perf_counter() - t0)

    for rep in range(a.steps + 1):
        for name, step in variants.items():
            timed(name, step)
            if not rep:
                times[name].clear()  # the warm-up step
    def profiled(step, name: str) -> dict[str, float]:
        return dict.fromkeys(KINDS, 0.0) if a.no_breakdown else breakdown(step, name)

    kinds = {name: profiled(step, name) for name, step in variants.items()}

    def run_last(name: str, step) -> None:  # after the eager variants: it changes the shared model or heap
        variants[name], times[name] = step, []
        for rep in range(a.steps + 1):  # the warm-up step compiles
            timed(name, step)
            if not rep:
                times[name].clear()
        kinds[name] = profiled(step, name)

    defaults_step = variants[list(variants)[-1]]
    if auto.enable and a.only != "before":
        from torchtitan.distributed.compile import apply_compile, configure_compile_cache

        configure_compile_cache()
        apply_compile(model)
        settle()
        run_last("framework, defaults (compile.auto: on, each block compiled)", defaults_step)
        if a.tuned:
            settle()
            heap["bound"] = None  # kept without bound from here on
            if a.malloc == "mimalloc":
                cpu_malloc.mimalloc_purge_delay(-1)
            else:
                cpu_malloc.keep_freed_memory()
            run_last("framework, tuned (defaults, freed memory kept without bound)", defaults_step)
    settle()
    rss = _peak_rss_bytes()

    print(f"Llama slice: dim {a.dim}, {args.n_heads} heads, {args.n_kv_heads} kv heads, FFN {ffn}, vocab {args.vocab_size}, "
          f"{a.layers} layers, batch {a.batch} x seq {a.seq_len}, {a.dtype} parameters; {torch.get_num_threads()} threads, "
          f"{cpu_model_name()}, torch {torch.__version__}")
    print(f"compile.auto for a {cfg.training.steps}-step run of this shape: {auto.reason}")
    print(f"model FLOPs per step {flops_per_step / 1e12:.2f} TFLOP; measured peak (best large {a.dtype} GEMM) "
          f"{peak / 1e9:,.0f} GFLOP/s; process peak RSS {rss / 2**30:.1f} GiB; CPU allocator: {cpu_malloc.describe()}; "
          f"kept-heap trims {heap['trims']}; load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    print("| variant | step s (median, min-max) | tokens/s | MFU | " + " | ".join(f"{k} %" for k in KINDS) + " |")
    print("|---|---|---|---|" + "---|" * len(KINDS))
    for name in variants:
        med = statistics.median(times[name])
        total = sum(kinds[name].values()) or 1.0
        shares = " | ".join(f"{100 * kinds[name][k] / total:.1f}" for k in KINDS)
        print(f"| {name} | {med:.2f} ({min(times[name]):.2f}-{max(times[name]):.2f}) | "
              f"{a.batch * a.seq_len / med:,.0f} | {100 * flops_per_step / med / peak:.1f}% | {shares} |")
    for name in [n for n in variants if n.startswith("framework, ") and "before" not in n]:
        top = sorted(TOP_OPS.get(name, {}).items(), key=lambda kv: -kv[1])[:8]
        print(f"largest ops outside the matmuls, {name}: " + "; ".join(f"{op} {t:.2f} s" for op, t in top))
    if a.only:
        return
    med = {n: statistics.median(times[n]) for n in variants}
    names = list(variants)
    bare_s = med["bare PyTorch (same kernels)"]
    eager = next(med[n] for n in names if n.startswith("framework, eager defaults"))
    compiled = [n for n in names if n.startswith("framework, defaults ")]
    defaults = med[compiled[0]] if compiled else eager
    line = f"tokens/s ratios: defaults / bare {bare_s / defaults:.3f}x; defaults / eager defaults {eager / defaults:.3f}x"
    if not a.skip_before:
        before = med[names[0]]
        line += f"; framework before / bare {bare_s / before:.3f}x; defaults / before {before / defaults:.3f}x"
    best = min(med.values())
    print(line + f"; defaults / the fastest variant {best / defaults:.3f}x")


if __name__ == "__main__":
    main()
