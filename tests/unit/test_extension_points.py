"""The extension points a model folder uses, each exercised by a toy model registered here: a model output
with an auxiliary loss and metrics, dict inputs, its own config section, and the optimizer, LR-scheduler,
validator and post-optimizer-step hooks. None of them needs a change to the trainer."""

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.optim.lr_scheduler import build_lr_schedulers
from torchtitan.components.optim.optimizer import OptimizersContainer
from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.config import ConfigError
from torchtitan.protocols.train_spec import config_manager
from torchtitan.datasets.dataloader import build_text_dataloader
from torchtitan.protocols.model import BaseModelArgs, ModelOutput
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec
from torchtitan.train import main

AUX_PER_TOKEN = 0.25


@dataclass
class ToyConfig:
    aux_weight: float = 0.0
    """Auxiliary loss per token added by the toy model."""

    marker: str = "plain"
    """A string the toy model reports back."""


@dataclass
class ToyArgs(BaseModelArgs):
    dim: int = 32
    vocab_size: int = 2048
    max_seq_len: int = 32

    def flops_per_token(self, num_non_embedding_params: int, seq_len: int) -> int:
        return 6 * num_non_embedding_params


class ToyWithAux(nn.Module):
    """Bigram model returning a ModelOutput: a constant auxiliary loss per token, and a metric vector."""

    pipeline_head, pipeline_tail = ("tok_embeddings",), ("output",)
    aux_weight = 0.0

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({"0": nn.Linear(args.dim, args.dim)})
        self.output = nn.Linear(args.dim, args.vocab_size)

    def init_weights(self, buffer_device=None):
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        logits = self.output(h + self.layers["0"](h))
        aux = torch.full((), self.aux_weight * tokens.numel(), device=tokens.device)
        return ModelOutput(logits, aux_loss=aux, metrics={"toy/load": torch.tensor([1.0, 3.0])})


CALLS: dict[str, int] = {}


def _optimizers(model_parts, cfg, parallel_dims):
    CALLS["optimizers"] = CALLS.get("optimizers", 0) + 1
    return OptimizersContainer(model_parts, [torch.optim.SGD(m.parameters(), lr=cfg.lr) for m in model_parts])


def _lr_schedulers(optimizers, cfg, steps):
    CALLS["lr"] = CALLS.get("lr", 0) + 1
    return build_lr_schedulers(optimizers, cfg, steps)


def _after_step(model_parts, parallel_dims):
    CALLS["post_step"] = CALLS.get("post_step", 0) + 1


def _validator(job_config):
    def validate(forward_loss_sum, batches, reduce_sum):
        inputs, labels = next(iter(batches))
        return {"validation/toy_sum": reduce_sum(forward_loss_sum(inputs, labels)).item()}

    return validate


def _register():
    try:
        return get_train_spec("toy_aux")
    except ValueError:
        pass
    spec = TrainSpec(
        name="toy_aux",
        model_cls=ToyWithAux,
        flavors={"small": ToyArgs()},
        parallelize_fn=lambda model, parallel_dims, job_config: _configure(model, job_config),
        build_tokenizer_fn=lambda job_config: build_tokenizer(job_config.model.tokenizer_path),
        build_dataloader_fn=build_text_dataloader,
        build_loss_fn=build_cross_entropy_loss,
        build_optimizers_fn=_optimizers,
        build_lr_schedulers_fn=_lr_schedulers,
        build_validator_fn=_validator,
        post_optimizer_step_fns=(_after_step,),
        config_section=("toy", ToyConfig),
    )
    register_train_spec(spec)
    return spec


def _configure(model, job_config):
    model.aux_weight = job_config.toy.aux_weight  # the model's own section reaches its parallelize_fn
    return model


ARGS = ["--model.name", "toy_aux", "--model.flavor", "small", "--training.seq_len", "32",
        "--training.local_batch_size", "4", "--training.steps", "3", "--metrics.log_freq", "1",
        "--training.mixed_precision_param", "float32", "--debug.seed", "1"]


def _metrics(folder):
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_model_section_parses_from_the_command_line_and_the_recipe(tmp_path):
    _register()
    cfg = config_manager().parse_args(["--model.name", "toy_aux", "--toy.aux_weight", "0.5"])
    assert cfg.toy.aux_weight == 0.5 and cfg.toy.marker == "plain"
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\nname = "toy_aux"\n[toy]\nmarker = "from-toml"\n')
    cfg = config_manager().parse_args(["--job.config_file", str(recipe), "--toy.aux_weight", "2"])
    assert (cfg.toy.marker, cfg.toy.aux_weight) == ("from-toml", 2.0)


def test_model_section_rejects_unknown_keys_and_is_absent_for_other_models():
    _register()
    with pytest.raises(ConfigError, match=r"unknown option --toy.aux_weigth; did you mean --toy.aux_weight"):
        config_manager().parse_args(["--model.name", "toy_aux", "--toy.aux_weigth", "1"])
    with pytest.raises(ConfigError, match="unknown section 'toy'"):
        config_manager().parse_args(["--model.name", "llama3", "--toy.aux_weight", "1"])
    assert not hasattr(config_manager().parse_args([]), "toy")


def test_model_section_is_in_help(capsys):
    _register()
    with pytest.raises(SystemExit):
        config_manager().parse_args(["--model.name", "toy_aux", "--help"])
    out = capsys.readouterr().out
    assert "[toy]" in out and "--toy.aux_weight" in out and "Auxiliary loss per token" in out


def test_aux_loss_metrics_and_hooks_reach_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    _register()
    CALLS.clear()
    common = ARGS + ["--validation.enable", "--validation.freq", "3", "--validation.local_batch_size", "2"]
    assert main(common + ["--job.dump_folder", str(tmp_path / "a")]) == 0
    assert CALLS == {"optimizers": 1, "lr": 1, "post_step": 3}
    assert main(common + ["--job.dump_folder", str(tmp_path / "b"), "--toy.aux_weight", str(AUX_PER_TOKEN)]) == 0
    plain = [m for m in _metrics(tmp_path / "a") if "loss" in m]
    with_aux = [m for m in _metrics(tmp_path / "b") if "loss" in m]
    # The aux loss is a per-token sum like the token loss, so the logged mean loss rises by exactly its
    # per-token value at step 1 (same weights, same batch).
    assert with_aux[0]["loss"] == pytest.approx(plain[0]["loss"] + AUX_PER_TOKEN, abs=1e-5)
    assert plain[0]["toy/load/0"] == 1.0 and plain[0]["toy/load/1"] == 3.0
    validation = [m for m in _metrics(tmp_path / "a") if "validation/toy_sum" in m]
    assert len(validation) == 1 and validation[0]["validation/toy_sum"] > 0
