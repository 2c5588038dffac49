"""Per-rank peak memory of a training layout, by component.

    peak = model states (parameter, gradient and optimizer shards, buffers: the dry run's real sizes)
         + activations kept for backward (a per-block formula per AC mode) x microbatches in flight
         + the output side (final norm, fp32 log-softmax, logits) x the last stage's microbatches alive
         + the loss's temporaries (fp32 gradients of the log-probabilities and of the logits)
         + communication/temporary buffers (FSDP's unsharded block parameters and gradients)
         + FSDP with several microbatches: gradient sync is off for every microbatch but the last (the
           trainer's gradient accumulation; torch's PipelineStage under PP), so FSDP accumulates the
           gradients unsharded, in fp32 (the reduce dtype), instead of the sharded ones; under PP the
           stage's parameters also stay gathered (compute dtype) for the whole step (no reshard after
           forward or backward)
         + PP receive buffers: torch's PipelineStage allocates, up front and for good, one activation
           buffer per microbatch for each local stage but the first and one gradient buffer per
           microbatch for each but the last (sequence-parallel boundary activations)
         + PP, the last stage, when the schedule returns its outputs (torch before 2025 always did; the trainer
           passes return_outputs=False): every microbatch's logits kept until the step ends, then concatenated
         + allocator overhead (CUDA caching allocator: a stated fraction; CPU: none)
         + CUDA context and NCCL buffers (GPU: a stated constant; CPU: none)

Activation formula, elements per token of one transformer block (D model dim, H FFN hidden, KV the
key/value width, h heads), measured with torchtitan/tools/activation_memory.py on three shapes (see
docs/planning.md) and exact there:
    AC none          10 D + 4 H + h          (norm inputs/outputs, q, attention output, FFN w1/w3/silu/product, lse)
    AC selective op   5 D + 2 KV + 2 H + h   (matmul and attention outputs only)
    AC full           D                      (the block input)
Qwen3.5's blocks (gated softmax attention, Gated DeltaNet, MoE feed-forwards; measured the same way on the
debug flavors' shapes, tests/unit/test_memory_estimate.py, exact up to the conv's K-1 token halo and
per-block constants). Q = query width, h/hkv heads, KD/VD = DeltaNet key/value widths, Hk/Hv its heads of
dk/dv, C its chunk; FFN = 4 H without AC and FFN_op = 2 H + D with op AC (SwiGLU), or the MoE's terms below:
    gated attention, AC none   6 D + 9 Q + 2 KV + 2 h + hkv + FFN
                     AC op     2 D + 3 Q + 2 KV + h + FFN_op
    Gated DeltaNet,  AC none   6 D + 6 KD + 7 VD + 2 Hk + Hv (6 dk + 4 dv + 5 C + 7 + dk dv / C) + FFN
                               (norms and residuals; q/k convs and their inputs and SiLUs, v's conv; the
                               chunked kernel's q, k, k*beta, v, solved [U0 | W], decayed keys and query reads,
                               five C-wide rows per token - pairwise decays, k k^T, the triangular system,
                               q k^T, masked scores -, the corrections U, outputs, one [dk, dv] state per
                               chunk; gates; the output norm, z and its gate)
                     AC op     2 D + 2 KD + 2 VD + 2 Hv + Hv (2 C + 3 dv + dk dv / C) + FFN_op
                               (projections, the kernel's batched matmuls and the chunk loop's four products)
    MoE FFN (E experts, top k of hidden He, shared Hs)
                     AC none   E + 3 k D + 4 k He + 8 k + 1 + 4 Hs (+ D + 1 with the shared expert's gate)
                     AC op     E + 2 k He + k D + 2 Hs (+ D + 1 gated; + D ungated with a shared expert)
    AC full          D
A hybrid model's per-block figure (block_elems_per_token without `kind`) is the average over its blocks, so
blocks x figure is the model's total; the dry run also prints each kind's figure.
Tensor parallel with sequence parallel divides everything by tp except, without AC, the two all-gathered
norm outputs the attention and FFN projections keep (2 D). Context parallel divides tokens by cp; by
all-to-all (ulysses / hierarchical) without AC a block keeps one more D: the attention kernel's output on
head shards, beside the sequence-sharded copy the output projection keeps (measured: docs/context_parallel.md).
CPU eager blocks with document masking read grouped kv heads in place (the CPU flash blocks): without AC they
keep k and v at the kv width, 2 (Q - KV) less than the formula's repeated copies (RankWork.kv_heads_in_place;
measured, tests/unit/test_memory_estimate.py).
"""

import dataclasses
import functools

import torch

from torchtitan.components.loss import AUTO_CHUNK, auto_chunks
from torchtitan.distributed.compile import compiles
from torchtitan.planning.schedule_order import B, F, I, W, passes, schedule_order, splits_backward
from torchtitan.protocols.model import LinearAttentionShape, MoEShape
from torchtitan.tools.precision import DTYPE_NAMES, resolve_precision

RUNTIME_BYTES_GPU = 2 * 2**30
"""CUDA context, NCCL's communicator buffers and cuBLAS workspaces per GPU, outside PyTorch's allocator;
stated, not measured here."""
RUNTIME_COMPONENT = "CUDA context and NCCL buffers"
ALLOCATOR_OVERHEAD_GPU = 0.08
"""Reserved-but-unused fraction of PyTorch's CUDA caching allocator at peak, a typical figure for these
transformer steps (fragmentation between differently sized blocks); stated, not measured here."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    dim: int
    hidden: int
    kv_dim: int
    n_heads: int
    vocab: int
    n_layers: int
    q_dim: int | None = None
    """Width of the query (and attention output) projection; None = dim (Llama). Qwen3 decouples it."""
    gated_attention: bool = False
    """Softmax blocks are Qwen3.5's gated attention (TransformerShape.gated_attention)."""
    linear: LinearAttentionShape | None = None
    """Gated DeltaNet blocks among the n_layers (hybrid models); None = none."""
    moe: MoEShape | None = None
    """The feed-forward of every block is this MoE layer (hidden unused); None = SwiGLU of `hidden`."""

    @classmethod
    def from_args(cls, a) -> "ModelShape | None":
        """The shape the model args declare (BaseModelArgs.transformer_shape), or None for a model that
        declares none (then there is no memory estimate)."""
        s = a.transformer_shape()
        if s is None:
            return None
        q_dim = s.n_heads * s.head_dim
        return cls(s.dim, s.ffn_hidden, s.n_kv_heads * s.head_dim, s.n_heads, s.vocab_size, s.n_layers,
                   None if q_dim == s.dim else q_dim, s.gated_attention, s.linear_attention, s.moe)

    @property
    def hybrid(self) -> bool:
        """Blocks other than Llama-style softmax + SwiGLU: only the memory estimator has formulas for them (the
        step-time planner does not)."""
        return self.gated_attention or self.linear is not None or self.moe is not None

    @functools.cached_property
    def kinds(self) -> dict[str, int]:
        """Block kind -> how many blocks of it."""
        n_linear = self.linear.layers if self.linear else 0
        return {k: n for k, n in (("full_attention", self.n_layers - n_linear), ("linear_attention", n_linear)) if n}

    def _ffn_params(self) -> int:
        d, m = self.dim, self.moe
        if m is None:
            return 3 * d * self.hidden
        return 3 * d * (m.experts * m.hidden + m.shared_hidden) + d * m.experts + (d if m.shared_gate else 0)

    def kind_params(self, kind: str) -> int:
        """Parameters of one block of `kind` (FSDP gathers a block's parameters whole)."""
        d, q = self.dim, self.q_dim or self.dim
        if kind == "linear_attention":
            la = self.linear
            kd, vd = la.key_heads * la.key_head_dim, la.value_heads * la.value_head_dim
            mixer = d * (2 * kd + 2 * vd + 2 * la.value_heads) + vd * d + la.conv_kernel * (2 * kd + vd) \
                + 2 * la.value_heads + la.value_head_dim
        elif self.gated_attention:
            mixer = 3 * d * q + 2 * d * self.kv_dim + 2 * (q // self.n_heads)
        else:
            mixer = 2 * d * q + 2 * d * self.kv_dim
        return mixer + self._ffn_params() + 2 * d

    @functools.cached_property
    def block_params(self) -> int:
        """Parameters of one block (a hybrid model's: the average over its blocks)."""
        kinds = self.kinds
        return round(sum(n * self.kind_params(k) for k, n in kinds.items()) / sum(kinds.values()))


@dataclasses.dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int
    buffers: int = 0
    step_workspace: int = 0
    """What the optimizer step allocates beyond the states (Muon: the gathered matrices and Newton-Schulz
    temporaries of the matrices this rank orthogonalises; AdamW: nothing)."""


@dataclasses.dataclass(frozen=True)
class RankWork:
    """What one rank computes in a step, as the estimator needs it."""

    tokens_per_microbatch: int
    """Tokens of one microbatch on this rank before context parallel (sequences x seq_len)."""
    blocks: int
    """Transformer blocks this rank holds (all its pipeline stages together)."""
    holds_embedding: bool = True
    holds_output: bool = True
    in_flight: float = 1
    """Microbatches whose activations are alive together (1 without PP; up to pp under 1F1B)."""
    out_in_flight: float | None = None
    """PP, the rank holding the last stage: that stage's microbatches whose output side is alive together (the
    final norm's tensors, the loss's saved log-softmax, and the logits - kept by PipelineStage's forward cache
    until the microbatch's backward, then, under split backward, their gradient until the weight pass). None:
    `in_flight` (one stage per rank: every microbatch in flight is the last stage's)."""
    pp_sends_held: float = 0
    """PP, several stages on this rank: activations and input gradients sent to another rank whose tensors the
    schedule still holds (torch's multi-stage runtime waits for its sends only when the step ends, and a send
    keeps its tensor), each tokens/cp x D/tp: a stage's output from its forward (the forward cache holds it until
    its backward anyway; the block formula does not count it) and each input gradient from its pass."""
    grads_live: bool = False
    """Gradients already exist while activations peak (gradient accumulation or several PP microbatches)."""
    tp: int = 1
    cp: int = 1
    fsdp: int = 1
    """Ranks the parameters are sharded over (dp_shard x cp); 1 = no FSDP gathers."""
    ac: str = "none"
    """none | op (selective op) | full | an integer k (selective: every k-th block checkpointed)."""
    act_bytes: int = 4
    """Bytes per activation element (the compute dtype: 2 for bf16 mixed precision)."""
    gathered_param_bytes: int = 4
    unsharded_grad_params: int = 0
    """FSDP with several microbatches: parameters of this rank (after TP) whose gradients accumulate
    unsharded in fp32 (0 = gradients are reduce-scattered per microbatch, or no FSDP)."""
    params_stay_gathered: bool = False
    """PP with FSDP: those parameters also stay gathered for the whole step."""
    pp_recv_buffers: int = 0
    """PP: receive buffers torch's PipelineStage allocates up front and keeps, one per microbatch for the
    activations of each of this rank's stages but the first and for the gradients of each but the last."""
    pp_kept_outputs: int = 0
    """PP, the rank holding the last stage: microbatch outputs (the logits) torch's PipelineStage keeps for the
    schedule's return value, `output_chunks`, until the step ends (torch before 2025 always did; now only with
    `step(return_outputs=True)`: this repository's trainer passes False, so 0 for its jobs). The last microbatch
    runs with the n - 1 earlier ones kept, counted on top of the in-flight peak: exact for 1F1B, whose last rank
    has one microbatch in flight, and for Interleaved1F1B with as many microbatches as ranks (torch's order keeps
    the last rank's in-flight peak through every last-stage backward: planning.schedule_order), an upper bound
    otherwise. At the step's end the schedule concatenates all n into a new tensor beside them."""
    pp_moments: tuple["PPMoment", ...] = ()
    """PP with several stages on this rank and several microbatches: the moments of its schedule that can be its
    peak (`pp_moments`), each with what is alive then; the estimate is the largest. Empty: `in_flight` with
    every gradient, and on the last stage its loss's temporaries (exact with one stage per rank, whose first
    backward starts at its in-flight peak)."""
    on_gpu: bool = False
    loss_chunk_tokens: int = 0
    """Chunked loss (training.loss_chunk_size): tokens of one chunk (its positions x the microbatch's
    sequences); 0 = the plain loss over the whole microbatch."""
    cp_all_to_all: bool = False
    """Context parallel by all-to-all (ulysses / hierarchical): without AC each block also keeps the
    head-sharded attention output beside the sequence-sharded copy its output projection keeps."""
    kv_heads_in_place: bool = False
    """The attention kernel reads grouped kv heads in place instead of repeating them to the query heads: CPU
    eager blocks with document masking (the CPU flash blocks, models/common/attention.py), without context
    parallel. Without AC a block then keeps k and v at their projected width (2 KV per token, not 2 x the query
    width); with AC the formula is unchanged (op AC keeps the projections' outputs either way)."""
    block_activation_bytes: int | None = None
    """Bytes all blocks keep for backward, all microbatches in flight together, when a per-block plan decides
    them (planning/memory_budget.py: keep, op, full, offload or full_offload per block); None = `ac`'s formula for every
    block."""
    loss_parallel: bool = False
    """The loss runs on vocabulary-sharded logits (TP's loss parallel). Eager, its backward (torch's
    `_nll_loss_and_log_softmax_backward`) builds the one-hot update in a zeroed fp32 buffer and returns
    (buffer + exp(log-softmax)) x grad: one fp32 logits-sized tensor more than the plain loss's backward holds."""
    loss_compiled: bool = False
    """The loss is compiled (GPU): inductor fuses the fp32 upcast, log-softmax and its backward into passes over
    the logits, keeping their log-sum-exp per token instead of the fp32 log-softmax and writing the gradient in
    the logits' dtype (no fp32 gradients). Set for GPU ranks (the planner, the dry run's --device-type); CPU
    estimates keep the eager loss's bytes, which bound inductor's CPU loss from above."""
    block_transient_bytes: int = 0
    """With a per-block plan: the largest a block holds during its own backward beyond what it kept (what
    recomputation rebuilds, offloaded groups read back). It comes after the loss's temporaries are freed, with
    the gradients of the blocks already done: see estimate_memory's "block backward" term."""


@dataclasses.dataclass(frozen=True)
class PPMoment:
    """A moment of a pp rank's step, played from torch's order (`pp_moments`)."""

    in_flight: float
    """(stage, microbatch) activations alive, in units of one microbatch through all the rank's stages."""
    grad_share: float
    """Share of the rank's gradients made so far: a stage's appear at its first full or weight-gradient pass."""
    out_in_flight: float = 0.0
    """Microbatches of the last stage (when the rank holds it) whose output side is alive (RankWork.out_in_flight)."""
    sends_held: float = 0.0
    """Sent tensors still held (RankWork.pp_sends_held)."""


@dataclasses.dataclass
class MemoryEstimate:
    components: dict[str, int]

    @property
    def peak(self) -> int:
        return sum(self.components.values())

    @property
    def allocator_reserved(self) -> int:
        """The part of the peak PyTorch's caching allocator holds: what `torch.cuda.max_memory_reserved()` reports
        and torchtitan logs as its memory ("max_reserved"), so what its published tables quote. The CUDA context,
        NCCL's own buffers and the driver's are outside it (RUNTIME_BYTES_GPU)."""
        return self.peak - self.components.get(RUNTIME_COMPONENT, 0)

    def table(self, capacity: float | None = None) -> str:
        rows = [f"  {k:<34} {v / 2**30:>9.3f} GiB" for k, v in self.components.items()]
        rows.append(f"  {'peak':<34} {self.peak / 2**30:>9.3f} GiB")
        if capacity:
            rows[-1] += f"  ({100 * self.peak / capacity:.0f}% of {capacity / 2**30:.0f} GiB)"
        return "\n".join(rows)


def _ffn_elems(shape: ModelShape, ac: str) -> float:
    """What the feed-forward keeps per token (AC none or op; see the module docstring)."""
    d, m = shape.dim, shape.moe
    if m is None:
        return 4 * shape.hidden if ac == "none" else 2 * shape.hidden + d
    if ac == "none":
        routed = m.experts + 3 * m.top_k * d + 4 * m.top_k * m.hidden + 8 * m.top_k + 1
        return routed + 4 * m.shared_hidden + (d + 1 if m.shared_gate and m.shared_hidden else 0)
    routed = m.experts + 2 * m.top_k * m.hidden + m.top_k * d
    return routed + (2 * m.shared_hidden + d + (1 if m.shared_gate else 0) if m.shared_hidden else 0)


def _mixer_elems(shape: ModelShape, kind: str, ac: str) -> float:
    """What the token mixer of a `kind` block keeps per token beyond the block input, norms, residuals and
    feed-forward (AC none or op; see the module docstring)."""
    d, kv, nh = shape.dim, shape.kv_dim, shape.n_heads
    if kind == "linear_attention":
        la = shape.linear
        hv, dk, dv, c = la.value_heads, la.key_head_dim, la.value_head_dim, la.chunk_size
        kd, vd = la.key_heads * dk, hv * dv
        if ac == "none":
            return 6 * kd + 7 * vd + 2 * la.key_heads + hv * (6 * dk + 4 * dv + 5 * c + 7 + dk * dv / c)
        return 2 * kd + 2 * vd + 2 * hv + hv * (2 * c + 3 * dv + dk * dv / c) + d
    q = shape.q_dim or d
    if ac == "none":
        return 9 * q + 2 * kv + 2 * nh + kv // (q // nh)
    return 3 * q + 2 * kv + nh + d


def _hybrid_block_elems(shape: ModelShape, kind: str, ac: str, tp: int) -> float:
    d = shape.dim
    if ac == "full":
        return d / tp
    # AC none: input-side norm (2 D + 1), the residual sum, the FFN norm (2 D + 1) and the block output (6 D + 2).
    # AC op: the block input (kept for recomputation).
    outside = 6 * d + 2 if ac == "none" else d
    per_token = outside + _mixer_elems(shape, kind, ac) + _ffn_elems(shape, ac)
    if ac == "none" and tp > 1:  # the two all-gathered norm outputs stay whole (as for Llama's blocks)
        return 2 * d + (per_token - 2 * d) / tp
    return per_token / tp


OP_HALF_MATMULS = "op_half_matmuls"
"""The AC of published torchtitan runs (2024-25): selective op that recomputes every other matmul of a block
(wk, wo, w3) and saves the others' outputs; the planner does not offer it (this repository's "op" saves all)."""


def block_elems_per_token(shape: ModelShape, ac: str, tp: int = 1, kind: str | None = None) -> float:
    """Activation elements one block keeps per token of the microbatch (see the module docstring). `kind`
    (hybrid models: `linear_attention` / `full_attention`): that kind's blocks; None: the average over the
    model's blocks."""
    if shape.hybrid:
        if ac not in ("none", "op", "full"):
            k = int(ac)  # selective every k-th block: 1/k of the blocks keep only their input
            return (block_elems_per_token(shape, "none", tp, kind) * (k - 1) + shape.dim / tp) / k
        kinds = {kind: 1} if kind else shape.kinds
        return sum(n * _hybrid_block_elems(shape, k, ac, tp) for k, n in kinds.items()) / sum(kinds.values())
    d, h, kv, nh = shape.dim, shape.hidden, shape.kv_dim, shape.n_heads
    none = 2 * d + (8 * d + 4 * h + nh) / tp if tp > 1 else 10 * d + 4 * h + nh
    if ac == "none":
        return none
    if ac == "op":
        return (5 * d + 2 * kv + 2 * h + nh) / tp
    if ac == OP_HALF_MATMULS:  # torchtitan upstream's op policy: of wq wk wv wo w1 w3 w2 it saves the odd ones
        return (4 * d + kv + h + nh) / tp
    if ac == "full":
        return d / tp
    k = int(ac)  # selective every k-th block: 1/k of the blocks keep only their input
    return (none * (k - 1) + d / tp) / k


MUON_STEP_COMPONENT = "Muon step (beyond backward)"


def estimate_memory(shape: ModelShape, state: StateBytes, work: RankWork) -> MemoryEstimate:
    """The rank's peak, by component. With `work.pp_moments`, the largest over those moments of the step."""
    if not work.pp_moments or work.block_activation_bytes is not None:
        return _estimate(shape, state, work, 1.0, work.in_flight, work.out_in_flight, work.pp_sends_held)
    # The moment's three figures are passed beside `work` rather than by dataclasses.replace: the planner
    # estimates some 10^5 moments for a large cluster, and copying RankWork was a third of that time.
    return max((_estimate(shape, state, work, m.grad_share, m.in_flight, m.out_in_flight, m.sends_held)
                for m in work.pp_moments), key=lambda e: e.peak)


def _estimate(shape: ModelShape, state: StateBytes, work: RankWork, grad_share: float, in_flight: float,
              out_in_flight: float | None, sends_held: float) -> MemoryEstimate:
    """The peak with `in_flight` microbatches alive (`out_in_flight` and `sends_held` as the RankWork fields of
    those names: the work's own, or a PP moment's) and `grad_share` of the gradients that accumulate over
    several microbatches made (1 without PP moments; the loss's temporaries, on the last stage, are counted at
    every moment: an upper bound)."""
    w = work
    live_grads = int(state.grads * grad_share)
    tokens = w.tokens_per_microbatch / w.cp
    vocab_local = shape.vocab / w.tp
    blocks = block_elems_per_token(shape, w.ac, w.tp) * w.blocks * w.act_bytes
    if w.cp_all_to_all and w.cp > 1 and w.ac == "none":
        blocks += (shape.q_dim or shape.dim) / w.tp * w.blocks * w.act_bytes
    if w.kv_heads_in_place and not shape.hybrid and w.ac not in ("op", OP_HALF_MATMULS, "full"):
        # The formula counts k and v repeated to the query width; every non-checkpointed block keeps them as
        # projected instead (selective every k-th block: k-1 of k blocks).
        kept = 1.0 if w.ac == "none" else (int(w.ac) - 1) / int(w.ac)
        blocks -= 2 * ((shape.q_dim or shape.dim) - shape.kv_dim) / w.tp * kept * w.blocks * w.act_bytes
    chunked = 0 < w.loss_chunk_tokens < tokens
    # The plain loss keeps the fp32 log-softmax (V per token) for backward; the chunked one keeps nothing.
    fused_loss = w.loss_compiled and not chunked
    outside = shape.dim * w.act_bytes / w.tp if w.holds_embedding else 0
    if not w.holds_embedding and not w.pp_recv_buffers:
        outside += shape.dim * w.act_bytes / w.tp  # the stage input received from the previous stage
    # The output side, per microbatch of the last stage alive: the final norm's input and output, the loss's
    # fp32 log-softmax, and the logits (the caller's; under PP the forward cache's until that microbatch's
    # backward, then under split backward their gradient, the same size, until the weight pass).
    output_side = (2 * shape.dim * w.act_bytes / w.tp + (0 if chunked or fused_loss else 4 * vocab_local)
                   + vocab_local * w.act_bytes) if w.holds_output else 0
    out_in_flight = in_flight if out_in_flight is None else out_in_flight
    activations = int(tokens * ((blocks + outside) * in_flight + output_side * out_in_flight))
    if w.block_activation_bytes is not None:
        activations = w.block_activation_bytes + int(tokens * (outside * in_flight + output_side * out_in_flight))
    # When backward starts, beside the logits (counted above): the fp32 gradient of the log-probabilities and
    # the fp32 gradient of the logits, each over the (local) vocabulary.
    # Chunked: the gradient buffer the logits get (in their dtype), and one chunk's fp32 upcast and fp32
    # softmax (the upcast is freed before the softmax is cast back).
    if chunked:
        loss_temp = int(vocab_local * (tokens * w.act_bytes + w.loss_chunk_tokens * 2 * 4))
    elif fused_loss:  # compiled: the logits' gradient, in their dtype
        loss_temp = int(tokens * vocab_local * w.act_bytes)
    else:
        loss_temp = int(tokens * vocab_local * (3 if w.loss_parallel else 2) * 4)
    loss_temp = loss_temp if w.holds_output else 0
    # FSDP: the current and the prefetched block's parameters gathered, and one block's unsharded gradient.
    fsdp_buffers = 0
    if w.fsdp > 1:  # (the unsharded gradient is part of the accumulated ones when those are kept)
        grad_buffer = 0 if w.unsharded_grad_params else 4
        fsdp_buffers = int(shape.block_params / w.tp * (2 * w.gathered_param_bytes + grad_buffer))
    c = {
        "parameters": state.params,
        "gradients": live_grads,
        "optimizer state": state.optimizer,
        "buffers": state.buffers,
        "activations": activations,
        "loss temporaries": loss_temp,
        "FSDP gather/reduce buffers": fsdp_buffers,
        # Sequence-parallel (1/tp) boundary activations; the stage inputs in flight are among them.
        "PP receive buffers": int(w.pp_recv_buffers * tokens * shape.dim / w.tp * w.act_bytes),
        "PP sends held (until the step ends)": int(sends_held * tokens * shape.dim / w.tp * w.act_bytes),
    }
    logits_bytes = int(tokens * vocab_local * w.act_bytes)  # one microbatch's output of the last stage
    # Inside a block's backward the loss is done and the microbatch's logits are freed (the forward cache hands
    # them over at the start of its backward); the other microbatches' stay among the activations.
    logits_now = logits_bytes if w.holds_output else 0
    if w.pp_kept_outputs and w.holds_output:  # those still in flight are counted among the activations
        c["PP outputs kept (last stage)"] = int(max(0, w.pp_kept_outputs - out_in_flight) * logits_bytes)
    if w.unsharded_grad_params:
        c["gradients"] = 0  # the sharded gradients appear only as the last microbatch reduce-scatters
        c["FSDP unsharded gradients"] = int(4 * w.unsharded_grad_params * grad_share)
        if w.params_stay_gathered:
            c["FSDP gather/reduce buffers"] = 0
            c["FSDP gathered stage (PP)"] = w.gathered_param_bytes * w.unsharded_grad_params
    # Gradients and activations overlap only partly: while backward frees a block's activations it creates
    # that block's gradients. Without gradients from an earlier microbatch the peak is the larger of the two.
    if not w.grads_live and not w.unsharded_grad_params:
        overlap = min(state.grads, activations + loss_temp)
        c["gradients"] = state.grads - overlap
    # A per-block plan's transient (recomputation, offloaded groups read back) happens inside a block's
    # backward: the loss's temporaries are gone by then, and the gradients of the blocks after it exist. (The
    # block's own backward temporaries, the gradients of its intermediates, grow as it frees the saved tensors
    # they replace: they do not come on top of the whole transient.) In block i's backward the kept bytes of
    # blocks <= i and the gradients of blocks >= i are alive: both are bounded by the whole, which is exact at
    # either end of backward (the measured peak of full AC and offload plans on thin blocks is in the blocks'
    # backward, at the first block's with every gradient made). The peak is the larger of this and the start
    # of backward (activations + loss temporaries, counted above).
    if w.block_activation_bytes is not None and w.block_transient_bytes:
        grads = c.get("FSDP unsharded gradients", live_grads)
        during = w.block_activation_bytes + w.block_transient_bytes + grads
        at_start = activations + loss_temp + c["gradients"] + c.get("FSDP unsharded gradients", 0)
        c["block backward (beyond the above)"] = max(0, during - at_start)
    elif w.block_activation_bytes is None and (w.ac == "full" or w.ac.isdigit()) and w.blocks:
        # The same moment under full AC (every block, or every k-th): the block being differentiated replays its
        # forward first, so one microbatch's activations of a block without AC live beside everything kept (its
        # own input is among those), with every gradient already made (the unsharded ones under FSDP with
        # several microbatches; all of them at the first block).
        grads = c.get("FSDP unsharded gradients", live_grads)
        replay = int(tokens * (block_elems_per_token(shape, "none", w.tp) - shape.dim / w.tp) * w.act_bytes)
        during = activations - logits_now + replay + grads
        at_start = activations + loss_temp + c["gradients"] + c.get("FSDP unsharded gradients", 0)
        c["block backward (beyond the above)"] = max(0, during - at_start)
    # At the step's end, with outputs kept, the schedule concatenates them into its return value: activations and
    # the loss's temporaries are gone, and so are FSDP's gathered stage and unsharded gradients (the last backward
    # reduce-scatters and reshards): the sharded gradients and the receive buffers remain.
    if w.pp_kept_outputs and w.holds_output:
        at_end = (state.params + state.grads + state.optimizer + state.buffers + c["PP receive buffers"]
                  + 2 * w.pp_kept_outputs * logits_bytes)
        c["PP outputs merged (step end, beyond the above)"] = max(0, at_end - sum(c.values()))
    # The optimizer step runs after backward: activations are gone and every gradient is live. Its
    # workspace counts only as far as it takes the step above the forward/backward peak.
    if state.step_workspace:
        at_step = state.params + state.grads + state.optimizer + state.buffers + state.step_workspace
        c[MUON_STEP_COMPONENT] = max(0, at_step - sum(c.values()))
    total = sum(c.values())
    c["allocator overhead"] = int(ALLOCATOR_OVERHEAD_GPU * total) if w.on_gpu else 0
    c[RUNTIME_COMPONENT] = RUNTIME_BYTES_GPU if w.on_gpu else 0
    return MemoryEstimate(c)


def ac_key(ac_cfg) -> str:
    """The estimator's AC key for an ActivationCheckpoint config section."""
    if ac_cfg.mode == "selective":
        return "op" if ac_cfg.selective_ac_option == "op" else str(int(ac_cfg.selective_ac_option))
    if ac_cfg.mode == "memory_budget":
        raise ValueError("the memory estimator has no formula for --activation_checkpoint.mode memory_budget")
    return ac_cfg.mode


def in_flight_microbatches(schedule: str, n_microbatches: int, pp: int, pp_rank: int, stages_per_rank: int,
                           pending_weight: float = 0.0) -> float:
    """The most (stage, microbatch) activations a pp rank keeps at once, in units of one microbatch through
    all its stages (the estimator multiplies by the blocks of all local stages). GPipe and LoopedBFS run
    every forward before any backward: all microbatches. 1F1B keeps its pp - rank warm-up forwards;
    Interleaved1F1B its warm-up, (v - 1) x pp + 2 x (pp - 1 - rank) + 1 single-stage forwards (torch's
    formula; the planner evaluates thousands of these, and a test checks it against the played order).
    The split-backward and V-shaped schedules are played from torch's own action order
    (`_peak_stage_activations`); `pending_weight` is what a stage waiting for its weight pass holds beyond
    its activations, in units of them (`split_backward_pending_weight`)."""
    v = stages_per_rank
    if schedule in ("GPipe", "LoopedBFS"):
        return n_microbatches
    if v == 1:
        return min(n_microbatches, pp - pp_rank)
    if schedule == "Interleaved1F1B":
        return min(v * n_microbatches, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1) / v
    return _peak_stage_activations(schedule, n_microbatches, pp, v, round(pending_weight, 3))[pp_rank] / v


def split_backward_pending_weight(shape: ModelShape, ac: str, tp: int = 1) -> float:
    """Between a split backward's input pass and its weight pass a stage keeps, besides its activations
    (recomputed ones included: the input pass recomputes under AC), the gradient arriving at every node where a
    weight joins the graph (torch's `stage_backward_input` hooks them for the weight pass): the linears' outputs
    - q, the attention output and w2's output (D each), k and v (KV each), w1 and w3 (H each) - and the two
    norms' outputs (D each). Returned in units of the activations the AC mode keeps."""
    kept = block_elems_per_token(shape, ac, tp)
    recomputed = block_elems_per_token(shape, "none", tp) - kept
    grads = (5 * shape.dim + 2 * shape.kv_dim + 2 * shape.hidden) / tp
    return (recomputed + grads) / kept


@functools.lru_cache(maxsize=256)
def _peak_stage_activations(
    schedule: str, n_microbatches: int, pp: int, stages_per_rank: int, pending_weight: float = 0.0
) -> tuple[float, ...]:
    """Per pp rank, the peak of (stage, microbatch) activations alive, walking the action order that
    torch's schedule class computes for itself (planning.schedule_order). A
    forward keeps its stage's activations until its backward; schedules that split backward keep them
    through the input-gradient pass until the weight-gradient pass (it needs them), and a stage between the
    two passes counts 1 + pending_weight."""
    order = schedule_order(schedule, n_microbatches, pp, stages_per_rank)
    change = {F: (1, 0), B: (-1, 0), I: (0, 1), W: (-1, -1)}
    peaks = []
    for rank in range(pp):
        alive = pending = 0
        peak = 0.0
        for action in order[rank]:
            for sub in passes(action):  # DualPipeV's overlapped forward and backward: both
                d_alive, d_pending = change.get(sub.computation_type, (0, 0))
                alive, pending = alive + d_alive, pending + d_pending
                peak = max(peak, alive + pending_weight * pending)
        peaks.append(peak)
    return tuple(peaks)


def pp_moments(schedule: str, n_microbatches: int, pp: int, pp_rank: int, stages_per_rank: int,
               pending_weight: float = 0.0, stage_shares: tuple[float, ...] | None = None) -> tuple[PPMoment, ...]:
    """RankWork.pp_moments of a pp rank: torch's action order for the rank walked pass by pass, keeping the
    moments no other exceeds in activations alive, gradients made and (on the rank holding the last stage)
    that stage's microbatches alive, whose output side (RankWork.out_in_flight) weighs more than a block's
    activations. A stage's weight gradients are made
    in its first full or weight-gradient pass, counted from that pass's start, when the microbatch it
    differentiates is still alive. `stage_shares`: each local stage's share of the rank's trainable
    parameters, in stage order (equal when None). () with one stage per rank (its first backward starts at
    its in-flight peak, with every gradient of the rank made during it)."""
    if stages_per_rank == 1:
        return ()
    shares = stage_shares or (1 / stages_per_rank,) * stages_per_rank
    # Without input/weight passes nothing is pending: one walk serves every pending weight.
    split = splits_backward(schedule, n_microbatches, pp, stages_per_rank)
    return tuple(PPMoment(alive / stages_per_rank, sum(shares[i] for i in made), out, sent)
                 for alive, made, out, sent in _moments(schedule, n_microbatches, pp, stages_per_rank,
                                                        round(pending_weight, 3) if split else 0.0, pp_rank))


@functools.lru_cache(maxsize=256)
def _stage_ranks(schedule: str, n_microbatches: int, pp: int, stages_per_rank: int) -> dict[int, int]:
    """Stage index -> the pp rank torch's order runs it on."""
    order = schedule_order(schedule, n_microbatches, pp, stages_per_rank)
    return {p.stage_index: r for r in range(pp) for a in order[r] for p in passes(a)}


@functools.lru_cache(maxsize=4096)
def _moments(schedule: str, n_microbatches: int, pp: int, stages_per_rank: int, pending_weight: float,
             rank: int) -> tuple:
    """A pp rank's undominated moments: (activations alive, local stages whose gradients exist, microbatches
    of the last stage alive - from its forward to its full or weight-gradient pass - when the rank holds it,
    sent tensors held - torch's multi-stage runtime waits for its sends when the step ends: each forward of a
    stage whose next stage is on another rank, each full or input-gradient pass of a stage whose previous
    one is). Per rank: the planner asks for three ranks of a pipeline (the first, the busiest, the last)."""
    order = schedule_order(schedule, n_microbatches, pp, stages_per_rank)
    change = {F: (1, 0), B: (-1, 0), I: (0, 1), W: (-1, -1)}
    last = pp * stages_per_rank - 1
    rank_of = _stage_ranks(schedule, n_microbatches, pp, stages_per_rank)
    local = sorted({p.stage_index for a in order[rank] for p in passes(a)})
    alive = pending = out = sent = 0
    made: frozenset[int] = frozenset()
    # (made, sent) only grow through the walk, so its moments fall into groups, one per state of the two,
    # ordered in time; a later group's state is at least an earlier one's in both.
    groups: dict[tuple[frozenset, int], set[tuple[float, int]]] = {}
    for action in order[rank]:
        for sub in passes(action):
            s, kind = sub.stage_index, sub.computation_type
            if kind in (B, W) and local.index(s) not in made:
                made = made | {local.index(s)}
            groups.setdefault((made, sent), set()).add((alive + pending_weight * pending, out))
            d_alive, d_pending = change.get(kind, (0, 0))
            alive, pending = alive + d_alive, pending + d_pending
            if s == last:
                out += d_alive
            if (kind == F and s != last and rank_of[s + 1] != rank) or (
                    kind in (B, I) and s != 0 and rank_of[s - 1] != rank):
                sent += 1
            groups.setdefault((made, sent), set()).add((alive + pending_weight * pending, out))
    return tuple(sorted(_undominated(groups), key=lambda m: (m[0], sorted(m[1]), m[2], m[3])))


def _undominated(groups: dict[tuple[frozenset, int], set[tuple[float, int]]]) -> list[tuple]:
    """The moments (alive, made, out, sent) no other is at least in every coordinate, from `groups`: per (made,
    sent) state in time order, its (alive, out) points. A state's point is dominated by one of a later state
    at least as large in (alive, out), or by one of its own state larger in one and not smaller in the other;
    walking the states backwards with the later states' most alive per out count, this is near linear in the
    moments, not quadratic."""
    later: dict[int, float] = {}  # out -> the most alive at that out in the states after the current one
    top = []
    for (made, sent), points in reversed(list(groups.items())):
        most_out = None
        for a, o in sorted(points, reverse=True):  # most alive first: kept when more out than all before it
            if most_out is not None and o <= most_out:
                continue
            most_out = o
            if not any(qa >= a for qo, qa in later.items() if qo >= o):
                top.append((a, made, o, sent))
        for a, o in points:
            later[o] = max(a, later.get(o, a))
    return top


def output_in_flight(moments: tuple[PPMoment, ...], stages_per_rank: int) -> float | None:
    """RankWork.out_in_flight outside the moments (a per-block plan's estimate): with one stage per rank, None
    (every microbatch in flight is the last stage's when the rank holds it); with several, the most its moments
    hold (one microbatch when there are none: a single microbatch)."""
    if stages_per_rank == 1:
        return None
    return max((m.out_in_flight for m in moments), default=1.0)


def sends_held(moments: tuple[PPMoment, ...]) -> float:
    """RankWork.pp_sends_held outside the moments (a per-block plan's estimate, one moment for the whole step):
    the most its moments hold, an upper bound like the rest of that estimate."""
    return max((m.sends_held for m in moments), default=0.0)


def pp_recv_buffer_count(n_microbatches: int, stages_per_rank: int, holds_first: bool, holds_last: bool) -> int:
    """Receive buffers a pp rank keeps (RankWork.pp_recv_buffers): per microbatch, one activation buffer
    per local stage that is not the first and one gradient buffer per local stage that is not the last."""
    return n_microbatches * (2 * stages_per_rank - holds_first - holds_last)


def rank_work(cfg, parallel_dims, grad_accum: int, *, blocks: int, holds_embedding: bool, holds_output: bool,
              shape: ModelShape, pp_rank: int = 0, stages_per_rank: int = 1, on_gpu: bool = False,
              fsdp_shard_params: int = 0, stage_shares: tuple[float, ...] | None = None) -> RankWork:
    """RankWork of a job's rank from its config and layout (what the dry run knows about it);
    `fsdp_shard_params` = the rank's trainable parameter elements (its FSDP shard), for FSDP with
    several microbatches; `stage_shares`: each of its pipeline stages' share of them (pp_moments)."""
    pd, t, p = parallel_dims, cfg.training, cfg.parallelism
    compute = t.mixed_precision_param if (pd.fsdp_enabled or t.dtype == "float32") else t.dtype
    if compute == "auto":
        # Every GPU in the planner's device table multiplies bf16 natively; on CPU, what this machine would pick.
        local = DTYPE_NAMES[resolve_precision(t.dtype, "auto", torch.device("cpu")).mixed]
        compute = "bfloat16" if on_gpu else local
    act_bytes = 2 if compute in ("bfloat16", "float16") else 4
    if pd.pp_enabled:
        n_mb = t.local_batch_size // p.pipeline_parallel_microbatch_size
        tokens = p.pipeline_parallel_microbatch_size * t.seq_len
        pending = split_backward_pending_weight(shape, ac_key(cfg.activation_checkpoint), pd.tp)
        in_flight = in_flight_microbatches(p.pipeline_parallel_schedule, n_mb, pd.pp, pp_rank, stages_per_rank, pending)
        recv = pp_recv_buffer_count(n_mb, stages_per_rank, holds_embedding, holds_output)
        grads_live = n_mb > 1 or grad_accum > 1
        moments = pp_moments(p.pipeline_parallel_schedule, n_mb, pd.pp, pp_rank, stages_per_rank, pending,
                             stage_shares) if n_mb > 1 else ()
        out_in_flight = output_in_flight(moments, stages_per_rank)
    else:
        tokens, in_flight, grads_live, recv = t.local_batch_size * t.seq_len, 1, grad_accum > 1, 0
        moments, out_in_flight = (), None
    chunk = t.loss_chunk_size
    if chunk == -1:  # auto: the trainer's rule (components/loss.py)
        loss_parallel = pd.tp > 1 and not p.disable_loss_parallel
        vocab_local = shape.vocab // pd.tp if loss_parallel else shape.vocab
        positions = t.seq_len // pd.cp
        chunk = AUTO_CHUNK if auto_chunks(vocab_local, positions, compiles(cfg, "loss"), loss_parallel) else 0
    chunk_tokens = (tokens // t.seq_len) * chunk if 0 < chunk < t.seq_len // pd.cp else 0
    fsdp = pd.dp_shard * pd.cp if pd.fsdp_enabled else 1
    return RankWork(
        tokens_per_microbatch=tokens, blocks=blocks, holds_embedding=holds_embedding, holds_output=holds_output,
        in_flight=in_flight, out_in_flight=out_in_flight, pp_sends_held=sends_held(moments), grads_live=grads_live,
        pp_moments=moments, tp=pd.tp, cp=pd.cp,
        fsdp=fsdp, ac=ac_key(cfg.activation_checkpoint),
        act_bytes=act_bytes, gathered_param_bytes=act_bytes, on_gpu=on_gpu,
        unsharded_grad_params=fsdp * fsdp_shard_params if fsdp > 1 and grads_live else 0,
        params_stay_gathered=pd.pp_enabled, pp_recv_buffers=recv, loss_chunk_tokens=chunk_tokens,
        cp_all_to_all=p.context_parallel_method != "ring",
        kv_heads_in_place=t.document_masking and not on_gpu and pd.cp == 1 and not compiles(cfg, "model"),
        loss_compiled=on_gpu and compiles(cfg, "loss"),
        loss_parallel=pd.tp > 1 and not p.disable_loss_parallel,
    )
