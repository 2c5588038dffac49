"""The evaluation pass: the configured tasks' requests built once, scored on demand by whatever forward the
caller has (the trainer's ranks in their layout, or `python -m torchtitan.eval` on a checkpoint).

    evaluator = Evaluator(cfg.eval, tokenizer, seq_len)           # tasks read, requests built, checked
    metrics = evaluator.run(forward_sums, dp_rank, dp_degree, reduce_sum, device)
    # {"eval/<task>/<metric>": value, "eval/<task>/<metric>_stderr": value, "eval/<task>/requests": n,
    #  "eval/<task>/rows": inputs the model read for them (requests sharing one are read from it)}

A task that fails while scoring, on any rank, is reported by every rank (logged, its metrics absent) and the
others, and the training, go on: before a task's results are summed over the ranks, every rank of the job adds
its failure flag to one all-reduce (a rank that failed adds it in place of that reduction, after running its
remaining forwards on empty batches: scoring.py), so all ranks skip the reduction together; rank 0 logs the
failing rank's reason. A failure inside a forward's own collectives cannot be paired up this way.
"""

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchtitan.eval.bootstrap import task_stderrs
from torchtitan.eval.requests import TaskRequests, build_requests
from torchtitan.eval.scoring import ForwardSums, request_loglikelihoods, score_windows, share_rows, task_metrics
from torchtitan.eval.tasks import load_task
from torchtitan.tools.logging import logger


def build_task_requests(eval_cfg, tokenizer, max_length: int) -> list[TaskRequests]:
    """Every configured task read and turned into windows; raises TaskError with one line on bad input."""
    return [
        build_requests(load_task(name, eval_cfg.limit, eval_cfg.num_fewshot), tokenizer, max_length,
                       eval_cfg.fewshot_seed)
        for name in eval_cfg.tasks
    ]


def plain_forward_sums(model, scored_logits_only: bool = True) -> ForwardSums:
    """The per-window sums of a whole model in one process (the entry point's forward; the trainer's is its
    validation forward, whatever the layout). The output head (the model's `output` module) projects only
    the positions that carry a label: a row's context needs no logits, and the head is a tenth of the debug
    model's FLOPs (a fifth of a 1B model's at a 128k vocabulary). Per position the same computation.
    `scored_logits_only=False`: every position's logits (as the trainer's forward; a benchmark's baseline)."""
    from torchtitan.components.loss import IGNORE_INDEX, per_source_loss_sums, pop_source_ids
    from torchtitan.protocols.model import as_model_output, split_inputs

    head = getattr(model, "output", None) if scored_logits_only else None

    @torch.no_grad()
    def forward_sums(inputs, labels, num_sources):
        inputs, source_ids = pop_source_ids(inputs)
        tokens, extra = split_inputs(inputs)
        scored = labels.ne(IGNORE_INDEX)
        scored = scored.any(-1) if scored.dim() == 3 else scored
        handle = None
        if isinstance(head, torch.nn.Module):
            handle = head.register_forward_pre_hook(lambda _, args: (args[0][scored].unsqueeze(0), *args[1:]))
        try:
            logits = as_model_output(model(tokens, **extra)).logits
        finally:
            if handle is not None:
                handle.remove()
        if logits.shape[:2] != scored.shape:  # the head saw the scored positions only: [1, scored, vocab]
            labels, source_ids = labels[scored].unsqueeze(0), source_ids[scored].unsqueeze(0)
        return per_source_loss_sums(logits, labels, source_ids, num_sources)

    return forward_sums


class Evaluator:
    def __init__(self, eval_cfg, tokenizer, seq_len: int) -> None:
        self.cfg = eval_cfg
        self.seq_len = seq_len
        self.pad_id = tokenizer.eos_id
        self.tasks = build_task_requests(eval_cfg, tokenizer, seq_len)
        self.rows = [share_rows(reqs.windows) for reqs in self.tasks]  # inputs the model reads, per task
        self.last_loglikelihoods: dict[str, list[float]] = {}  # per task, of the last run (tests, the CLI)
        self.last_failures: dict[str, str] = {}  # task -> reason, of the last run

    def run(self, forward_sums: ForwardSums, dp_rank: int = 0, dp_degree: int = 1,
            reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
            device: torch.device | str = "cpu", packed: bool = False, row_multiple: int = 1) -> dict[str, float]:
        """Every task scored; `packed` when the layout needs rows of exactly seq_len (pipeline, context
        parallel; see scoring.py); else rows are padded to a multiple of `row_multiple` (the tp degree's)."""
        metrics: dict[str, float] = {}
        self.last_failures = {}
        for reqs, rows in zip(self.tasks, self.rows):
            name = reqs.task.name
            t0 = time.perf_counter()
            agreed = False

            def reduce_unless_failed(total: torch.Tensor) -> torch.Tensor:
                nonlocal agreed
                agreed = True
                failure = _failure_on_any_rank(None, device)
                if failure is not None:
                    raise _FailedElsewhere(failure)
                return reduce_sum(total)

            try:
                window_ll = score_windows(reqs.windows, forward_sums, seq_len=self.seq_len,
                                          batch_size=self.cfg.local_batch_size, pad_id=self.pad_id,
                                          dp_rank=dp_rank, dp_degree=dp_degree, reduce_sum=reduce_unless_failed,
                                          device=device, packed=packed, row_multiple=row_multiple, rows=rows)
                lls = request_loglikelihoods(reqs, window_ll)
                values = task_metrics(reqs, lls)
                values.update(task_stderrs(reqs, lls, self.cfg.bootstrap_iters))
            except _FailedElsewhere as e:
                self._report(name, str(e))
                continue
            except Exception as e:  # noqa: BLE001 - reported; the training goes on
                reason = f"{type(e).__name__}: {e}"
                # Before the reduction: the other ranks wait in the failure flag's all-reduce. After it (the
                # metrics, computed alike on every rank from the same sums), no rank waits for this one.
                self._report(name, reason if agreed else _failure_on_any_rank(reason, device))
                continue
            self.last_loglikelihoods[name] = lls
            metrics.update({f"eval/{name}/{k}": v for k, v in values.items()})
            metrics[f"eval/{name}/requests"] = len(lls)
            metrics[f"eval/{name}/rows"] = len(rows)
            metrics[f"eval/{name}/seconds"] = time.perf_counter() - t0
        return metrics

    def _report(self, task: str, reason: str) -> None:
        self.last_failures[task] = reason
        logger.error(f"Evaluation of task {task} failed and is skipped: {reason}")


class _FailedElsewhere(Exception):
    """The task failed on another rank (the message is that rank's reason)."""


def _failure_on_any_rank(reason: str | None, device) -> str | None:
    """This rank's failure of the current task (None: none) agreed over every rank of the job (every rank
    scores every task, whatever its layout): one all-reduce of a flag; when any rank failed, the first failing
    rank's reason, gathered from it (on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return reason
    flag = torch.tensor([0.0 if reason is None else 1.0], device=device)
    dist.all_reduce(flag)
    if flag.item() == 0:
        return None
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    failed = [(rank, r) for rank, r in enumerate(reasons) if r is not None]
    rank, first = failed[0]
    more = f" (and on {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    return f"on rank {rank}{more}: {first}"
