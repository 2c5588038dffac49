"""What the framework relies on in a model and in its args.

A model:
- is built from its args on the meta device (`model_cls(args)`), then materialised with `to_empty` and
  `init_weights(buffer_device=...)`, which also rebuilds derived buffers (e.g. RoPE tables);
- keeps its repeated blocks in `layers`, an `nn.ModuleDict` keyed by the block's original index, so a
  pipeline stage that deletes blocks keeps the parameter names of the whole model;
- names the modules before and after the blocks in `pipeline_head` / `pipeline_tail` (e.g. the embedding;
  the final norm and output); a pipeline stage sets those it does not hold to None, so forward must skip
  a None module;
- is called as `model(tokens, **extra_inputs)` where the batch carried more than tokens (e.g.
  `document_ids`, `positions`: see `split_inputs`), and returns the logits, or a `ModelOutput` when it has
  auxiliary losses or metrics to report.

Its args (a dataclass deriving from `BaseModelArgs`) own the FLOP count, the fields a parallel degree
must divide, and how a job's settings (tokenizer vocabulary, sequence length) resize them.
"""

import dataclasses
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn as nn


@dataclasses.dataclass
class ModelOutput:
    """A model's forward result when it carries more than logits."""

    logits: torch.Tensor
    aux_loss: torch.Tensor | None = None
    """An auxiliary loss (e.g. MoE load balancing) in the units of the token loss: a SUM over this
    microbatch's tokens. The trainer adds it to the token-loss sum before dividing by the step's global
    token count, so accumulation and data parallel leave it unchanged like the main loss."""
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Values to log (e.g. per-expert load), detached; averaged over the step's microbatches and over the
    data-parallel ranks when logged. Vectors are logged element-wise as name/i."""


def as_model_output(out: torch.Tensor | ModelOutput) -> ModelOutput:
    return out if isinstance(out, ModelOutput) else ModelOutput(logits=out)


def split_inputs(inputs: torch.Tensor | dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(tokens, extra keyword inputs) of a batch's inputs: a token tensor, or a dict holding "tokens" and
    other [batch, seq] tensors the model takes by keyword (e.g. "document_ids", "positions")."""
    if isinstance(inputs, torch.Tensor):
        return inputs, {}
    extra = dict(inputs)
    return extra.pop("tokens"), extra


@runtime_checkable
class ModelProtocol(Protocol):
    """The structure the parallelism appliers (FSDP, TP, AC, compile, pipeline) rely on."""

    layers: nn.ModuleDict
    pipeline_head: ClassVar[tuple[str, ...]]
    pipeline_tail: ClassVar[tuple[str, ...]]

    def init_weights(self, buffer_device: torch.device | None = None) -> None: ...


class BaseModelArgs:
    """Base class of a model's args dataclass. Subclasses declare `vocab_size` and `max_seq_len` fields and
    implement `flops_per_token`; they override `divisible_by` when a parallel degree splits their shapes."""

    vocab_size: int
    max_seq_len: int

    def flops_per_token(self, num_non_embedding_params: int, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token, for throughput and MFU."""
        raise NotImplementedError

    def divisible_by(self) -> dict[str, dict[str, int]]:
        """Mesh dimension -> {field name: value} that the dimension's degree must divide, e.g.
        {"tp": {"n_heads": 32, ...}}. The job planner checks these before any rank starts."""
        return {}

    def update_from_job(self, job_config: Any, tokenizer: Any) -> "BaseModelArgs":
        """These args resized for a job: the tokenizer's vocabulary, and room for the recipe's seq_len."""
        return dataclasses.replace(
            self,
            vocab_size=tokenizer.vocab_size,
            max_seq_len=max(self.max_seq_len, job_config.training.seq_len),
        )
