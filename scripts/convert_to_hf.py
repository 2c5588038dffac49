"""Convert a DCP checkpoint (full, export or seed) to a Hugging Face folder: config.json + model.safetensors.

    python scripts/convert_to_hf.py outputs/checkpoint/export-step-1000 outputs/hf [--dtype bfloat16]
        [--section.key VALUE ...]

The model shape comes from the checkpoint's config.toml (trailing options override it). Conversion goes
through the model's state-dict adapter (TrainSpec.state_dict_adapter). The default dtype float32 keeps the
weights bit-exact; bfloat16 halves the size. The tokenizer is not copied.

A step checkpoint of a LoRA run (--model.converters lora) holds only the adapters: the base is rebuilt from
the run's --checkpoint.initial_load_path (checked against the fingerprint the checkpoint names), and the
output is the merged model, or with --peft BASE the adapters alone in peft's format (adapter_config.json +
adapter_model.safetensors; BASE is written as base_model_name_or_path, e.g. the Hub id or the HF folder).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from torchtitan.components import checkpoint_folders as folders  # noqa: E402
from torchtitan.components.checkpoint import CheckpointError  # noqa: E402
from torchtitan.components.lora_export import export_hf, load_lora_model, save_merged, save_peft  # noqa: E402
from torchtitan.components.offline_model import build_cpu_model, job_config_of, load_model_weights  # noqa: E402
from torchtitan.config import ConfigError  # noqa: E402
from torchtitan.tools.precision import DTYPES



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("output")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--peft", metavar="BASE", help="LoRA runs: write the adapters alone in peft's format")
    args, overrides = p.parse_known_args(argv)
    try:
        if os.path.exists(args.output) and os.listdir(args.output):
            raise CheckpointError(f"{args.output} exists and is not empty; choose another output folder")
        cfg = job_config_of(args.checkpoint, overrides)
        if "lora" in cfg.model.converters and folders.read_manifest(args.checkpoint).get("base"):
            return _convert_lora(args, cfg)
        if args.peft:
            raise CheckpointError(f"--peft exports the adapters of a LoRA run; {args.checkpoint} is not one")
        model, spec, _, model_args = build_cpu_model(cfg)
        if spec.state_dict_adapter is None:
            raise CheckpointError(f"model {cfg.model.name} has no Hugging Face adapter")
        load_model_weights(model, args.checkpoint)
        export_hf(spec.state_dict_adapter, model.state_dict(), model_args, args.output, DTYPES[args.dtype])
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} (config.json + model.safetensors, {args.dtype})")
    return 0


def _convert_lora(args, cfg) -> int:
    model, spec, model_args = load_lora_model(args.checkpoint, cfg)
    if spec.state_dict_adapter is None:
        raise CheckpointError(f"model {cfg.model.name} has no Hugging Face adapter")
    if args.peft:
        save_peft(model, spec.state_dict_adapter, model_args, args.output, args.peft)
        print(f"wrote {args.output} (peft LoRA adapters: adapter_config.json + adapter_model.safetensors)")
    else:
        save_merged(model, spec.state_dict_adapter, model_args, args.output, DTYPES[args.dtype])
        print(f"wrote {args.output} (the merged model: config.json + model.safetensors, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
