"""How Qwen3-MoE is parallelised: Qwen3's attention plan (heads column-wise, QK-norm on local heads) and an MoE
layer in every block, routing its own sequence shard; EP and FSDP's expert groups come from the composition
(distributed/parallelize.py)."""

from torchtitan.distributed.parallelize import ParallelPlan, parallelizer
from torchtitan.models.common.tp_plans import MOE_FFN, QK_NORM, gqa_attention

QWEN3_MOE_PLAN = ParallelPlan(block_tp={**gqa_attention(num_inputs=3), **QK_NORM, **MOE_FFN})

parallelize_qwen3_moe = parallelizer(QWEN3_MOE_PLAN)
