"""Activation memory per transformer block, and step time, under each activation-checkpointing mode.

    python scripts/benchmarks/bench_activation_memory.py [--flavor debugmodel] [--seq-len 2048] [--batch 1] [--reps 3]

Memory: bytes a forward leaves alive for backward, per block (torchtitan/tools/activation_memory.py), fp32,
eager. Time: forward + backward of the whole model, median of --reps after one warm-up, modes interleaved.
Prints a Markdown table.
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
from torchtitan.models.llama3 import Transformer, llama3_flavors
from torchtitan.tools.activation_memory import OUTSIDE_BLOCKS, activation_bytes

MODES = {
    "none": ActivationCheckpoint(mode="none"),
    "selective 2 (every 2nd block)": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
    "selective op": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
    "full": ActivationCheckpoint(mode="full"),
}
_MIB = 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    args = dataclasses.replace(llama3_flavors[a.flavor], max_seq_len=max(a.seq_len, 2048))
    tokens = torch.randint(0, args.vocab_size, (a.batch, a.seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    models, memory = {}, {}
    for name, ac in MODES.items():
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights()
        apply_ac(model, ac)
        models[name] = model
        memory[name] = activation_bytes(model, lambda: cross_entropy_sum(model(inputs), labels))

    times = {name: [] for name in MODES}
    for rep in range(a.reps + 1):  # rep 0 warms up
        for name, model in models.items():
            start = time.perf_counter()
            cross_entropy_sum(model(inputs), labels).backward()
            if rep:
                times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)

    n = args.n_layers
    none_blocks = sum(memory["none"][k] for k in models["none"].layers.keys()) / n
    none_time = statistics.median(times["none"])
    print(f"{a.flavor}, batch {a.batch} x seq {a.seq_len}, fp32 eager, {torch.get_num_threads()} threads\n")
    print("| mode | activation MiB per block (mean) | vs none | blocks total MiB | outside blocks MiB | "
          "fwd+bwd s (median) | vs none |")
    print("|---|---|---|---|---|---|---|")
    for name, model in models.items():
        block = [memory[name][k] for k in model.layers.keys()]
        mean = sum(block) / n
        t = statistics.median(times[name])
        print(f"| {name} | {mean / _MIB:.2f} | {mean / none_blocks:.2f}x | {sum(block) / _MIB:.1f} | "
              f"{memory[name][OUTSIDE_BLOCKS] / _MIB:.1f} | {t:.3f} | {t / none_time:.2f}x |")


if __name__ == "__main__":
    main()
