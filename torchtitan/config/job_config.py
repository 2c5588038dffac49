"""The job configuration: one typed dataclass per TOML section.

The string literal under each field is that field's documentation: `--help` prints it, so this file is the
user manual of every option. Key names follow torchtitan v0.2 so recipes and habits carry over.
"""

from dataclasses import dataclass, field
from typing import ClassVar, Literal


@dataclass
class Job:
    config_file: str | None = None
    """TOML recipe to load (also settable as the first positional argument or `--job.config_file`)."""

    dump_folder: str = "./outputs"
    """Run folder: the resolved config, metrics.jsonl, TensorBoard logs and checkpoints are written under it."""

    description: str = "torchtitan training job"
    """Free text describing the job; logged at start."""

    print_config: bool = False
    """Print the resolved configuration at start (it is always saved to `{dump_folder}/config.toml`)."""

    storage_retry_seconds: float = 120.0
    """How long a request to an object store (a checkpoint or data path given as s3://, gs://, az:// URL) is
    retried, with backoff, on transient errors (connection lost, timeouts, 5xx, throttling) before the save or
    load fails with one line; see docs/object_storage.md."""


@dataclass
class Model:
    name: str = "llama3"
    """Registered model name (see torchtitan/protocols/train_spec.py); each model folder registers its own."""

    flavor: str = "debugmodel"
    """Size preset of the model, e.g. debugmodel, 8B, 70B, 405B for llama3."""

    tokenizer_path: str | None = None
    """Tokenizer file or folder: a tiktoken BPE file (Llama 3 format), a sentencepiece `.model`, a Hugging Face
    `tokenizer.json`, or a folder holding one of them; a local path or an object store URL. None uses the
    tokenizer shipped with the project (trained on the shipped stdlib_docs corpus). The model keeps its own
    vocabulary (flavor, hf_config, overrides) when the tokenizer fits in it, padded rows included; a larger
    tokenizer is refused."""

    converters: list[str] = field(default_factory=list)
    """Model converters applied after building on the meta device, in order, e.g. ["float8"]."""

    print_after_conversion: bool = False
    """Print the model after converters ran."""

    hf_config: str | None = None
    """A Hugging Face model folder (or its config.json; a local path or an object store URL) whose config gives
    the model's shape instead of --model.flavor: every key is read or refused in one line. Typically the folder
    of --checkpoint.initial_load_path with --checkpoint.initial_load_in_hf. A checkpoint's saved config.toml
    records the resolved shape (as overrides), so it reloads without the folder."""

    overrides: list[str] = field(default_factory=list)
    """Fields of the model args set on top of the flavor (or hf_config), as FIELD=VALUE, e.g.
    ["n_layers=4", "rope_scaling.factor=4.0", "moe.top_k=2"]; dotted names reach nested settings, `none`
    clears an optional one. Unknown fields and values of the wrong type are refused."""


@dataclass
class Training:
    dataset: str = "stdlib_docs"
    """Dataset name: `stdlib_docs` (shipped, offline), `c4`, `fineweb` (Hugging Face hub, streamed), `local` with
    `dataset_path` pointing to json/jsonl/parquet/txt files, `chat` with `dataset_path` a jsonl of chat records
    (SFT: only answers are trained); or a folder of pre-tokenized shards (`python -m torchtitan.datasets.pretokenize`)."""

    dataset_path: str | None = None
    """Local file, folder or glob for the dataset (overrides the hub path of a named dataset)."""

    datasets: list[str] = field(default_factory=list)
    """Weighted mixture replacing `dataset`: entries SOURCE:WEIGHT, a SOURCE being a registered dataset name (at
    its default location) or a folder written by `python -m torchtitan.datasets.pretokenize`, e.g.
    ["stdlib_docs:0.7", "/data/web_shards:0.3"]. Which source each sample comes from is drawn from the seed;
    the loss of each source is logged as loss/<source>. Weight 0: a source that a later `mixture_phases`
    phase brings in."""

    dataset_exhausted: Literal["loop", "stop"] = "loop"
    """When a training source runs out: loop (start it over, a new epoch, with a warning) or stop (end
    training with a message)."""

    document_masking: bool = False
    """Attention stays within each document of a packed sequence (block-causal); documents are told apart by
    their BOS tokens."""

    document_positions: bool = False
    """RoPE positions restart at 0 at every document of a packed sequence (use with document_masking)."""

    local_batch_size: int = 8
    """Sequences per microbatch on each data-parallel rank."""

    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks. -1 = local_batch_size x data-parallel degree
    (no accumulation). Gradient accumulation steps = global / (local x data-parallel degree)."""

    seq_len: int = 2048
    """Tokens per training sequence."""

    max_norm: float = 1.0
    """Gradient clipping by global norm; 0 or less disables clipping (the norm is still logged)."""

    steps: int = 10000
    """Number of optimizer steps to train."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the parameters are stored and updated in. bfloat16 = fully low-precision training (warned about
    on a device that emulates bfloat16)."""

    mixed_precision_param: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of parameters in forward/backward (FSDP mixed precision, autocast without FSDP). auto =
    bfloat16 where the device multiplies it natively (CPUs with AVX-512-BF16/AMX or Arm BF16, CUDA compute
    capability >= 8.0), else float32; the log says which and why. float32 gives a pure fp32 run; an explicit
    16-bit dtype the device only emulates runs with a warning."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduction across data-parallel ranks under FSDP."""

    gc_freq: int = 50
    """Run Python's garbage collector every N steps (automatic collection is disabled during training)."""

    enable_cpu_offload: bool = False
    """Offload parameters, gradients and optimizer state to CPU under FSDP (CUDA only)."""

    mixture_phases: list[str] = field(default_factory=list)
    """Mixture schedule: phases after step 0 (which uses `datasets`), each "step=N SOURCE:WEIGHT ... [ramp=M]":
    from step N the weights move linearly over M steps (none: at once) to the listed ones, a source not listed
    getting 0, e.g. ["step=90000 web:0.4 code:0.3 curated:0.3 ramp=1000"] (command line: phases separated by
    commas). Steps must increase. See docs/data.md."""

    mixture_anneal: list[str] = field(default_factory=list)
    """Annealing preset: the SOURCE:WEIGHT entries of a last phase that starts where the LR starts decaying
    (needs lr_scheduler.decay_ratio), e.g. ["curated:0.6", "web:0.2", "code:0.2"]."""

    source_retries: int = 3
    """Times a document source that fails while reading (a dropped stream, a vanished file) is reopened at the
    same document, the k-th retry after source_retry_backoff_s x 2^(k-1) seconds; then the rank stops with one
    line naming the source (a restartable failure for tools/restart.py). A ValueError (a record that does not
    parse) is not retried."""

    source_retry_backoff_s: float = 1.0
    """Seconds before the first retry of a failing source; doubled for each further one."""

    cpu_huge_pages: bool = True
    """CPU runs: torch's tensors of 2 MiB or more go on transparent huge pages (THP_MEM_ALLOC_ENABLE, set by
    the entry point before torch's first tensor; tools/cpu_malloc.py), so the large blocks a step allocates
    afresh fault in 2 MiB at a time instead of 4 KiB (with cpu_keep_freed_memory, only the first time). false: the process restarts once without them. No effect on GPU runs,
    without the kernel's transparent huge pages, or where THP_MEM_ALLOC_ENABLE is set in the environment."""

    cpu_allocator: Literal["glibc", "mimalloc", "jemalloc", "tcmalloc"] = "glibc"
    """CPU runs: the malloc serving the process's tensors. glibc (the default): glibc's, with
    cpu_keep_freed_memory. mimalloc, jemalloc, tcmalloc: that library preloaded (the entry point restarts the
    rank once with LD_PRELOAD, the same pid; it must be installed, pre-flight says so; mimalloc: pip install -e
    ".[cpu]"). Measured (docs/performance.md): mimalloc's peak memory is tighter under varying shapes,
    its steps slower at the 1B slice. An allocator already in LD_PRELOAD is left alone; the log's
    `CPU allocator:` line names what runs. No effect on machines with a GPU."""

    cpu_keep_freed_memory: bool = True
    """CPU runs under glibc's malloc (cpu_allocator glibc): glibc's malloc keeps large freed blocks for the next
    step instead of unmapping each one and page-faulting it in again (tools/cpu_malloc.py), within a bound: the
    free pages go back to the OS (malloc_trim) before a step whose shapes differ from the last step's (another
    sequence length, a validation pass), and when a step leaves the process's resident memory more than
    cpu_kept_heap_growth above the first steps'. Faster steps at the same peak memory as glibc's default (figures: docs/performance.md).
    false: glibc as it starts. --memory.cpu_return_freed (a memory budget) wins over it. No effect on GPU runs
    or without glibc."""

    cpu_kept_heap_growth: float = 0.10
    """The bound on the kept heap (cpu_keep_freed_memory): the fraction by which resident memory after a step
    may exceed the highest of the first two steps' before the free pages are returned. Smaller: tighter memory,
    more steps that fault their blocks in again."""

    loss_chunk_size: int = -1
    """Cross entropy over chunks of this many sequence positions (components/loss.py): no float32
    copy of the whole [tokens x vocabulary] logits, nor of their gradient, exists at once. -1 = auto:
    chunks of 512 where it was measured never slower (an eager loss on logits not sharded by TP's loss
    parallel, with a local vocabulary of 32768 or more and 2048 or more positions), the plain loss
    elsewhere. training.seq_len = one chunk (the plain loss, always). At most training.seq_len. See
    docs/performance.md."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate loss and perplexity on the held-out split during training."""

    freq: int = 100
    """Validate every N steps (and at the last step)."""

    steps: int = 10
    """Validation batches per evaluation; -1 = the whole validation split."""

    local_batch_size: int = 8
    """Sequences per validation batch on each data-parallel rank."""


@dataclass
class Eval:
    """Downstream tasks scored during training (see docs/evaluation.md), by the training ranks in their layout."""

    enable: bool = False
    """Score `tasks` every `freq` steps and at the last step; metrics eval/<task>/<metric> (and _stderr)."""

    freq: int = 500
    """Steps between evaluations (the last step is always evaluated)."""

    tasks: list[str] = field(default_factory=lambda: ["stdlib_next_line"])
    """Tasks to score: lm-evaluation-harness YAML task files with local data (`dataset_path: json`), or the
    names of tasks shipped in torchtitan/assets/eval_tasks (stdlib_next_line)."""

    local_batch_size: int = 8
    """Rows of --training.seq_len tokens per evaluation batch on each data-parallel rank: the batch's token
    budget (one request's row per batch row, as many as fit; under PP or CP rows are packed several to a batch
    row of exactly seq_len)."""

    limit: int = -1
    """Documents of each task to score (the first ones); -1 = all."""

    num_fewshot: int = -1
    """Few-shot examples in each context; -1 = each task file's own num_fewshot."""

    fewshot_seed: int = 1234
    """Seed of the few-shot sampler (lm-evaluation-harness's default, so contexts are the same)."""

    bootstrap_iters: int = 1000
    """Bootstrap resamples for the stderr of perplexities (perplexity, word/byte perplexity, bits per byte:
    eval/<task>/<metric>_stderr), by the harness's estimator and seeds; 0 = none. 1000 (~0.3 s per 1,000
    documents and metric) estimates the stderr within ~2%; the harness's default, 100000, costs 100x that."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon"] = "AdamW"
    """Optimizer class. Muon: Muon for the 2-D weight matrices of the transformer blocks, AdamW (with the
    settings below) for embeddings, output head, norms and biases; see docs/optimizers.md."""

    lr: float = 8e-4
    """Peak learning rate."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    eps: float = 1e-8
    """Adam epsilon."""

    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW) or L2 penalty (Adam)."""

    implementation: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
    """Optimizer kernel (AdamW/Adam, and Muon's AdamW group): auto = fused (one kernel per step for every
    parameter; torch has it on CPU and CUDA) where torch has it for the parameters' device and dtype, foreach
    (multi-tensor) elsewhere; the log names the choice. fused is refused at build time where torch lacks it."""

    muon_momentum: float = 0.95
    """Muon: momentum coefficient of the matrices' momentum buffer."""

    muon_nesterov: bool = True
    """Muon: orthogonalise the Nesterov look-ahead (gradient + momentum x buffer) instead of the buffer."""

    muon_ns_steps: int = 5
    """Muon: quintic Newton-Schulz iterations that orthogonalise each matrix update."""

    muon_ns_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Muon: dtype of the Newton-Schulz iterations. auto = bfloat16 on CUDA, float32 elsewhere (CPUs
    without bf16 units emulate it)."""

    muon_update_rms: float = 0.2
    """Muon: RMS of a matrix's update before the learning rate (orthogonalised update x this x
    sqrt(max(rows, cols))). 0.2 matches AdamW's typical update RMS, so --optimizer.lr and weight_decay serve
    Muon and AdamW parameters alike."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from near zero to the peak learning rate."""

    decay_ratio: float | None = None
    """Warmup-stable-decay: the fraction of training spent decaying at the end. None = decay over all steps
    after warmup (no stable phase)."""

    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay phase."""

    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of the peak."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the model (DDP; HSDP when combined with sharding)."""

    data_parallel_shard_degree: int = -1
    """Ranks each replica is sharded over with FSDP2. -1 = all ranks left after the other degrees."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always (ZeRO-3 memory), never (ZeRO-2 speed), default = always
    except for the last module, whose parameters backward needs at once."""

    tensor_parallel_degree: int = 1
    """Tensor parallel degree (with sequence parallel on norms). For MoE models with expert_parallel_degree 1 it
    also splits every routed and shared expert by its hidden units (expert tensor parallel, docs/moe.md)."""

    expert_parallel_degree: int = 1
    """Ranks the routed experts of MoE models are split over (the "ep" mesh dimension), with all-to-all token
    dispatch. Taken from the ranks that hold different tokens (data_parallel_shard x context_parallel x
    tensor_parallel), so it must divide their product and be a multiple of context_parallel x
    tensor_parallel; FSDP shards the experts over the remaining shard ranks and the dense parts over all.
    1 under tensor parallel: each expert is split over the tp ranks instead (expert tensor parallel)."""

    disable_loss_parallel: bool = False
    """Gather the logits instead of computing cross entropy on vocab shards under tensor parallel."""

    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel collectives with the matmuls they feed (inductor micro-pipelining over symmetric
    memory). Needs CUDA, tensor parallel and --compile.enable with the model compiled."""

    pipeline_parallel_degree: int = 1
    """Ranks the model is cut across (the "pp" mesh dimension); each holds one stage, or two for looped and
    V-shaped schedules."""

    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B (one stage per rank); Interleaved1F1B, LoopedBFS, InterleavedZeroBubble
    (>= 2 stages per rank, stage s on rank s % pp); ZBVZeroBubble, DualPipeV (exactly 2 per rank, V-shaped)."""

    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline microbatch: each schedule step splits the local batch into
    local_batch_size / this microbatches (>= pp for all but GPipe, >= 2 x pp for V-shaped schedules)."""

    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer layers per pipeline stage, counting the embedding and output as the *_less_layers below;
    sets the number of stages. None = 1 stage per rank (2 for looped/V schedules), split evenly by compute."""

    pipeline_parallel_split: Literal["layers", "balanced"] = "layers"
    """How stages are cut when neither module_fqns_per_model_part nor pipeline_parallel_layers_per_stage is set:
    "layers" splits blocks evenly, the embedding and output counting as the *_less_layers below; "balanced"
    cuts contiguous stages that minimise the slowest stage's training FLOPs (exact; the output projection
    weighs in by its vocabulary matmul), ignoring *_less_layers."""

    pipeline_parallel_first_stage_less_layers: int = 1
    """Layers fewer on the first stage, which also holds the embedding."""

    pipeline_parallel_last_stage_less_layers: int = 1
    """Layers fewer on the last stage, which also holds the norm and output projection."""

    module_fqns_per_model_part: list[list[str]] | None = None
    """Explicit split: module names per stage, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm",
    "output"]]."""

    context_parallel_degree: int = 1
    """Ranks each sequence is split over. seq_len must be a multiple of 2 x this degree
    (x tensor_parallel_degree). See docs/context_parallel.md."""

    context_parallel_method: Literal["ring", "ulysses", "hierarchical"] = "ring"
    """How attention sees the whole sequence under context parallel. "ring": ring attention, k/v shards
    travel around the cp ranks (any head count; moves ~(cp-1)/cp of the sequence's k/v per layer).
    "ulysses": an all-to-all turns sequence shards into head shards, the model's own attention kernel runs
    over the whole sequence for heads/cp heads, a second all-to-all returns sequence shards (moves ~4/cp of
    the activations per layer; cp must divide the heads each tensor-parallel rank holds). "hierarchical":
    ulysses inside groups of context_parallel_a2a_degree ranks, ring across the groups."""

    context_parallel_a2a_degree: int = 0
    """Ranks of one all-to-all group: 0 = all cp ranks for "ulysses"; "hierarchical" needs a divisor of
    context_parallel_degree above 1 (a node's fast links), and the ring spans degree/a2a_degree groups."""

    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How key/value shards travel around the ring (methods "ring" and "hierarchical"): "allgather" gathers
    every ring rank's k/v once per layer (keeps O(seq_len) k/v per rank for backward); "alltoall" passes
    shards rank to rank by point-to-point sends, a ring rotation, not the all-to-all of "ulysses" (keeps only
    the local O(seq_len/cp) shard: use it for long sequences)."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the latest one in `{dump_folder}/{folder}`."""

    folder: str = "checkpoint"
    """Checkpoint folder under dump_folder, or an object store URL used as it is (`s3://bucket/run/checkpoint`,
    `gs://...`, `az://...`; credentials from the environment, see docs/object_storage.md)."""

    interval: int = 500
    """Save every N steps (and at the last step)."""

    load_step: int = -1
    """Resume from this step instead of the latest (-1 = latest complete checkpoint)."""

    keep_latest_k: int = 10
    """Checkpoints kept; older ones are removed. 0 keeps all."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Save in the background: async, or async with pinned-memory staging (CUDA only)."""

    last_save: Literal["full", "full_and_export", "export_only", "full_and_hf", "hf_only"] = "full"
    """What the last step writes: `full` = the whole training state (`step-N`; rerunning with more
    --training.steps extends the run); `full_and_export` = that and the model weights alone (`export-step-N`,
    in export_dtype, for generation and conversion); `export_only` = the export alone (smaller, but the run
    cannot be extended: a rerun refuses and names the options that continue from the export's weights);
    `full_and_hf` / `hf_only` = the whole state and / or a Hub-ready Hugging Face folder (`hf-step-N`:
    safetensors in export_dtype split at hf_max_shard_mb with save_pretrained's index, config.json,
    generation_config.json, tokenizer files), written from the sharded ranks without gathering the model."""

    export_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the model-only export (export-step-N)."""

    initial_load_path: str | None = None
    """Checkpoint to start from when the run folder has none (e.g. a seed checkpoint or a converted model); a local
    path or an object store URL (s3://..., docs/object_storage.md), a Hugging Face folder included."""

    initial_load_model_only: bool = True
    """Load only model weights from initial_load_path."""

    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face folder (config.json + *.safetensors)."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not to load when resuming, e.g. ["dataloader", "lr_scheduler"]."""

    keep_every_n_steps: int = 0
    """Milestones: besides the keep_latest_k newest, keep every checkpoint whose step is a multiple of this,
    forever (0: none). Must be a multiple of `interval` (else no saved step is one)."""

    keep_steps: list[int] = field(default_factory=list)
    """Named steps kept forever besides keep_latest_k, e.g. [1000, 5000]; each must be a saved step (a multiple
    of `interval`, or training.steps)."""

    hf_interval: int = 0
    """Also write a Hugging Face folder (`hf-step-N`, see last_save) every N steps; 0 = only as last_save says.
    Needs `enable`; the folders are not resume points and retention (keep_latest_k) never removes them."""

    hf_max_shard_mb: int = 5000
    """Size limit of one safetensors file in Hugging Face folders written by the run (save_pretrained's
    max_shard_size, in MB of 10^6 bytes); a larger model is split into model-0000i-of-0000n.safetensors."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every N steps."""

    straggler_threshold: float = 0.2
    """Warn when the slowest rank needs this fraction more time per step than the median rank to get its
    gradients ready (measured per rank, gathered every log step; straggler/* in metrics.jsonl)."""

    enable_tensorboard: bool = False
    """Write TensorBoard scalars under `{dump_folder}/{save_tb_folder}`."""

    save_tb_folder: str = "tb"
    """TensorBoard folder under dump_folder."""

    enable_wandb: bool = False
    """Log to Weights & Biases (WANDB_MODE=offline works without a network)."""

    rank_0_only: bool = True
    """Only rank 0 prints and writes metrics."""

    disable_color_printing: bool = False
    """Plain console output."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces."""

    save_traces_folder: str = "profile_traces"
    """Trace folder under dump_folder."""

    profile_freq: int = 10
    """Profile one step every N steps."""

    enable_memory_snapshot: bool = False
    """Dump CUDA memory snapshots (CUDA only)."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "memory_budget"] = "none"
    """Recompute activations in backward: none, full (every block), selective (see selective_ac_option), or
    memory_budget (the compiler picks what to save under `memory_budget`; needs compile of the model)."""

    selective_ac_option: str = "op"
    """Selective AC: an integer k checkpoints every k-th block; "op" saves matmul and attention outputs and
    recomputes the cheap element-wise ops."""

    memory_budget: float = 0.5
    """memory_budget mode: saved activations as a fraction of no-AC's (0 = recompute all it can, 1 = no AC)."""


@dataclass
class Memory:
    """A per-rank memory budget, and what each transformer block does with its activations
    (docs/memory_budget.md)."""

    budget_gib: float = 0.0
    """Per-rank peak memory budget in GiB; 0 = none. Before any rank starts, the planner
    (torchtitan/planning/memory_budget.py) chooses per block keep, op (selective op recompute), full
    (recompute), offload or full_offload (recompute from an offloaded input), by an exact search for the
    least predicted step time whose estimated peak stays within the budget; it prints the plan, or refuses with
    the smallest budget that could work. Needs --activation_checkpoint.mode none (the plan decides
    recomputation) and empty --memory.block_choices."""

    block_choices: list[str] = field(default_factory=list)
    """Per-block choices by hand, one per transformer block in order (or one for every block): keep, op
    (selective AC, op policy), full (full AC), offload (saved activations to --memory.offload_dir on CPU,
    to pinned host memory on CUDA) or full_offload (full AC whose saved input is offloaded: the block keeps
    nothing in RAM). Empty = --activation_checkpoint decides, or the budget's planner."""

    plan_choices: list[str] = field(default_factory=lambda: ["keep", "op", "full", "offload", "full_offload",
                                                               "optimizer"])
    """The choices the budget's planner may use per block (e.g. keep,op,full: no offload), and "optimizer":
    it may offload the optimizer state (--memory.offload_optimizer; CPU runs without checkpointing)."""

    offload_prefetch: bool = True
    """Offload: write a block's group while the next block runs forward and read the next group back while
    this one runs backward (two groups in RAM, the moves hidden behind compute); false = move each group
    while its block waits (one group in RAM). The budget's planner sets it."""

    offload_dir: str = ""
    """CPU offload: directory for the offloaded activations' files (default: the system temp directory).
    Use a local disk: on a tmpfs the files stay in RAM."""

    offload_bandwidth_gbps: float = 0.0
    """Bandwidth (GB/s, each way) of the offload tier the planner prices offload with; 0 = the stated default
    (CPU files: OFFLOAD_BANDWIDTH_CPU; CUDA pinned host: OFFLOAD_BANDWIDTH_CUDA in planning/memory_budget.py).
    scripts/benchmarks/bench_memory_budget.py measures this machine's."""

    host_gib: float = 0.0
    """Host RAM of one node in GiB that a memory plan may fill; 0 = this machine's (os.sysconf), or, on a dry
    run or layout plan for another machine (--device-type), unchecked until given. The budget's plan puts on
    the host, per rank: on CUDA the offloaded blocks' saved tensors and inputs (pinned host memory) and the
    state --training.enable_cpu_offload moves there; on CPU the whole rank. That x ranks per node (NNODES
    splits the world; a GPU type's node size on a dry run) must fit, or the plan is refused in one line."""

    cpu_return_freed: bool = False
    """CPU runs: glibc unmaps every freed block of 128 KiB or more (a fixed mmap threshold instead of its
    dynamic one, which keeps freed blocks of up to 32 MiB in a heap that never shrinks), so the process's
    resident memory follows its live tensors (tools/cpu_malloc.py). The budget's planner sets it on CPU.
    It wins over --training.cpu_keep_freed_memory."""

    offload_optimizer: bool = False
    """CPU: keep the optimizer state in files in --memory.offload_dir between steps and stream it through RAM
    one block's parameters at a time in each step (components/optim/optimizer_offload.py; bitwise the same
    training). The budget's planner sets it when parameters + optimizer state break the budget and it is in
    --memory.plan_choices as "optimizer". Not with checkpointing or Muon; on CUDA use
    --training.enable_cpu_offload."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile the components listed in `components`."""

    auto: bool = True
    """When `enable` is off: compile the transformer blocks anyway if the run is long enough to repay the
    compile (steps x ~4.5% of an estimated eager step > the compile's ~45 s cold / ~8 s with this job's kernels
    cached; distributed/compile_auto.py). Short runs (tests, debug recipes) and multi-process CPU runs stay
    eager. The log names the choice and its figures. false: compile only what `enable` asks."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: "model" (each transformer block) and/or "loss". Compiled kernels are cached in
    $TORCHINDUCTOR_CACHE_DIR (default: $TORCHTITAN_CACHE_DIR/inductor/<cpu isa> or ~/.cache/torchtitan/inductor/<cpu isa>)."""

    backend: str = "inductor"
    """The torch.compile backend: "inductor" generates fused kernels (the speed-up); "aot_eager" traces the
    forward and backward exactly as inductor receives them but runs them with eager kernels, with no code
    generation: a check that a model and layout compile, at a fraction of inductor's compile time (tests)."""


@dataclass
class Float8:
    recipe_name: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Float8 scaling: tensorwise dynamic or rowwise."""

    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP parameters in float8 (tensorwise only)."""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Compute float8 scales for all FSDP parameters in one kernel after the optimizer step."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose names contain one of these stay in high precision (as do layers with a dimension
    that is not a multiple of 16). Converting no layer at all is an error."""

    emulate: bool = False
    """Emulate float8 matmuls in float32 (for CPUs and GPUs without fp8 tensor cores; slow, for correctness)."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout for the first collectives (process-group start-up, model building)."""

    train_timeout_seconds: int = 100
    """Timeout for collectives once training has started."""

    hang_timeout_seconds: float = 30.0
    """Hang diagnosis (keep it well below train_timeout_seconds): when a rank has waited this long in a
    collective that other ranks have not reached, it logs the collective (per-group sequence number and name)
    and the ranks that have not arrived, and every rank dumps its Python stack to {dump_folder}/hang/rank-N.txt.
    0 turns it off."""

    trace_buf_size: int = 0
    """CUDA: record the last N collectives per rank in NCCL's flight recorder and dump them to
    {dump_folder}/comm_traces/rank_N when a collective times out (e.g. 20000). 0 = off."""


@dataclass
class FaultTolerance:
    enable: bool = False
    """Fault-tolerant data-parallel replica groups (torchft; see docs/reliability.md): each group is its own
    torchrun job, gradients are averaged over the live groups every step, a group that dies is dropped without
    stopping the others, and a (re)joining group copies the training state from a live peer. Needs
    `pip install torchft==0.2.0` and a lighthouse (`torchft_lighthouse`) whose address is in TORCHFT_LIGHTHOUSE."""

    replica_id: int = 0
    """This group's index, 0..group_size-1 (it picks the group's share of the data)."""

    group_size: int = 1
    """How many replica groups the job has (the data is split among all of them)."""

    min_replica_size: int = 1
    """Steps are committed only while at least this many groups are in the quorum."""

    timeout_seconds: float = 10.0
    """Timeout of the collectives between groups: a dead group is noticed after at most this long."""

    quorum_timeout_seconds: float = 60.0
    """How long a group waits to form a quorum at the lighthouse."""


@dataclass
class Debug:
    seed: int | None = None
    """Random seed for weights, dropout and data order. None = 0 for weights, with non-deterministic kernels."""

    deterministic: bool = False
    """Use deterministic algorithms (slower; for exact reproducibility)."""


@dataclass
class Guard:
    """The spike and non-finite guard (components/faults/step_guard.py): every step the global loss and gradient norm
    are judged against the last `window` accepted steps; see docs/reliability.md."""

    enable: bool = False
    """Judge every step; off, a non-finite gradient norm stops the run (as before) and spikes go unnoticed."""

    window: int = 20
    """Accepted steps the baseline and the spread are taken over (at least 4: pre-flight refuses fewer); spikes
    are judged once it is full (non-finite values always)."""

    threshold: float = 6.0
    """Judged on the log scale against the window: a loss is a spike above max(window) x max(1.6, exp(threshold
    x 1.4826 x MAD)) (MAD of the window's log losses: `threshold` robust standard deviations, where the window is
    noisier than 1.6x), a gradient norm above 100x the window's median (no spread term: its spread is trends and
    clipped spikes). A steady rise (LR warmup, a batch change) moves the baselines with it, and an isolated
    gradient-norm spike that clipping absorbs (tens of times, MoE) is no event; docs/reliability.md has the
    measurements."""

    action: Literal["skip", "rollback"] = "skip"
    """skip: no optimizer update for that step (the LR schedule and the data position advance as usual);
    rollback: reload the last complete checkpoint and skip the data window of the offending step, then go on
    (needs --checkpoint.enable)."""

    max_events: int = 3
    """Events allowed within `event_span` steps; the next one stops the run with one line (0: the first event
    stops it)."""

    event_span: int = 100
    """The sliding span of steps `max_events` counts over: an event at step s counts until step s + event_span
    (by step number, so the events of a step trained again after a rollback all count); 0: the whole run."""

    replica_check_interval: int = 0
    """Silent-corruption check (components/faults/replica_check.py): every N steps the data-parallel replicas (HSDP's
    replicate dim, DDP, the same rank of every torchft replica group) compare a fingerprint of their parameters and optimizer state; 0 = off. Independent of
    `enable`."""

    replica_check_action: Literal["stop", "restart"] = "stop"
    """On a mismatch, naming the ranks: stop (not restarted by tools/restart.py), or restart (the supervisor
    restarts the run from the last checkpoint, which every replica reloads alike)."""


@dataclass
class JobConfig:
    # Options that no longer exist -> what replaces them (the config loader's error message names it).
    RETIRED_OPTIONS: ClassVar[dict[str, str]] = {
        "checkpoint.last_save_model_only": "checkpoint.last_save (true was export_only; full keeps the run "
        "extendable, full_and_export writes both)",
    }

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    memory: Memory = field(default_factory=Memory)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    debug: Debug = field(default_factory=Debug)
    guard: Guard = field(default_factory=Guard)
    lora: "LoRA" = field(default_factory=lambda: LoRA())


@dataclass
class LoRA:
    """Low-rank adapters (`--model.converters lora`, see docs/fine_tuning.md): each targeted linear layer y = W x
    becomes y = W x + (alpha / rank) B A x with A [rank, in] and B [out, rank] trainable and everything else
    frozen. B starts at zero, so step 0 computes exactly the base model."""

    rank: int = 8
    """Rank of each adapter (1 to the smaller dimension of every targeted layer)."""

    alpha: float = 16.0
    """Scale numerator: the update is multiplied by alpha / rank (peft's lora_alpha)."""

    dropout: float = 0.0
    """Dropout on the adapter's input (training only); 0 keeps runs layout-independent bit for bit."""

    target_modules: list[str] = field(default_factory=lambda: ["layers.*.attention.*"])
    """Which linear layers get adapters: fnmatch patterns on the module name (`*` also crosses dots), e.g.
    ["layers.*.attention.wq", "layers.*.attention.wv"] or ["layers.*"] (every linear of the blocks); the
    default adapts the attention projections. Every pattern must match at least one module, and at
    least one linear layer must be matched."""
