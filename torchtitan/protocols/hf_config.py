"""Reading a Hugging Face `config.json` strictly: every key is read, knowingly ignored, or refused.

A family's `from_hf_config` reads the keys its model computes with through an `HFConfigReader`; `finish()`
then refuses any key left over, so a setting this project does not implement (another attention variant, a
new rope option) stops the job in one line instead of loading into a silently different model. Keys that
never change what the model computes (token ids, initialisation, generation and bookkeeping settings) are
listed once here.
"""

import json
from typing import Any

from torchtitan.tools import storage


class UnsupportedHFConfig(ValueError):
    """A config.json this project cannot reproduce exactly; the message names the key and what to do."""


# Keys of every transformers config that do not change the forward pass of a causal LM.
IGNORED_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "chunk_size_feed_forward", "id2label", "label2id",
    "is_encoder_decoder", "problem_type", "tokenizer_class", "auto_map", "pretraining_tp",
    "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "ep_size",
    "_attn_implementation_autoset", "tie_encoder_decoder",
})


class HFConfigReader:
    """A config.json's dict with the keys read so far; `where` names the file in messages."""

    def __init__(self, config: dict, where: str = "config.json", family: str = "this model"):
        self.config, self.where, self.family = config, where, family
        self.seen: set[str] = set()

    def req(self, key: str) -> Any:
        """A required key's value."""
        self.seen.add(key)
        if self.config.get(key) is None:
            raise UnsupportedHFConfig(
                f"{self.where} lacks {key!r}, which {self.family} needs: the file is incomplete or describes "
                f"another architecture"
            )
        return self.config[key]

    def opt(self, key: str, default: Any = None) -> Any:
        """An optional key's value (`default` when absent or null)."""
        self.seen.add(key)
        value = self.config.get(key)
        return default if value is None else value

    def expect(self, key: str, allowed: Any, default: Any) -> Any:
        """A key this model supports only at the value(s) `allowed` (a value or a tuple of values)."""
        value = self.opt(key, default)
        ok = value in allowed if isinstance(allowed, tuple) else value == allowed
        if not ok:
            raise UnsupportedHFConfig(
                f"{self.where}: {key} {value!r} is not supported by {self.family} (supported: {allowed!r})"
            )
        return value

    def ignore(self, *keys: str) -> None:
        self.seen.update(keys)

    def finish(self) -> None:
        """Refuses the first key neither read nor ignored."""
        left = sorted(k for k in self.config if k not in self.seen and k not in IGNORED_KEYS)
        if left:
            raise UnsupportedHFConfig(
                f"{self.where}: key {left[0]!r} is not understood by {self.family} (it may change what the model "
                f"computes); this model cannot be reproduced exactly"
                + (f" ({len(left) - 1} more: {', '.join(left[1:4])})" if len(left) > 1 else "")
            )


def rope_dict(reader: HFConfigReader) -> dict:
    """The rope settings in either layout: transformers 5 `rope_parameters` (holding rope_theta), or 4.x
    top-level `rope_theta` + `rope_scaling` (older spelling of rope_type: `type`). Returned with `rope_type`
    and `rope_theta` filled in; the caller reads the rest through a reader of its own."""
    params = reader.opt("rope_parameters")
    scaling = reader.opt("rope_scaling")
    theta = reader.opt("rope_theta")
    rope = dict(params if isinstance(params, dict) else scaling if isinstance(scaling, dict) else {})
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", 10000.0 if theta is None else theta)
    return rope


def read_config_file(folder: str) -> dict:
    """The config.json of a folder (or a path to the file itself), with one-line errors."""
    path = folder if folder.endswith(".json") else storage.join(folder, "config.json")
    if not storage.isfile(path):
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(storage.read_bytes(path))
    except (OSError, ValueError) as e:
        raise UnsupportedHFConfig(f"{path} is not readable JSON: {e}") from e
    if not isinstance(config, dict):
        raise UnsupportedHFConfig(f"{path} does not hold a JSON object")
    return config
