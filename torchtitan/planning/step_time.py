"""Step-time model of a layout: each kind of kernel at the rate a datasheet or microbenchmark gives for its
shape, plus the communication each feature adds, minus what overlaps with compute. Three constants are
fitted (TRAINING_KERNEL_EFF, CP_RING_STEP_OVERHEAD here, hardware.H100_500W_CLOCK_FRACTION), each on a named
part of the training half of the published corpus only (planning/published.py fit_constants).

Rules (per rank, one optimizer step):
  compute   per kernel kind, for the busiest pipeline rank's modules and its tokens (block_seconds):
            each of a block's 7 linears at its own shape's GEMM efficiency (gemm_efficiency) of the bf16
            peak (Float8: of the float8 peak x FP8_GEMM_RATIO, plus the casts' HBM traffic), causal flash
            attention at Device.attn_eff, the element-wise kernels' bytes (eager or compiled) at the HBM
            rate, a launch gap per kernel; recomputation replays the forward's share AC recomputes
            (AC_RECOMPUTE). The output projection and the loss (output_seconds), the optimizer step
            (optimizer_seconds), and NCCL_SM_SHARE of the seconds FSDP's collectives overlap compute.
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
"""Fraction of the dense bf16 peak the memory-budget planner prices recomputation at (planning/memory_budget.py);
the step-time model below prices each kernel by its own shape instead."""
GEMM_HALF_DIM = 256
"""GEMM efficiency by shape: a matmul reaches Device.gemm_eff x f(m) x f(min(k, n)), f(x) = x / (x + 256):
cuBLAS sweeps on H100 give ~0.8 of the large-GEMM rate at 1,024-wide operands and ~0.95 at 4,096 (wave
quantization and the fixed cost of a tile's prologue/epilogue)."""
FP8_GEMM_RATIO = 0.9
"""A float8 GEMM reaches this fraction of the bf16 GEMM's efficiency against its own (2x) peak: cuBLAS float8
at 8K^3 sustains ~1,300-1,450 of H100's 1,979 TFLOP/s (0.66-0.73) vs bf16's ~0.75-0.8 of 989."""
HBM_EFF = 0.8
"""Fraction of the HBM datasheet bandwidth element-wise kernels reach (a stream copy reaches ~0.9)."""
ELEMENTWISE_BYTES = {
    # Bytes moved per token by a block's forward element-wise kernels, per unit of width (d = dim, q = query
    # width, kv = key/value width, h = SwiGLU hidden), counted kernel by kernel in bf16 (2-byte) activations.
    # Eager: RMSNorm as torchtitan writes it (to fp32, pow, mean, x * rsqrt, back to bf16, x weight: 36 bytes
    # per element) twice, 2 residual adds (6 each), RoPE through complex fp32 (to fp32, multiply, back: 20
    # bytes per q/k element) and the head transposes SDPA needs (4 per q, k, v and output element), SwiGLU
    # (silu, then the product: 10 per hidden element).
    "eager": {"d": 2 * 36 + 2 * 6, "q": 20 + 8, "kv": 20 + 8, "h": 10},
    # Compiled: each norm fused with the residual add before it (read x and the residual, write both: 8), RoPE
    # fused (read, write: 4), transposes folded into the kernels, SwiGLU fused (read 2, write 1: 6).
    "compiled": {"d": 2 * 8, "q": 4, "kv": 4, "h": 6},
}
"""The backward moves about twice the forward's bytes (each op reads its saved inputs and the incoming
gradient, writes a gradient); recomputation repeats the forward's."""
LOSS_BYTES_PER_LOGIT = {"eager": 30, "compiled": 8}
"""Cross-entropy over the vocabulary per token, forward + backward: eager upcasts the bf16 logits to fp32,
log-softmax (two passes), then the gradient (softmax minus one-hot, back to bf16); compiled fuses to a read of
the logits and a write of their gradient, fp32 inside."""
FLOAT8_CAST_BYTES = {"token": (5, 5, 2), "weight": 10, "weight_gathered_in_float8": 5}
"""Tensorwise dynamic Float8 (torchao), compiled: per token and linear, amax + cast of the input (read 2 bytes
twice, write 1: 5 per input element), of the output gradient (5 per output element) and a transposed copy of
the float8 input for the weight gradient (2 per input element); per weight element and microbatch, amax + cast
in forward and a transposed cast in backward (10 bytes), of which the forward's 5 move before FSDP's all-gather
(once per step, on the shard) with float8 all-gather."""
OPTIMIZER_BYTES_PER_PARAM = 40
"""AdamW (foreach) on a rank's fp32 shard, once per step: read parameter, gradient and two moments and write
three of them (28 bytes), plus the gradient-norm pass for clipping and foreach's temporaries."""
KERNELS_PER_BLOCK = {"eager": 60, "compiled": 20}
"""Kernels a block's forward launches (eager: every element-wise op is its own; compiled: matmuls, attention
and a few fused kernels); the backward launches twice as many."""
LAUNCH_S = 3e-6
"""GPU idle time per kernel launch once the CPU keeps ahead (launch latency + tail of the previous kernel)."""
NCCL_SM_SHARE = 0.1
"""Fraction of the compute a collective running beside it takes: NCCL's kernels occupy 8-24 of H100's 132 SMs
and share HBM bandwidth. Charged on the overlapped (hidden) seconds of FSDP's collectives."""
LINK_EFFICIENCY = {"intra": 0.8, "inter": 0.7}
"""Achieved bus bandwidth of NCCL collectives as a fraction of the link rate (nccl-tests all-gather on H100:
~360 GB/s bus bandwidth of NVLink's 450; ~35 of a 400 Gb/s NIC's 50 GB/s at the sizes FSDP moves)."""
LATENCY_S = {"intra": 3e-6, "inter": 15e-6}
"""Per ring step latency of a collective."""
ASYNC_TP_HIDDEN = 0.25
"""Fraction of TP's collectives that async TP hides behind the matmuls they feed (at most those matmuls'
time): chunking each collective into tp pieces costs the matmuls efficiency and the last chunk is exposed.
A microbenchmark-style figure (torch's async-TP posts report 10-30% of TP communication removed end to end
at 70B scale), not fitted."""


TRAINING_KERNEL_EFF = 0.85
"""Fraction of the microbenchmark rates (Device.gemm_eff, attn_eff) that matmuls and attention keep inside a
training step: caches cold after other kernels, backward's transposed GEMMs, streams shared with collectives.
FITTED (published.fit_constants) on the full-power devices' runs of published.TRAINING without CP."""
CP_RING_STEP_OVERHEAD = 0.05
"""Attention under ring CP runs at 1 / (1 + this x (cp - 1)) of its unsplit rate: each of the 2 x cp chunk
pairs is its own flash kernel (fwd and bwd) whose outputs and log-sum-exps merge in fp32, and the exchange of
the next chunk shares the SMs. FITTED (published.fit_constants) on the CP runs of published.TRAINING."""


def gemm_efficiency(device: Device, m: float, k: float, n: float) -> float:
    """Fraction of the bf16 peak an (m x k) @ (k x n) matmul reaches (GEMM_HALF_DIM)."""
    f = lambda x: x / (x + GEMM_HALF_DIM)  # noqa: E731
    return device.gemm_eff * device.clock_fraction * TRAINING_KERNEL_EFF * f(m) * f(min(k, n))


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """The widths of a Llama-style block (softmax attention + SwiGLU)."""

    dim: int
    q_dim: int
    kv_dim: int
    hidden: int

    def linears(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of wq, wk, wv, wo, w1, w3, w2."""
        d, q, kv, h = self.dim, self.q_dim, self.kv_dim, self.hidden
        return ((d, q), (d, kv), (d, kv), (q, d), (d, h), (d, h), (h, d))


AC_RECOMPUTE = {"none": 0.0, "op": 0.0, "op_half_matmuls": 3 / 7, "full": 1.0}
"""Share of a block's forward matmuls recomputed in backward. This repository's "op" saves every matmul;
torchtitan's upstream "op" policy (2024-25) recomputes every second mm of a block's forward, counted in call
order ("op_half_matmuls": wk, wo and w3 of wq wk wv wo w1 w3 w2; block_seconds prices those three); "k"
(every k-th block under full AC) recomputes 1/k."""
HALF_MATMULS_RECOMPUTED = (1, 3, 5)
"""Which of BlockShape.linears() torchtitan's op policy recomputes (the 2nd, 4th and 6th mm)."""


def ac_recompute(ac: str) -> float:
    return AC_RECOMPUTE[ac] if ac in AC_RECOMPUTE else 1.0 / int(ac)


def block_seconds(device: Device, b: BlockShape, tokens: float, seq_len: int, tp: int, cp: int, ac: str,
                  compiled: bool, float8: bool, float8_all_gather: bool) -> dict[str, float]:
    """Seconds one rank of a TP x CP group spends on one block for a microbatch of `tokens` tokens (the whole
    group's: the rank computes 1 / (tp x cp) of it), forward + backward + recomputation, by kind of kernel."""
    m = tokens / cp  # rows of every matmul on this rank (sequence-parallel activations are gathered first)
    rec = ac_recompute(ac)
    elem_rec = 1.0 if ac != "none" else 0.0  # every AC mode replays the forward's element-wise ops
    if ac not in AC_RECOMPUTE:  # every k-th block: the others replay nothing
        elem_rec = rec
    out: dict[str, float] = {"matmul": 0.0, "float8 casts": 0.0}
    fp8 = float8 and device.fp8_flops > 0
    hbm = device.hbm_bw * HBM_EFF
    for i, (k_in, n_out) in enumerate(b.linears()):
        k, n = (k_in, n_out // tp) if n_out != b.dim else (k_in // tp, n_out)  # column- / row-wise sharded
        linear_rec = float(i in HALF_MATMULS_RECOMPUTED) if ac == "op_half_matmuls" else rec
        flops = 2 * m * k * n * (3 + linear_rec)
        eff = gemm_efficiency(device, m, k, n)
        if fp8:
            out["matmul"] += flops / (device.fp8_flops * eff * FP8_GEMM_RATIO)
            tok_in, tok_out, transposed = FLOAT8_CAST_BYTES["token"]
            w = FLOAT8_CAST_BYTES["weight_gathered_in_float8" if float8_all_gather else "weight"]
            out["float8 casts"] += (m * ((tok_in + transposed) * k + tok_out * n) + w * k * n) / hbm
        else:
            out["matmul"] += flops / (device.bf16_flops * eff)
    # Causal flash attention: half of the 4 x seq x q_dim FLOPs per token of the full score matrix, forward
    # (and its replay under full AC) + backward (2.5 forwards).
    attn_rec = 1.0 if ac == "full" else (rec if ac not in AC_RECOMPUTE else 0.0)
    attn = m * 2 * seq_len * (b.q_dim // tp) * (3.5 + attn_rec)
    attn_eff = device.attn_eff * device.clock_fraction * TRAINING_KERNEL_EFF / (1 + CP_RING_STEP_OVERHEAD * (cp - 1))
    out["attention"] = attn / (device.bf16_flops * attn_eff)
    mode = "compiled" if compiled else "eager"
    per = ELEMENTWISE_BYTES[mode]
    fwd_bytes = (per["d"] * b.dim + per["q"] * b.q_dim + per["kv"] * b.kv_dim + per["h"] * b.hidden) / tp
    out["element-wise"] = m * fwd_bytes * (3 + elem_rec) / hbm
    out["launch"] = KERNELS_PER_BLOCK[mode] * (3 + elem_rec) * LAUNCH_S
    return out


def output_seconds(device: Device, dim: int, vocab: int, tokens: float, tp: int, cp: int, compiled: bool) -> float:
    """The output projection (bf16: Float8 leaves it out) and the loss, forward + backward, for a microbatch."""
    m = tokens / cp
    matmul = 6 * m * dim * vocab / tp / (device.bf16_flops * gemm_efficiency(device, m, dim, vocab / tp))
    loss = m * vocab / tp * LOSS_BYTES_PER_LOGIT["compiled" if compiled else "eager"] / (device.hbm_bw * HBM_EFF)
    return matmul + loss


def optimizer_seconds(device: Device, local_params: float) -> float:
    return OPTIMIZER_BYTES_PER_PARAM * local_params / (device.hbm_bw * HBM_EFF)


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
