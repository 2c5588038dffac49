"""What an evaluation of 1,000 requests costs at the debug shape, against lm-evaluation-harness on the same CPU.

    python scripts/benchmarks/eval_cost.py [--requests 1000] [--harness-batch 32] [--ranks 2] [--threads N] [--rounds 5]

The debug model (train_configs/debug_model.toml: llama3 debugmodel, seq_len 256, float32, random init) is
written as a Hugging Face folder; 1,000 multiple-choice requests (250 documents x 4 lines, the shipped task's
recipe over the training split's docstring lines) are scored
- in one process, alternating --rounds times on the same threads (every core, or --threads), both in float32:
  torchtitan's evaluator (the model loaded from the folder by offline_model.py, its forward;
  batches of eval.local_batch_size x 256 tokens) and lm_eval's HFLM.loglikelihood (dtype float32, its default
  logits cache that reads requests with one input row from one forward) on the same (context,
  continuation) pairs, batch --harness-batch; and ours again with the logits of every position (the
  trainer's forward computes them, and python -m torchtitan.eval, which now scores through the trainer's
  forward, does too; the first scorer's plain_forward_sums projects the labelled positions only);
- then by python -m torchtitan.eval under torchrun at each of --ranks processes (cores / N threads each).
Printed: the CPU (model name, native bf16 or not), wall and process-CPU seconds of scoring (model loading
excluded) per round, the minimum and median, ms per request, the ratios ours / the harness's (the minima: on a
shared machine the least disturbed round), rows the model read per request, and ranks x seconds.
"""

import argparse
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts", "data"))


def write_task(folder: str, n_docs: int) -> str:
    from build_eval_task import line_pairs

    with gzip.open(os.path.join(ROOT, "torchtitan/assets/stdlib_docs/train.jsonl.gz"), "rt") as f:
        pairs = line_pairs([json.loads(line)["text"] for line in f])
    rnd = random.Random(0)
    with open(os.path.join(folder, "cost.jsonl"), "w") as f:
        for i in rnd.sample(range(len(pairs)), n_docs):
            choices = [pairs[i][1]] + [pairs[j][1] for j in rnd.sample(range(len(pairs)), 3)]
            rnd.shuffle(choices)
            f.write(json.dumps({"line": pairs[i][0], "choices": choices, "label": choices.index(pairs[i][1])}) + "\n")
    path = os.path.join(folder, "cost.yaml")
    with open(path, "w") as f:
        f.write("task: cost\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: cost.jsonl\n"
                "output_type: multiple_choice\ntest_split: test\ndoc_to_text: \"{{line}}\\n\"\n"
                "doc_to_target: label\ndoc_to_choice: choices\ntarget_delimiter: \"\"\n")
    return path


def write_model(folder: str) -> None:
    import torch

    from torchtitan.components.checkpoint.hf_folder import save_hf_folder
    from torchtitan.components.checkpoint.offline_model import build_cpu_model
    from torchtitan.protocols.train_spec import config_manager

    cfg = config_manager().parse_args(["--job.config_file", os.path.join(ROOT, "train_configs/debug_model.toml")])
    model, spec, tok, args = build_cpu_model(cfg)
    save_hf_folder(model.state_dict(), spec.state_dict_adapter, args, folder, dtype=torch.float32, tokenizer=tok)


def ours(folder: str, task: str, ranks: int, cores: int) -> float:  # cores: threads over all ranks
    """Seconds of scoring, rank 0's (every rank waits for the final sum, so it is the slowest's)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(max(cores // ranks, 1))}
    out = os.path.join(os.path.dirname(folder), f"ours_{ranks}.json")
    cmd = [sys.executable, "-m", "torchtitan.eval", folder, "--output", out, "--training.seq_len", "256",
           "--eval.tasks", task, "--training.mixed_precision_param", "float32"]  # the harness's dtype
    if ranks > 1:  # a whole model per process (the entry point's default under torchrun is FSDP over them)
        cmd += ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree",
                str(ranks)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "-m", *cmd[2:]]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["metrics"]["eval/cost/seconds"]


def in_process(folder: str, task: str, batch: int, rounds: int) -> tuple[list, list, list, int]:
    """(our (wall, CPU) seconds, the harness's, ours with every position's logits as the trainer's forward
    computes them) per round, alternating in one process on the same threads: a shared machine's load then
    falls on all alike (the minimum is the figure to compare; the process's CPU seconds leave out the time
    other jobs held the core); and the rows we score."""
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from torchtitan.components.checkpoint.offline_model import build_cpu_model, job_config_of, load_model_weights
    from torchtitan.eval.runner import Evaluator, plain_forward_sums

    cfg = job_config_of(folder, ["--training.seq_len", "256", "--eval.tasks", task,
                                 "--model.tokenizer_path", folder])
    model, spec, tokenizer, args = build_cpu_model(cfg)
    load_model_weights(model, folder, spec.state_dict_adapter, args)
    model.eval()
    evaluator = Evaluator(cfg.eval, tokenizer, 256)
    lm = HFLM(pretrained=folder, dtype="float32", max_length=256, batch_size=batch, device="cpu")
    assert next(model.parameters()).dtype == next(lm.model.parameters()).dtype == torch.float32
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(evaluator.tasks[0].pairs)]
    forward, every_logit = plain_forward_sums(model), plain_forward_sums(model, scored_logits_only=False)
    ours_s, theirs_s, full_s = [], [], []
    with torch.no_grad():
        evaluator.run(forward)  # warm-up of both (allocator, first-call dispatch)
        lm.loglikelihood(instances[:batch], disable_tqdm=True)
        for _ in range(rounds):
            for run, out in ((lambda: evaluator.run(forward), ours_s),
                             (lambda: lm.loglikelihood(instances, disable_tqdm=True), theirs_s),
                             (lambda: evaluator.run(every_logit), full_s)):
                t0, c0 = time.perf_counter(), time.process_time()
                run()
                out.append((time.perf_counter() - t0, time.process_time() - c0))
    return ours_s, theirs_s, full_s, len(evaluator.rows[0])


def cpu_name() -> str:
    """lscpu's model name, and whether the CPU has native bf16 (avx512_bf16): what a CPU figure depends on."""
    name, flags = "unknown CPU", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown CPU":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value
    except OSError:
        pass
    return f"{name}, {'with' if 'avx512_bf16' in flags.split() else 'without'} avx512_bf16"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--harness-batch", type=int, default=32)
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="threads of the one-process runs (0: every core)")
    args = p.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cores = os.cpu_count() or 1
    threads = args.threads or cores
    import torch

    torch.set_num_threads(threads)  # the harness's process
    with tempfile.TemporaryDirectory() as tmp:
        task = write_task(tmp, args.requests // 4)
        model = os.path.join(tmp, "hf")
        write_model(model)
        n = args.requests // 4 * 4
        print(f"{n} requests, debug model (llama3 debugmodel, float32 on both sides), {cpu_name()}, {cores} cores, "
              f"one-process runs {threads} thread(s), {args.rounds} interleaved rounds")
        ours_s, theirs_s, full_s, rows = in_process(model, task, args.harness_batch, args.rounds)
        for name, rounds in (("torchtitan.eval", ours_s), (f"lm_eval hf batch {args.harness_batch}", theirs_s),
                             ("ours, every logit", full_s)):
            wall, cpu = [w for w, _ in rounds], [c for _, c in rounds]
            print(f"{name:24s} 1 process, {threads} thread(s): min {min(wall):6.2f} s ({1000 * min(wall) / n:5.2f} "
                  f"ms/request), median {statistics.median(wall):6.2f} s, CPU min {min(cpu):6.2f} s; rounds (wall/CPU) "
                  f"{', '.join(f'{w:.2f}/{c:.2f}' for w, c in rounds)}")
        for what, k in (("wall", 0), ("CPU", 1)):
            ours_k, theirs_k = [r[k] for r in ours_s], [r[k] for r in theirs_s]
            print(f"ours / the harness's, {what} seconds: {min(ours_k) / min(theirs_k):.3f} at the minimum, "
                  f"{statistics.median(ours_k) / statistics.median(theirs_k):.3f} at the median")
        print(f"ours read {rows} rows for {n} requests")
        for ranks in [r for r in args.ranks if r > 1]:
            s = ours(model, task, ranks, cores)
            print(f"torchtitan.eval {ranks} processes (torchrun, {max(cores // ranks, 1)} thread(s) each): {s:6.2f} s, "
                  f"ranks x s {ranks * s:6.2f}")


if __name__ == "__main__":
    main()
