"""The pre-flight check rejects, in one line and before any rank starts, every job that the trainer would
reject while building it; and the trainer gives the same line (both ask torchtitan.job_plan.plan_job)."""

import pytest

from torchtitan import preflight
from torchtitan.train import main as train_main

TINY = ["--model.flavor", "debugmodel_tiny4", "--training.seq_len", "32", "--training.local_batch_size", "4",
        "--training.steps", "1", "--training.mixed_precision_param", "float32"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]

# (world size, options, what the one line must say). Each was an error raised while the trainer built the
# model (parallelize, pipeline, converters) before plan_job judged it.
REJECTED = {
    "unknown compile component": (1, ["--compile.enable", "--compile.components", "model,bogus"], "--compile.components bogus unknown"),
    "memory budget without compile": (1, ["--activation_checkpoint.mode", "memory_budget"], "memory_budget is applied by the compiler"),
    "bad selective option": (1, ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"], "selective_ac_option"),
    "async TP on CPU": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel", "--compile.enable"], "enable_async_tensor_parallel cannot be used"),
    "float8 without fp8 hardware": (1, ["--model.converters", "float8"], "float8"),
    "unknown converter": (1, ["--model.converters", "bogus"], "unknown model converter 'bogus'"),
    "tp does not divide the heads": (3, ["--parallelism.tensor_parallel_degree", "3"], "tensor_parallel_degree 3 does not divide"),
    "too few microbatches": (2, PP2 + ["--parallelism.pipeline_parallel_schedule", "DualPipeV", "--parallelism.pipeline_parallel_microbatch_size", "2"], "DualPipeV needs at least"),
    "validation batch vs microbatches": (2, PP2 + ["--validation.enable", "--validation.local_batch_size", "3"], "--validation.local_batch_size 3 must be a multiple"),
    "zero bubble with reshard always": (4, PP2 + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--parallelism.fsdp_reshard_after_forward", "always"], "cannot run with --parallelism.fsdp_reshard_after_forward always"),
    # Measured: torch's split backward runs a second backward over op-selective AC regions and raises mid-step.
    "zero bubble with op-selective AC": (2, PP2 + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--activation_checkpoint.mode", "selective"], "cannot run with selective op activation checkpointing"),
    "explicit split misses a layer": (2, PP2 + ["--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0;layers.1,norm,output"], "module_fqns_per_model_part"),
    "document masking on a model without it": (1, ["--model.name", "qwen3", "--model.flavor", "debugmodel_tiny", "--training.document_masking"], "does not take that input"),
    "unknown schedule": (2, PP2 + ["--parallelism.pipeline_parallel_schedule", "OneFOneB"], "unknown pipeline schedule"),
    "Muon without Newton-Schulz steps": (1, ["--optimizer.name", "Muon", "--optimizer.muon_ns_steps", "0"], "--optimizer.muon_ns_steps must be at least 1"),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_preflight_rejects_in_one_line(case, capsys):
    world, argv, says = REJECTED[case]
    assert preflight.main(["--world-size", str(world)] + TINY + argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and says in err, err


@pytest.mark.parametrize("case", [c for c, (world, _, _) in REJECTED.items() if world == 1])
def test_trainer_gives_the_same_line(case, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    _, argv, _ = REJECTED[case]
    preflight.main(["--world-size", "1"] + TINY + argv)
    expected = capsys.readouterr().err.strip()
    assert train_main(TINY + argv + ["--job.dump_folder", str(tmp_path)]) == 1
    assert expected in capsys.readouterr().err.strip().splitlines()
