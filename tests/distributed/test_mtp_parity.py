"""Multi-token prediction changes nothing under FSDP 2 and PP 2.

The DeepSeek-V3 debug model with one MTP depth (`--model.overrides mtp_depth=1`) trains under each layout
with the parity protocol of test_parity_2d (same recipe, seed, data; loss rtol 1e-5, grad norm rtol 5e-5)
and must log the same per-step loss, grad norm and `loss/mtp_1` as one process. Under PP the MTP module
sits on the last stage and the first stage's input embeddings travel down the pipeline beside the hidden
state, so the one shared embedding gets the MTP loss's gradient through the pipeline.

The negative control detaches those travelling embeddings on the pipeline's receiving stage (the MTP
module then trains, but the embedding never learns from it): the loss still falls, only parity notices.
"""

import pytest
import torch

from tests.distributed.test_parity_2d import assert_parity
from tests.distributed.trainer_runs import curves, train
from tests.tolerances import LOSS_RTOL

pytestmark = pytest.mark.distributed

MTP = ["--model.name", "deepseek_v3", "--model.overrides", "mtp_depth=1,mtp_loss_weight=0.3",
       "--training.steps", "4"]
LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]),
}


def _mtp_curve(steps: list[dict]) -> torch.Tensor:
    return torch.tensor([m["loss/mtp_1"] for m in steps], dtype=torch.float64)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    steps, _ = train(1, MTP + ["--training.local_batch_size", "4"], str(tmp_path_factory.mktemp("single")))
    assert len(steps) == 4
    return curves(steps), _mtp_curve(steps)


def test_reference_learns_and_logs_each_depth(reference):
    (loss, _), mtp = reference
    assert loss[-1] < loss[0] - 0.3, loss.tolist()
    assert mtp[-1] < mtp[0], mtp.tolist()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference, tmp_path):
    world, argv = LAYOUTS[layout]
    steps, _ = train(world, MTP + argv, str(tmp_path))
    ref_curves, ref_mtp = reference
    assert_parity(curves(steps), ref_curves)
    # the MTP loss is a mean of positive per-token terms like the main loss: LOSS_RTOL (tests/tolerances.py)
    torch.testing.assert_close(_mtp_curve(steps), ref_mtp, rtol=LOSS_RTOL, atol=0)


def _embeddings_detached_between_stages(rank, world_size):
    """Breaks MTP under PP on purpose: a later stage cuts the gradient of the embeddings it receives."""
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    real = DeepSeekV3Model.forward

    def forward(self, tokens, mtp_embeddings=None, positions=None):
        if mtp_embeddings is not None and self.tok_embeddings is None:
            mtp_embeddings = mtp_embeddings.detach()
        return real(self, tokens, mtp_embeddings, positions)

    DeepSeekV3Model.forward = forward


def test_parity_check_catches_embeddings_cut_off_between_stages(reference, tmp_path):
    world, argv = LAYOUTS["pp2"]
    steps, _ = train(world, MTP + argv, str(tmp_path), setup=_embeddings_detached_between_stages)
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), reference[0])
