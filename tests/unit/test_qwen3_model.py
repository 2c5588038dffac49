"""Qwen3 (dense): the published shapes, the same logits as transformers' Qwen3ForCausalLM both ways through
real Hugging Face folders, tied embeddings that stay one parameter, and the job checks the model declares."""

import dataclasses

import pytest
import torch
import transformers  # the test extra (pyproject.toml, scripts/ensure_env.sh)

from tests.tolerances import contraction_width, logits_tol
from torchtitan.config import ConfigError, ConfigManager
from torchtitan.distributed.parallel_dims import LayoutError
from torchtitan.job_plan import plan_job
from torchtitan.models.qwen3 import Qwen3, qwen3_flavors
from torchtitan.models.common.qwen3_state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.tools.params import count_params
from torchtitan.components.checkpoint.hf_folder import load_hf_folder, save_hf_folder  # noqa: E402

# What Qwen's model cards quote: (parameters, non-embedding parameters), in billions, to the digits quoted.
PUBLISHED = {
    "0.6B": ("0.6", "0.44"),
    "1.7B": ("1.7", "1.4"),
    "4B": ("4.0", "3.6"),
    "8B": ("8.2", "6.95"),
    "14B": ("14.8", "13.2"),
    "32B": ("32.8", "31.2"),
}
TINY = dataclasses.replace(qwen3_flavors["debugmodel_tiny"], vocab_size=96, max_seq_len=64)


def _billions(n: int, quoted: str) -> str:
    digits = len(quoted.split(".")[1])
    return f"{n / 1e9:.{digits}f}"


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_sizes_have_the_published_parameter_counts(flavor):
    args = qwen3_flavors[flavor]
    with torch.device("meta"):
        model = Qwen3(args)
    total, _ = count_params(model)
    # The cards' non-embedding count leaves out the embedding and, when untied, the output projection too.
    embedding = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    assert (_billions(total, PUBLISHED[flavor][0]), _billions(total - embedding, PUBLISHED[flavor][1])) == PUBLISHED[flavor]
    assert args.tie_embeddings == (flavor in ("0.6B", "1.7B", "4B"))
    assert (args.head_dim, args.n_kv_heads, args.rope_theta) == (128, 8, 1e6)


def _random(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights far from the default init (norm weights too), so QK-norm, a wrong RoPE layout or a swapped
    projection changes the logits well beyond the tolerance."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3 if "proj" in name or ".w" in name else 0.5)
    return model.eval()


def _ours(args) -> Qwen3:
    model = Qwen3(args)
    model.init_weights()
    return _random(model)


def _tokens() -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_our_weights_in_transformers_give_our_logits(tie, tmp_path):
    args = dataclasses.replace(TINY, tie_embeddings=tie)
    ours = _ours(args)
    save_hf_folder(ours.state_dict(), Qwen3StateDictAdapter, args, str(tmp_path), dtype=torch.float32)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings == tie and hf.config.head_dim == args.head_dim
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tie
    tokens = _tokens()
    with torch.no_grad():
        expected = ours(tokens)
        # Two float32 forward passes of 2 blocks (QK-norm, sharp random weights: condition 4). Measured: uses 0.0058 of
        # it (AVX-512), 0.0058 (AVX2 caps).
        torch.testing.assert_close(hf(tokens).logits, expected,
                                   **logits_tol(expected, args.n_layers, contraction_width(ours, tokens.shape[1]), 4))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_transformers_weights_in_ours_give_its_logits(tie, tmp_path):
    config = transformers.Qwen3Config(**Qwen3StateDictAdapter.to_hf_config(dataclasses.replace(TINY, tie_embeddings=tie)))
    torch.manual_seed(0)
    hf = _random(transformers.Qwen3ForCausalLM(config).float(), seed=2)
    hf.save_pretrained(str(tmp_path))
    state_dict, args = load_hf_folder(str(tmp_path), Qwen3StateDictAdapter)
    assert args == dataclasses.replace(TINY, tie_embeddings=tie)
    ours = Qwen3(args)
    ours.load_state_dict(state_dict, strict=True)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tie
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(tokens).logits
        # As above, the other way. Measured: uses 0.0056 of it (AVX-512), 0.0054 (AVX2 caps).
        torch.testing.assert_close(ours(tokens), expected,
                                   **logits_tol(expected, args.n_layers, contraction_width(ours, tokens.shape[1]), 4))


def test_tied_folder_stores_the_matrix_once(tmp_path):
    from safetensors.torch import load_file

    ours = _ours(TINY)
    save_hf_folder(ours.state_dict(), Qwen3StateDictAdapter, TINY, str(tmp_path), dtype=torch.float32)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored


def test_tie_survives_materialisation_and_is_one_parameter():
    with torch.device("meta"):
        model = Qwen3(TINY)
    model.to_empty(device="cpu")  # replaces parameters module by module, which unties them ...
    model.init_weights()  # ... and init_weights ties them again
    assert model.output.weight is model.tok_embeddings.weight
    untied = Qwen3(dataclasses.replace(TINY, tie_embeddings=False))
    shared = TINY.vocab_size * TINY.dim
    assert count_params(untied)[0] - count_params(model)[0] == shared
    # The shared matrix has the output's init (std dim^-0.5, truncated), not the embedding's N(0, 1).
    assert model.output.weight.std().item() == pytest.approx(TINY.dim**-0.5, rel=0.15)


def test_flops_count_the_tied_output_matmul():
    """Tying changes the parameter count, not the work: both spend the same FLOPs per token."""
    tied, untied = TINY, dataclasses.replace(TINY, tie_embeddings=False)
    flops = [a.flops_per_token(count_params(Qwen3(a))[1], 64) for a in (tied, untied)]
    assert flops[0] == flops[1]


def _cfg(*argv: str):
    return ConfigManager().parse_args(["--model.name", "qwen3", *argv])


def test_tied_flavor_refuses_pipeline_parallel_before_any_rank_starts():
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]
    with pytest.raises(LayoutError, match=r"ties its output projection to the embedding.*untied flavor") as e:
        plan_job(_cfg("--model.flavor", "debugmodel_tiny", *pp2), world_size=2)
    assert "\n" not in str(e.value)
    plan = plan_job(_cfg("--model.flavor", "debugmodel_tiny_untied", *pp2), world_size=2)
    assert plan.pipeline_plan is not None and plan.pipeline_plan.num_stages == 2


def test_published_vocabulary_keeps_its_padded_rows():
    """Qwen pads 151,665 tokens to 151,936 rows (the published weights' shape); a job's smaller tokenizer keeps
    them, a larger one than the model's vocabulary is refused in one line (the rule of every family:
    tests/unit/test_vocabulary.py)."""
    assert plan_job(_cfg("--model.flavor", "0.6B"), world_size=1).model_args.vocab_size == 151936
    small = dataclasses.replace(TINY, vocab_size=1000)
    with pytest.raises(ConfigError, match="has 2,048 tokens, more than the model's vocabulary of 1,000 rows"):
        small.update_from_job(_cfg(), plan_job(_cfg(), world_size=1).tokenizer)


def test_tensor_parallel_degree_must_divide_the_kv_heads():
    with pytest.raises(LayoutError, match=r"tensor_parallel_degree 16 does not divide the model's n_kv_heads \(8\)"):
        plan_job(_cfg("--model.flavor", "0.6B", "--parallelism.tensor_parallel_degree", "16"), world_size=16)
