"""How GPT-OSS is parallelised: heads column-wise (q, k, v with their biases), wo row-wise, the sinks sharded
with their heads (HEAD_PARAMS), and an MoE layer in every block routing its own sequence shard; the experts
(weights and biases, all [E, ...]) split over ep and FSDP's expert groups by the composition
(distributed/parallelize.py)."""

from torchtitan.distributed.parallelize import HEAD_PARAMS, ParallelPlan, parallelizer
from torchtitan.models.common.tp_plans import MOE_FFN, gqa_attention

GPT_OSS_PLAN = ParallelPlan(
    block_tp={**gqa_attention(num_inputs=4), "attention.sinks": HEAD_PARAMS, **MOE_FFN}
)

parallelize_gpt_oss = parallelizer(GPT_OSS_PLAN)
