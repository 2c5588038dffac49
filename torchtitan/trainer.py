"""The trainer: builds the pieces of a run in order, then runs the training loop.

    config ─▶ process group + mesh ─▶ train spec ─▶ tokenizer, data ─▶ model on meta ─▶ converters
    ─▶ parallelize ─▶ weights on device ─▶ optimizer, LR schedule ─▶ checkpoint ─▶ loop

What holds and runs the model (process group, mesh, parallelize, weights, the validation forward) is
`ModelRuntime` (torchtitan/model_runtime.py), shared with `python -m torchtitan.eval`. The entry point is
`torchtitan/train.py` (`./run_train.sh` or `python -m torchtitan.train --help`).
"""

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor, Partial

from torchtitan.tools import storage
from torchtitan.components.checkpoint import manager as ckpt
from torchtitan.components.loss import (
    IGNORE_INDEX,
    loss_value,
    mtp_metrics,
    per_source_loss_sums,
    per_source_metrics,
    pop_source_ids,
    token_and_mtp_loss,
)
from torchtitan.components.metrics import MetricsLogger, throughput_metrics
from torchtitan.components.faults.replica_check import ReplicaCheck
from torchtitan.components.faults.step_guard import StepGuard
from torchtitan.components.train_state import TrainState
from torchtitan.config import JobConfig
from torchtitan.config.manager import save_config, to_toml
from torchtitan.distributed import fault_tolerance, hang_watch
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.compile import compiles
from torchtitan.distributed.compile_auto import remember_compiled
from torchtitan.distributed.context_parallel import shard_batch
from torchtitan.distributed.pipeline import split_backward_recompute
from torchtitan.errors import TrainingError
from torchtitan.eval.runner import Evaluator
from torchtitan.job_plan import plan_job
from torchtitan.model_runtime import ModelRuntime, to_device
from torchtitan.protocols.model_shape import model_summary, pin_model_shape
from torchtitan.tools import cpu_malloc, fault_injection, stragglers
from torchtitan.tools.device_peak import peak_flops
from torchtitan.tools.logging import logger
from torchtitan.tools.memory import MemoryMonitor
from torchtitan.tools.params import count_params
from torchtitan.tools.precision import emulation_warning
from torchtitan.tools.preemption import PreemptionWatch
from torchtitan.tools.profiling import Profiler


class Trainer(ModelRuntime):
    def __init__(self, cfg: JobConfig):
        self.start(cfg)  # the process group, the logger (model_runtime.py: what the evaluation entry point shares)
        self.kept_heap = None  # CPU: the bound on glibc's kept heap, checked after every step
        if self.device.type == "cpu":
            if cfg.memory.cpu_return_freed:  # a memory budget bounds resident memory: nothing freed stays
                cpu_malloc.return_freed_memory()
            elif cfg.training.cpu_keep_freed_memory and cpu_malloc.loaded_allocator() is None:  # glibc's malloc
                self.kept_heap = cpu_malloc.keep_freed_memory_bounded(cfg.training.cpu_kept_heap_growth)
            logger.info(f"CPU allocator: {cpu_malloc.describe()}")
        fault_injection.install(self.rank)  # no-op unless TORCHTITAN_FAULTS is set (fault-tolerance tests)
        storage.set_retry_seconds(cfg.job.storage_retry_seconds)  # object-store paths (tools/storage.py)
        self.preempted = False
        self.step_clock = stragglers.StepClock()  # this rank's data and time-to-ready per step
        logger.info(f"Starting job: {cfg.job.description}")
        if self.rank == 0:
            os.makedirs(cfg.job.dump_folder, exist_ok=True)
            save_config(cfg, os.path.join(cfg.job.dump_folder, "config.toml"))
            if cfg.job.print_config:
                logger.info(f"Resolved configuration:\n{to_toml(cfg)}")

        # ---- what to train (checked before anything is built) --------------------------------------------
        plan = plan_job(cfg, self.world_size)
        if cfg.memory.budget_gib:
            raise ValueError("--memory.budget_gib is planned by the entry point (python -m torchtitan.train, "
                             "planning.memory_budget.resolve_budget) before the trainer: pass its "
                             "--memory.block_choices")
        model_line = model_summary(cfg, plan.model_args, plan.tokenizer)  # before pinning rewrites the source
        pin_model_shape(cfg, plan.model_args)  # checkpoints' config.toml rebuild this shape without hf_config
        if plan.moe_balancing is not None:  # ... and train with this balancing, which hf_config may have chosen
            b = plan.moe_balancing
            cfg.moe.load_balance_coeff, cfg.moe.router_aux_loss_coef = b.load_balance_coeff, b.router_aux_loss_coef
        self.global_batch_size, self.grad_accum = plan.global_batch_size, plan.grad_accum
        precision = plan.precision
        logger.info(f"Precision: {precision.reason}")
        if precision.emulated and self.rank == 0:
            logger.warning(emulation_warning(precision, self.device))
        self.lay_out(plan)  # spec, tokenizer, model args, parallel_dims, mesh, dp coordinate
        pd = self.parallel_dims
        self.dp_rank, self.dp_degree, self.global_batch_size = fault_tolerance.data_coordinate(
            cfg.fault_tolerance, *self.group_dp, self.global_batch_size
        )  # fault-tolerant replica groups split the training data among them
        seed = dist_utils.set_determinism(cfg.debug, self.device)

        # ---- data --------------------------------------------------------------------------------------
        self.dataloader = self._build_dataloader("train", cfg.training.local_batch_size, infinite=True)
        self.source_names = getattr(self.dataloader.dataset, "source_names", [])

        # ---- model: meta (converted by the plan) ─▶ parallelize ─▶ weights ----------------------------------
        model = plan.model
        if cfg.model.print_after_conversion and self.rank == 0:
            logger.info(f"Model after converters:\n{model}")
        self.num_params, non_embedding = count_params(model)
        self.flops_per_token = self.model_args.flops_per_token(non_embedding, cfg.training.seq_len)
        logger.info(
            f"{model_line}: {self.num_params:,} parameters "
            f"({non_embedding:,} non-embedding), {self.flops_per_token / 1e9:.3f} GFLOP/token (train)"
        )
        if plan.moe_balancing is not None:
            logger.info(f"MoE router balancing: {plan.moe_balancing.why}")
        self.compile_choice = plan.compile_choice
        if self.rank == 0:
            logger.info(self.compile_choice.reason)
            if plan.pipeline_plan is not None and (
                    slow := split_backward_recompute(plan.pipeline_plan.schedule, cfg.activation_checkpoint)):
                logger.warning(slow)
        # loss, pipeline stages or parallelize, converters' post-parallelize hooks, weights, autocast
        self.build_model(plan, seed)

        # ---- optimization state -------------------------------------------------------------------------
        self.optimizers = self.spec.build_optimizers_fn(self.model_parts, cfg.optimizer, pd)
        if cfg.memory.offload_optimizer:  # optimizer state in files between steps (checked in plan_job)
            from torchtitan.components.optim.optimizer_offload import OffloadedOptimizerState

            self.optimizers.state_offload = [OffloadedOptimizerState(m, cfg.memory.offload_dir)
                                             for m in self.model_parts]
        self.lr_schedulers = self.spec.build_lr_schedulers_fn(self.optimizers, cfg.lr_scheduler, cfg.training.steps)
        self.post_optimizer_step_fns = (self.converters.post_optimizer_hook, *self.spec.post_optimizer_step_fns)
        self.validator = self.spec.build_validator_fn(cfg) if cfg.validation.enable else None
        # Downstream tasks: read and turned into token windows once (pre-flight judged them already).
        self.evaluator = Evaluator(cfg.eval, self.tokenizer, cfg.training.seq_len) if cfg.eval.enable else None
        self.train_state = TrainState()
        self.checkpointer = ckpt.CheckpointManager(
            cfg,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            dataloader=self.dataloader,
            train_state=self.train_state,
            hf_adapter=self.spec.state_dict_adapter,
            model_args=self.model_args,
            tokenizer=self.tokenizer,
        )
        self.replicas = (
            fault_tolerance.Replicas(cfg.fault_tolerance, self.checkpointer.states, self.rank, self.world_size, self.device)
            if cfg.fault_tolerance.enable else None
        )

        # ---- observability --------------------------------------------------------------------------------
        self.metrics = MetricsLogger(cfg.job.dump_folder, cfg.metrics, self.rank, dataclasses.asdict(cfg))
        self.guard = StepGuard(cfg.guard) if cfg.guard.enable else None
        self._guard_event = None
        # step -> data windows left out when the run reaches it (each rollback from that step adds one; kept, since
        # a later rollback to a checkpoint before it reloads the data position from before those windows)
        self._skip_windows: dict[int, int] = {}
        self.replica_check = (
            ReplicaCheck(cfg.guard.replica_check_interval, cfg.guard.replica_check_action, pd, self.device,
                         self.replicas)
            if cfg.guard.replica_check_interval > 0 and (pd.dp_replicate > 1 or self.replicas is not None) else None
        )
        self.memory = MemoryMonitor(self.device)
        # The peak of the dtype the matmuls really run in: fp8 for float8, fp32 when float8 is emulated.
        compute_dtype = self.converters.matmul_dtype(precision.matmul)
        self.peak_flops = peak_flops(self.device, compute_dtype)
        dist_utils.set_pg_timeout(cfg.comm.train_timeout_seconds)

    # ------------------------------------------------------------------------------------------------------
    def _build_dataloader(self, split: str, local_batch_size: int, infinite: bool):
        dp_rank, dp_degree = (self.dp_rank, self.dp_degree) if split == "train" else self.group_dp
        gbs = self.global_batch_size if split == "train" else local_batch_size * dp_degree
        return self.spec.build_dataloader_fn(
            tokenizer=self.tokenizer,
            job_config=self.cfg,
            split=split,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            global_batch_size=gbs,
            local_batch_size=local_batch_size,
            infinite=infinite,
        )

    # ------------------------------------------------------------------------------------------------------
    def _next_microbatches(self, data_iter: Iterator) -> list[tuple]:
        step = self.train_state.step + 1
        skip = self._skip_windows.get(step, 0) + fault_injection.skips_data(step)
        for _ in range(skip * self.grad_accum):  # the windows of the step a rollback undid are left out
            next(data_iter)
        return [to_device(next(data_iter), self.device) for _ in range(self.grad_accum)]

    def global_token_count(self, microbatches) -> torch.Tensor:
        """Label tokens of the whole optimizer step over every data-parallel and cp rank (this rank's
        microbatches given as sharded for cp): the loss divisor. Every rank divides by the same count, so
        summed gradients give the global mean."""
        local_tokens = sum((lab != IGNORE_INDEX).sum() for _, lab in microbatches)
        return self._reduce_over(local_tokens.to(torch.float32), "dp_cp").clamp_min(1)

    def train_step(self, microbatches) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One optimizer step over the rank's microbatches; returns (global loss, grad norm, model metrics
        averaged over the microbatches), unsynced."""
        microbatches = [shard_batch(mb, *self.parallel_dims.coordinate("cp")) for mb in microbatches]
        global_tokens = self.global_token_count(microbatches)
        loss_sum = torch.zeros((), device=self.device)
        model_metrics: dict[str, torch.Tensor] = {}
        self._source_sums = None  # a mixture's [2, sources] loss sums and token counts
        self._mtp_sums = None  # multi-token prediction's [2, depths] loss sums and token counts
        for i, (inputs, labels) in enumerate(microbatches):
            inputs, source_ids = pop_source_ids(inputs)
            last = i == len(microbatches) - 1
            for m in self.model_parts:
                if hasattr(m, "set_requires_gradient_sync"):
                    m.set_requires_gradient_sync(last)  # FSDP: reduce-scatter once, on the last microbatch
            with self.autocast, self._loss_context():
                if self.pipeline is not None:  # forward+backward
                    loss, sums, mtp_sums = self.pipeline.step(
                        inputs, labels, global_tokens, source_ids, len(self.source_names)
                    )
                    loss_sum += loss
                    self._add_source_sums(sums)
                    self._mtp_sums = _add(self._mtp_sums, mtp_sums)
                    continue
                out = self._forward(inputs)
                token_loss, mtp_sums = token_and_mtp_loss(self.loss_fn, out.logits, out.mtp_logits, labels,
                                                          self.mtp_weight)
                self._mtp_sums = _add(self._mtp_sums, mtp_sums)
                if out.aux_loss is not None:
                    token_loss = add_aux_loss(token_loss, out.aux_loss)
                loss = token_loss / global_tokens
                loss.backward()
                if source_ids is not None:
                    self._add_source_sums(
                        per_source_loss_sums(out.logits.detach(), labels, source_ids, len(self.source_names))
                    )
            loss_sum += loss_value(loss)
            for k, v in out.metrics.items():
                model_metrics[k] = model_metrics.get(k, 0) + v.detach() / len(microbatches)
        fault_injection.point(self.train_state.step + 1, self.model_parts, self.optimizers)
        self.step_clock.ready()
        if self.replicas is not None:
            self.replicas.average_gradients(self.model_parts)
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.cfg.training.max_norm,
            pp_group=self.pipeline.group if self.pipeline is not None else None,
        )
        self._step_lr = self.optimizers.param_groups[0]["lr"]  # the LR this step trained with
        self._guard_event = None if self.guard is None else self.guard.judge(
            self.train_state.step + 1, self._reduce_over(loss_sum.detach().clone(), "dp_cp"), grad_norm
        )
        if self.replicas is None or self.replicas.should_commit(self.train_state.step + 1):
            if self._guard_event is None:  # a skipped step leaves weights and optimizer state alone
                self.optimizers.step()
                for fn in self.post_optimizer_step_fns:
                    fn(self.model_parts, self.parallel_dims)
            self.lr_schedulers.step()
        self.optimizers.zero_grad()
        return loss_sum, grad_norm, model_metrics

    def _add_source_sums(self, sums: torch.Tensor | None) -> None:
        if sums is not None:
            self._source_sums = sums if self._source_sums is None else self._source_sums + sums

    def validate(self, step: int) -> dict[str, float]:
        """The spec's validator over the validation split; a mixture adds validation/loss/<source>."""
        loader = self._build_dataloader("validation", self.cfg.validation.local_batch_size, infinite=False)
        source_sums: list[torch.Tensor] = []
        if self.kept_heap is not None:  # a pass of other shapes: the training steps' kept heap goes back first
            self.kept_heap.before(("validation",))

        def forward_loss_sum(inputs, labels: torch.Tensor) -> torch.Tensor:
            loss, sums = self._forward_loss_sums(inputs, labels)
            if sums is not None:
                source_sums.append(sums)
            return loss

        for m in self.model_parts:
            m.eval()
        try:
            metrics = self.validator(forward_loss_sum, loader, lambda x: self._reduce_over(x, "dp_cp"))
        finally:
            for m in self.model_parts:
                m.train()
        if source_sums:  # every rank saw batches of the mixture, so every rank reduces
            sums = self._reduce_over(torch.stack(source_sums).sum(0), "dp_cp")
            metrics.update({f"validation/{k}": v for k, v in per_source_metrics(sums, self.source_names).items()})
        self.metrics.log(step, metrics)
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        """The [eval] tasks scored by every rank in the training layout (ModelRuntime.score_tasks), logged."""
        if self.kept_heap is not None:
            self.kept_heap.before(("eval",))
        metrics = self.score_tasks(self.evaluator)
        self.metrics.log(step, metrics)
        return metrics

    def _model_metrics(self, model_metrics: dict[str, torch.Tensor]) -> dict[str, float]:
        """The model's own metrics, averaged over the data-parallel ranks, vectors logged element-wise."""
        out = {}
        for name, value in model_metrics.items():
            value = self._reduce_over(value.detach().float().clone(), "dp_cp") / (self.parallel_dims.dp * self.parallel_dims.cp)
            if value.dim() == 0:
                out[name] = value.item()
            else:
                out.update({f"{name}/{i}": v for i, v in enumerate(value.flatten().tolist())})
        return out

    def train(self) -> None:
        cfg = self.cfg
        self.checkpointer.load()
        data_iter = iter(self.dataloader)
        gc.disable()  # collect on our schedule, not in the middle of a step on one rank only
        gc.collect()
        tokens_per_step = self.global_batch_size * cfg.training.seq_len
        window_start, window_tokens, data_time = time.perf_counter(), 0, 0.0
        self.memory.reset_peak_stats()
        profiler = Profiler(cfg.profiling, cfg.job.dump_folder, self.rank, self.device)
        preemption = PreemptionWatch() if cfg.checkpoint.enable else None
        logger.info(
            f"Training {cfg.training.steps} steps: global batch {self.global_batch_size} x seq {cfg.training.seq_len}, "
            f"{self.grad_accum} microbatch(es) per rank, layout {self.parallel_dims}"
        )
        first_step = self.train_state.step + 1
        with profiler, contextlib.ExitStack() as cleanup:
            if preemption is not None:
                cleanup.callback(preemption.close)
            if self.world_size > 1 and cfg.comm.hang_timeout_seconds > 0:
                watch = hang_watch.HangWatch(cfg.comm.hang_timeout_seconds, cfg.job.dump_folder, self.rank)
                cleanup.callback(watch.close)
            while self.train_state.step < cfg.training.steps:
                if self.replicas is not None and self.replicas.start_step():
                    data_iter = iter(self.dataloader)  # healed: continue from the peer's data position
                    first_step = self.train_state.step + 1
                step = self.train_state.step + 1
                if step % cfg.training.gc_freq == 0:
                    gc.collect(1)
                t0 = time.perf_counter()
                self.step_clock.start()
                try:
                    microbatches = self._next_microbatches(data_iter)
                except StopIteration as e:
                    raise TrainingError(f"the data ran out at step {step}") from e
                data_time += time.perf_counter() - t0
                self.step_clock.data_loaded()
                if self.kept_heap is not None:  # other shapes than the last step's: return the kept heap first
                    self.kept_heap.before(("train", *(tuple(labels.shape) for _, labels in microbatches)))
                loss, grad_norm, model_metrics = self.train_step(microbatches)
                if self._guard_event is not None:
                    self.guard.record(self._guard_event, self.metrics)  # stops the run past max_events
                    if self._guard_event.action == "rollback":
                        data_iter = self._rollback(step)
                        continue
                self.train_state.step = step
                self.train_state.tokens_seen += tokens_per_step
                window_tokens += tokens_per_step
                if step == first_step:
                    # The first step compiles and warms up: it is reported as first_step_s, and the throughput
                    # window starts after it.
                    first_step_s = time.perf_counter() - window_start
                    if compiles(self.cfg, "model") and self.rank == 0:  # the next run's compile estimate is warm
                        remember_compiled(self.compile_choice.key)
                    window_start, window_tokens, data_time = time.perf_counter(), 0, 0.0
                    self.step_clock.reset()
                if self.guard is None and not torch.isfinite(grad_norm):
                    raise TrainingError(
                        f"loss or gradients became non-finite at step {step} (local loss {loss.item():.4g}, "
                        f"grad norm {grad_norm.item():.4g}); lower --optimizer.lr, raise --lr_scheduler.warmup_steps "
                        f"or check the data"
                    )
                last = step == cfg.training.steps
                if step == 1 or step % cfg.metrics.log_freq == 0 or last:
                    global_loss = self._reduce_over(loss.detach().clone(), "dp_cp")
                    elapsed = time.perf_counter() - window_start
                    speed = {"first_step_s": first_step_s}  # a window holding only the first step
                    if window_tokens:
                        speed = throughput_metrics(
                            tokens=window_tokens / self.world_size,
                            seconds=elapsed,
                            flops_per_token=self.flops_per_token,
                            peak_flops=self.peak_flops,
                        )
                        speed["data_loading_pct"] = 100.0 * data_time / max(elapsed, 1e-9)
                        speed.update(stragglers.report(self.step_clock, cfg.metrics.straggler_threshold, self.device))
                    metrics = {
                        "loss": global_loss.item(),
                        "grad_norm": grad_norm.item(),
                        "lr": self._step_lr,
                        **speed,
                        "tokens_seen": self.train_state.tokens_seen,
                        **self.memory.get_peak_stats(),
                        **self._model_metrics(model_metrics),
                    }
                    if self._source_sums is not None:  # loss/<source> over every rank's tokens of the step
                        sums = self._reduce_over(self._source_sums, "dp_cp")
                        metrics.update(per_source_metrics(sums, self.source_names))
                        metrics.update(self.dataloader.dataset.tokens_seen())  # the same on every rank
                    if self._mtp_sums is not None:  # loss/mtp_k over every rank's tokens of the step
                        metrics.update(mtp_metrics(self._reduce_over(self._mtp_sums, "dp_cp")))
                    self.metrics.log(step, metrics)
                    window_start, window_tokens, data_time = time.perf_counter(), 0, 0.0
                    self.memory.reset_peak_stats()
                if self.replica_check is not None:  # before the save: a drifted replica's state is not saved
                    self.replica_check.check(step, self.model_parts, self.optimizers)
                if cfg.validation.enable and (step % cfg.validation.freq == 0 or last):
                    self.validate(step)
                if self.evaluator is not None and (step % cfg.eval.freq == 0 or last):
                    self.evaluate(step)
                self.checkpointer.save(step, last=last)
                if self.kept_heap is not None and self.kept_heap.after_step():
                    logger.debug(f"CPU allocator: step {step} left the kept heap above its bound; returned "
                                 f"{self.kept_heap.last_trim_freed / 2**20:,.0f} MiB (trim {self.kept_heap.trims})")
                profiler.step(step)
                if preemption is not None and not last and preemption.requested(self.device):
                    self.checkpointer.save(step, force=True)
                    self.preempted = True
                    logger.warning(
                        f"Preempted (SIGTERM) at step {step}: its checkpoint is saved (completed before exit) in "
                        f"{self.checkpointer.root}; rerun the same command to resume"
                    )
                    break
            else:
                logger.info("Training finished")
        self.checkpointer.wait()  # the last save is complete (or its failure reported) when train() returns
        gc.enable()

    def _rollback(self, step: int) -> Iterator:
        """The guard's rollback: the last complete checkpoint reloaded, `step`'s data window to be skipped when
        the run gets there again; returns the data iterator to continue with."""
        self.checkpointer.wait()  # a save in flight completes first: it may be the newest checkpoint
        if not ckpt.has_checkpoint(self.cfg) or not self.checkpointer.load():
            raise TrainingError(f"the guard cannot roll back from step {step}: no complete checkpoint yet; lower "
                                f"--checkpoint.interval or use --guard.action skip")
        self._skip_windows[step] = self._skip_windows.get(step, 0) + 1
        logger.warning(f"Guard: rolled back to step {self.train_state.step}; the data window of step {step} is "
                       f"skipped when the run reaches it again")
        return iter(self.dataloader)

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.close()
        self.checkpointer.close()
        self.metrics.close()
        if self.kept_heap is not None:  # a process that goes on (tests, notebooks) does not keep this run's heap
            cpu_malloc.restore_initial()
            self.kept_heap = None
        dist_utils.end_distributed()  # the groups' threads end once this trainer is dropped (train.main does)
        if self.cfg.compile.enable:
            # Dynamo keeps this run's graphs keyed on nn.Module's shared call code; a later trainer in the same
            # process (tests, notebooks) would add its own and reach the recompile limit, fatal under fullgraph.
            torch._dynamo.reset()


def _add(total: torch.Tensor | None, x: torch.Tensor | None) -> torch.Tensor | None:
    return x if total is None else total if x is None else total + x


def add_aux_loss(token_loss: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """The token loss plus the model's balance loss (both sums over tokens). Under loss parallel the token
    loss is a DTensor replicated over the tp ranks, while each tp rank's balance loss is that of its own
    sequence shard (an MoE layer routes its shard), a plain tensor: it joins as a Partial DTensor, the sum
    over the shards, which is also what the step logs. (Added as a plain tensor it passed forward as an
    implicitly replicated scalar and failed in backward: mixed torch.Tensor and DTensor.)"""
    if isinstance(token_loss, DTensor):
        mesh = token_loss.device_mesh
        aux_loss = DTensor.from_local(aux_loss, mesh, [Partial()] * mesh.ndim, run_check=False)
    return token_loss + aux_loss
