"""Convert a Hugging Face folder (config.json + *.safetensors) to a DCP checkpoint for
`--checkpoint.initial_load_path`.

    python scripts/checkpoints/convert_from_hf.py path/to/hf_folder outputs/from_hf --model.name llama3 [--model.tokenizer_path ...]

The model's shape comes from the folder's config.json (transformers 4.x or 5.x layout; --model.hf_config is
set to the folder unless given), every key read or refused in one line; `--model.flavor F` without hf_config
is not needed. The weights keep their stored dtype (training casts them on load) and go through the model's
state-dict adapter. The checkpoint carries a config.toml recording the resolved shape, so training, generation
and conversion back rebuild the model from it alone. (Loading the HF folder directly with
--checkpoint.initial_load_in_hf also works.)
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torchtitan.components.checkpoint.manager import CheckpointError, write_model_checkpoint  # noqa: E402
from torchtitan.config import ConfigError  # noqa: E402
from torchtitan.components.checkpoint.hf_folder import read_hf_state_dict  # noqa: E402
from torchtitan.protocols.model_shape import pin_model_shape, resolve_model  # noqa: E402
from torchtitan.protocols.train_spec import config_manager  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_folder")
    p.add_argument("output")
    args, overrides = p.parse_known_args(argv)
    try:
        cfg = config_manager().parse_args(overrides)
        if not os.path.isfile(os.path.join(args.hf_folder, "config.json")):
            raise CheckpointError(f"{args.hf_folder}: not a Hugging Face folder (no config.json)")
        if os.path.exists(args.output):
            raise CheckpointError(f"{args.output} already exists; remove it or choose another output folder")
        cfg.model.hf_config = cfg.model.hf_config or args.hf_folder
        spec, _, model_args = resolve_model(cfg)
        if spec.state_dict_adapter is None:
            raise CheckpointError(f"model {cfg.model.name} has no Hugging Face adapter")
        state_dict = read_hf_state_dict(args.hf_folder, spec.state_dict_adapter, model_args)
        pin_model_shape(cfg, model_args)
        write_model_checkpoint(args.output, state_dict, cfg, {"step": 0, "source": os.path.abspath(args.hf_folder)})
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}; train from it with --checkpoint.initial_load_path {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
