"""How Qwen3 is parallelised: Llama's plan plus QK-norm on local heads, declared; distributed/parallelize.py
applies it with CP, AC, compile and FSDP, to the whole model or to each pipeline stage.

QK-norm runs on this rank's heads: its weight is replicated and its gradient, a sum over every head, is summed
over tp (HEAD_NORM); left out of the plan, each rank would update it from its own heads only and the replicas
drift. Tied flavors stay tied under TP (the composition calls `tie_weights`); PP refuses them
(Qwen3ModelArgs.update_from_job).
"""

from torchtitan.distributed.parallelize import ParallelPlan, parallelizer
from torchtitan.models.common.tp_plans import QK_NORM, SWIGLU_FFN, gqa_attention

# attention(x, rope cache, positions)
QWEN3_PLAN = ParallelPlan(block_tp={**gqa_attention(num_inputs=3), **QK_NORM, **SWIGLU_FFN})

parallelize_qwen3 = parallelizer(QWEN3_PLAN)
