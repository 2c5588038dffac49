"""Devices and interconnects the planner knows: data, one entry per device type. Add a line to extend.

Figures are vendor datasheet values (dense, no sparsity); bandwidths are per GPU and per direction, the
rate one GPU can push into a collective: NVLink/xGMI within a node, the GPU's share of the node's
network (its NIC) across nodes.
"""

import dataclasses
import difflib

H100_500W_CLOCK_FRACTION = 0.84
"""Fitted (published.fit_constants on published.TRAINING): see the H100-96GB entry of DEVICES."""


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float
    """Dense 16-bit matmul peak, FLOP/s."""
    memory_bytes: float
    intra_node_bw: float
    """Bytes/s per GPU per direction inside a node (NVLink)."""
    inter_node_bw: float
    """Bytes/s per GPU per direction between nodes (its NIC share)."""
    gpus_per_node: int = 8
    hbm_bw: float = 2e12
    """Bytes/s of device memory (HBM): what element-wise kernels, casts and the optimizer step move at (a device
    entered without it: an HBM2e-class 2 TB/s)."""
    fp8_flops: float = 0.0
    """Dense float8 matmul peak, FLOP/s (0 = no float8 tensor cores: Float8 linears run at the bf16 rate)."""
    gemm_eff: float = 0.8
    """Fraction of the bf16 peak that a large bf16 GEMM sustains (cuBLAS microbenchmarks; shape losses on top:
    step_time.gemm_efficiency)."""
    attn_eff: float = 0.35
    """Fraction of the bf16 peak that causal flash attention (forward + backward, head dim 128) sustains."""
    clock_fraction: float = 1.0
    """Fraction of the datasheet rate the device sustains under its power limit (1 at its TDP)."""


_T, _G = 1e12, 1e9
# Efficiencies (microbenchmarks, not fitted): large bf16 GEMMs reach ~0.75-0.8 of the dense peak on H100/H200 in
# cuBLAS sweeps (8K x 8K x 8K: ~750-800 TFLOP/s) and ~0.9 on A100 (~280 of 312); MI300X's hipBLASLt ~0.6. Causal
# flash attention (FlashAttention-2, torch SDPA's flash backend, head dim 128, forward + backward) reaches
# ~0.35 of H100's peak (FlashAttention-3 paper, Fig. 5/6: FA2 at 300-350 TFLOP/s) and ~0.6 of A100's
# (FlashAttention-2 paper: 50-73% forward, less backward).
_H100 = dict(gemm_eff=0.8, attn_eff=0.35)
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # H100 SXM: 989 TFLOP/s bf16, 80 GB HBM3, NVLink 4 900 GB/s bidirectional, one 400 Gb/s NIC per GPU.
        # HBM3 3.35 TB/s, float8 1,979 TFLOP/s dense.
        Device("H100-80GB", 989.4 * _T, 80e9, 450 * _G, 50 * _G, hbm_bw=3.35e12, fp8_flops=1978.9 * _T, **_H100),
        # H100 with 96 GB HBM2e at 2.4 TB/s (Meta's Grand Teton hosts of the torchtitan paper's runs), same links,
        # run at a 500 W power limit (TDP 700 W): its sustained rate is "between SXM and NVL" (torchtitan
        # benchmarks/llama3_h100_202412_torchtitan.md); clock_fraction is fitted (published.fit_constants, on
        # the training half of the corpus only) within that bracket (H100 NVL: 835 of 989 TFLOP/s, 0.84).
        Device("H100-96GB", 989.4 * _T, 96e9, 450 * _G, 50 * _G, hbm_bw=2.4e12, fp8_flops=1978.9 * _T,
               clock_fraction=H100_500W_CLOCK_FRACTION, **_H100),
        # HBM3e 4.8 TB/s.
        Device("H200-141GB", 989.4 * _T, 141e9, 450 * _G, 50 * _G, hbm_bw=4.8e12, fp8_flops=1978.9 * _T, **_H100),
        # A100 SXM: 312 TFLOP/s, NVLink 3 600 GB/s bidirectional, 200 Gb/s NIC per GPU; HBM2e 2.04 / 1.56 TB/s.
        Device("A100-80GB", 312 * _T, 80e9, 300 * _G, 25 * _G, hbm_bw=2.039e12, gemm_eff=0.9, attn_eff=0.6),
        Device("A100-40GB", 312 * _T, 40e9, 300 * _G, 25 * _G, hbm_bw=1.555e12, gemm_eff=0.9, attn_eff=0.6),
        # B200: 2.25 PFLOP/s dense bf16 (4.5 float8), 192 GB (180 usable), NVLink 5 1.8 TB/s bidirectional,
        # 400 Gb/s NIC, HBM3e 8 TB/s.
        Device("B200-180GB", 2250 * _T, 180e9, 900 * _G, 50 * _G, hbm_bw=8e12, fp8_flops=4500 * _T, **_H100),
        # MI300X: 1307 TFLOP/s (2,615 float8), 192 GB, Infinity Fabric ~448 GB/s per GPU per direction, 400 Gb/s
        # NIC, HBM3 5.3 TB/s.
        Device("MI300X-192GB", 1307.4 * _T, 192e9, 448 * _G, 50 * _G, hbm_bw=5.3e12, fp8_flops=2614.9 * _T,
               gemm_eff=0.6, attn_eff=0.3),
    )
}


def get_device(name: str) -> Device:
    by_lower = {k.lower(): v for k, v in DEVICES.items()}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    near = difflib.get_close_matches(name, DEVICES, n=3) or sorted(DEVICES)
    raise ValueError(f"unknown device type {name!r} (--device-type); known: {', '.join(near)} "
                     f"(add one to torchtitan/planning/hardware.py DEVICES)")


def memory_limit(device: Device, memory_headroom: float = 0.0) -> float:
    """Bytes a rank's estimated peak may reach: the device's memory less the fraction the user keeps free
    (--memory-headroom: room for what the estimator does not model on that device)."""
    if not 0.0 <= memory_headroom < 1.0:
        raise ValueError(f"--memory-headroom must be a fraction in [0, 1), got {memory_headroom}")
    return device.memory_bytes * (1.0 - memory_headroom)


def headroom_note(memory_headroom: float) -> str:
    """What a "does not fit" message adds when a share of memory is kept free."""
    return f" less {100 * memory_headroom:.0f}% headroom" if memory_headroom else ""


@dataclasses.dataclass(frozen=True)
class Network:
    """How the nodes are connected: full bisection bandwidth within a pod of `pod_size` GPUs (0 = the whole
    cluster is one pod), `cross_pod_fraction` of it between pods (1 / the oversubscription of the layer
    above the pods)."""

    pod_size: int = 0
    cross_pod_fraction: float = 1.0


FLAT_NETWORK = Network()
LLAMA3_RDMA_CLUSTER = Network(pod_size=3072, cross_pod_fraction=1 / 7)
"""Meta's 24K-GPU RoCE cluster (Llama 3 paper, section 3.3.1): pods of 3,072 GPUs with full bisection
bandwidth; the aggregation layer between pods is oversubscribed 1:7."""
