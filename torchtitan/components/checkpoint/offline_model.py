"""One-process access to a checkpoint's model outside training (conversion, generation, seed checkpoints).

A checkpoint written by the trainer carries its resolved config (config.toml), so the model is rebuilt with
exactly the shape it was trained with; options given on the command line override it (and are needed for a
checkpoint without config, e.g. one converted from Hugging Face).
"""

import os
import tempfile

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from torchtitan.components.checkpoint import folders
from torchtitan.components.checkpoint.manager import (
    DCP_ERRORS,
    CheckpointError,
    ModelWrapper,
    check_shapes,
    content_problem,
    read_dcp_metadata,
)
from torchtitan.components.checkpoint.hf_folder import load_hf_into
from torchtitan.config import JobConfig
from torchtitan.protocols.train_spec import config_manager
from torchtitan.protocols.model_shape import resolve_model
from torchtitan.tools import storage


def job_config_of(checkpoint: str, overrides: list[str]) -> JobConfig:
    """The config `checkpoint` was written with (when it has one), then `overrides` (--section.key value)."""
    saved = storage.join(checkpoint, folders.CONFIG)
    with tempfile.TemporaryDirectory(prefix="torchtitan-config-") as work:
        if storage.is_url(saved) and storage.isfile(saved):  # the config parser reads local files
            local = os.path.join(work, folders.CONFIG)
            with open(local, "wb") as f:
                f.write(storage.read_bytes(saved))
            saved = local
        recipe = ["--job.config_file", saved] if storage.isfile(saved) else []
        cfg = config_manager(skip_retired=True).parse_args(recipe + list(overrides))  # older runs' configs load too
    if is_hf_folder(checkpoint) and not cfg.model.hf_config:
        cfg.model.hf_config = checkpoint  # a Hugging Face folder carries its shape in config.json
    return cfg


def is_hf_folder(path: str) -> bool:
    return storage.isfile(storage.join(path, "config.json"))


def build_cpu_model(cfg: JobConfig) -> tuple[nn.Module, object, object, object]:
    """(model in fp32 on CPU, train spec, tokenizer, model args), initialised by the model's own init under
    the job's seed (exactly as a one-process training run starts)."""
    spec, tokenizer, args = resolve_model(cfg)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0 if cfg.debug.seed is None else cfg.debug.seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # also builds derived buffers (RoPE tables)
    return model, spec, tokenizer, args


def load_model_weights(model: nn.Module, checkpoint: str, hf_adapter=None, model_args=None) -> None:
    """Loads the model weights of a DCP checkpoint (full, export or seed) or of a Hugging Face folder (one with
    config.json) into `model`, casting to its dtype; one clear line when the checkpoint does not fit. A Hugging
    Face folder's config is compared with `model_args` (every setting the model computes with)."""
    expected = model.state_dict()
    shapes = {k: v.shape for k, v in expected.items()}
    if not storage.isdir(checkpoint):
        raise CheckpointError(f"checkpoint {checkpoint}: no such folder")
    if is_hf_folder(checkpoint):
        if hf_adapter is None:
            raise CheckpointError(f"{checkpoint} is a Hugging Face folder but the model has no adapter")
        try:
            hf_adapter.check_hf_config(checkpoint, hf_adapter.args_from_hf(checkpoint), model_args)
            load_hf_into(expected, checkpoint, hf_adapter(model_args))
        except ValueError as e:  # the folder's config differs from the model (or cannot be read): one line
            raise CheckpointError(str(e)) from e
        return
    why = folders.problem(checkpoint, require_manifest=False) or content_problem(checkpoint)
    if why is not None:
        raise CheckpointError(f"checkpoint {checkpoint}: {why}")
    saved = read_dcp_metadata(checkpoint).state_dict_metadata
    saved_model = {k[len("model.") :]: m.size for k, m in saved.items() if k.startswith("model.")}
    check_shapes(f"checkpoint {checkpoint}", saved_model, shapes, exact=True)
    try:
        dcp.load({"model": ModelWrapper([model])}, checkpoint_id=checkpoint,
                 storage_reader=storage.dcp_reader(checkpoint), no_dist=True)
    except DCP_ERRORS as e:  # DCP raises many types
        raise CheckpointError(f"cannot load checkpoint {checkpoint}: {type(e).__name__}: {str(e).strip()[:200]}") from e
