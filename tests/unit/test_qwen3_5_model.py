"""Qwen3.5's shape, FLOPs and the job checks its args declare, through plan_job (before any rank starts):
one line each for an unknown layer type, a conv kernel of 0, heads TP cannot split and a CP layout the state
passing cannot serve; layer kinds as data survive the shape a checkpoint records."""

import pytest
import torch

from torchtitan.config import ConfigManager
from torchtitan.errors import USER_ERRORS
from torchtitan.job_plan import plan_job
from torchtitan.models.qwen3_5 import Qwen3_5, qwen3_5_flavors
from torchtitan.protocols.model_shape import apply_overrides, flatten_args


def _cfg(*argv: str):
    return ConfigManager().parse_args(["--model.name", "qwen3_5", "--model.flavor", "debugmodel_tiny", *argv])


@pytest.mark.parametrize("argv, world, phrase", [
    (["--model.overrides", "layer_types=linear_attention+mamba"], 1, "unknown layer type 'mamba'"),
    (["--model.overrides", "linear_conv_kernel_dim=0"], 1, "linear_conv_kernel_dim must be >= 1"),
    (["--model.overrides", "linear_num_value_heads=6,linear_num_key_heads=3",
      "--parallelism.tensor_parallel_degree", "2"], 2, "does not divide the model's linear_num_key_heads (3)"),
    (["--parallelism.context_parallel_degree", "4", "--training.seq_len", "16"], 4,
     "fewer than the linear attention's conv window"),
])
def test_bad_input_refused_in_one_line_before_ranks_start(argv, world, phrase):
    with pytest.raises(USER_ERRORS) as e:
        plan_job(_cfg(*argv), world_size=world)
    assert phrase in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_layer_types_are_data_and_survive_the_recorded_shape():
    args = plan_job(_cfg("--model.overrides", "layer_types=full_attention+linear_attention"), world_size=1).model_args
    assert args.layer_types == ("full_attention", "linear_attention")
    model = Qwen3_5(args)
    assert [type(b.attention).__name__ for b in model.layers.values()] == ["GatedAttention", "GatedDeltaNet"]
    # What a checkpoint's config.toml records (every field as an override) rebuilds the same args.
    assert apply_overrides(qwen3_5_flavors["debugmodel"], flatten_args(args)) == args


def test_default_layer_types_every_fourth_full():
    kinds = qwen3_5_flavors["9B"].layer_kinds
    assert len(kinds) == 32 and [i for i, k in enumerate(kinds) if k == "full_attention"] == list(range(3, 32, 4))


def test_published_parameter_counts():
    """Text-model parameters of the flavors (the published totals also count a vision tower and MTP layers)."""
    with torch.device("meta"):
        counts = {f: sum(p.numel() for p in Qwen3_5(qwen3_5_flavors[f]).parameters()) for f in ("0.8B", "9B", "35B-A3B")}
    assert 0.7e9 < counts["0.8B"] < 0.8e9 and 8.5e9 < counts["9B"] < 9.5e9 and 34e9 < counts["35B-A3B"] < 35.5e9


def test_flops_count_linear_and_full_layers_apart():
    a = qwen3_5_flavors["9B"]
    f1, f2 = a.flops_per_token(10**9, 4096), a.flops_per_token(10**9, 8192)
    # Only the 8 full-attention layers grow with the sequence; the DeltaNet term does not.
    assert f2 - f1 == 12 * 8 * a.n_heads * a.head_dim * 4096
