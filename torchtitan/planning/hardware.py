"""Devices and interconnects the planner knows: data, one entry per device type. Add a line to extend.

Figures are vendor datasheet values (dense, no sparsity); bandwidths are per GPU and per direction, the
rate one GPU can push into a collective: NVLink/xGMI within a node, the GPU's share of the node's
network (its NIC) across nodes.
"""

import dataclasses
import difflib


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


_T, _G = 1e12, 1e9
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # H100 SXM: 989 TFLOP/s bf16, 80 GB HBM3, NVLink 4 900 GB/s bidirectional, one 400 Gb/s NIC per GPU.
        Device("H100-80GB", 989.4 * _T, 80e9, 450 * _G, 50 * _G),
        # H100 with 96 GB HBM2e (Meta's Grand Teton hosts of the torchtitan paper's runs), same compute and links.
        Device("H100-96GB", 989.4 * _T, 96e9, 450 * _G, 50 * _G),
        Device("H200-141GB", 989.4 * _T, 141e9, 450 * _G, 50 * _G),
        # A100 SXM: 312 TFLOP/s, NVLink 3 600 GB/s bidirectional, 200 Gb/s NIC per GPU.
        Device("A100-80GB", 312 * _T, 80e9, 300 * _G, 25 * _G),
        Device("A100-40GB", 312 * _T, 40e9, 300 * _G, 25 * _G),
        # B200: 2.25 PFLOP/s dense bf16, 192 GB (180 usable), NVLink 5 1.8 TB/s bidirectional, 400 Gb/s NIC.
        Device("B200-180GB", 2250 * _T, 180e9, 900 * _G, 50 * _G),
        # MI300X: 1307 TFLOP/s, 192 GB, Infinity Fabric ~448 GB/s per GPU per direction, 400 Gb/s NIC.
        Device("MI300X-192GB", 1307.4 * _T, 192e9, 448 * _G, 50 * _G),
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
