"""A checkpoint written under expert parallel resumes in one process (the routed experts, split over the ep
ranks when saved, are resharded on load, with the balancing bias and the optimizer state): the resumed
steps match an uninterrupted EP 2 run within the parity tolerances of test_parity_2d."""

import pytest

from tests.distributed.test_parity_2d import assert_parity
from tests.distributed.trainer_runs import curves, train

pytestmark = pytest.mark.distributed

MOE = ["--model.name", "deepseek_v3"]
EP2 = (2, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"])
SINGLE = (1, ["--training.local_batch_size", "4"])
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]


def test_ep2_checkpoint_resumes_in_one_process(tmp_path):
    straight, _ = train(EP2[0], MOE + EP2[1] + ["--training.steps", "4"], str(tmp_path / "straight"))
    folder = str(tmp_path / "resumed")
    train(EP2[0], MOE + EP2[1] + CKPT + ["--training.steps", "2"], folder)
    steps, _ = train(SINGLE[0], MOE + SINGLE[1] + CKPT + ["--training.steps", "4"], folder)
    resumed = [m for m in steps if m["step"] > 2][-2:]
    assert [m["step"] for m in resumed] == [3, 4]
    assert_parity(curves(resumed), tuple(c[2:] for c in curves(straight)))
