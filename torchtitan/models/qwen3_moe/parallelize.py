"""How Qwen3-MoE is parallelised: Qwen3's attention plan (heads column-wise, QK-norm on local heads) and an MoE
layer in every block, routing its own sequence shard; EP and FSDP's expert groups come from the composition
(distributed/parallelize.py)."""

from torchtitan.distributed.parallelize import (
    COLWISE,
    HEAD_NORM,
    MOE,
    ROWWISE,
    SEQUENCE_PARALLEL,
    GatherInputs,
    ParallelPlan,
    parallelizer,
)

QWEN3_MOE_PLAN = ParallelPlan(
    block_tp={
        "attention_norm": SEQUENCE_PARALLEL,
        "attention": GatherInputs(num_inputs=3),
        "attention.wq": COLWISE,
        "attention.wk": COLWISE,
        "attention.wv": COLWISE,
        "attention.q_norm": HEAD_NORM,
        "attention.k_norm": HEAD_NORM,
        "attention.wo": ROWWISE,
        "ffn_norm": SEQUENCE_PARALLEL,
        "moe": MOE,
    }
)

parallelize_qwen3_moe = parallelizer(QWEN3_MOE_PLAN)
