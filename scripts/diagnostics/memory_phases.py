"""Where a training step's memory peaks: resident memory sampled every ~0.3 ms through the real entry point,
reported per phase (forward, backward, optimizer step) of each step, with the backward of the last step as a
40-point series (docs/memory_budget.md, "Where the peak is").

    python scripts/diagnostics/memory_phases.py [torchtitan.train arguments...]
e.g. the benchmark's full AC run:
    python scripts/diagnostics/memory_phases.py --model.flavor debugmodel --model.overrides n_layers=16 \\
        --training.seq_len 512 --training.local_batch_size 8 --training.steps 3 \\
        --training.mixed_precision_param float32 --debug.seed 7 --debug.deterministic \\
        --memory.cpu_return_freed --compile.auto false --activation_checkpoint.mode full --job.dump_folder /tmp/p

Figures are MiB above the RSS before torch was imported. Phases are marked by wrapping Tensor.backward and by
torch's global optimizer step hooks; a sampler thread reads /proc/self/statm (Linux).
"""

import os
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def main(argv: list[str]) -> int:
    base = rss()
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    phase, peaks, marks, series, step = ["setup"], {}, [], [], [0]
    stop = threading.Event()
    last_backward = [None]

    def sample():
        while not stop.is_set():
            r, k = rss(), phase[0]
            peaks[k] = max(peaks.get(k, 0), r)
            if k == last_backward[0]:
                series.append(r)
            time.sleep(0.0003)

    threading.Thread(target=sample, daemon=True).start()
    backward = torch.Tensor.backward

    def marked_backward(self, *a, **k):
        marks.append(("end of forward", step[0], rss()))
        phase[0] = last_backward[0] = f"backward {step[0]}"
        series.clear()
        out = backward(self, *a, **k)
        marks.append(("end of backward", step[0], rss()))
        phase[0] = f"after backward {step[0]}"
        return out

    def before_step(*_):
        phase[0] = f"optimizer {step[0]}"

    def after_step(*_):
        marks.append(("end of optimizer step", step[0], rss()))
        step[0] += 1
        phase[0] = f"forward {step[0]}"

    torch.Tensor.backward = marked_backward
    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)
    from torchtitan.train import main as train

    code = train(argv)
    stop.set()
    for k, v in peaks.items():
        print(f"{k:<20} peak {(v - base) / MIB:8.1f} MiB")
    for what, i, r in marks:
        print(f"{what} (step {i}): {(r - base) / MIB:.1f} MiB")
    n = len(series)
    if n:
        print(f"{last_backward[0]}, 40 points:", [round((series[i * n // 40] - base) / MIB) for i in range(40)])
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
