"""Step-time model of a layout: matmul FLOPs at a stated fraction of the device's peak, plus the
communication each feature adds, minus what overlaps with compute.

Rules (per rank, one optimizer step):
  compute   training FLOPs of the busiest pipeline rank's modules for its tokens (6 x params + attention,
            per token; the output projection weighs more than a block, the embedding nothing) / tp / cp,
            x 4/3 with full AC (one more forward), x (1 + 1/(3k)) with selective every k-th block; at
            `mfu` of the device's dense bf16 peak. Selective "op" recomputes element-wise ops only: no FLOPs.
            With Float8 the blocks' linears run FLOAT8_LINEAR_SPEEDUP x faster (the output projection
            stays bf16: --float8.filter_fqns keeps it by default; attention stays bf16).
  FSDP      all-gather of the parameters (bf16, or float8 with float8 all-gather) and one reduce-scatter
            of the gradients (fp32), which happens after the last microbatch (gradient sync is off for the
            others). Without PP blocks are gathered per microbatch in forward and again in backward, one
            block ahead, so a phase's gathers hide only behind that phase's compute: the forward's behind
            the forward, the backward's together with the reduction (the same link carries both) behind
            the last microbatch's backward. Under PP a stage stays gathered, so its gathers hide only
            behind the first microbatch's forward, and the reduction behind the backward of the rank's
            last stage to finish. One block's gather and reduction are always exposed.
  HSDP      all-reduce of the gradient shards across replicas, with the reduce-scatter (same rule; it
            shares the link when both groups leave the node).
  TP        per block and microbatch: 2 all-gathers + 2 reduce-scatters of the sequence-sharded
            activations in forward, as many in backward, and recomputation repeats the forward's 4 (full
            AC) or its 2 all-gathers (op AC saves only reduce-scatter outputs); exposed. With Float8 the
            forward's all-gathers (and their recomputation) move float8 bytes. Async TP splits each
            collective into chunks overlapped with the matmul it feeds: it hides ASYNC_TP_HIDDEN of
            the traffic, at most the block's linears' time.
  CP        the default rotate method all-gathers K and V of the whole sequence before attention and
            reduce-scatters their gradients in backward (3 collectives per block and microbatch); exposed.
  PP        the schedule's bubble: 1F1B (pp - 1) / n_microbatches extra, interleaved (pp - 1) / (v x n);
            each stage boundary sends the microbatch's activations forward and their gradients back
            (between nodes); exposed.
  Small     matmuls and attention reach `mfu` only with at least FULL_SPEED_TOKENS tokens per rank and
  batches   microbatch; below that the efficiency falls in proportion (kernel launch and latency bound).
Collectives: ring algorithms, time = (n - 1) x latency + (n - 1) / n x bytes / bandwidth, where the
bandwidth is NVLink when the whole group sits inside one node and otherwise the NICs of the group's
members in a node (each GPU has its own; NCCL spreads its rings over them), at LINK_EFFICIENCY of the
datasheet rate, and the cross-pod share of that when the group leaves a pod of
the network (hardware.Network). A group spans its size x its stride in the mesh (pp, dp_replicate,
dp_shard, cp, tp from outermost to innermost).
"""

import dataclasses

from torchtitan.planning.hardware import FLAT_NETWORK, Device, Network

DEFAULT_MFU = 0.5
"""Fraction of the dense bf16 peak large transformer matmuls reach (flash attention included)."""
FULL_SPEED_TOKENS = 4096
"""Tokens per rank and microbatch from which H100-class matmuls and flash attention run at full speed."""
LINK_EFFICIENCY = {"intra": 0.8, "inter": 0.7}
"""Achieved bus bandwidth of NCCL collectives as a fraction of the link rate."""
LATENCY_S = {"intra": 3e-6, "inter": 15e-6}
"""Per ring step latency of a collective."""
FLOAT8_LINEAR_SPEEDUP = 1.45
"""How much faster a tensorwise Float8 linear runs than bf16, its casts included (H100's fp8 tensor cores
double the dense peak; dynamic scaling's amax and cast kernels take back part). Calibrated on one published
measurement where communication is hidden: torchtitan's Table 1, Llama 3.1 8B on 8 H100, compile 6,667 ->
compile + Float8 8,532 tokens/s/GPU (x1.28, which this model gives with 1.45). Checked, not fitted, on Table 3
(the same on 128 GPUs: published x1.286, predicted x1.288)."""
ASYNC_TP_HIDDEN = 0.25
"""Fraction of TP's collectives that async TP hides behind the matmuls they feed (at most those matmuls'
time). Calibrated on torchtitan's Table 4: Llama 3.1 70B, FSDP 32 x TP 8, 829 -> 876 tokens/s/GPU with async
TP, where this model predicts the plain layout at 826 with 4.2 s of its 19.8 s step in TP collectives.
Chunking each collective into tp pieces costs the matmuls efficiency, which is why this is far from 1."""


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float
    exposed: dict[str, float]
    bubble: float

    @property
    def total(self) -> float:
        return self.compute * (1 + self.bubble) + sum(self.exposed.values())


def link(device: Device, span: int) -> str:
    """Which link a group spanning `span` consecutive ranks rides: "intra" (NVLink) or "inter" (the NIC)."""
    return "inter" if span > device.gpus_per_node else "intra"


def collective_time(device: Device, group: int, bytes_per_rank: float, span: int, network: Network = FLAT_NETWORK) -> float:
    """Ring all-gather / reduce-scatter of `bytes_per_rank` (the full buffer) over `group` ranks that lie
    within `span` consecutive ranks: NVLink inside a node, the NIC between nodes, the NIC's cross-pod share
    when the span leaves a pod."""
    if group <= 1:
        return 0.0
    where = link(device, span)
    bw = (device.inter_node_bw if where == "inter" else device.intra_node_bw) * LINK_EFFICIENCY[where]
    if where == "inter":
        # Each GPU drives its own NIC and NCCL runs one ring per channel, each leaving the node through a
        # different NIC: data enters a node once and is forwarded over NVLink, so a group with k members per
        # node moves k NICs' worth (up to NVLink's rate). One member per node (stride >= a node) gets one NIC.
        per_node = max(1, min(group, device.gpus_per_node * group // span))
        bw = min(bw * per_node, device.intra_node_bw * LINK_EFFICIENCY["intra"])
    if network.pod_size and span > network.pod_size:
        bw *= network.cross_pod_fraction
    return (group - 1) * LATENCY_S[where] + (group - 1) / group * bytes_per_rank / bw
