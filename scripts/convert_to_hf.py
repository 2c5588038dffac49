"""Convert a DCP checkpoint (full, export or seed) to a Hugging Face folder: config.json + model.safetensors.

    python scripts/convert_to_hf.py outputs/checkpoint/export-step-1000 outputs/hf [--dtype bfloat16]
        [--section.key VALUE ...]

The model shape comes from the checkpoint's config.toml (trailing options override it). Conversion goes
through the model's state-dict adapter (TrainSpec.state_dict_adapter). The default dtype float32 keeps the
weights bit-exact; bfloat16 halves the size. The tokenizer is not copied.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from torchtitan.components.checkpoint import CheckpointError  # noqa: E402
from torchtitan.components.offline_model import build_cpu_model, job_config_of, load_model_weights  # noqa: E402
from torchtitan.config import ConfigError  # noqa: E402
from torchtitan.tools.precision import DTYPES



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("output")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    args, overrides = p.parse_known_args(argv)
    try:
        if os.path.exists(args.output) and os.listdir(args.output):
            raise CheckpointError(f"{args.output} exists and is not empty; choose another output folder")
        cfg = job_config_of(args.checkpoint, overrides)
        model, spec, _, model_args = build_cpu_model(cfg)
        if spec.state_dict_adapter is None:
            raise CheckpointError(f"model {cfg.model.name} has no Hugging Face adapter")
        load_model_weights(model, args.checkpoint)
        spec.state_dict_adapter.save_hf(model.state_dict(), model_args, args.output, DTYPES[args.dtype])
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} (config.json + model.safetensors, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
