"""Qwen3.5 (a linear-attention layer, then a gated full-attention layer) trains the same curve under every
layout as on one process: the parity harness of test_qwen3_parity.py (same tiny fp32 recipe, seed and global
batches of 8 x 64 tokens, tests/tolerances.py's curve tolerances).

FSDP 2, TP 2 (DeltaNet heads split: projections column-wise, conv channels and A_log/dt_bias sharded alike,
out_proj row-wise), PP 2, CP 2 and TP 2 x CP 2 against the plain reference; CP 4 with document masking (the
state and the conv window restart at each document, across cp pieces) against one process with document
masking; EP 2 and TP 2 (expert tensor parallel: the routed and the shared expert split over tp by hidden units,
the shared expert's sigmoid gate replicated, its gradient a partial sum over tp) on the MoE flavor against its own
reference. Negative control: with the state passing removed (every piece starts from a zero state) CP 2 no longer
matches.
"""

import pytest
import torch

from tests.distributed.trainer_runs import DOCUMENT_MASKING, curves, train
from tests.tolerances import assert_curves_close

pytestmark = pytest.mark.distributed

STEPS = 4
DENSE = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_tiny", "--training.steps", str(STEPS)]
MOE = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_tiny_moe", "--training.steps", str(STEPS),
       "--moe.load_balance_coeff", "0"]
LBS4 = ["--training.local_batch_size", "4"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]

# name: (reference, world size, arguments)
LAYOUTS = {
    "fsdp2": ("dense", 2, DENSE + ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]),
    "tp2": ("dense", 2, DENSE + TP2 + LBS4),
    "pp2": ("dense", 2, DENSE + ["--parallelism.pipeline_parallel_degree", "2"] + LBS4),
    "cp2": ("dense", 2, DENSE + CP2 + LBS4),
    "tp2_cp2": ("dense", 4, DENSE + TP2 + CP2 + LBS4),
    "cp4_documents": ("documents", 4, DENSE + DOCUMENT_MASKING + ["--parallelism.context_parallel_degree", "4"] + LBS4),
    "ep2": ("moe", 2, MOE + ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"]),
    "tp2_moe": ("moe", 2, MOE + TP2 + LBS4),
}
REFERENCES = {"dense": DENSE + LBS4, "documents": DENSE + DOCUMENT_MASKING + LBS4, "moe": MOE + LBS4}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    refs = {}
    for name, argv in REFERENCES.items():
        steps, _ = train(1, argv, str(tmp_path_factory.mktemp(name)))
        assert len(steps) == STEPS
        refs[name] = curves(steps)
    return refs


def test_references_learn(references):
    for name, (loss, _) in references.items():
        assert loss[-1] < loss[0] - 0.3, f"the tiny {name} model should learn in {STEPS} steps: {loss.tolist()}"
    # Document masking changes the numbers (else the CP 4 test would not show the resets cross pieces).
    assert not torch.allclose(references["documents"][0], references["dense"][0], rtol=1e-4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, references, tmp_path):
    ref, world, argv = LAYOUTS[layout]
    steps, _ = train(world, argv, str(tmp_path))
    assert_curves_close(curves(steps), references[ref])


def _no_state_passing(rank, world_size):
    """Every cp piece starts from a zero state: what CP would compute without passing the states."""
    import torchtitan.distributed.linear_attention_cp as lacp

    lacp.incoming_states = lambda all_finals, dv: [
        torch.zeros_like(all_finals[0, 0, ..., :dv]) for _ in range(2 * all_finals.shape[0])
    ]


def test_cp_without_state_passing_fails(references, tmp_path):
    steps, _ = train(2, LAYOUTS["cp2"][2], str(tmp_path), setup=_no_state_passing)
    with pytest.raises(AssertionError):
        assert_curves_close(curves(steps), references["dense"])
