"""The base class of a model's Hugging Face adapter: state dicts and configs both ways, and HF folders.

A subclass implements the four conversions; folder I/O (safetensors, single or sharded, `config.json`) is
shared. `check_hf_config` compares what a folder's config says with the args the job will train, so a
folder of another shape is refused in one line instead of loading into a silently different model.
"""

import json
import os
from abc import ABC, abstractmethod
from typing import Any

import torch
from safetensors.torch import load_file, save_file


class StateDictAdapter(ABC):
    def __init__(self, args: Any):
        self.args = args

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
    def from_hf_config(config: dict) -> Any:
        """Our args reproducing an HF config."""

    @classmethod
    def save_hf(
        cls, state_dict: dict[str, torch.Tensor], args: Any, folder: str, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        """Write `config.json` + a single `model.safetensors`; `state_dict` holds full tensors, our FQNs."""
        os.makedirs(folder, exist_ok=True)
        hf = cls(args).to_hf(state_dict)
        tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in hf.items()}
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cls.to_hf_config(args, dtype), f, indent=2)

    @classmethod
    def load_hf(cls, folder: str) -> tuple[dict[str, torch.Tensor], Any]:
        """(state dict with our FQNs, args) of an HF folder; tensors keep their stored dtype."""
        config = read_hf_config(folder)
        args = cls.from_hf_config(config)
        return cls(args).from_hf(read_hf_tensors(folder, config)), args


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    with open(path) as f:
        return json.load(f)


def read_hf_tensors(folder: str, config: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files (single or sharded by an index). Tied embeddings are
    untied by copying the embedding into `lm_head.weight` when the folder does not store it."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    hf: dict[str, torch.Tensor] = {}
    for name in files:
        hf.update(load_file(os.path.join(folder, name)))
    if config.get("tie_word_embeddings") and "lm_head.weight" not in hf:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"].clone()
    return hf
