"""Negative control of the expert-tensor-parallel parity tests (docs/moe.md): with the reduce-scatter's sum dropped
(each tp rank keeps its own partial sums of the MoE output for its sequence shard) every MoE family under TP 2 must
fail the parity check against one process. Run from the repo root:
PYTHONPATH=. python scripts/diagnostics/etp_negative_control.py   (about 2 min on 2 cores)
Prints one line per family: whether the check failed, and the largest relative loss difference."""

import tempfile

from tests.distributed.test_parity_2d import assert_parity
from tests.distributed.trainer_runs import curves, train

FAMILIES = {"deepseek_v3": [], "qwen3_moe": [], "gpt_oss": [],
            "qwen3_5": ["--model.flavor", "debugmodel_tiny_moe", "--moe.load_balance_coeff", "0"]}


def no_sum(rank, world_size):
    import torch.distributed as dist

    import torchtitan.distributed.expert_parallel as ep

    def reduce(self, out):  # this rank's shard of its own partial sums: the other ranks' parts are lost
        return out.chunk(dist.get_world_size(self.group), dim=1)[dist.get_rank(self.group)].contiguous()

    ep.ExpertTensorParallel.reduce = reduce


if __name__ == "__main__":
    for family, extra in FAMILIES.items():
        argv = ["--model.name", family, *extra, "--training.steps", "4", "--training.local_batch_size", "4"]
        folder = tempfile.mkdtemp()
        ref, _ = train(1, argv, folder + "/single")
        got, _ = train(2, argv + ["--parallelism.tensor_parallel_degree", "2"], folder + "/tp2", setup=no_sum)
        a, b = curves(ref), curves(got)
        try:
            assert_parity(b, a)
            verdict = "PASSED the check (the check is blind!)"
        except AssertionError:
            verdict = "fails the check, as it must"
        print(f"{family}: {verdict}; largest relative loss difference {((a[0] - b[0]).abs() / a[0]).max().item():.2g}")
