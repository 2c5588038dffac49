"""Sample text from a checkpoint (DCP full/export/seed, or a Hugging Face folder), one process on CPU.

    python scripts/checkpoints/generate.py outputs/checkpoint/export-step-1000 --prompt "The os module" \
        [--max_new_tokens 64] [--temperature 0.8 --top_k 50 --seed 0] [--section.key VALUE ...]

The model shape and tokenizer come from the checkpoint's config.toml; trailing --section.key options override
it (needed for a checkpoint without config, e.g. converted from Hugging Face). temperature 0 (default) is greedy.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from torchtitan.components.checkpoint.manager import CheckpointError  # noqa: E402
from torchtitan.components.checkpoint.offline_model import build_cpu_model, job_config_of, load_model_weights  # noqa: E402
from torchtitan.config import ConfigError  # noqa: E402
from torchtitan.tools.generation import generate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    args, overrides = p.parse_known_args(argv)
    try:
        cfg = job_config_of(args.checkpoint, overrides)
        model, spec, tokenizer, model_args = build_cpu_model(cfg)
        load_model_weights(model, args.checkpoint, spec.state_dict_adapter, model_args)
        new = generate(
            model,
            tokenizer.encode(args.prompt, bos=True, eos=False),
            max_new_tokens=args.max_new_tokens,
            max_seq_len=model_args.max_seq_len,
            temperature=args.temperature,
            top_k=args.top_k,
            eos_id=tokenizer.eos_id,
            generator=torch.Generator().manual_seed(args.seed),
        )
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(args.prompt + tokenizer.decode([t for t in new if t != tokenizer.eos_id]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
