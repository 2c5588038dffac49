"""How DeepSeek-V3 is parallelised: MLA heads and the dense FFNs Megatron-style, MoE layers on sequence shards;
declared here, applied by distributed/parallelize.py (CP, TP, EP, AC, compile, FSDP with the expert mesh).

MLA: the query/kv up-projections (wq, or wq_b with a compressed query; wkv_b) are column-wise over heads and wo
row-wise; the down-projections and their norms (wq_a, q_norm, wkv_a, kv_norm) stay replicated and read plain
tensors (the attention input is gathered to local tensors), their gradients complete on every rank because
they feed column-wise layers, except the shared rope key, which feeds every local head directly: its
gradient is summed over tp (`shared_key_grad`). Dense blocks (the first n_dense_layers) have `feed_forward`,
the others `moe`; each entry applies where the block has the module.
"""

from torchtitan.distributed.parallelize import (
    COLWISE,
    ROWWISE,
    SEQUENCE_PARALLEL,
    GatherInputs,
    ParallelPlan,
    parallelizer,
)
from torchtitan.models.common.tp_plans import MOE_FFN, SWIGLU_FFN

DEEPSEEK_V3_PLAN = ParallelPlan(
    block_tp={
        "attention_norm": SEQUENCE_PARALLEL,
        "attention": GatherInputs(num_inputs=3, local_output=True),
        "attention.wq": COLWISE,
        "attention.wq_b": COLWISE,
        "attention.wkv_b": COLWISE,
        "attention.wo": ROWWISE,
        **SWIGLU_FFN,
        **MOE_FFN,
    },
    tp_grad_sums=("attention.shared_key_grad",),
)

parallelize_deepseek_v3 = parallelizer(DEEPSEEK_V3_PLAN)
