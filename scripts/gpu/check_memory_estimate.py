"""Memory estimator vs measured CUDA peak on one GPU, for each AC mode (run on a lent GPU machine).

    python scripts/gpu/check_memory_estimate.py [--layers 4] [--seq-len 8192] [--batch 1] [--compile] [--float8]

The model: Llama 3.1 8B's shape cut to --layers blocks (vocabulary 128256), fp32 parameters, bf16 autocast
(the trainer's one-rank mixed precision), AdamW foreach. One warm-up step creates the optimizer state;
the next step runs with the peak counters reset. Measured: torch.cuda.max_memory_allocated (what tensors
hold) and max_memory_reserved (what the caching allocator took from the driver). Estimated:
torchtitan/planning/memory.py with the real parameter/optimizer bytes, without (vs allocated) and with
(vs reserved) its stated GPU allocator overhead; the CUDA context and NCCL constant are left out of both,
since neither counter includes them.

--compile and --float8 apply them the trainer's way (each block compiled after AC, the loss compiled;
tensorwise Float8 linears, the output projection kept in bf16). The estimator models the compiled loss
(RankWork.loss_compiled: no fp32 log-softmax or fp32 gradients), not compile's fusions inside the blocks nor
Float8: these runs measure how far off it is with them, which is where it misses torchtitan's published GPU memory most
(docs/planning.md; on CPU, scripts/planning/bench_memory.py measures the same for compile).
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchtitan.components.loss import cross_entropy_sum  # noqa: E402
from torchtitan.config.job_config import ActivationCheckpoint  # noqa: E402
from torchtitan.distributed.activation_checkpoint import apply_ac  # noqa: E402
from torchtitan.models.llama3 import Transformer, llama3_flavors  # noqa: E402
from torchtitan.planning.memory import (  # noqa: E402
    ALLOCATOR_OVERHEAD_GPU,
    ModelShape,
    RankWork,
    StateBytes,
    estimate_memory,
)

MODES = {"none": ActivationCheckpoint(mode="none"), "op": ActivationCheckpoint(mode="selective"),
         "full": ActivationCheckpoint(mode="full")}


def build(args, ac, device: torch.device, compile: bool, float8: bool):
    """The model with AC, Float8 and compile applied in the trainer's order, and its loss function."""
    with torch.device(device):
        model = Transformer(args)
    model.init_weights(buffer_device=device)
    if float8:
        from torchtitan.components.quantization.float8 import Float8Converter
        from torchtitan.config.job_config import JobConfig
        from torchtitan.distributed.parallel_dims import ParallelDims

        job = JobConfig()
        job.float8.emulate = device.type != "cuda"  # a CPU smoke run; on the GPU the real float8 GEMMs
        Float8Converter(job, ParallelDims(1, 1, 1, 1, 1, 1), device).convert(model)
    apply_ac(model, ac, model_compiled=compile)
    loss_fn = cross_entropy_sum
    if compile:
        from torchtitan.distributed.compile import apply_compile, compile_loss

        apply_compile(model)
        loss_fn = compile_loss(cross_entropy_sum)
    return model, loss_fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="compile each block and the loss, as the trainer does")
    ap.add_argument("--float8", action="store_true", help="tensorwise Float8 linears (H100-class GPU)")
    a = ap.parse_args()
    args = dataclasses.replace(llama3_flavors["8B"], n_layers=a.layers, max_seq_len=a.seq_len)
    shape = ModelShape.from_args(args)
    dev = torch.device("cuda")
    features = "".join((", compile" if a.compile else "", ", Float8" if a.float8 else ""))
    print(f"{torch.cuda.get_device_name()}; 8B shape, {a.layers} layers, batch {a.batch} x seq {a.seq_len}, "
          f"fp32 params, bf16 autocast{features}\n")
    print("| AC | allocated GiB | estimate GiB | est/meas | reserved GiB | estimate+overhead GiB | est/meas |")
    print("|---|---|---|---|---|---|---|")
    for name, ac in MODES.items():
        torch.manual_seed(0)
        model, loss_fn = build(args, ac, dev, a.compile, a.float8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        x = torch.randint(0, args.vocab_size, (a.batch, a.seq_len), device=dev)
        for step in range(2):
            if step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                loss = loss_fn(logits, x)
            loss.backward()
            del logits, loss
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        optim = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        est = estimate_memory(shape, StateBytes(params, params, optim, buffers),
                              RankWork(tokens_per_microbatch=a.batch * a.seq_len, blocks=a.layers, ac=name,
                                       act_bytes=2, loss_compiled=a.compile))
        with_overhead = est.peak * (1 + ALLOCATOR_OVERHEAD_GPU)
        g = 2**30
        print(f"| {name} | {allocated / g:.2f} | {est.peak / g:.2f} | {est.peak / allocated:.3f} | "
              f"{reserved / g:.2f} | {with_overhead / g:.2f} | {with_overhead / reserved:.3f} |", flush=True)
        del model, opt, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
