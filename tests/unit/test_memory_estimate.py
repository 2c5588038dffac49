"""The estimator's activation formula against the saved-tensor bytes tools/activation_memory.py measures."""

import dataclasses

import pytest
import torch

from torchtitan.components.loss import cross_entropy_sum
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3 import Transformer, llama3_flavors
from torchtitan.planning.memory import ModelShape, RankWork, StateBytes, block_elems_per_token, estimate_memory
from torchtitan.tools.activation_memory import activation_bytes

TINY = llama3_flavors["debugmodel_tiny"]
SHAPES = {
    "tiny (GQA 4/2)": TINY,
    "wider FFN, no GQA": dataclasses.replace(TINY, dim=96, n_heads=6, n_kv_heads=6, multiple_of=128),
}
MODES = {"none": ActivationCheckpoint(mode="none"), "op": ActivationCheckpoint(mode="selective"),
         "full": ActivationCheckpoint(mode="full")}


@pytest.mark.parametrize("ac", MODES)
@pytest.mark.parametrize("name", SHAPES)
def test_block_formula_matches_measured_saved_bytes(name, ac):
    args = SHAPES[name]
    torch.manual_seed(0)
    model = Transformer(args)
    apply_ac(model, MODES[ac])
    batch, seq = 2, 64
    x = torch.randint(0, args.vocab_size, (batch, seq))
    measured = activation_bytes(model, lambda: cross_entropy_sum(model(x), x))["0"]
    predicted = block_elems_per_token(ModelShape.from_args(args), ac) * batch * seq * 4
    assert predicted == pytest.approx(measured, rel=0.02)


def test_components_add_up_and_gpu_overheads_are_cpu_free():
    shape = ModelShape.from_args(TINY)
    state = StateBytes(params=1000, grads=1000, optimizer=2000)
    cpu = estimate_memory(shape, state, RankWork(tokens_per_microbatch=128, blocks=2, grads_live=True))
    gpu = estimate_memory(shape, state, RankWork(tokens_per_microbatch=128, blocks=2, grads_live=True, on_gpu=True))
    assert cpu.peak == sum(cpu.components.values()) and cpu.components["gradients"] == 1000
    assert cpu.components["allocator overhead"] == 0 and gpu.components["allocator overhead"] > 0
    # AC changes the blocks' share only: by the formula's difference, per token, block and in-flight microbatch.
    full = estimate_memory(shape, state, RankWork(tokens_per_microbatch=128, blocks=2, ac="full", in_flight=3))
    none = estimate_memory(shape, state, RankWork(tokens_per_microbatch=128, blocks=2, in_flight=3))
    per_token = block_elems_per_token(shape, "none") - block_elems_per_token(shape, "full")
    assert none.components["activations"] - full.components["activations"] == pytest.approx(per_token * 4 * 128 * 2 * 3)


@pytest.mark.parametrize("m,pp,v", [(4, 2, 2), (8, 2, 2), (8, 4, 2), (16, 4, 3), (12, 4, 2), (32, 8, 4)])
def test_interleaved_warmup_formula_equals_torchs_played_order(m, pp, v):
    """Interleaved1F1B's closed form (used by the planner, fast) and the peak read off torch's own action
    order agree on every rank; LoopedBFS's order runs every forward first, as its formula says."""
    from torchtitan.planning.memory import _peak_stage_activations, in_flight_microbatches

    played = _peak_stage_activations("Interleaved1F1B", m, pp, v)
    assert [in_flight_microbatches("Interleaved1F1B", m, pp, r, v) for r in range(pp)] == [p / v for p in played]
    assert _peak_stage_activations("LoopedBFS", m, pp, v) == (v * m,) * pp


def test_split_backward_schedules_keep_activations_until_the_weight_pass():
    """Read off torch's order (pp 2, 8 microbatches): ZBV's rank 0 runs 0F0 0F1 0F2 3F0 before its first
    backward, and each input-gradient pass (I) keeps its activations until the weight pass (W): 4 stage
    activations at most. DualPipeV overlaps a forward with a backward, one more: 5."""
    from torchtitan.planning.memory import _peak_stage_activations, in_flight_microbatches

    assert _peak_stage_activations("ZBVZeroBubble", 8, 2, 2) == (4, 4)
    assert _peak_stage_activations("DualPipeV", 8, 2, 2) == (5, 5)
    assert in_flight_microbatches("ZBVZeroBubble", 8, 2, 0, 2) == 2.0


def _captured_for_weight_pass_per_token(args, tokens: int = 64) -> float:
    """Elements per token torch's `stage_backward_input` keeps for the weight pass of one llama3 block (the
    gradients its hooks capture), measured."""
    from torch.distributed.pipelining._backward import stage_backward_input

    from torchtitan.models.llama3.model import TransformerBlock, precompute_rope_cache

    torch.manual_seed(0)
    block = TransformerBlock(0, args)
    rope = precompute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
    x = torch.randn(1, tokens, args.dim, requires_grad=True)
    y = block(x, rope, None)
    _, groups = stage_backward_input([y], [torch.randn_like(y)], [x], block.parameters())
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for g in groups for grads in g["grads"] for t in (grads if isinstance(grads, tuple) else (grads,))
            if isinstance(t, torch.Tensor)}
    return sum(kept.values()) / 4 / tokens


def test_a_stage_waiting_for_its_weight_pass_holds_its_output_gradients_too():
    """InterleavedZeroBubble's rank 1 runs 1F0 1F1 3F0 3I0 3F1 3I1: 4 stage activations alive, 2 of them
    past their input pass and holding, for the weight pass, the gradients torch's input pass captured (measured
    on a block: its linears' and norms' outputs)."""
    from torchtitan.planning.memory import _peak_stage_activations, split_backward_pending_weight

    assert _peak_stage_activations("InterleavedZeroBubble", 8, 2, 2, 0.5)[1] == 4 + 2 * 0.5
    s = ModelShape.from_args(llama3_flavors["debugmodel"])
    grads = _captured_for_weight_pass_per_token(llama3_flavors["debugmodel"])
    assert split_backward_pending_weight(s, "none") == pytest.approx(grads / block_elems_per_token(s, "none"))
    # under full AC the input pass also recomputes the block's activations, which then wait as well
    full = block_elems_per_token(s, "full")
    assert split_backward_pending_weight(s, "full") == pytest.approx(
        (block_elems_per_token(s, "none") - full + grads) / full)


QWEN3_5 = ("debugmodel_tiny", "debugmodel_tiny_moe")  # block 0 Gated DeltaNet, block 1 gated attention


@pytest.mark.parametrize("ac", MODES)
@pytest.mark.parametrize("flavor", QWEN3_5)
def test_qwen3_5_block_formulas_match_measured_saved_bytes(flavor, ac):
    """Gated DeltaNet and gated-attention blocks, dense and MoE: each kind's formula against what its block
    keeps (seq 64 = 4 chunks of 16; the conv's 3-token halo, 0.2%, is what the formula leaves out), and the
    model's per-block figure is their average."""
    from torchtitan.models.qwen3_5 import Qwen3_5, qwen3_5_flavors

    args = qwen3_5_flavors[flavor]
    torch.manual_seed(0)
    model = Qwen3_5(args)
    model.init_weights()
    apply_ac(model, MODES[ac])
    batch, seq = 2, 64
    x = torch.randint(0, args.vocab_size, (batch, seq))
    measured = activation_bytes(model, lambda: cross_entropy_sum(model(x).logits if args.moe else model(x), x))
    shape = ModelShape.from_args(args)
    per_kind = {k: block_elems_per_token(shape, ac, kind=k) * batch * seq * 4 for k in shape.kinds}
    assert per_kind["linear_attention"] == pytest.approx(measured["0"], rel=0.01)
    assert per_kind["full_attention"] == pytest.approx(measured["1"], rel=0.01)
    assert block_elems_per_token(shape, ac) * batch * seq * 4 == pytest.approx(sum(per_kind.values()) / 2)


def test_dry_run_prints_qwen3_5_block_kinds_and_estimates_its_peak():
    """The dry run of a Qwen3.5 MoE debug model (one rank, fp32, AC op): a memory estimate, and one line with
    each block kind's activations per microbatch from the formula (2 x 64 tokens x 4 bytes)."""
    from torchtitan.models.qwen3_5 import qwen3_5_flavors
    from torchtitan.planning.dry_run import dry_run, format_report
    from torchtitan.protocols.train_spec import config_manager

    cfg = config_manager().parse_args([
        "--model.name", "qwen3_5", "--model.flavor", "debugmodel_tiny_moe", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode",
        "selective"])
    report = dry_run(cfg, world_size=1)
    assert not report.errors and report.ranks[0].memory.components["activations"] > 0
    shape = ModelShape.from_args(qwen3_5_flavors["debugmodel_tiny_moe"])
    mib = {k: block_elems_per_token(shape, "op", kind=k) * 128 * 4 / 2**20 for k in shape.kinds}
    assert report.block_kinds == (f"activations kept per block and microbatch (AC op): full_attention x1 "
                                  f"{mib['full_attention']:,.1f} MiB, linear_attention x1 "
                                  f"{mib['linear_attention']:,.1f} MiB")
    assert report.block_kinds in format_report(report)


@pytest.mark.parametrize("ac", MODES)
def test_document_masking_keeps_what_the_formula_counts(ac):
    """Packed documents on CPU in eager mode (the flash blocks: 2 query blocks of 256, documents of ~50 tokens)
    keep what the estimator predicts for them: the formula, less k and v repeated to the query width without AC
    (the flash blocks read the kv heads in place: RankWork.kv_heads_in_place). The per-block SDPA path they
    replaced kept each block's output and mask besides: 9-24% over the formula without AC (seq 64-600)."""
    torch.manual_seed(0)
    model = Transformer(TINY)
    apply_ac(model, MODES[ac])
    batch, seq = 2, 300
    x = torch.randint(0, TINY.vocab_size, (batch, seq))
    ids = torch.cumsum(torch.rand(batch, seq, generator=torch.Generator().manual_seed(0)) < 0.02, dim=1)
    measured = activation_bytes(model, lambda: cross_entropy_sum(model(x, document_ids=ids), x))["0"]
    shape, state = ModelShape.from_args(TINY), StateBytes(params=0, grads=0, optimizer=0)

    def activations(in_place: bool) -> int:
        work = RankWork(tokens_per_microbatch=batch * seq, blocks=1, ac=ac, kv_heads_in_place=in_place)
        return estimate_memory(shape, state, work).components["activations"]

    predicted = block_elems_per_token(shape, ac) * batch * seq * 4 + activations(True) - activations(False)
    assert predicted == pytest.approx(measured, rel=0.01)
