"""A LoRA run handed back to Hugging Face tools, both ways (one process, on CPU):

* merged: the adapters folded into the base weights, written as a Hub-ready Hugging Face folder
  (`hf_folder.save_hf_folder`, the writer the run's own HF saves use);
* adapters alone, in peft's format (`adapter_config.json` + `adapter_model.safetensors`, peft's key names), so
  `peft.PeftModel.from_pretrained(transformers_base, folder)` applies them to the transformers base.

The adapted model is rebuilt from a step checkpoint: its config.toml gives the shape and the LoRA options,
the base comes from the run's --checkpoint.initial_load_path (or the model's own init under the run's seed)
and must have the fingerprint the checkpoint's manifest names.
"""

import json
import os
import shutil
import tempfile

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import save_file

from torchtitan.components.checkpoint import folders
from torchtitan.components.checkpoint.manager import (
    DCP_ERRORS,
    CheckpointError,
    ModelWrapper,
    base_fingerprint,
    check_shapes,
    read_dcp_metadata,
)
from torchtitan.components.checkpoint.hf_folder import save_hf_folder, upload_files
from torchtitan.components.lora.adapters import LoRAConverter, lora_modules, merge_adapters
from torchtitan.components.checkpoint.offline_model import build_cpu_model, load_model_weights
from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import parallel_dims_from_config
from torchtitan.tools import storage


def load_lora_model(checkpoint: str, cfg: JobConfig) -> tuple[nn.Module, object, object]:
    """(the adapted model in fp32 on CPU, train spec, model args) of a LoRA run's step checkpoint."""
    why = folders.problem(checkpoint)
    if why is not None:
        raise CheckpointError(f"checkpoint {checkpoint}: {why}")
    base_ref = folders.read_manifest(checkpoint).get("base")
    if base_ref is None or "lora" not in cfg.model.converters:
        raise CheckpointError(f"checkpoint {checkpoint} is not one of a LoRA run (its manifest names no base)")
    model, spec, _, args = build_cpu_model(cfg)
    base = cfg.checkpoint.initial_load_path
    if base:
        load_model_weights(model, base, spec.state_dict_adapter, args)
    LoRAConverter(cfg, parallel_dims_from_config(cfg.parallelism, 1), torch.device("cpu")).convert(model)
    model.to(getattr(torch, base_ref.get("dtype", "float32")))  # the fingerprint is of the dtype it trained in
    fingerprint = base_fingerprint([model])
    if fingerprint != base_ref["fingerprint"]:
        raise CheckpointError(
            f"checkpoint {checkpoint} was trained on base {base_ref['path']} (fingerprint "
            f"{base_ref['fingerprint'][:16]}) but the base rebuilt here ({base or 'the seeded init'}) has "
            f"fingerprint {fingerprint[:16]}: pass --checkpoint.initial_load_path {base_ref['path']}"
        )
    model.float()
    adapters = ModelWrapper([model], "trainable")
    saved = read_dcp_metadata(checkpoint).state_dict_metadata
    saved_model = {k[len("model."):]: m.size for k, m in saved.items() if k.startswith("model.")}
    check_shapes(f"checkpoint {checkpoint}", saved_model, {k: v.shape for k, v in adapters.state_dict().items()},
                 exact=True)
    try:
        dcp.load({"model": adapters}, checkpoint_id=checkpoint, storage_reader=storage.dcp_reader(checkpoint),
                 no_dist=True)
    except DCP_ERRORS as e:
        raise CheckpointError(f"cannot load checkpoint {checkpoint}: {type(e).__name__}: {e}") from e
    return model.eval(), spec, args


def save_merged(model: nn.Module, adapter_cls, args, folder: str, dtype: torch.dtype = torch.float32,
                **hf_options) -> None:
    """The adapters folded into the base (in place: `model` becomes the merged model), as a Hub-ready HF
    folder (hf_folder.save_hf_folder; `hf_options`: max_shard_bytes, tokenizer)."""
    merge_adapters(model)
    save_hf_folder(model.state_dict(), adapter_cls, args, folder, dtype=dtype, **hf_options)


def _hf_row_col_order(adapter, key: str, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor, str]:
    """How the family's to_hf moves a weight's rows and columns: it is applied to matrices of row and column
    indices. (Rotary layouts permute q/k rows; a conversion that mixes values is refused by the caller's check.)"""
    rows = torch.arange(shape[0], dtype=torch.float64)[:, None].expand(shape).contiguous()
    cols = torch.arange(shape[1], dtype=torch.float64)[None, :].expand(shape).contiguous()
    (hf_key, r), = adapter.to_hf({key: rows}).items()
    (_, c), = adapter.to_hf({key: cols}).items()
    return r[:, 0].long(), c[0, :].long(), hf_key


@torch.no_grad()
def save_peft(model: nn.Module, adapter_cls, args, folder: str, base_name_or_path: str) -> None:
    """The adapters alone in peft's LoRA format, under the transformers base's module names."""
    adapter = adapter_cls(args)
    tensors, targets, rank, alpha = {}, [], None, None
    for name, m in lora_modules(model).items():
        rows, cols, hf_key = _hf_row_col_order(adapter, f"{name}.weight", m.weight.shape)
        a, b = m.lora_a.detach().float()[:, cols], m.lora_b.detach().float()[rows, :]
        want = adapter.to_hf({f"{name}.weight": m.lora_b.float() @ m.lora_a.float()})[hf_key]
        if not torch.allclose(b @ a, want, rtol=0, atol=1e-6):
            raise ValueError(f"the Hugging Face layout of {name} is not a permutation of ours: cannot express its "
                             f"adapter in peft's format (export the merged model instead)")
        module = hf_key.removesuffix(".weight")
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        targets.append(module)
        rank, alpha = m.lora_a.shape[0], m.lora_scale * m.lora_a.shape[0]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name_or_path,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": targets, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "modules_to_save": None,
        "inference_mode": True,
    }
    remote = storage.is_url(folder)
    work = tempfile.mkdtemp(prefix="torchtitan-peft-") if remote else folder  # on a store: written, then uploaded
    try:
        os.makedirs(work, exist_ok=True)
        save_file(tensors, os.path.join(work, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(work, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if remote:
            upload_files(work, folder, last="adapter_config.json")
    finally:
        if remote:
            shutil.rmtree(work, ignore_errors=True)
