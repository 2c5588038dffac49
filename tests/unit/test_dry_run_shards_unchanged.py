"""The trainer's per-rank shards survive the parallelize refactor (issue 27): the dry run builds every rank with
the same code the trainer runs (the family's declared plan through distributed/parallelize.py), so its per-rank
bytes for the shipped recipes are compared with figures taken before the refactor.

EXPECTED was measured at commit ae3f7d6, BEFORE the refactor (models/*/parallelize.py as their own compositions),
with `dry_run(cfg, 64, [0, 37, 63])` on the shipped recipes; rank 37 is an interior rank of every mesh.
Each row: (num_params, param_bytes, grad_bytes, optimizer_bytes, buffer_bytes, pipeline stages held).
"""

import pytest

from torchtitan.planning.dry_run import dry_run
from torchtitan.protocols.train_spec import config_manager

RANKS = [0, 37, 63]
LLAMA_8B = (125472832, 501891328, 501891328, 1003783820, 67108864, ())
LLAMA_70B = (1102545920, 4410183680, 4410183680, 8820370252, 67108864, ())
LLAMA_405B = (6341912576, 25367650304, 25367650304, 50735305156, 67108864, ())
DSV3_16B_EP8 = (245413816, 981655264, 981655264, 1963312036, 41956352, ())
DSV3_16B_EP8_TP2 = (252995440, 1011981760, 1011981760, 2023965028, 41956352, ())
QWEN3_MOE_30B_TP2 = (477264320, 1909057280, 1909057280, 3818116876, 21020672, ())
QWEN3_06B_TP2 = (9314304, 37257216, 37257216, 74515672, 20971520, ())

EXPECTED = {
    ("llama3_8b", ()): ("dp_shard 64", [LLAMA_8B] * 3),
    ("llama3_70b", ()): ("dp_shard 8 x tp 8", [LLAMA_70B] * 3),
    ("llama3_405b", ()): ("dp_shard 8 x tp 8", [LLAMA_405B] * 3),
    (
        "llama3_405b",
        ("--parallelism.pipeline_parallel_degree", "4", "--parallelism.tensor_parallel_degree", "4",
         "--training.local_batch_size", "4"),
    ): (
        "pp 4 x dp_shard 4 x tp 4",
        [
            (6307700736, 25230802944, 25230802944, 50461607008, 67108864, (0,)),
            (6375604224, 25502416896, 25502416896, 51004834944, 67108864, (2,)),
            (6307704832, 25230819328, 25230819328, 50461639780, 67108864, (3,)),
        ],
    ),
    ("deepseek_v3_16b", ()): ("dp_shard 64", [DSV3_16B_EP8] * 3),  # the recipe's expert_parallel_degree 8
    ("deepseek_v3_16b", ("--parallelism.tensor_parallel_degree", "2")): ("dp_shard 32 x tp 2", [DSV3_16B_EP8_TP2] * 3),
    ("qwen3_moe_30b_a3b", ("--parallelism.tensor_parallel_degree", "2")): ("dp_shard 32 x tp 2", [QWEN3_MOE_30B_TP2] * 3),
    ("qwen3_0.6b", ("--parallelism.tensor_parallel_degree", "2")): ("dp_shard 32 x tp 2", [QWEN3_06B_TP2] * 3),
}


@pytest.mark.parametrize("recipe,extra", list(EXPECTED), ids=[f"{r}{'+' if e else ''}" for r, e in EXPECTED])
def test_dry_run_per_rank_bytes_as_before_the_refactor(recipe, extra):
    layout, rows = EXPECTED[(recipe, extra)]
    cfg = config_manager().parse_args(["--job.config_file", f"train_configs/{recipe}.toml", *extra])
    report = dry_run(cfg, 64, RANKS)
    assert [e for e in report.errors if "tokenizer" not in e] == []  # recipes name tokenizers not shipped here
    assert report.layout == layout
    got = [
        (r.num_params, r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.buffer_bytes, tuple(s.index for s in r.stages))
        for r in report.ranks
    ]
    assert got == rows
