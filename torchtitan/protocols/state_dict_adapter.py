"""The base class of a model's Hugging Face adapter: state dicts and configs both ways, and HF folders.

A subclass implements the four conversions and, where to_hf moves elements within a tensor, `hf_layout`;
folder I/O (safetensors, single or sharded, read and written slice by slice) is components/checkpoint/hf_folder.py.
`check_hf_config` compares what a folder's config says with the args the job will train, so a folder of
another model (another shape, rope theta, norm eps, ...) is refused in one line instead of loading into a
silently different model.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.protocols.hf_config import UnsupportedHFConfig, read_config_file
from torchtitan.tools import storage


@dataclass
class HFLayout:
    """Where one of our tensors lives in an HF folder, so a rank can read or write just its slice of it:
    under `hf_keys[0]` with the same shape, or (`stacked`) as one HF tensor per index of our dim 0 (routed
    experts). With `row_block`, to_hf/from_hf permute rows within blocks of that many rows (Llama's q/k
    heads): `to_hf_rows` / `from_hf_rows` convert any whole number of blocks. With `hf_rows`, our tensor is
    rows [row_offset, row_offset + its rows) of an HF tensor of `hf_rows` rows (one of several of ours fused
    into one HF tensor, e.g. Qwen3.5's q, k and v in `in_proj_qkv`)."""

    hf_keys: list[str]
    stacked: bool = False
    row_block: int = 0
    to_hf_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    from_hf_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    copies: tuple[str, ...] = ()
    """More HF names the folder stores the same tensor under (DeepSeek-V3's MTP layer repeats the embedding
    and output head): written with it, never read (a plain rename only)."""
    row_offset: int = 0
    hf_rows: int = 0


class StateDictAdapter(ABC):
    def __init__(self, args: Any):
        self.args = args

    def hf_layout(self, key: str, shape: torch.Size) -> HFLayout | None:
        """How our tensor `key` (global `shape`) maps to HF tensors; None when the folder does not store it
        (a tied output projection, a state HF has no slot for). Derived from `to_hf` on a meta tensor: a
        pure rename, or a split along dim 0. An adapter whose to_hf also moves elements within a tensor
        overrides this (see HFLayout.row_block)."""
        hf = self.to_hf({key: torch.empty(shape, device="meta")})
        if not hf:
            return None
        if len(hf) == 1 and tuple(next(iter(hf.values())).shape) == tuple(shape):
            return HFLayout(list(hf))
        if len(hf) == shape[0] and all(tuple(t.shape) == tuple(shape[1:]) for t in hf.values()):
            return HFLayout(list(hf), stacked=True)
        raise NotImplementedError(f"{type(self).__name__}: no slice layout for {key!r}")

    def hf_reader(self, reader: Any) -> Any:
        """The reader (components/hf_folder.SliceReader: `where`, `shape`, `read` of boxes) the load paths use
        for a folder. An adapter whose published checkpoints store some tensors in another form (GPT-OSS's
        MXFP4 experts) wraps it, so that those read as the plain tensors `from_hf` names, box by box."""
        return reader

    @abstractmethod
    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our FQNs -> HF names; works on any subset (e.g. one pipeline stage's state dict)."""

    @abstractmethod
    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names -> our FQNs."""

    @staticmethod
    @abstractmethod
    def to_hf_config(args: Any, dtype: torch.dtype = torch.bfloat16) -> dict:
        """Contents of an HF `config.json` for these args (weights stored in `dtype`)."""

    @staticmethod
    @abstractmethod
    def from_hf_config(config: dict, where: str = "config.json") -> Any:
        """Our args reproducing an HF config; a key the model cannot reproduce is refused in one line
        (UnsupportedHFConfig, naming `where`)."""

    HF_MODEL_TYPES: tuple[str, ...] = ()
    """The config.json `model_type`s this adapter reads (e.g. ("llama",))."""

    HF_KEEPS_EXPERT_BIAS: bool = True
    """MoE families: whether the format stores the routers' balancing bias (`moe.expert_bias`; DeepSeek-V3's
    `e_score_correction_bias`). False (Qwen3-MoE, Qwen3.5-MoE, GPT-OSS): it has no slot for it, so to_hf
    refuses a moved one; a job whose model comes from such a folder balances by the format's loss instead
    (components/moe/args.py resolve_moe_balancing), and an HF save of a bias-balanced job is refused before
    any rank starts (job_plan)."""

    @classmethod
    def args_from_hf(cls, folder: str) -> Any:
        """Our args for an HF folder (or config.json path): its model_type must be one this adapter reads."""
        config = read_config_file(folder)
        where = folder if folder.endswith(".json") else storage.join(folder, "config.json")
        model_type = config.get("model_type")
        if model_type not in cls.HF_MODEL_TYPES:
            arch = ", ".join(config.get("architectures") or []) or "no architectures listed"
            raise UnsupportedHFConfig(
                f"{where}: model_type {model_type!r} ({arch}) is not supported by this model, which reads "
                f"{' / '.join(cls.HF_MODEL_TYPES)} configs; pick the --model.name of the folder's architecture"
            )
        return cls.from_hf_config(config, where)

    # config.json keys that do not change what the model computes. max_position_embeddings only bounds the
    # positions a model may be given (the RoPE table length), so a longer or shorter one is the same model.
    HF_CONFIG_NOT_COMPARED = frozenset({"architectures", "model_type", "dtype", "torch_dtype", "max_position_embeddings"})

    @classmethod
    def check_hf_config(cls, folder: str, args: Any, expected: Any) -> None:
        """Raises HFConfigMismatch, one line naming every differing setting with both values, when the args a
        folder's config gives are not the job's. Both sides are compared as the config.json this adapter would
        write for them, so each setting has its HF name, and one the model does not compute with
        (HF_CONFIG_NOT_COMPARED) is left out. Same-shaped weights with another rope theta or norm eps would
        otherwise load into a silently different model."""
        theirs, ours = _leaves(cls.to_hf_config(args)), _leaves(cls.to_hf_config(expected))
        diffs = [
            f"{key} {theirs.get(key)} in the folder vs {ours.get(key)} in the model"
            for key in [*ours, *(k for k in theirs if k not in ours)]
            if key not in cls.HF_CONFIG_NOT_COMPARED and theirs.get(key) != ours.get(key)
        ]
        if diffs:
            raise HFConfigMismatch(
                f"Hugging Face config {storage.join(folder, 'config.json')} does not match the model: "
                f"{'; '.join(diffs)}; train the folder's own shape (--model.hf_config {folder}) or pick the "
                f"--model.flavor (and tokenizer) the folder was made for"
            )


class HFConfigMismatch(ValueError):
    """An HF folder's config.json describes another model than the one the job trains."""


def _leaves(config: dict) -> dict:
    """Nested settings by their own name (transformers 5.x nests rope_theta inside rope_parameters)."""
    flat = {}
    for key, value in config.items():
        flat.update(_leaves(value) if isinstance(value, dict) else {key: value})
    return flat
