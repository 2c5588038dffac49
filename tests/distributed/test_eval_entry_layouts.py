"""`python -m torchtitan.eval` scores a checkpoint in the trainer's layouts as one process does.

Two checkpoints: a DCP seed checkpoint of debugmodel_tiny4 (random init) and a Hugging Face folder (a random
LlamaForCausalLM saved with save_pretrained, weights drawn wide enough that requests differ, and the project's
tokenizer). Each is scored by the entry point (`main`, in forked gloo ranks as torchrun would start it) in one
process, then on 2 ranks with no --parallelism option (the trainer's default: FSDP over both ranks), under
TP 2, under PP 2 and as 2 whole-model replicas; every request's log-likelihood must equal the one-process value within `_tolerances`.
Negative control: under FSDP 2, rank 1's shards are drawn afresh after the load: the check fails.
A layout that does not fit the world is one line and exit 1, before any process group (no ranks needed).

Tolerance (tests/tolerances.py): the layouts reorder float32 sums only (TP: the row-parallel matmuls' partial
sums and loss parallel's log-sum-exp over vocabulary shards; PP: packed rows with block-causal attention
against one process's padded rows; FSDP and replicas: none). A target token's log-probability is its logit minus the
log-sum-exp of the logits: two values at the logits' scale, each through the model's chain of contractions
(logits_tol of its depth and widest contraction, at the largest |logit| the model gives), plus the
log-sum-exp's own reordered sum over the vocabulary (reordered_sum_rtol(vocab), relative to the sum, absolute
after the log). A request sums its target tokens' log-probabilities: the bound times its token count.
"""

import json

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.tolerances import logits_tol, reordered_sum_rtol

pytestmark = pytest.mark.distributed

WINDOW = 64
COMMON = ["--training.seq_len", str(WINDOW), "--training.mixed_precision_param", "float32",
          "--training.local_batch_size", "4", "--eval.local_batch_size", "4", "--eval.limit", "6",
          "--eval.tasks", "stdlib_next_line"]
LAYOUTS = {
    "default (fsdp 2)": [],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2"],
    "replicate 2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree",
                    "2"],
}


def _seed_checkpoint(path) -> None:
    from torchtitan.create_seed_checkpoint import main

    assert main(["--model.flavor", "debugmodel_tiny4", "--output", str(path)]) == 0


def _hf_folder(path):
    pytest.importorskip("transformers")
    from tests.unit.test_eval_harness_parity import _hf_folder as random_llama_folder  # same model, same window

    return random_llama_folder(path)


def _score(rank, world_size, argv, out, redraw_on):
    from torch.distributed.tensor import DTensor

    from torchtitan.components.checkpoint import manager
    from torchtitan.eval.__main__ import main

    if rank in redraw_on:  # the negative control: this rank's shards are not the checkpoint's
        real_load = manager.CheckpointManager.load

        def load(self):
            loaded = real_load(self)  # a collective: every rank loads
            with torch.no_grad():
                for m in self.model_parts:
                    for p in m.parameters():
                        (p.to_local() if isinstance(p, DTensor) else p).normal_(0, 0.02)
            return loaded

        manager.CheckpointManager.load = load
    rc = main(argv + ["--output", out])
    return rc, json.load(open(out)) if rank == 0 and rc == 0 else None


def _run(world, checkpoint, layout, out, redraw_on=()) -> list[float]:
    results = run_ranks(_score, world, [str(checkpoint)] + COMMON + layout, str(out), redraw_on, timeout=300)
    assert [rc for rc, _ in results] == [0] * world
    return results[0][1]["loglikelihoods"]["stdlib_next_line"]


def _targets_per_request() -> list[int]:
    from types import SimpleNamespace

    from torchtitan.components.tokenizer.backends import build_tokenizer
    from torchtitan.eval.runner import build_task_requests

    cfg = SimpleNamespace(tasks=["stdlib_next_line"], limit=6, num_fewshot=-1, fewshot_seed=1234)
    (reqs,) = build_task_requests(cfg, build_tokenizer(None), WINDOW)
    n = [0] * len(reqs.pairs)
    for w in reqs.windows:
        n[w.request] += len(w.targets)
    return n


def _tolerances(logits: torch.Tensor, n_layers: int, width: int) -> list[float]:
    chain = logits_tol(logits, n_layers, width)
    per_token = 2 * chain["atol"] + reordered_sum_rtol(logits.shape[-1])
    return [n * per_token for n in _targets_per_request()]


def _differences(ref, got, tols) -> list[str]:
    assert len(ref) == len(got) == len(tols) == 24
    return [f"request {i}: {a} vs {b} (tolerance {t:.2g})" for i, (a, b, t) in enumerate(zip(ref, got, tols))
            if abs(a - b) > t]


def test_entry_point_scores_every_layout_as_one_process(tmp_path):
    from torchtitan.components.checkpoint.offline_model import build_cpu_model, job_config_of, load_model_weights
    from tests.tolerances import contraction_width
    from torchtitan.protocols.model import as_model_output

    tokens = torch.randint(0, 2000, (2, WINDOW), generator=torch.Generator().manual_seed(0))
    seed, hf = tmp_path / "seed", tmp_path / "hf"
    _seed_checkpoint(seed)
    hf_model = _hf_folder(hf)
    with torch.no_grad():
        hf_tols = _tolerances(hf_model(tokens).logits, 2, contraction_width(hf_model, WINDOW))
        model, _, _, args = build_cpu_model(job_config_of(str(seed), []))
        load_model_weights(model, str(seed))
        seed_tols = _tolerances(as_model_output(model(tokens)).logits, args.n_layers, contraction_width(model, WINDOW))

    failures = {}
    for name, checkpoint, tols in (("dcp seed", seed, seed_tols), ("hf folder", hf, hf_tols)):
        reference = _run(1, checkpoint, [], tmp_path / f"{name}-1.json")
        assert len(set(round(x, 2) for x in reference)) > 12, "the model must tell requests apart"
        for layout, options in LAYOUTS.items():
            got = _run(2, checkpoint, options, tmp_path / f"{name}-{layout}.json")
            print(f"{name}, {layout}: largest difference / tolerance "
                  f"{max(abs(a - b) / t for a, b, t in zip(reference, got, tols)):.3g}")
            bad = _differences(reference, got, tols)
            if bad:
                failures[f"{name}, {layout}"] = bad[:3]
        if name == "dcp seed":  # negative control: a rank that did not load its shards is caught
            broken = _run(2, checkpoint, [], tmp_path / "broken.json", redraw_on=(1,))
            print(f"negative control: largest difference / tolerance "
                  f"{max(abs(a - b) / t for a, b, t in zip(reference, broken, tols)):.3g}")
            assert _differences(reference, broken, tols), "a rank scoring with other weights went unnoticed"
    assert not failures, f"the entry point's scores differ from one process: {failures}"


def test_a_layout_that_does_not_fit_is_one_line_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    from torchtitan.eval.__main__ import main

    _seed_checkpoint(tmp_path / "seed")
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    rc = main([str(tmp_path / "seed"), "--parallelism.tensor_parallel_degree", "3"] + COMMON)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and not dist.is_initialized()
    assert len(err.splitlines()) == 1 and err.startswith("error: world size 2 is not divisible"), err
    assert main([str(tmp_path / "missing")] + COMMON) == 1
    assert capsys.readouterr().err.strip() == f"error: checkpoint {tmp_path / 'missing'}: no such folder"
