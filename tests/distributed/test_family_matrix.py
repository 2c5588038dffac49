"""Every registered family x every feature, 2 steps of its debug flavor at the default precision (`auto`).

Generated from the registry: a family joins by being registered with a `debugmodel_tiny` flavor (the shipped
families have one; test-registered toys have none and stay out). Each combination either trains, or is refused
by `plan_job` before any rank starts with one line (a USER_ERROR) that the table below expects.

One process (in-process trainers, one after another): each AC mode, Float8 (emulated on CPU), document masking,
Muon, and LoRA composed with Float8 and full AC. Two ranks, in ONE spawned group that builds one trainer per combination: FSDP 2, TP 2, PP 2, CP 2
and, for the MoE families, EP 2 (TP 2 alone is expert tensor parallel for them).

Compile and AC under every layout (issue 31: the matrix tried compile only alone, and MoE compiled under EP died):
every two-rank run is checkpointed (full / op-level AC rotated, compiled runs included: Qwen3 compiled with full AC
under TP 2) and one in four is compiled (aot_eager, rotated so every family and every layout gets one); Llama 3
under CP 2 is compiled by inductor against the same layout eager (COMPILED_RTOL); test_compiled_under_ep_tp trains
MoE compiled under EP 2 x TP 2 on 4 ranks (the experts FSDP-sharded apart from their block). docs/compile.md says
what composes.

What is checked: the run ends with 2 finite losses; features that do not change the forward (AC, Muon) and the
layouts log the same first-step loss as the family's plain one-process run (before any update: same init,
same data) within 2e-2 relative (bf16 matmuls and reductions in another order), Float8 within 5e-2.
"""

import json
import math
import os

import pytest

from tests.multiprocess import free_port, run_ranks
from torchtitan.errors import USER_ERRORS
from torchtitan.job_plan import plan_job
from torchtitan.protocols.train_spec import _registered, config_manager

pytestmark = pytest.mark.distributed

FAMILIES = sorted(name for name, spec in _registered().items() if "debugmodel_tiny" in spec.flavors)
MOE = {"qwen3_moe", "deepseek_v3", "gpt_oss"}

BASE = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.steps", "2",
        "--training.global_batch_size", "4", "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--debug.seed", "3",
        "--lr_scheduler.warmup_steps", "1"]

ONE_PROCESS = {
    "plain": [],
    "ac_full": ["--activation_checkpoint.mode", "full"],
    "ac_selective_op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "ac_selective_2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
    "float8": ["--model.converters", "float8", "--float8.emulate"],
    "document_masking": ["--training.document_masking"],
    "muon": ["--optimizer.name", "Muon"],
    # LoRA on the attention projections, composed with emulated Float8 and full AC (B starts at zero: the first
    # step computes the Float8 base model).
    "lora_float8_ac": ["--model.converters", "float8,lora", "--float8.emulate", "--activation_checkpoint.mode", "full"],
}
SAME_FIRST_LOSS = {"ac_full": 2e-2, "ac_selective_op": 2e-2, "ac_selective_2": 2e-2, "muon": 2e-2, "float8": 5e-2,
                   "lora_float8_ac": 5e-2}

TWO_RANKS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "GPipe"],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
    "ep2": ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"],
    # TP for an MoE model on 2 ranks with EP (TP alone is expert tensor parallel, "tp2" above): ep spans the tp
    # ranks and no FSDP, so the parameters TP leaves replicated stay plain tensors beside DTensors (DeepSeek-V3's
    # MLA down-projections): one optimizer group mixing both stopped in foreach/fused AdamW before the groups were
    # split by kind.
    "ep2_tp2": ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
}

# (family, feature) -> a phrase of the one-line refusal. Anything else must train.
REFUSED = {
    ("llama3", "ep2"): "needs a model with routed experts",
    ("qwen3", "ep2"): "needs a model with routed experts",
    ("qwen3", "pp2"): "tie",  # the tied debug flavor cannot be cut into stages
    ("llama3", "memory_budget"): "memory_budget is applied by the compiler",
    **{(f, "document_masking"): "does not take that input" for f in ("qwen3", "qwen3_moe", "deepseek_v3")},
}
ONE_PROCESS_REFUSALS = {"memory_budget": ["--activation_checkpoint.mode", "memory_budget"]}


def _argv(family, extra, dump):
    return ["--model.name", family, *BASE, *extra, "--job.dump_folder", str(dump)]


def _losses(dump) -> list[float]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if "loss" in json.loads(line)]


def _refusal(family, extra, world) -> str | None:
    try:
        plan_job(config_manager().parse_args(_argv(family, extra, "/unused")), world)
    except USER_ERRORS as e:
        return str(e)
    return None


def _check(family, feature, losses, plain):
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (family, feature, losses)
    rtol = SAME_FIRST_LOSS.get(feature, 2e-2 if feature in TWO_RANKS else None)
    if rtol is not None:
        assert losses[0] == pytest.approx(plain[0], rel=rtol), (family, feature, losses, plain)


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory):
    from torchtitan.train import main

    out = {}
    for family in FAMILIES:
        dump = tmp_path_factory.mktemp(f"{family}_plain")
        assert main(_argv(family, [], dump)) == 0
        out[family] = _losses(dump)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_features(family, plain_losses, tmp_path, monkeypatch):
    from torchtitan.train import main

    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    for feature, extra in {**ONE_PROCESS, **ONE_PROCESS_REFUSALS}.items():
        if feature == "plain":
            continue
        refusal = _refusal(family, extra, 1)
        expected = REFUSED.get((family, feature), REFUSED.get(("llama3", feature)) if feature == "memory_budget" else None)
        if expected is not None:
            assert refusal is not None and expected in refusal and "\n" not in refusal, (family, feature, refusal)
            continue
        assert refusal is None, (family, feature, refusal)
        dump = tmp_path / feature
        assert main(_argv(family, extra, dump)) == 0, (family, feature)
        _check(family, feature, _losses(dump), plain_losses[family])


# Every layout run is checkpointed, by an AC mode rotated over the layouts, and one run in four (rotated so that
# every layout and every family gets one) is compiled with aot_eager: dynamo and AOTAutograd trace forward and
# backward exactly as for inductor, without inductor's code generation. Compiling every run cost 60-280 s a run on
# the loaded 2-core machine, over the suite's budget. Inductor itself is checked compiled == eager under CP 2
# (below) and EP 2 x TP 2 (test_compiled_under_ep_tp), and dense under FSDP/TP in tests/distributed/test_compile.py.
AOT = ["--compile.enable", "--compile.backend", "aot_eager"]
AC_ROTATION = [["--activation_checkpoint.mode", "full"],
               ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]]
COMPILE_EVERY = 4


def _combos():
    runs, refusals = [], []
    for i, family in enumerate(FAMILIES):
        for j, (feature, extra) in enumerate(TWO_RANKS.items()):
            if feature.startswith("ep2") and family not in MOE and (family, feature) not in REFUSED:
                continue
            if (family, feature) in REFUSED:
                refusals.append((family, feature, extra))
            else:
                # The AC rotation covers the compiled runs too: qwen3 under TP 2, deepseek_v3 under FSDP 2 and
                # EP 2 and qwen3_5 under FSDP 2 are compiled with full AC (traced with the block, or, under TP,
                # eager around it: distributed/compile.py), the others with op-level AC.
                compiled = (i + j) % COMPILE_EVERY == 0
                ac = AC_ROTATION[(i // 2 + j) % len(AC_ROTATION)]
                runs.append((family, feature, extra + (AOT if compiled else []) + ac))
    return runs, refusals


# Inductor under CP 2 (ring attention stays eager, the rest of each block compiled around it) against the same
# layout eager: same seed, data and layout, so only inductor's reordered fp32 sums differ (measured 2.3e-7).
# Negative control (scripts/diagnostics/compile_cp_negative_control.py, run once): the compiled blocks' kernel made local attention (each rank attending
# within its own slice) moved the losses by 3.1e-5 and 7.9e-5, which COMPILED_RTOL catches and 1e-4 would not: at
# this size the first losses barely depend on attention.
CP_PARITY = [("llama3", "cp2_inductor", TWO_RANKS["cp2"] + ["--compile.enable", "--training.mixed_precision_param", "float32"]),
             ("llama3", "cp2_eager", TWO_RANKS["cp2"] + ["--training.mixed_precision_param", "float32"])]
COMPILED_RTOL = 2e-6


def _train_all(rank, world_size, runs, ports, folder):
    import torch.distributed as dist

    from torchtitan.trainer import Trainer

    dist.destroy_process_group()  # each trainer sets up (and closes) its own group, on its own port
    for (family, feature, extra), port in zip(runs, ports):
        os.environ["MASTER_PORT"] = str(port)
        trainer = Trainer(config_manager().parse_args(_argv(family, extra, os.path.join(folder, f"{family}_{feature}"))))
        try:
            trainer.train()
        finally:
            trainer.close()
    return rank


def test_two_rank_layouts(plain_losses, tmp_path, monkeypatch):
    runs, refusals = _combos()
    for family, feature, extra in refusals:
        refusal = _refusal(family, extra, 2)
        assert refusal is not None and REFUSED[family, feature] in refusal and "\n" not in refusal, (family, feature)
    for family, feature, extra in runs:
        assert _refusal(family, extra, 2) is None, (family, feature)
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))  # cold, like CI; the ranks share it
    everything = runs + CP_PARITY
    run_ranks(_train_all, 2, everything, [free_port() for _ in everything], str(tmp_path), timeout=1500)
    for family, feature, _ in runs:
        _check(family, feature, _losses(tmp_path / f"{family}_{feature}"), plain_losses[family])
    compiled, eager = (_losses(tmp_path / f"llama3_{feature}") for _, feature, _ in CP_PARITY)
    assert len(compiled) == 2 and compiled == pytest.approx(eager, rel=COMPILED_RTOL), (compiled, eager)


EP_TP = ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
         "--training.local_batch_size", "2"]


def test_compiled_under_ep_tp(plain_losses, tmp_path, monkeypatch):
    """Every MoE family trains compiled with AC under EP 2 x TP 2 on 4 ranks, where FSDP shards the experts
    apart from their block over dp_shard_mod_ep 2 (issue 31: refused before; the block is compiled around the
    experts). qwen3_moe with inductor equals the same layout eager within COMPILED_RTOL (fp32; measured 1.2e-7);
    deepseek_v3 (MLA) compiles with aot_eager (the trace inductor would get) and starts from the plain loss.
    gpt_oss was run so by hand (inductor, losses 8.27, 8.11), left out for the suite's time."""
    ac = AC_ROTATION[1]
    runs = [("qwen3_moe", "eptp_inductor", EP_TP + ac + ["--compile.enable", "--training.mixed_precision_param", "float32"]),
            ("qwen3_moe", "eptp_eager", EP_TP + ac + ["--training.mixed_precision_param", "float32"])]
    runs += [("deepseek_v3", "eptp_compiled", EP_TP + AOT + ac)]
    for family, _, extra in runs:
        assert _refusal(family, extra, 4) is None, family
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    run_ranks(_train_all, 4, runs, [free_port() for _ in runs], str(tmp_path), timeout=1500)
    for family, feature, _ in runs[2:]:
        _check(family, feature, _losses(tmp_path / f"{family}_{feature}"), plain_losses[family])
    compiled, eager = _losses(tmp_path / "qwen3_moe_eptp_inductor"), _losses(tmp_path / "qwen3_moe_eptp_eager")
    assert len(compiled) == 2 and compiled == pytest.approx(eager, rel=COMPILED_RTOL), (compiled, eager)
