"""LoRA: low-rank adapters on a frozen base model (`--model.converters lora`, options in `[lora]`).

Each targeted linear layer keeps its class, its parameter names and its forward; the converter mixes
`LoRAMixin` into its class (so a Float8Linear stays one) and adds two parameters beside the weight:

    y = base(x) + (alpha / rank) * lora_b @ lora_a @ dropout(x)      lora_a [rank, in], lora_b [out, rank]

Every other parameter of the model is frozen (requires_grad False): no gradient, no optimizer state, and the
checkpoint manager saves only trainable parameters (plus a reference to the base they were trained on).

Works for every family through the model protocol: the converter only looks for nn.Linear modules by name.
Parallelisms need nothing of their own: the adapters are parameters of the linear, so a TP style distributes
them with the weight (DTensor then computes the adapter path on the sharded operands and keeps the result in
the base output's placement), FSDP shards them like any parameter, a pipeline stage carries the layers it
keeps, AC and compile wrap the blocks that hold them.

Initialisation is layout-independent: each adapter is drawn whole from a generator seeded by its module name
(A uniform in +-1/sqrt(in), peft's default; B zero) and each rank keeps its shard, so every layout and every
restart trains the same adapters.
"""

import fnmatch
import types
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools.logging import logger

ADAPTER_NAMES = ("lora_a", "lora_b")


class LoRAMixin:
    """Mixed into a linear layer's own class by `add_adapter`; the base layer's forward is unchanged."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    lora_scale: float
    lora_dropout: float
    lora_name: str  # the module's name in the whole model: seeds its adapter init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_dropout and self.training:
            x = F.dropout(x, self.lora_dropout)
        adapted = F.linear(F.linear(x, self.lora_a), self.lora_b)
        return super().forward(x) + self.lora_scale * adapted

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """A drawn from a generator seeded by the module's name (whole, then this rank's shard); B zero."""
        rank, fan_in = self.lora_a.shape
        gen = torch.Generator().manual_seed(zlib.crc32(self.lora_name.encode()))
        bound = 1.0 / fan_in**0.5
        full_a = torch.empty(rank, fan_in).uniform_(-bound, bound, generator=gen)
        _copy_full(self.lora_a, full_a)
        self.lora_b.zero_()


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copies a whole tensor into a parameter, sharded or not (each rank keeps its own shard)."""
    full = full.to(dtype=param.dtype)
    if isinstance(param, DTensor):  # src_data_rank None: every rank slices its shard, no communication
        mesh = param.device_mesh
        param.copy_(distribute_tensor(full.to(mesh.device_type), mesh, param.placements, src_data_rank=None))
    else:
        param.copy_(full.to(param.device))


_MIXED: dict[type, type] = {}


def _lora_class(base: type) -> type:
    if base not in _MIXED:
        _MIXED[base] = type(f"LoRA{base.__name__}", (LoRAMixin, base), {})
    return _MIXED[base]


def add_adapter(module: nn.Linear, name: str, rank: int, alpha: float, dropout: float) -> None:
    """Turns `module` (an nn.Linear or subclass) into its LoRA variant in place, on its own device."""
    kw = {"device": module.weight.device, "dtype": module.weight.dtype}
    module.__class__ = _lora_class(type(module))
    module.lora_a = nn.Parameter(torch.empty(rank, module.in_features, **kw))
    module.lora_b = nn.Parameter(torch.empty(module.out_features, rank, **kw))
    module.lora_dropout = dropout  # a float, not a child module: a TP style applies itself to every submodule
    module.lora_scale = alpha / rank
    module.lora_name = name


def lora_modules(model: nn.Module) -> dict[str, LoRAMixin]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRAMixin)}


def _init_weights_with_adapters(self, *args, **kwargs) -> None:
    """The model's own init_weights, then the adapters' (bound to the model by the converter; a bound method
    survives the deepcopy that cuts pipeline stages)."""
    type(self).init_weights(self, *args, **kwargs)
    for m in lora_modules(self).values():
        m.reset_adapter()


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Folds every adapter into its base weight (W += scale B A) and restores the base class, in place: the
    model then has exactly the base's parameters and computes what the adapted model computed. Full
    (unsharded) tensors only: this is for export, after training."""
    for m in lora_modules(model).values():
        delta = m.lora_scale * (m.lora_b.float() @ m.lora_a.float())
        m.weight.copy_((m.weight.float() + delta).to(m.weight.dtype))
        del m.lora_a, m.lora_b, m.lora_dropout
        m.__class__ = next(c for c in type(m).__mro__[1:] if not issubclass(c, LoRAMixin))
    if "init_weights" in vars(model):
        del model.init_weights


def _fqn_matches(name: str, patterns: list[str]) -> list[str]:
    return [p for p in patterns if fnmatch.fnmatchcase(name, p)]


class LoRAConverter:
    matmul_dtype = None  # the base matmuls keep their dtype (Float8 before LoRA still sets its own)

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device):
        self.cfg = job_config.lora
        converters = job_config.model.converters
        if "float8" in converters and converters.index("float8") > converters.index("lora"):
            raise ValueError(
                "--model.converters lists lora before float8: float8 would replace the adapted layers and drop "
                "their adapters; use --model.converters float8,lora"
            )
        if self.cfg.rank < 1:
            raise ValueError(f"--lora.rank must be at least 1 (got {self.cfg.rank})")
        if not 0.0 <= self.cfg.dropout < 1.0:
            raise ValueError(f"--lora.dropout must be in [0, 1) (got {self.cfg.dropout})")
        if not self.cfg.target_modules:
            raise ValueError("--lora.target_modules is empty: name the linear layers to adapt, e.g. 'layers.*'")

    def convert(self, model: nn.Module) -> None:
        patterns = self.cfg.target_modules
        matched, linears, used = [], [], set()
        for name, module in model.named_modules():
            hits = _fqn_matches(name, patterns) if name else []
            used.update(hits)
            if hits:
                matched.append(name)
                if isinstance(module, nn.Linear) and not isinstance(module, LoRAMixin):
                    linears.append((name, module))
        unused = [p for p in patterns if p not in used]
        if unused:
            examples = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:3]
            raise ValueError(
                f"--lora.target_modules pattern {unused[0]!r} matches no module of the model; its linear layers are "
                f"named like {', '.join(examples) or '(none)'}"
            )
        if not linears:
            raise ValueError(
                f"--lora.target_modules {patterns} matched {len(matched)} module(s) but no linear layer (e.g. "
                f"{matched[0]}): LoRA adapts nn.Linear layers; name them (e.g. 'layers.*.attention.wq')"
            )
        for name, module in linears:
            limit = min(module.in_features, module.out_features)
            if self.cfg.rank > limit:
                raise ValueError(
                    f"--lora.rank {self.cfg.rank} is above the size of {name} ({module.out_features} x "
                    f"{module.in_features}); use a rank of at most {limit} or leave that layer out of "
                    f"--lora.target_modules"
                )
        for p in model.parameters():
            p.requires_grad_(False)
        for name, module in linears:
            add_adapter(module, name, self.cfg.rank, self.cfg.alpha, self.cfg.dropout)
        model.init_weights = types.MethodType(_init_weights_with_adapters, model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        logger.info(
            f"LoRA rank {self.cfg.rank}, alpha {self.cfg.alpha}: adapters on {len(linears)} linear layers "
            f"({', '.join(n for n, _ in linears[:3])}{', ...' if len(linears) > 3 else ''}); trainable "
            f"{trainable:,} of {total:,} parameters ({100 * trainable / total:.2f}%), the rest frozen"
        )

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        pass

    def post_parallelize(self, model_parts: list[nn.Module]) -> None:
        """Freezes the base again: TP's SequenceParallel (norms) and DTensor's replication of a module's other
        parameters re-create them as new, trainable Parameters."""
        for m in model_parts:
            for name, p in m.named_parameters():
                p.requires_grad_(name.rsplit(".", 1)[-1] in ADAPTER_NAMES)
