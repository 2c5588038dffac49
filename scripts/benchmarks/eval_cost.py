"""What an evaluation of 1,000 requests costs at the debug shape, against lm-evaluation-harness on the same CPU.

    python scripts/benchmarks/eval_cost.py [--requests 1000] [--harness-batch 32] [--ranks 2] [--threads N] [--rounds 3]

The debug model (train_configs/debug_model.toml: llama3 debugmodel, seq_len 256, float32, random init) is
written as a Hugging Face folder; 1,000 multiple-choice requests (250 documents x 4 lines, the shipped task's
recipe over the training split's docstring lines) are scored
- in one process, alternating --rounds times on the same threads (every core, or --threads): torchtitan's
  evaluator (the model loaded from the folder as python -m torchtitan.eval loads it; batches of 8 x 256 tokens)
  and lm_eval's HFLM.loglikelihood on the same (context, continuation) pairs, batch --harness-batch;
- then by python -m torchtitan.eval under torchrun at each of --ranks processes (cores / N threads each).
Printed: seconds of scoring (model loading excluded), ms per request, ranks x seconds.
"""

import argparse
import gzip
import json
import os
import random
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


def in_process(folder: str, task: str, batch: int, rounds: int) -> tuple[list[float], list[float]]:
    """(our seconds, the harness's seconds) per round, alternating in one process on the same threads: a shared
    machine's load then falls on both alike (the minimum is the figure to compare)."""
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
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(evaluator.tasks[0].pairs)]
    ours_s, theirs_s = [], []
    with torch.no_grad():
        for _ in range(rounds):
            t0 = time.perf_counter()
            evaluator.run(plain_forward_sums(model))
            ours_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            lm.loglikelihood(instances, disable_tqdm=True)
            theirs_s.append(time.perf_counter() - t0)
    return ours_s, theirs_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--harness-batch", type=int, default=32)
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--rounds", type=int, default=3)
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
        print(f"{n} requests, debug model (llama3 debugmodel, fp32), {cores} cores, one-process runs {threads} threads")
        ours_s, theirs_s = in_process(model, task, args.harness_batch, args.rounds)
        for name, times in (("torchtitan.eval", ours_s), (f"lm_eval hf batch {args.harness_batch}", theirs_s)):
            best = min(times)
            print(f"{name:24s} 1 process, {threads} thread(s): min {best:6.2f} s ({1000 * best / n:5.2f} ms/request), "
                  f"rounds {', '.join(f'{t:.2f}' for t in times)}")
        for ranks in [r for r in args.ranks if r > 1]:
            s = ours(model, task, ranks, cores)
            print(f"torchtitan.eval {ranks} processes (torchrun, {max(cores // ranks, 1)} thread(s) each): {s:6.2f} s, "
                  f"ranks x s {ranks * s:6.2f}")


if __name__ == "__main__":
    main()
