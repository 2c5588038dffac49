"""Mixture-of-Experts building blocks shared by the MoE model folders (deepseek_v3, qwen3_moe).

    args.py          MoEArgs: the shape and routing of one MoE layer
    router.py        token-choice top-k routing (softmax/sigmoid, group-limited, bias, normalise, scale)
    experts.py       routed experts as stacked weights; the grouped-GEMM / exact-loop choice, in one place
    moe.py           the MoE layer: route, dispatch, experts, combine, shared experts, aux losses, loads
    load_balance.py  the auxiliary-loss-free bias update run after each optimizer step

Expert parallelism (the all-to-all dispatch and the `ep` mesh) is in torchtitan/distributed/expert_parallel.py.
"""

from torchtitan.components.moe.args import MoEArgs
from torchtitan.components.moe.load_balance import update_expert_bias
from torchtitan.components.moe.moe import MoE, MoEOutput, RouterBalance

__all__ = ["MoE", "MoEArgs", "MoEOutput", "RouterBalance", "update_expert_bias"]
