"""How Qwen3 is parallelised: Llama's plan plus QK-norm on local heads, declared; distributed/parallelize.py
applies it with CP, AC, compile and FSDP, to the whole model or to each pipeline stage.

QK-norm runs on this rank's heads: its weight is replicated and its gradient, a sum over every head, is summed
over tp (HEAD_NORM); left out of the plan, each rank would update it from its own heads only and the replicas
drift. Tied flavors stay tied under TP (the composition calls `tie_weights`); PP refuses them
(Qwen3ModelArgs.update_from_job).
"""

from torchtitan.distributed.parallelize import (
    COLWISE,
    HEAD_NORM,
    ROWWISE,
    SEQUENCE_PARALLEL,
    GatherInputs,
    ParallelPlan,
    parallelizer,
)

QWEN3_PLAN = ParallelPlan(
    block_tp={
        "attention_norm": SEQUENCE_PARALLEL,
        "attention": GatherInputs(num_inputs=3),  # x, rope cache, positions
        "attention.wq": COLWISE,
        "attention.wk": COLWISE,
        "attention.wv": COLWISE,
        "attention.q_norm": HEAD_NORM,
        "attention.k_norm": HEAD_NORM,
        "attention.wo": ROWWISE,
        "ffn_norm": SEQUENCE_PARALLEL,
        "feed_forward": GatherInputs(),
        "feed_forward.w1": COLWISE,
        "feed_forward.w2": ROWWISE,
        "feed_forward.w3": COLWISE,
    }
)

parallelize_qwen3 = parallelizer(QWEN3_PLAN)
