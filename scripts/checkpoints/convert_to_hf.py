"""Convert a DCP checkpoint (full, export or seed) to a Hub-ready Hugging Face folder, one tensor at a time.

    python scripts/checkpoints/convert_to_hf.py outputs/checkpoint/export-step-1000 outputs/hf [--dtype bfloat16]
        [--max_shard_mb 5000] [--section.key VALUE ...]

The model shape and tokenizer come from the checkpoint's config.toml (trailing options override it). The
output is what save_pretrained writes: model.safetensors, or model-0000i-of-0000n.safetensors split at
--max_shard_mb with model.safetensors.index.json, plus config.json, generation_config.json and the tokenizer
files (tokenizer.json, tokenizer_config.json, special_tokens_map.json), so AutoModelForCausalLM and
AutoTokenizer load the folder as it is. Tensors are read from the checkpoint one by one and written in parts
(components/checkpoint/hf_folder.py): memory stays at a few tensors, not the model. The default dtype float32 keeps the
weights bit-exact; bfloat16 halves the size. The output folder must be new or empty.

A step checkpoint of a LoRA run (--model.converters lora) holds only the adapters: the base is rebuilt from
the run's --checkpoint.initial_load_path (checked against the fingerprint the checkpoint names), and the
output is the merged model, or with --peft BASE the adapters alone in peft's format (adapter_config.json +
adapter_model.safetensors; BASE is written as base_model_name_or_path, e.g. the Hub id or the HF folder).

The checkpoint and the output may be object store URLs (s3://bucket/run/checkpoint/step-100,
s3://bucket/exports/hf; docs/object_storage.md): the output is written locally and uploaded, config.json
(adapter_config.json for peft) last.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from torchtitan.components.checkpoint import folders  # noqa: E402
from torchtitan.components.checkpoint.manager import DCP_ERRORS, CheckpointError, check_shapes, read_dcp_metadata  # noqa: E402
from torchtitan.components.checkpoint.hf_folder import (  # noqa: E402
    check_output_folder,
    hf_chunks,
    model_hf_shapes,
    write_hf_metadata,
    write_hf_weights,
)
from torchtitan.components.checkpoint.offline_model import job_config_of  # noqa: E402
from torchtitan.components.lora.export import load_lora_model, save_merged, save_peft  # noqa: E402
from torchtitan.config import ConfigError  # noqa: E402
from torchtitan.protocols.model_shape import resolve_model  # noqa: E402
from torchtitan.tools import storage  # noqa: E402
from torchtitan.tools.precision import DTYPES  # noqa: E402


def convert(checkpoint: str, output: str, dtype: torch.dtype, max_shard_bytes: int, overrides: list[str]) -> None:
    check_output_folder(output)
    if not storage.isdir(checkpoint):
        raise CheckpointError(f"checkpoint {checkpoint}: no such folder")
    why = folders.problem(checkpoint, require_manifest=False)
    if why is not None:
        raise CheckpointError(f"checkpoint {checkpoint}: {why}")
    cfg = job_config_of(checkpoint, overrides)
    spec, tokenizer, model_args = resolve_model(cfg)
    if spec.state_dict_adapter is None:
        raise CheckpointError(f"model {cfg.model.name} has no Hugging Face adapter")
    config = spec.state_dict_adapter.to_hf_config(model_args, dtype)  # refuses what HF cannot express, early
    with torch.device("meta"):
        expected = spec.model_cls(model_args).state_dict()
    saved = read_dcp_metadata(checkpoint).state_dict_metadata
    saved_model = {k[len("model."):]: m for k, m in saved.items() if k.startswith("model.")}
    check_shapes(f"checkpoint {checkpoint}", {k: m.size for k, m in saved_model.items()},
                 {k: v.shape for k, v in expected.items()}, exact=True)
    adapter = spec.state_dict_adapter(model_args)

    def chunks():
        for key in expected:
            meta = saved_model[key]
            t = torch.empty(meta.size, dtype=meta.properties.dtype)
            try:
                dcp.load({"model": {key: t}}, checkpoint_id=checkpoint,
                         storage_reader=storage.dcp_reader(checkpoint), no_dist=True)
            except DCP_ERRORS as e:
                raise CheckpointError(f"cannot read {key} from {checkpoint}: {type(e).__name__}: {e}") from e
            yield from hf_chunks(adapter, key, t)

    storage.makedirs(output)
    write_hf_weights(chunks(), model_hf_shapes(adapter, expected), output, dtype, max_shard_bytes)
    write_hf_metadata(output, config, tokenizer)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("output")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--max_shard_mb", type=int, default=5000, help="size limit of one safetensors file (MB)")
    p.add_argument("--peft", metavar="BASE", help="LoRA runs: write the adapters alone in peft's format")
    args, overrides = p.parse_known_args(argv)
    try:
        if _is_lora_checkpoint(args.checkpoint):
            check_output_folder(args.output)
            return _convert_lora(args, job_config_of(args.checkpoint, overrides))
        if args.peft:
            raise CheckpointError(f"--peft exports the adapters of a LoRA run; {args.checkpoint} is not one")
        convert(args.checkpoint, args.output, DTYPES[args.dtype], args.max_shard_mb * 10**6, overrides)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} (Hugging Face folder, {args.dtype})")
    return 0


def _is_lora_checkpoint(path: str) -> bool:
    """A step checkpoint of a run on a frozen base (it names the base in its manifest)."""
    try:
        return bool(folders.read_manifest(path).get("base"))
    except (OSError, ValueError):
        return False


def _convert_lora(args, cfg) -> int:
    model, spec, model_args = load_lora_model(args.checkpoint, cfg)
    if spec.state_dict_adapter is None:
        raise CheckpointError(f"model {cfg.model.name} has no Hugging Face adapter")
    if args.peft:
        save_peft(model, spec.state_dict_adapter, model_args, args.output, args.peft)
        print(f"wrote {args.output} (peft LoRA adapters: adapter_config.json + adapter_model.safetensors)")
    else:
        save_merged(model, spec.state_dict_adapter, model_args, args.output, DTYPES[args.dtype],
                    max_shard_bytes=args.max_shard_mb * 10**6, tokenizer=spec.build_tokenizer_fn(cfg))
        print(f"wrote {args.output} (the merged model as a Hugging Face folder, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
