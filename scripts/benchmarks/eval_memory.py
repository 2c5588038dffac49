"""Peak host memory (RSS high-water mark) per rank of `python -m torchtitan.eval` under FSDP, on CPU with gloo.

    python scripts/benchmarks/eval_memory.py [--dim 1024 --layers 8] [--ranks 1,2,4]

A seed checkpoint of a Llama (debugmodel's vocabulary, --dim/--layers wide and deep: 113M parameters, 453 MB
in float32 by default) is written once; then, for each world size N, N fresh gloo ranks run the entry point
(torchtitan/eval/__main__.py main, with no --parallelism option: FSDP over the N ranks) on 4 documents of the
shipped task, float32. Each row gives the ranks' RSS before the entry point ("base": imports), their peak
during it (/proc VmHWM, reset by clear_refs before), the largest peak above base, and the model's share
model / N. No optimizer state is read or allocated, so the peak above base is model / N plus what does not
shrink with N: the blocks FSDP gathers at once (the running one and the prefetched next), the logits, DCP's
read buffers and the init's temporaries.
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.multiprocess import run_ranks  # noqa: E402


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _score(rank, world_size, argv):
    from torchtitan.eval.__main__ import main

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current RSS
    base = _status("VmRSS")
    assert main(argv) == 0
    return base, _status("VmHWM")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ranks", default="1,2,4")
    a = p.parse_args()
    from torchtitan.create_seed_checkpoint import main as seed_main

    overrides = f"dim={a.dim},n_layers={a.layers},n_heads={a.dim // 64},n_kv_heads={a.dim // 128}"
    with tempfile.TemporaryDirectory(prefix="eval-mem-") as work:
        ckpt = os.path.join(work, "seed")
        assert seed_main(["--model.flavor", "debugmodel", "--model.overrides", overrides, "--output", ckpt]) == 0
        model_mb = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".distcp")) / 2**20
        argv = [ckpt, "--eval.tasks", "stdlib_next_line", "--eval.limit", "4", "--eval.local_batch_size", "4",
                "--training.seq_len", "256", "--training.mixed_precision_param", "float32"]
        print(f"model {overrides}: {model_mb:.0f} MB in float32")
        print("ranks | base MB (max over ranks) | peak MB per rank | peak - base (max) | model / N")
        for n in [int(x) for x in a.ranks.split(",")]:
            rows = run_ranks(_score, n, argv)
            base = max(b for b, _ in rows)
            peaks = ", ".join(f"{pk:.0f}" for _, pk in rows)
            print(f"{n} | {base:.0f} | {peaks} | {max(pk - b for b, pk in rows):.0f} | {model_mb / n:.0f}", flush=True)


if __name__ == "__main__":
    main()
