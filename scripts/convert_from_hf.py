"""Convert a Hugging Face Llama folder (config.json + *.safetensors) to a DCP checkpoint for
`--checkpoint.initial_load_path`.

    python scripts/convert_from_hf.py path/to/hf_folder outputs/from_hf --model.flavor 8B [--model.tokenizer_path ...]

The weights keep their stored dtype (training casts them on load) and go through the model's state-dict
adapter. The options (or --job.config_file) name the model the checkpoint is for: the folder's config.json
(transformers 4.x or 5.x layout) must match it in every setting the model computes with (dims, heads, kv heads,
head dim, FFN size, vocabulary, rope theta and scaling, norm eps), or conversion stops with one line naming
each difference; a DCP checkpoint records no rope theta, so it cannot be caught later. (Loading the HF folder directly with --checkpoint.initial_load_in_hf also works;
converting once avoids re-reading safetensors on every rank at each start.)
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan.components.checkpoint import CheckpointError, write_model_checkpoint  # noqa: E402
from torchtitan.config import ConfigError  # noqa: E402
from torchtitan.protocols.train_spec import resolve_model  # noqa: E402
from torchtitan.protocols.train_spec import config_manager  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_folder")
    p.add_argument("output")
    args, overrides = p.parse_known_args(argv)
    try:
        cfg = config_manager().parse_args(overrides)
        spec, _, model_args = resolve_model(cfg)
        if spec.state_dict_adapter is None:
            raise CheckpointError(f"model {cfg.model.name} has no Hugging Face adapter")
        if not os.path.isfile(os.path.join(args.hf_folder, "config.json")):
            raise CheckpointError(f"{args.hf_folder}: not a Hugging Face folder (no config.json)")
        state_dict, _ = spec.state_dict_adapter.load_hf(args.hf_folder, expected=model_args)
        write_model_checkpoint(args.output, state_dict, None, {"step": 0, "source": os.path.abspath(args.hf_folder)})
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}; train from it with --checkpoint.initial_load_path {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
