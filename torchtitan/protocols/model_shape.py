"""The shape a job trains: a registered flavor, or a Hugging Face config.json, then field overrides.

`--model.hf_config PATH` (an HF folder or its config.json) replaces the flavor: the family's adapter reads
every key of the file or refuses it in one line (protocols/hf_config.py). `--model.overrides` then sets any
field of the args, e.g. `n_layers=4,rope_scaling.factor=4.0,moe.top_k=2` (dotted names reach nested
dataclasses; `none` clears an optional one). Each value is checked against the field's type.

`pin_model_shape` writes the resolved args back into the config as overrides of every field (and drops
hf_config), so the config.toml a checkpoint carries rebuilds the model without the folder.
"""

import dataclasses
import difflib
import types
import typing
from typing import Any

from torchtitan.config import ConfigError, JobConfig
from torchtitan.protocols.hf_config import read_config_file
from torchtitan.protocols.model import shape_source
from torchtitan.protocols.train_spec import TrainSpec, _registered, get_flavor, get_train_spec


def base_model_args(spec: TrainSpec, cfg: JobConfig) -> Any:
    """The flavor's args, or those of --model.hf_config, with --model.overrides applied."""
    return model_args_for(spec, cfg.model.flavor, cfg.model.hf_config, cfg.model.overrides)


def model_args_for(spec: TrainSpec, flavor: str, hf_config: str | None = None, overrides: list[str] = ()) -> Any:
    """The args of `flavor`, or of the HF config at `hf_config` when given, with `overrides` applied."""
    if hf_config:
        if spec.state_dict_adapter is None:
            raise ConfigError(f"--model.hf_config: model {spec.name} has no Hugging Face adapter to read {hf_config}")
        args = _args_from_hf(spec, hf_config)
    else:
        args = get_flavor(spec, flavor)
    _check_family_fields(spec, args, overrides)
    return apply_overrides(args, list(overrides))


def _check_family_fields(spec: TrainSpec, args: Any, overrides) -> None:
    """An override of a field this family lacks but other registered families have (e.g. mtp_depth, a
    DeepSeek-V3 option) is refused naming those families, rather than as a misspelt field."""
    ours = {f.name for f in dataclasses.fields(args)}
    for item in overrides:
        name = item.partition("=")[0].strip().split(".")[0]
        if not name or name in ours:
            continue
        owners = sorted(
            s.name for s in _registered().values() if s.name != spec.name and s.flavors
            and name in {f.name for f in dataclasses.fields(next(iter(s.flavors.values())))}
        )
        if owners:
            raise ConfigError(
                f"--model.overrides {item!r}: model {spec.name} has no {name} (an option of "
                f"{', '.join(owners)}); use --model.name {owners[0]} or drop the override"
            )


def _args_from_hf(spec: TrainSpec, path: str) -> Any:
    model_type = read_config_file(path).get("model_type")
    if model_type not in spec.state_dict_adapter.HF_MODEL_TYPES:
        readers = [s.name for s in _registered().values()
                   if s.state_dict_adapter is not None and model_type in s.state_dict_adapter.HF_MODEL_TYPES]
        if readers:
            raise ConfigError(
                f"--model.hf_config {path} is a {model_type!r} model: use --model.name {readers[0]} "
                f"(--model.name {spec.name} reads {' / '.join(spec.state_dict_adapter.HF_MODEL_TYPES)})"
            )
        supported = sorted(t for s in _registered().values() if s.state_dict_adapter for t in s.state_dict_adapter.HF_MODEL_TYPES)
        raise ConfigError(
            f"--model.hf_config {path}: architecture {model_type!r} is not supported; supported model_types: "
            f"{', '.join(supported)}"
        )
    return spec.state_dict_adapter.args_from_hf(path)


def apply_overrides(args: Any, overrides: list[str]) -> Any:
    """`args` with each FIELD=VALUE of `overrides` set (dotted FIELD for nested dataclasses)."""
    for item in overrides:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--model.overrides {item!r}: write FIELD=VALUE, e.g. n_layers=4")
        args = _set(args, name.strip().split("."), text.strip(), item)
    return args


def _set(obj: Any, path: list[str], text: str, item: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    name = path[0]
    if name not in fields:
        near = difflib.get_close_matches(name, fields, n=3) or sorted(fields)
        raise ConfigError(
            f"--model.overrides {item!r}: {type(obj).__name__} has no field {name!r}; try: {', '.join(near)}"
        )
    hint = typing.get_type_hints(type(obj))[name]
    if len(path) > 1:
        inner = getattr(obj, name)
        if inner is None:  # e.g. rope_scaling: start from its defaults
            cls = next((t for t in typing.get_args(hint) if dataclasses.is_dataclass(t)), hint)
            if not dataclasses.is_dataclass(cls):
                raise ConfigError(f"--model.overrides {item!r}: {name} has no fields")
            inner = cls()
        if not dataclasses.is_dataclass(inner):
            raise ConfigError(f"--model.overrides {item!r}: {name} has no fields")
        return dataclasses.replace(obj, **{name: _set(inner, path[1:], text, item)})
    return dataclasses.replace(obj, **{name: _parse(hint, text, item)})


def _parse(hint: Any, text: str, item: str) -> Any:
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if text.lower() in ("none", "null") and type(None) in options:
        return None
    for t in options:
        if t is bool and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if t is int:
            try:
                return int(text)
            except ValueError:
                pass
        if t is float:
            try:
                return float(text)
            except ValueError:
                pass
        if t is str:
            return text
        if typing.get_origin(t) is typing.Literal and text in typing.get_args(t):
            return text
        if typing.get_origin(t) is tuple and typing.get_args(t)[:1] == (str,):
            # e.g. layer_types=linear_attention+full_attention (the command line splits lists at commas)
            return tuple(x.strip() for x in text.split("+") if x.strip())
    names = ", ".join(getattr(t, "__name__", str(t)) for t in options)
    raise ConfigError(f"--model.overrides {item!r}: {text!r} is not a valid {names}")


def flatten_args(args: Any, prefix: str = "") -> list[str]:
    """Every field of `args` as FIELD=VALUE (apply_overrides' input), nested dataclasses dotted."""
    out = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if dataclasses.is_dataclass(value):
            out.extend(flatten_args(value, f"{prefix}{f.name}."))
        elif value is None:
            out.append(f"{prefix}{f.name}=none")
        elif isinstance(value, tuple) and all(isinstance(v, str) for v in value):
            out.append(f"{prefix}{f.name}={'+'.join(value)}")
        elif isinstance(value, (bool, int, float, str)):
            out.append(f"{prefix}{f.name}={value!r}" if isinstance(value, float) else f"{prefix}{f.name}={value}")
    return out


def pin_model_shape(cfg: JobConfig, args: Any) -> None:
    """Records the resolved shape in `cfg` (every field as an override, hf_config dropped), so the config a
    checkpoint carries rebuilds this model without the HF folder."""
    if cfg.model.hf_config or cfg.model.overrides:
        cfg.model.overrides = flatten_args(args)
        cfg.model.hf_config = None


def resolve_model(cfg: JobConfig, tokenizer: object | None = None) -> tuple[TrainSpec, object, object]:
    """(train spec, tokenizer, model args) of a job: the flavor's shape (or --model.hf_config's, with
    --model.overrides) resized for the job (the tokenizer's vocabulary, room for the recipe's seq_len; see
    BaseModelArgs.update_from_job). Also used offline (conversion, generation) from a checkpoint's saved
    config, so a model is rebuilt with exactly the shape it was trained with. A caller without the tokenizer
    file (the dry run) passes a stand-in `tokenizer` with the `vocab_size` to plan for."""
    spec = get_train_spec(cfg.model.name)
    tokenizer = tokenizer if tokenizer is not None else spec.build_tokenizer_fn(cfg)
    return spec, tokenizer, base_model_args(spec, cfg).update_from_job(cfg, tokenizer)


def model_summary(cfg: JobConfig, args: Any, tokenizer: Any) -> str:
    """The log's name of the model a job trains: the family, where its shape comes from (the flavor, or the
    HF config, with the overrides) and, when they differ, its vocabulary against the tokenizer's, e.g.
    `Model llama3 (flavor 8B + overrides n_layers=2; vocabulary 128,256 rows for 2,048 tokens)`."""
    padded = (f"; vocabulary {args.vocab_size:,} rows for {tokenizer.vocab_size:,} tokens"
              if args.vocab_size != tokenizer.vocab_size else "")
    return f"Model {cfg.model.name} ({shape_source(cfg.model)}{padded})"
