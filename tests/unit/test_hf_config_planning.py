"""The planner (`python -m torchtitan.plan --hf-config / --override`) and the dry run (`--model.hf_config`) take a
model's shape from a Hugging Face folder: the same figures as the same shape given field by field on a flavor,
per-rank bytes that add up to the folder's model, and one line with the bad-input exit code for a folder that
cannot give a shape. Only config.json is needed (written by transformers' save_pretrained), so the shape can be
one of realistic size (~1B, no flavor has it) at no cost: neither tool allocates weights."""

import pytest

from torchtitan.dry_run import main as dry_run_main
from torchtitan.plan import main as plan_main
from torchtitan.planning.dry_run import dry_run
from torchtitan.protocols.model_shape import model_args_for
from torchtitan.protocols.train_spec import config_manager, get_train_spec

transformers = pytest.importorskip("transformers")

# 20 layers of hidden 2048 (16 heads, 4 kv heads), FFN 5632, tied embeddings, the shipped tokenizer's vocabulary.
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=4096,
             rms_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
SAME_BY_OVERRIDES = ["dim=2048", "ffn_hidden_dim=5632", "n_layers=20", "n_heads=16", "n_kv_heads=4", "vocab_size=2048",
                     "tie_embeddings=true", "max_seq_len=4096", "norm_eps=1e-5", "rope_theta=10000.0",
                     "rope_scaling=none"]
PLAN = ["--devices", "8", "--device-type", "H100-80GB", "--seq-len", "4096", "--global-batch-size", "16", "--top", "3"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_1b")
    transformers.LlamaConfig(**SHAPE).save_pretrained(path)
    return str(path)


def _body(out: str) -> str:
    """The planner's output after its first line (which names the flavor or the folder)."""
    return out.split("\n", 1)[1]


def test_planner_hf_config_gives_the_figures_of_the_same_shape_by_overrides(folder, capsys):
    spec = get_train_spec("llama3")
    from_folder = model_args_for(spec, "(folder)", folder)
    assert model_args_for(spec, "debugmodel", None, SAME_BY_OVERRIDES) == from_folder
    assert plan_main(["--hf-config", folder, *PLAN]) == 0
    by_folder = capsys.readouterr().out
    overrides = [a for o in SAME_BY_OVERRIDES for a in ("--override", o)]
    assert plan_main(["--flavor", "debugmodel", *overrides, *PLAN]) == 0
    by_overrides = capsys.readouterr().out
    assert by_folder.startswith(f"llama3 ({folder}) on 8 x H100-80GB") and "#3" in by_folder
    assert "peak memory" in by_folder and _body(by_folder) == _body(by_overrides)
    # The flavor alone is another model: its figures differ (the comparison above can fail).
    assert plan_main(["--flavor", "debugmodel", *PLAN]) == 0
    assert _body(capsys.readouterr().out) != _body(by_folder)


def test_planner_refuses_a_folder_that_gives_no_shape_in_one_line(folder, tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(gpt2)
    (tmp_path / "empty").mkdir()
    for bad, message in [(gpt2, "architecture 'gpt2' is not supported"),
                         (tmp_path / "empty", "config.json"),
                         (folder, "has no field 'n_layer'; try: n_layers")]:
        extra = ["--override", "n_layer=3"] if bad == folder else []
        assert plan_main(["--hf-config", str(bad), *extra, *PLAN]) == 2, bad
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_dry_run_takes_the_shape_from_hf_config_and_shards_it(folder, capsys):
    d, f, kv, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_key_value_heads"] * 128, SHAPE["vocab_size"]
    block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # wq wo, wk wv (4 kv heads of 128), w1 w2 w3, 2 norms
    hf_params = v * d + SHAPE["num_hidden_layers"] * block + d  # embedding (tied: no output matrix), final norm
    cfg = config_manager().parse_args(["--model.hf_config", folder, "--training.seq_len", "256"])
    report = dry_run(cfg, world_size=4, ranks=[0, 1, 2, 3])
    assert report.errors == [] and report.layout == "dp_shard 4" and report.model == f"llama3 ({folder})"
    assert sum(r.num_params for r in report.ranks) == hf_params  # the tied embedding counted once, as HF does
    for r in report.ranks:
        assert r.param_bytes == 4 * r.num_params  # float32 parameters
        assert abs(r.num_params - hf_params / 4) < 0.01 * hf_params  # each rank holds its quarter
    assert dry_run_main(["--world-size", "4", "--model.hf_config", folder, "--training.seq_len", "256"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dry run: llama3 ({folder}) on 4 ranks") and "no validation errors" in out
    assert dry_run_main(["--world-size", "4", "--model.hf_config", folder + "/missing"]) == 1
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "missing" in errors[0], errors
