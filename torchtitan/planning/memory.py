"""Per-rank peak memory of a training layout, by component.

    peak = model states (parameter, gradient and optimizer shards, buffers: the dry run's real sizes)
         + activations kept for backward (a per-block formula per AC mode) x microbatches in flight
         + the loss's temporaries (logits, fp32 gradients of the log-probabilities and of the logits)
         + communication/temporary buffers (FSDP's unsharded block parameters and gradients)
         + FSDP with several microbatches: gradient sync is off for every microbatch but the last (the
           trainer's gradient accumulation; torch's PipelineStage under PP), so FSDP accumulates the
           gradients unsharded, in fp32 (the reduce dtype), instead of the sharded ones; under PP the
           stage's parameters also stay gathered (compute dtype) for the whole step (no reshard after
           forward or backward)
         + PP receive buffers: torch's PipelineStage allocates, up front and for good, one activation
           buffer per microbatch for each local stage but the first and one gradient buffer per
           microbatch for each but the last (sequence-parallel boundary activations)
         + allocator overhead (CUDA caching allocator: a stated fraction; CPU: none)
         + CUDA context and NCCL buffers (GPU: a stated constant; CPU: none)

Activation formula, elements per token of one transformer block (D model dim, H FFN hidden, KV the
key/value width, h heads), measured with torchtitan/tools/activation_memory.py on three shapes (see
docs/planning.md) and exact there:
    AC none          10 D + 4 H + h          (norm inputs/outputs, q, attention output, FFN w1/w3/silu/product, lse)
    AC selective op   5 D + 2 KV + 2 H + h   (matmul and attention outputs only)
    AC full           D                      (the block input)
Tensor parallel with sequence parallel divides everything by tp except, without AC, the two all-gathered
norm outputs the attention and FFN projections keep (2 D). Context parallel divides tokens by cp; by
all-to-all (ulysses / hierarchical) without AC a block keeps one more D: the attention kernel's output on
head shards, beside the sequence-sharded copy the output projection keeps (measured: docs/context_parallel.md).
"""

import dataclasses
import functools

import torch

from torchtitan.components.loss import AUTO_CHUNK, auto_chunks
from torchtitan.distributed.compile import compiles
from torchtitan.planning.schedule_order import B, F, I, W, passes, schedule_order
from torchtitan.tools.precision import DTYPE_NAMES, resolve_precision

RUNTIME_BYTES_GPU = 2 * 2**30
"""CUDA context, NCCL's communicator buffers and cuBLAS workspaces per GPU, outside PyTorch's allocator;
stated, not measured here."""
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

    @classmethod
    def from_args(cls, a) -> "ModelShape | None":
        """The shape the model args declare (BaseModelArgs.transformer_shape), or None for a model that is
        not a dense decoder of this shape (e.g. MoE): then there is no memory estimate."""
        s = a.transformer_shape()
        if s is None:
            return None
        q_dim = s.n_heads * s.head_dim
        return cls(s.dim, s.ffn_hidden, s.n_kv_heads * s.head_dim, s.n_heads, s.vocab_size, s.n_layers,
                   None if q_dim == s.dim else q_dim)

    @property
    def block_params(self) -> int:
        q = self.q_dim or self.dim
        return 2 * self.dim * q + 2 * self.dim * self.kv_dim + 3 * self.dim * self.hidden + 2 * self.dim


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
    on_gpu: bool = False
    loss_chunk_tokens: int = 0
    """Chunked loss (training.loss_chunk_size): tokens of one chunk (its positions x the microbatch's
    sequences); 0 = the plain loss over the whole microbatch."""
    cp_all_to_all: bool = False
    """Context parallel by all-to-all (ulysses / hierarchical): without AC each block also keeps the
    head-sharded attention output beside the sequence-sharded copy its output projection keeps."""
    block_activation_bytes: int | None = None
    """Bytes all blocks keep for backward, all microbatches in flight together, when a per-block plan decides
    them (planning/memory_budget.py: keep, op, full or offload per block); None = `ac`'s formula for every
    block."""


@dataclasses.dataclass
class MemoryEstimate:
    components: dict[str, int]

    @property
    def peak(self) -> int:
        return sum(self.components.values())

    def table(self, capacity: float | None = None) -> str:
        rows = [f"  {k:<34} {v / 2**30:>9.3f} GiB" for k, v in self.components.items()]
        rows.append(f"  {'peak':<34} {self.peak / 2**30:>9.3f} GiB")
        if capacity:
            rows[-1] += f"  ({100 * self.peak / capacity:.0f}% of {capacity / 2**30:.0f} GiB)"
        return "\n".join(rows)


def block_elems_per_token(shape: ModelShape, ac: str, tp: int = 1) -> float:
    """Activation elements one block keeps per token of the microbatch (see the module docstring)."""
    d, h, kv, nh = shape.dim, shape.hidden, shape.kv_dim, shape.n_heads
    none = 2 * d + (8 * d + 4 * h + nh) / tp if tp > 1 else 10 * d + 4 * h + nh
    if ac == "none":
        return none
    if ac == "op":
        return (5 * d + 2 * kv + 2 * h + nh) / tp
    if ac == "full":
        return d / tp
    k = int(ac)  # selective every k-th block: 1/k of the blocks keep only their input
    return (none * (k - 1) + d / tp) / k


MUON_STEP_COMPONENT = "Muon step (beyond backward)"


def estimate_memory(shape: ModelShape, state: StateBytes, work: RankWork) -> MemoryEstimate:
    w = work
    tokens = w.tokens_per_microbatch / w.cp
    vocab_local = shape.vocab / w.tp
    blocks = block_elems_per_token(shape, w.ac, w.tp) * w.blocks * w.act_bytes
    if w.cp_all_to_all and w.cp > 1 and w.ac == "none":
        blocks += (shape.q_dim or shape.dim) / w.tp * w.blocks * w.act_bytes
    chunked = 0 < w.loss_chunk_tokens < tokens
    # The plain loss keeps the fp32 log-softmax (V per token) for backward; the chunked one keeps nothing.
    outside = (shape.dim * w.act_bytes / w.tp if w.holds_embedding else 0) + (
        2 * shape.dim * w.act_bytes / w.tp + (0 if chunked else 4 * vocab_local) if w.holds_output else 0
    )
    if not w.holds_embedding and not w.pp_recv_buffers:
        outside += shape.dim * w.act_bytes / w.tp  # the stage input received from the previous stage
    activations = int(tokens * (blocks + outside) * w.in_flight)
    if w.block_activation_bytes is not None:
        activations = w.block_activation_bytes + int(tokens * outside * w.in_flight)
    # When backward starts: the logits (still referenced by the caller), the fp32 gradient of the
    # log-probabilities and the fp32 gradient of the logits, each over the (local) vocabulary.
    # Chunked: the logits and the gradient buffer they get (both in the logits' dtype), and one chunk's
    # fp32 upcast and fp32 softmax (the upcast is freed before the softmax is cast back).
    if chunked:
        loss_temp = int(vocab_local * (2 * tokens * w.act_bytes + w.loss_chunk_tokens * 2 * 4))
    else:
        loss_temp = int(tokens * vocab_local * (w.act_bytes + 2 * 4))
    loss_temp = loss_temp if w.holds_output else 0
    # FSDP: the current and the prefetched block's parameters gathered, and one block's unsharded gradient.
    fsdp_buffers = 0
    if w.fsdp > 1:  # (the unsharded gradient is part of the accumulated ones when those are kept)
        grad_buffer = 0 if w.unsharded_grad_params else 4
        fsdp_buffers = int(shape.block_params / w.tp * (2 * w.gathered_param_bytes + grad_buffer))
    c = {
        "parameters": state.params,
        "gradients": state.grads,
        "optimizer state": state.optimizer,
        "buffers": state.buffers,
        "activations": activations,
        "loss temporaries": loss_temp,
        "FSDP gather/reduce buffers": fsdp_buffers,
        # Sequence-parallel (1/tp) boundary activations; the stage inputs in flight are among them.
        "PP receive buffers": int(w.pp_recv_buffers * tokens * shape.dim / w.tp * w.act_bytes),
    }
    if w.unsharded_grad_params:
        c["gradients"] = 0  # the sharded gradients appear only as the last microbatch reduce-scatters
        c["FSDP unsharded gradients"] = 4 * w.unsharded_grad_params
        if w.params_stay_gathered:
            c["FSDP gather/reduce buffers"] = 0
            c["FSDP gathered stage (PP)"] = w.gathered_param_bytes * w.unsharded_grad_params
    # Gradients and activations overlap only partly: while backward frees a block's activations it creates
    # that block's gradients. Without gradients from an earlier microbatch the peak is the larger of the two.
    if not w.grads_live and not w.unsharded_grad_params:
        overlap = min(state.grads, activations + loss_temp)
        c["gradients"] = state.grads - overlap
    # The optimizer step runs after backward: activations are gone and every gradient is live. Its
    # workspace counts only as far as it takes the step above the forward/backward peak.
    if state.step_workspace:
        at_step = state.params + state.grads + state.optimizer + state.buffers + state.step_workspace
        c[MUON_STEP_COMPONENT] = max(0, at_step - sum(c.values()))
    total = sum(c.values())
    c["allocator overhead"] = int(ALLOCATOR_OVERHEAD_GPU * total) if w.on_gpu else 0
    c["CUDA context and NCCL buffers"] = RUNTIME_BYTES_GPU if w.on_gpu else 0
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
    (recomputed ones included: the input pass recomputes under AC), the gradients of its linears' outputs,
    which the weight pass multiplies: q, the attention output and w2's output (D each), k and v (KV each),
    w1 and w3 (H each). Returned in units of the activations the AC mode keeps."""
    kept = block_elems_per_token(shape, ac, tp)
    recomputed = block_elems_per_token(shape, "none", tp) - kept
    grads = (3 * shape.dim + 2 * shape.kv_dim + 2 * shape.hidden) / tp
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


def pp_recv_buffer_count(n_microbatches: int, stages_per_rank: int, holds_first: bool, holds_last: bool) -> int:
    """Receive buffers a pp rank keeps (RankWork.pp_recv_buffers): per microbatch, one activation buffer
    per local stage that is not the first and one gradient buffer per local stage that is not the last."""
    return n_microbatches * (2 * stages_per_rank - holds_first - holds_last)


def rank_work(cfg, parallel_dims, grad_accum: int, *, blocks: int, holds_embedding: bool, holds_output: bool,
              shape: ModelShape, pp_rank: int = 0, stages_per_rank: int = 1, on_gpu: bool = False,
              fsdp_shard_params: int = 0) -> RankWork:
    """RankWork of a job's rank from its config and layout (what the dry run knows about it);
    `fsdp_shard_params` = the rank's trainable parameter elements (its FSDP shard), for FSDP with
    several microbatches."""
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
    else:
        tokens, in_flight, grads_live, recv = t.local_batch_size * t.seq_len, 1, grad_accum > 1, 0
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
        in_flight=in_flight, grads_live=grads_live, tp=pd.tp, cp=pd.cp,
        fsdp=fsdp, ac=ac_key(cfg.activation_checkpoint),
        act_bytes=act_bytes, gathered_param_bytes=act_bytes, on_gpu=on_gpu,
        unsharded_grad_params=fsdp * fsdp_shard_params if fsdp > 1 and grads_live else 0,
        params_stay_gathered=pd.pp_enabled, pp_recv_buffers=recv, loss_chunk_tokens=chunk_tokens,
        cp_all_to_all=p.context_parallel_method != "ring",
    )
