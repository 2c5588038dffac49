"""How Qwen3.5 is parallelised, declared; distributed/parallelize.py applies it with CP, EP, AC, compile and
FSDP, to the whole model or to each pipeline stage.

Both kinds of block keep their token mixer at `attention` (called as attention(x, rope, positions,
document_ids)), so one entry gathers its input. Gated attention: heads column-wise (wq holds each head's query
and gate, so whole heads of both), QK-norm on local heads, wo row-wise. Gated DeltaNet: the q/k/v/z/a/b
projections column-wise, the conv channels and A_log/dt_bias split alike (HEAD_PARAMS), the per-head output
norm's gradient summed over tp (HEAD_NORM), out_proj row-wise. Head counts TP cannot split are refused by
plan_job (Qwen3_5ModelArgs.divisible_by). Context parallel picks ring attention or state passing per block by
its kernel's kind (distributed/parallelize.apply_cp).
"""

from torchtitan.distributed.parallelize import (
    COLWISE,
    HEAD_NORM,
    HEAD_PARAMS,
    ROWWISE,
    SEQUENCE_PARALLEL,
    GatherInputs,
    ParallelPlan,
    parallelizer,
)
from torchtitan.models.common.tp_plans import MOE_FFN, QK_NORM, SWIGLU_FFN

GATED_DELTANET = {
    **{f"attention.in_proj_{p}": COLWISE for p in ("q", "k", "v", "z", "a", "b")},
    "attention.conv": HEAD_PARAMS,
    "attention.decay": HEAD_PARAMS,
    "attention.norm": HEAD_NORM,
    "attention.out_proj": ROWWISE,
}
GATED_ATTENTION = {
    "attention.wq": COLWISE,
    "attention.wk": COLWISE,
    "attention.wv": COLWISE,
    "attention.wo": ROWWISE,
    **QK_NORM,
}

QWEN3_5_PLAN = ParallelPlan(block_tp={
    "attention_norm": SEQUENCE_PARALLEL,
    "attention": GatherInputs(num_inputs=4),
    **GATED_ATTENTION,
    **GATED_DELTANET,
    **SWIGLU_FFN,
    **MOE_FFN,
})

parallelize_qwen3_5 = parallelizer(QWEN3_5_PLAN)
