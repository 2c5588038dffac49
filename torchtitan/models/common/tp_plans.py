"""TP plan fragments for the blocks in models/common and the families' shared module names: a family's plan
(distributed/parallelize.py's ParallelPlan) is the union of the fragments its blocks are made of."""

from torchtitan.distributed.parallelize import COLWISE, HEAD_NORM, MOE, ROWWISE, SEQUENCE_PARALLEL, GatherInputs


def gqa_attention(num_inputs: int) -> dict:
    """Pre-norm grouped-query attention: heads column-wise (wq, wk, wv), wo row-wise; `num_inputs` positional
    inputs of the attention module (x first)."""
    return {
        "attention_norm": SEQUENCE_PARALLEL,
        "attention": GatherInputs(num_inputs=num_inputs),
        "attention.wq": COLWISE,
        "attention.wk": COLWISE,
        "attention.wv": COLWISE,
        "attention.wo": ROWWISE,
    }


QK_NORM = {"attention.q_norm": HEAD_NORM, "attention.k_norm": HEAD_NORM}
"""QK-norm (models/common/qk_norm_attention.py) on this rank's heads."""

SWIGLU_FFN = {
    "ffn_norm": SEQUENCE_PARALLEL,
    "feed_forward": GatherInputs(),
    "feed_forward.w1": COLWISE,
    "feed_forward.w2": ROWWISE,
    "feed_forward.w3": COLWISE,
}
"""A pre-norm SwiGLU feed-forward at `feed_forward` (w1, w3 column-wise, w2 row-wise)."""

MOE_FFN = {"ffn_norm": SEQUENCE_PARALLEL, "moe": MOE}
"""A pre-norm MoE layer at `moe`, routing this rank's sequence shard."""
