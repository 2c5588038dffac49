"""Step-time model of a layout: matmul FLOPs at a stated fraction of the device's peak, plus the
communication each feature adds, minus what overlaps with compute.

Rules (per rank, one optimizer step):
  compute   training FLOPs of the rank's tokens (6 x params + attention, per token) / tp / pp share,
            x 4/3 with full AC (one more forward), x (1 + 1/(3k)) with selective every k-th block; at
            `mfu` of the device's dense bf16 peak. Selective "op" recomputes element-wise ops only: no FLOPs.
  FSDP      all-gather of the rank's stage parameters in forward and again in backward (bf16) and a
            reduce-scatter of the gradients (fp32), once per microbatch (once per step under PP, whose
            stages stay gathered); prefetching hides it behind compute except one block's worth.
  HSDP      all-reduce of the gradient shards across replicas, hidden behind backward like FSDP.
  TP        per block and microbatch: 2 all-gathers + 2 reduce-scatters of the sequence-sharded
            activations in forward, as many in backward (and in the recomputed forward); exposed.
  CP        the default rotate method all-gathers K and V of the whole sequence before attention and
            reduce-scatters their gradients in backward (3 collectives per block and microbatch); exposed.
  PP        the schedule's bubble: 1F1B (pp - 1) / n_microbatches extra, interleaved (pp - 1) / (v x n);
            each stage boundary sends the microbatch's activations forward and their gradients back
            (between nodes); exposed.
  Small     matmuls and attention reach `mfu` only with at least FULL_SPEED_TOKENS tokens per rank and
  batches   microbatch; below that the efficiency falls in proportion (kernel launch and latency bound).
Collectives: ring algorithms, time = (n - 1) x latency + (n - 1) / n x bytes / bandwidth, where the
bandwidth is NVLink when the whole group sits inside one node and the NIC's share otherwise, at
LINK_EFFICIENCY of the datasheet rate, and the cross-pod share of that when the group leaves a pod of
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


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float
    exposed: dict[str, float]
    bubble: float

    @property
    def total(self) -> float:
        return self.compute * (1 + self.bubble) + sum(self.exposed.values())


def collective_time(device: Device, group: int, bytes_per_rank: float, span: int, network: Network = FLAT_NETWORK) -> float:
    """Ring all-gather / reduce-scatter of `bytes_per_rank` (the full buffer) over `group` ranks that lie
    within `span` consecutive ranks: NVLink inside a node, the NIC between nodes, the NIC's cross-pod share
    when the span leaves a pod."""
    if group <= 1:
        return 0.0
    where = "inter" if span > device.gpus_per_node else "intra"
    bw = (device.inter_node_bw if where == "inter" else device.intra_node_bw) * LINK_EFFICIENCY[where]
    if network.pod_size and span > network.pod_size:
        bw *= network.cross_pod_fraction
    return (group - 1) * LATENCY_S[where] + (group - 1) / group * bytes_per_rank / bw
