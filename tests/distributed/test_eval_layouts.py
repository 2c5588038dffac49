"""Evaluation in the loop scores the same under FSDP 2, TP 2, PP 2 and CP 2 as in one process.

One training step at learning rate 0 (the weights stay the seed's, the same in every layout), then the [eval]
pass at the last step: the shipped multiple-choice task (8 documents, 32 requests), a rolling perplexity task
whose documents span several 64-token windows, packed 4 rows to a batch, and an ARC-style task whose choices
are single letters (4 documents, 16 requests read from 4 rows: positions with 4 label slots through the
pipeline's targets, the context-parallel shards and loss parallel). Every request's log-likelihood (read
from rank 0's evaluator) and every logged metric must equal the one-process run's within 1e-5 relative: the
layouts change only the order of float32 sums (FSDP and PP none, TP the row-parallel matmuls' partial sums, CP
the ring's log-sum-exp merges and the sum of the two shards' per-request sums), ~1e-7 relative per window.

Negative control: under FSDP 2, rank 1 scores its share of the batches twice (rank 0 runs as many empty
batches, so the gathers still pair up): the check fails.
"""

import gzip
import json
import math

import pytest

from tests.distributed.trainer_runs import read_metrics, train
from torchtitan.eval.tasks import SHIPPED_DIR

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
}
REL = 1e-5


def _rolling_task(folder) -> str:
    with gzip.open(SHIPPED_DIR.parent / "stdlib_docs" / "validation.jsonl.gz", "rt") as f:
        texts = [json.loads(line)["text"][:500] for line in f][:3]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    path = folder / "rolling.yaml"
    path.write_text("task: rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: docs.jsonl\n"
                    "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_target: text\n")
    return str(path)


def _letters_task(folder) -> str:
    docs = [{"q": f"Question {i}: which letter follows {'ABCD'[i]}?\nAnswer:", "choices": list("ABCD"), "label": 0}
            for i in range(4)]
    (folder / "letters.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    path = folder / "letters.yaml"
    path.write_text("task: letters\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: letters.jsonl\n"
                    "output_type: multiple_choice\ntest_split: test\ndoc_to_text: q\ndoc_to_target: label\n"
                    "doc_to_choice: choices\n")
    return str(path)


def _args(task_file: str) -> list[str]:
    return ["--model.flavor", "debugmodel_tiny4", "--training.steps", "1", "--optimizer.lr", "0",
            "--training.local_batch_size", "4",
            "--eval.enable", "--eval.local_batch_size", "4", "--eval.limit", "8",
            "--eval.tasks", f"stdlib_next_line,{task_file}"]


def _probe(trainer):
    return trainer.evaluator.last_loglikelihoods


def _double_rank1_shard(rank, world_size):
    from torchtitan.eval import scoring

    real = scoring.shard

    def shard(batches, dp_rank, degree):
        mine = real(batches, dp_rank, degree)
        return mine + mine if rank == 1 else mine + [[]] * len(mine)

    scoring.shard = shard


def _run(world, argv, folder, setup=None):
    _, extras = train(world, argv, str(folder), probe=_probe, setup=setup)
    metrics = {k: v for m in read_metrics(str(folder)) for k, v in m.items() if k.startswith("eval/")
               and not k.endswith("/seconds")}
    return metrics, extras[0]


def _differences(ref, got) -> list[str]:
    (ref_m, ref_ll), (got_m, got_ll) = ref, got
    bad = [k for k in ref_m if not math.isclose(ref_m[k], got_m.get(k, math.nan), rel_tol=REL, abs_tol=1e-12)]
    for task, lls in ref_ll.items():
        bad += [f"{task} request {i}" for i, (a, b) in enumerate(zip(lls, got_ll[task]))
                if not math.isclose(a, b, rel_tol=REL)]
    return bad


def test_eval_scores_equal_single_process_under_every_layout(tmp_path):
    task = f"{_rolling_task(tmp_path)},{_letters_task(tmp_path)}"
    reference = _run(1, _args(task), tmp_path / "single")
    assert reference[0]["eval/stdlib_next_line/requests"] == 32 and reference[0]["eval/rolling/requests"] == 3
    assert reference[0]["eval/letters/requests"] == 16 and reference[0]["eval/letters/rows"] == 4
    failures = {}
    for name, layout in LAYOUTS.items():
        bad = _differences(reference, _run(2, _args(task) + layout, tmp_path / name))
        if bad:
            failures[name] = bad[:5]
    assert not failures, f"evaluation differs from the single process: {failures}"
    # Negative control: a rank scoring its shard twice is caught.
    doubled = _run(2, _args(task) + LAYOUTS["fsdp2"], tmp_path / "doubled", setup=_double_rank1_shard)
    assert _differences(reference, doubled), "a rank scoring its shard twice went unnoticed"
