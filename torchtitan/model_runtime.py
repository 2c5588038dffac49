"""A job's model on its ranks, laid out as the job says, and its validation forward: what the trainer and
`python -m torchtitan.eval` share.

    plan_job ─▶ process group ─▶ mesh (parallel_dims) ─▶ model on meta ─▶ parallelize (or pipeline stages)
    ─▶ weights on device ─▶ forward loss sums in any layout (pipeline schedule, cp shards, loss parallel)

The trainer (torchtitan/trainer.py) adds the data, the optimizer, the checkpoint manager and the loop;
`ModelRuntime.for_checkpoint` (the evaluation entry point) adds only the model's weights, loaded from a
checkpoint through the trainer's own initial load (DCP resharding, or each rank's slices of a Hugging Face
folder), with no optimizer state anywhere.
"""

import contextlib
import logging
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.components.checkpoint import manager as ckpt
from torchtitan.components.loss import first_label_slot, loss_value, per_source_loss_sums, pop_source_ids
from torchtitan.config import JobConfig
from torchtitan.distributed import hang_watch
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.context_parallel import shard_batch
from torchtitan.job_plan import JobPlan
from torchtitan.protocols.model import ModelOutput, as_model_output, mtp_settings, split_inputs
from torchtitan.tools import cpu_malloc
from torchtitan.tools.logging import init_logger, logger


class ModelRuntime:
    """The pieces of a run that hold and run the model: `start` joins the process group, `lay_out` builds the
    mesh of the plan's layout, `build_model` parallelizes the plan's model and initialises its weights. Fields
    after build_model: device, rank, world_size, parallel_dims, mesh, dp_rank, dp_degree, spec, model_args,
    tokenizer, converters, loss_fn, model_parts, pipeline, autocast."""

    source_names: list[str] = []  # a data mixture's sources (the trainer's loader sets them)

    def start(self, cfg: JobConfig, quiet: bool = False) -> None:
        """Joins the process group torchrun describes (none for one process); `quiet`: warnings only in the log
        (an entry point whose stdout is its result)."""
        self.cfg = cfg
        hang_watch.enable_flight_recorder(cfg.comm.trace_buf_size, cfg.job.dump_folder)  # NCCL only; before init
        self.device, self.rank, self.world_size = dist_utils.init_distributed(cfg.comm)
        init_logger(self.rank)
        if quiet:
            logger.setLevel(logging.WARNING)

    def lay_out(self, plan: JobPlan) -> None:
        self.spec, self.tokenizer, self.model_args = plan.spec, plan.tokenizer, plan.model_args
        self.parallel_dims = pd = plan.parallel_dims
        self.mesh = pd.build_mesh(self.device.type) if self.world_size > 1 else None
        # Validation and evaluation are summed over this process group's dp ranks alone (_reduce_over), so
        # they deal their batches over those ranks: every fault-tolerant replica group scores the whole split.
        # The trainer replaces dp_rank/dp_degree with the fault-tolerant coordinate for its training data.
        self.group_dp = pd.coordinate("dp") if self.mesh else (0, 1)
        self.dp_rank, self.dp_degree = self.group_dp

    def build_model(self, plan: JobPlan, seed: int) -> None:
        """The plan's model (on meta, converted) split into pipeline stages or parallelized, then its weights on
        the device (`_init_weights`), and the autocast its precision needs."""
        cfg, pd, model = self.cfg, self.parallel_dims, plan.model
        self.converters = plan.converters
        self.loss_fn = self.spec.build_loss_fn(cfg)
        self.mtp_weight = mtp_settings(model)[1]  # multi-token prediction's lambda (0 without it)
        self.pipeline = None
        if pd.pp_enabled:
            self.pipeline = self.spec.pipelining_fn(model, pd, cfg, self.device, self.spec.parallelize_fn, self.loss_fn)
            self.model_parts = self.pipeline.parts
        else:
            self.model_parts = [self.spec.parallelize_fn(model, pd, cfg)]
        self.converters.post_parallelize(self.model_parts)
        self._init_weights(seed)
        # Autocast gives mixed precision where FSDP's policy does not apply (no data-parallel sharding).
        param_dtype, mp = plan.precision.param, plan.precision.mixed
        self.autocast = (
            torch.autocast(self.device.type, dtype=mp)
            if not pd.fsdp_enabled and mp != param_dtype and param_dtype == torch.float32
            else contextlib.nullcontext()
        )

    @classmethod
    def for_checkpoint(cls, cfg: JobConfig, plan: JobPlan, quiet: bool = False) -> "ModelRuntime":
        """The model of `cfg.checkpoint.initial_load_path` in the plan's layout, for scoring: weights only (the
        trainer's initial load, model-only), no optimizer, data or training state. The caller judged the job
        with plan_job before any rank started; this joins the process group."""
        self = cls()
        self.start(cfg, quiet)
        if self.device.type == "cpu":
            # Batches of every length and FSDP's gathered blocks: with glibc's dynamic mmap threshold their freed
            # memory would stay in the heap (a rank's RSS at whole-model size under FSDP); returned instead.
            cpu_malloc.return_freed_memory()
        self.lay_out(plan)
        self.build_model(plan, dist_utils.set_determinism(cfg.debug, self.device))
        checkpointer = ckpt.CheckpointManager(cfg, model_parts=self.model_parts, hf_adapter=self.spec.state_dict_adapter,
                                              model_args=self.model_args)
        try:
            checkpointer.load()
        finally:
            checkpointer.close()
        for m in self.model_parts:
            m.eval()
        return self

    def _init_weights(self, seed: int) -> None:
        """Same initial weights whatever the layout: from a seed/initial checkpoint when one is given (the
        checkpoint manager loads it before training), else from the model's own init under `seed`.

        On CPU a sharded random init would draw the same numbers on every rank (duplicated shards), so there
        each rank initialises the full model once and keeps its shards. On CUDA, DTensor's offset-tracked RNG
        initialises shards in place (distinct, but not bit-equal across layouts: use a seed checkpoint)."""
        for m in self.model_parts:
            m.to_empty(device=self.device)
        # A frozen base's checkpoints hold only the trainable weights: the base is initialised again on resume.
        resumes_weights = ckpt.has_checkpoint(self.cfg) and not ckpt.has_frozen_base(self.model_parts)
        from_checkpoint = bool(self.cfg.checkpoint.initial_load_path) or resumes_weights
        full_init = not from_checkpoint and self.world_size > 1 and self.device.type == "cpu"
        if not full_init:
            torch.manual_seed(seed)
        with torch.no_grad(), warnings.catch_warnings():
            # On CPU, DTensor warns that its random ops are not layout-aware; full_init below handles that.
            warnings.filterwarnings("ignore", message="DTensor random operators")
            for m in self.model_parts:
                m.init_weights(buffer_device=self.device)  # also builds derived buffers (e.g. RoPE tables)
        if full_init:
            with torch.device("meta"):
                full = self.spec.model_cls(self.model_args)
            self.converters.convert(full)  # the same parameters as the parts (e.g. LoRA adapters)
            full.to_empty(device="cpu")
            torch.manual_seed(seed)
            with torch.no_grad():
                full.init_weights(buffer_device=None)
            ckpt.load_full_state_dict(self.model_parts, full.state_dict())
            del full
        torch.manual_seed(seed)  # later randomness does not depend on how much the init consumed

    # ---- the forward, in any layout ----------------------------------------------------------------------
    def _reduce_over(self, x: torch.Tensor, dim: str) -> torch.Tensor:
        mesh = self.parallel_dims.submesh(dim) if self.mesh is not None else None
        if mesh is not None:
            dist.all_reduce(x, group=mesh.get_group())
        return x

    def _forward(self, inputs) -> ModelOutput:
        tokens, extra = split_inputs(inputs)
        return as_model_output(self.model_parts[0](tokens, **extra))

    def _loss_context(self):
        pd = self.parallel_dims
        if pd.tp_enabled and not self.cfg.parallelism.disable_loss_parallel:
            return loss_parallel()
        return contextlib.nullcontext()

    @torch.no_grad()
    def _forward_loss_sums(self, inputs, labels: torch.Tensor,
                           num_sources: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Summed token loss of one validation batch, however the job is laid out, and for a mixture its
        [2, sources] per-source token-loss sums and token counts (else None). The evaluation pass gives each
        request its own source (`num_sources` of them) to get each request's summed loss."""
        inputs, labels = shard_batch(to_device((inputs, labels), self.device), *self.parallel_dims.coordinate("cp"))
        inputs, source_ids = pop_source_ids(inputs)
        n = len(self.source_names) if num_sources is None else num_sources
        with self.autocast, self._loss_context():
            if self.pipeline is not None:
                return self.pipeline.eval(inputs, labels, source_ids, n)
            logits = self._forward(inputs).logits
            sums = None if source_ids is None else per_source_loss_sums(logits, labels, source_ids, n)
            return loss_value(self.loss_fn(logits, first_label_slot(labels))), sums

    def score_tasks(self, evaluator) -> dict[str, float]:
        """An Evaluator's tasks scored by every rank in this layout: each data-parallel rank a share of the
        batches, through the validation forward (pipeline schedule, context-parallel shards, loss parallel),
        the per-request sums completed over the dp and cp ranks (torchtitan/eval/scoring.py)."""

        def forward_sums(inputs, labels, num_sources):
            return self._forward_loss_sums(inputs, labels, num_sources)[1]

        training = [m.training for m in self.model_parts]
        for m in self.model_parts:
            m.eval()
        try:
            pd = self.parallel_dims  # pipeline stages and cp shards need rows of exactly seq_len: packed
            return evaluator.run(forward_sums, *self.group_dp,
                                 lambda x: self._reduce_over(x, "dp_cp"), self.device,
                                 packed=pd.pp_enabled or pd.cp_enabled, row_multiple=pd.tp)
        finally:
            for m, was in zip(self.model_parts, training):
                m.train(was)


def to_device(batch, device: torch.device):
    """A batch (tensors, or tuples/dicts of them) moved to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return tuple(to_device(x, device) for x in batch)
