"""Training throughput with torch.compile vs eager on CPU: tokens/s, interleaved steps, medians.

    python scripts/benchmarks/bench_compile.py [--flavor debugmodel] [--dtype bfloat16] [--batch 4] [--seq-len 512]
                                    [--steps 20] [--ac none]

Two identical models (same init) train side by side, one eager, one compiled the way the trainer compiles it
(each transformer block with fullgraph=True, and the loss); their steps alternate so that load on a shared
machine hits both alike. A step is forward, loss, backward and an AdamW step, as in the trainer. Compile time
(the first step) is reported apart and excluded from the medians. The losses of the two models are compared at
the end (they train on the same batches).
"""

import argparse
import dataclasses
import statistics
import sys
import time

from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an installed copy

from torchtitan.components.loss import cross_entropy_sum
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile, compile_loss, configure_compile_cache
from torchtitan.models.llama3 import Transformer, llama3_flavors
from torchtitan.tools.precision import DTYPES



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ac", choices=["none", "full", "op"], default="none")
    a = p.parse_args()
    configure_compile_cache()
    args = dataclasses.replace(llama3_flavors[a.flavor], max_seq_len=max(a.seq_len, 2048))
    ac = ActivationCheckpoint(mode={"none": "none", "full": "full", "op": "selective"}[a.ac])

    def build(compiled: bool):
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights()
        model.to(DTYPES[a.dtype])
        apply_ac(model, ac)
        if compiled:
            apply_compile(model)
        loss_fn = compile_loss(cross_entropy_sum) if compiled else cross_entropy_sum
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        return model, loss_fn, opt

    runs = {"eager": build(False), "compiled": build(True)}
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab_size, (a.batch, a.seq_len + 1), generator=gen) for _ in range(a.steps + 1)]
    times = {name: [] for name in runs}
    losses = {name: [] for name in runs}
    for step, tokens in enumerate(batches):
        for name, (model, loss_fn, opt) in runs.items():
            start = time.perf_counter()
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            losses[name].append(loss.item())
            if step == 0:
                print(f"first step ({name}): {elapsed:.1f}s")
            else:
                times[name].append(elapsed)

    tokens_per_step = a.batch * a.seq_len
    tps = {name: tokens_per_step / statistics.median(t) for name, t in times.items()}
    gap = max(abs(x - y) / abs(y) for x, y in zip(losses["compiled"], losses["eager"]))
    print(f"\n{a.flavor} {a.dtype}, batch {a.batch} x seq {a.seq_len}, AC {a.ac}, {a.steps} timed steps, "
          f"{torch.get_num_threads()} threads")
    print("| mode | tokens/s (median) | step s (median) | vs eager |")
    print("|---|---|---|---|")
    for name in runs:
        print(f"| {name} | {tps[name]:,.0f} | {statistics.median(times[name]):.3f} | {tps[name] / tps['eager']:.2f}x |")
    print(f"max relative loss difference compiled vs eager over {len(batches)} steps: {gap:.2e}")


if __name__ == "__main__":
    main()
