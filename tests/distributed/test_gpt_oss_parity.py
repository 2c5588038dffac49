"""GPT-OSS layouts change memory and speed, never the numbers.

The debug flavor `debugmodel_tiny` (2 layers: a sliding window of 8, then full attention; sinks; biased router
and experts; YaRN) trains 4 steps of the parity recipe (tests/distributed/trainer_runs.py: fp32, same seed and
global batches of 8 x 64 tokens) under each layout and must log the same per-step loss (rtol 1e-5) and grad
norm (rtol 5e-5) as one process: FSDP 2; TP 2 x EP 2 (the sinks sharded with their heads, the experts' weights
and biases with their experts), on 2 ranks and on 4 (FSDP 2 over the experts apart); EP 2; PP 2; CP 2 with
document masking, where the window (8) is shorter than a cp chunk (64 / 4 = 16), so ring attention must skip and
cut key blocks by the window; and expert tensor parallel (TP 2 with EP 1: every expert's fused gate/up columns
and its gate_up_bias split over tp by whole (gate, up) pairs, `down` by its input rows, down_bias replicated and
added by tp rank 0 alone), alone and under FSDP 2 (4 ranks).

Negative controls: ring attention told to ignore the window still trains, but the CP parity check must fail; so
must expert tensor parallel with down_bias added on every tp rank (the bias starts at zero, so step 1 agrees and
the later steps must not). (Dropping the sinks in ring attention is caught at the kernel level, tests/distributed/
test_context_parallel_attention_kinds.py.)
"""

import pytest

from tests.distributed.test_qwen3_parity import assert_parity
from tests.distributed.trainer_runs import DOCUMENT_MASKING, curves, train

pytestmark = pytest.mark.distributed

STEPS = 4
GPT_OSS = ["--model.name", "gpt_oss", "--training.steps", str(STEPS)]
CP2 = ["--parallelism.context_parallel_degree", "2", *DOCUMENT_MASKING]
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
    "tp2_ep2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                "--training.local_batch_size", "4"],
    "ep2": ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"],
    "cp2_documents": [*CP2, "--training.local_batch_size", "4"],
    "tp2_ep2_fsdp2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
    "tp2_fsdp2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                  "--training.local_batch_size", "4"],
}
WORLD = {"tp2_ep2_fsdp2": 4, "tp2_fsdp2": 4}  # the others run on 2 ranks


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process, 2 microbatches of 4; with and without document masking."""
    refs = {}
    for name, extra in (("plain", []), ("documents", DOCUMENT_MASKING)):
        steps, _ = train(1, GPT_OSS + extra + ["--training.local_batch_size", "4"], str(tmp_path_factory.mktemp(name)))
        assert len(steps) == STEPS
        refs[name] = curves(steps)
    return refs


def _reference(layout, references):
    return references["documents" if "documents" in layout else "plain"]


def _local_shapes(trainer) -> dict:
    """This rank's shard shapes of the sinks and of the experts' biases (its first block)."""
    from torch.distributed.tensor import DTensor

    block = next(iter(trainer.model_parts[0].layers.values()))
    tensors = {"sinks": block.attention.sinks.weight, "gate_up_bias": block.moe.experts.gate_up_bias,
               "down_bias": block.moe.experts.down_bias}
    return {k: tuple((t.to_local() if isinstance(t, DTensor) else t).shape) for k, t in tensors.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, references, tmp_path):
    steps, shapes = train(WORLD.get(layout, 2), GPT_OSS + LAYOUTS[layout], str(tmp_path), probe=_local_shapes)
    assert_parity(curves(steps), _reference(layout, references))
    if layout == "tp2_ep2":
        # 4 heads, 8 experts of hidden 32, dim 64: each rank holds 2 heads' sinks and 4 experts' biases.
        assert shapes == [{"sinks": (2,), "gate_up_bias": (4, 64), "down_bias": (4, 64)}] * 2
    if layout == "tp2":
        # Expert TP: every expert, half of its 2 x 32 gate/up columns; the whole down_bias (added by rank 0).
        assert shapes == [{"sinks": (2,), "gate_up_bias": (8, 32), "down_bias": (8, 64)}] * 2


def _ring_ignores_the_window(rank, world_size):
    import torchtitan.distributed.context_parallel as cp

    real = cp.ring_attention

    def windowless(q, k, v, cp_group=None, rotate_method="alltoall", document_ids=None, window=None, sinks=None):
        return real(q, k, v, cp_group, rotate_method, document_ids, None, sinks)

    cp.ring_attention = windowless


def _down_bias_on_every_tp_rank(rank, world_size):
    import torchtitan.components.moe.experts as ex

    ex._added_once = lambda b: ex._local(b)


def test_parity_check_catches_the_down_bias_added_by_every_tp_rank(references, tmp_path):
    steps, _ = train(2, GPT_OSS + LAYOUTS["tp2"], str(tmp_path), setup=_down_bias_on_every_tp_rank)
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), references["plain"])


def test_parity_check_catches_ring_attention_ignoring_the_window(references, tmp_path):
    steps, _ = train(2, GPT_OSS + LAYOUTS["cp2_documents"], str(tmp_path), setup=_ring_ignores_the_window)
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), references["documents"])
