"""What the framework relies on in a model and in its args.

A model:
- is built from its args on the meta device (`model_cls(args)`), then materialised with `to_empty` and
  `init_weights(buffer_device=...)`, which also rebuilds derived buffers (e.g. RoPE tables) and re-ties
  shared parameters (tied embeddings: `to_empty` unties them);
- keeps its repeated blocks in `layers`, an `nn.ModuleDict` keyed by the block's original index, so a
  pipeline stage that deletes blocks keeps the parameter names of the whole model;
- names the modules before and after the blocks in `pipeline_head` / `pipeline_tail` (e.g. the embedding;
  the final norm and output); a pipeline stage sets those it does not hold to None, so forward must skip
  a None module;
- is called as `model(tokens, **extra_inputs)` where the batch carried more than tokens (e.g.
  `document_ids`, `positions`: see `split_inputs`), and returns the logits, or a `ModelOutput` when it has
  auxiliary losses, metrics or multi-token-prediction logits to report (see `mtp_settings`).

Its args (a dataclass deriving from `BaseModelArgs`) own the FLOP count, the fields a parallel degree
must divide, and how a job's settings (the tokenizer, the sequence length) check and resize them.
"""

import contextlib
import contextvars
import dataclasses
import os
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn as nn

from torchtitan.config import ConfigError


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
    mtp_logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Logits of multi-token prediction depths 1..D (models/common/mtp.py), in training only: depth k's
    position i predicts the token k+1 positions ahead. The trainer trains them with the labels shifted by
    k, weighted by the model's `mtp_loss_weight` (see `mtp_settings`)."""


def mtp_settings(model: nn.Module) -> tuple[int, float]:
    """(depths D, loss weight lambda) of a model with multi-token prediction (its `mtp_depth` and
    `mtp_loss_weight` attributes), (0, 0.0) for others. Such a model returns ModelOutput.mtp_logits in
    training, and its last pipeline stage returns (logits, *mtp_logits), for the loss to train them
    (components/loss.py token_and_mtp_loss)."""
    return int(getattr(model, "mtp_depth", 0)), float(getattr(model, "mtp_loss_weight", 0.0))


_SHAPE_ONLY = contextvars.ContextVar("shape_only_forward", default=False)


@contextlib.contextmanager
def shape_only_forward():
    """Marks forward calls made only to learn activation shapes (a pipeline stage's metadata inference,
    on placeholder data): a model skips its side effects there, e.g. an MoE layer's load counting."""
    token = _SHAPE_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPE_ONLY.reset(token)


def is_shape_only_forward() -> bool:
    return _SHAPE_ONLY.get()


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


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """The sizes of a dense decoder block that the planning tools' memory and step-time models read."""

    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    gated_attention: bool = False
    """The softmax blocks are Qwen3.5's gated attention (query + output gate projection, QK-norm, partial RoPE,
    zero-centred norms) rather than Llama's."""
    linear_attention: "LinearAttentionShape | None" = None
    """Some blocks are Gated DeltaNet linear attention (hybrid models); None = every block is softmax."""
    moe: "MoEShape | None" = None
    """Every block's feed-forward is this MoE layer instead of a SwiGLU of ffn_hidden."""


@dataclasses.dataclass(frozen=True)
class LinearAttentionShape:
    """Sizes of a Gated DeltaNet block (models/common/gated_deltanet.py) that the memory estimator reads."""

    layers: int
    """How many of the n_layers blocks are linear attention (the others are softmax)."""
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    chunk_size: int
    conv_kernel: int


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """Sizes of an MoE feed-forward (components/moe) that the memory estimator reads."""

    experts: int
    top_k: int
    hidden: int
    """Hidden width of one routed expert."""
    shared_hidden: int = 0
    """Hidden width of the shared expert(s) together; 0 = none."""
    shared_gate: bool = False
    """The shared expert's output is scaled by a sigmoid gate (Qwen3.5)."""


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

    def transformer_shape(self) -> TransformerShape | None:
        """The dense-block sizes the planner's activation and step-time models use; None (the default) when
        the model is not a dense decoder of that shape: the planning tools then report no estimate."""
        return None

    def update_from_job(self, job_config: Any, tokenizer: Any) -> "BaseModelArgs":
        """These args for a job: the vocabulary checked against the tokenizer (`job_vocab_size`: kept, padded
        rows included, or refused), and room for the recipe's seq_len. A family that overrides this calls it."""
        return dataclasses.replace(
            self,
            vocab_size=job_vocab_size(self.vocab_size, tokenizer.vocab_size, job_config.model),
            max_seq_len=max(self.max_seq_len, job_config.training.seq_len),
        )


def shape_source(model_config: Any) -> str:
    """Where a job's model shape comes from, for the log and for messages: the flavor or the Hugging Face
    config (--model.hf_config replaces the flavor), then --model.overrides. `model_config` is JobConfig.model."""
    source = (f"the Hugging Face config {model_config.hf_config}" if model_config.hf_config
              else f"flavor {model_config.flavor}")
    return source + (f" + overrides {','.join(model_config.overrides)}" if model_config.overrides else "")


def job_vocab_size(model_vocab: int, tokenizer_vocab: int, model_config: Any) -> int:
    """The one vocabulary rule of every family: the model keeps its own vocabulary (the flavor's, the HF
    folder's or an override's) when the tokenizer fits in it. Published checkpoints pad their embedding past
    the tokenizer (DeepSeek-V3: 128,815 tokens in 129,280 rows; Qwen3: 151,665 in 151,936; Llama derivatives:
    a multiple of 64 or 128), and a flavor's output layer is part of the shape it stands for, so the padded
    rows stay, and are loaded and saved like any other. The loss needs no mask for them: the labels are the
    tokenizer's ids, never a padded one. A tokenizer larger than the vocabulary would produce ids that index no
    embedding row: refused (ConfigError, one line naming both sizes and the options that fix it)."""
    if tokenizer_vocab <= model_vocab:
        return model_vocab
    tokenizer = model_config.tokenizer_path or "the shipped tokenizer"
    hf = model_config.hf_config or ""
    folder = (os.path.dirname(hf) or ".") if hf.endswith(".json") else hf  # --model.hf_config may name the file
    fix = (f"use the folder's own tokenizer (--model.tokenizer_path {folder})"
           if model_config.hf_config else "use the tokenizer the flavor was made for (--model.tokenizer_path)")
    raise ConfigError(
        f"{tokenizer} has {tokenizer_vocab:,} tokens, more than the model's vocabulary of {model_vocab:,} rows "
        f"({shape_source(model_config)}): its ids past {model_vocab - 1} would have no embedding row; {fix}, or "
        f"give the model room for them with --model.overrides vocab_size={tokenizer_vocab}"
    )
