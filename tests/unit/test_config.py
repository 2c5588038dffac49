import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from typing import Literal

import pytest

from torchtitan.config import ConfigError, ConfigManager, JobConfig, field_docs, save_config, to_dict, to_toml

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


SPLIT = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]


@pytest.fixture
def manager() -> ConfigManager:
    return ConfigManager(config_cls=JobConfig)


def write(tmp_path, text: str, name: str = "recipe.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(manager: ConfigManager, argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        manager.parse_args(argv)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- precedence --------------------------------------------------------------------------------------------


def test_defaults(manager):
    assert manager.parse_args([]) == JobConfig()


def test_toml_overrides_defaults(manager, tmp_path):
    recipe = write(
        tmp_path,
        """
[training]
steps = 42
max_norm = 2          # an int is fine for a float field
dtype = "bfloat16"

[model]
converters = ["float8"]

[parallelism]
module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
""",
    )
    cfg = manager.parse_args(["--job.config_file", recipe])
    assert cfg.training.steps == 42
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.training.dtype == "bfloat16"
    assert cfg.model.converters == ["float8"]
    assert cfg.parallelism.module_fqns_per_model_part == SPLIT
    assert cfg.job.config_file == recipe
    assert cfg.training.seq_len == 2048  # untouched keys keep their defaults


def test_cli_overrides_toml_whatever_the_order(manager, tmp_path):
    recipe = write(tmp_path, "[training]\nsteps = 42\nseq_len = 512\n")
    cfg = manager.parse_args(["--training.steps", "7", "--job.config_file", recipe])
    assert cfg.training.steps == 7
    assert cfg.training.seq_len == 512


def test_recipe_as_first_positional_and_equals_syntax(manager, tmp_path):
    recipe = write(tmp_path, "[training]\nsteps = 42\n")
    assert manager.parse_args([recipe]).training.steps == 42
    cfg = manager.parse_args([f"--job.config_file={recipe}", "--optimizer.lr=3e-4", "--job.description=a=b"])
    assert cfg.training.steps == 42
    assert cfg.optimizer.lr == 3e-4
    assert cfg.job.description == "a=b"


# --- value syntax ------------------------------------------------------------------------------------------


def test_bool_bare_flag_and_explicit_values(manager):
    assert manager.parse_args(["--compile.enable"]).compile.enable is True
    cfg = manager.parse_args(["--compile.enable", "--checkpoint.enable"])
    assert cfg.compile.enable and cfg.checkpoint.enable
    for word, expected in [("false", False), ("FALSE", False), ("0", False), ("no", False), ("True", True),
                           ("1", True), ("yes", True)]:
        assert manager.parse_args(["--compile.enable", word]).compile.enable is expected
        assert manager.parse_args([f"--compile.enable={word}"]).compile.enable is expected
    assert manager.parse_args(["--metrics.rank_0_only", "false"]).metrics.rank_0_only is False


def test_lists(manager):
    cfg = manager.parse_args(["--model.converters", "float8, other", "--compile.components", ""])
    assert cfg.model.converters == ["float8", "other"]
    assert cfg.compile.components == []
    split = "tok_embeddings,layers.0;layers.1,norm,output"
    cfg = manager.parse_args(["--parallelism.module_fqns_per_model_part", split])
    assert cfg.parallelism.module_fqns_per_model_part == SPLIT


def test_numbers_including_negative(manager):
    cfg = manager.parse_args(
        ["--training.global_batch_size", "-1", "--optimizer.eps", "1e-6", "--training.max_norm", "-2"]
    )
    assert cfg.training.global_batch_size == -1
    assert cfg.optimizer.eps == 1e-6
    assert cfg.training.max_norm == -2.0


def test_optional_accepts_none(manager):
    cfg = manager.parse_args(["--debug.seed", "3", "--model.tokenizer_path", "tok.model"])
    assert cfg.debug.seed == 3 and cfg.model.tokenizer_path == "tok.model"
    cfg = manager.parse_args(["--debug.seed", "3", "--debug.seed", "none", "--model.tokenizer_path", "NULL"])
    assert cfg.debug.seed is None and cfg.model.tokenizer_path is None
    # "none" is an ordinary choice of a non-optional Literal field, not None.
    assert manager.parse_args(["--activation_checkpoint.mode", "none"]).activation_checkpoint.mode == "none"


# --- errors --------------------------------------------------------------------------------------------------


def test_literal_choice_error(manager):
    assert error_of(manager, ["--training.dtype", "fp8"]) == (
        "--training.dtype expects one of 'float32', 'bfloat16', got 'fp8'"
    )
    assert manager.parse_args(["--training.dtype", "bfloat16"]).training.dtype == "bfloat16"


def test_unknown_key_suggests_nearest_in_section(manager):
    message = error_of(manager, ["--training.stepz", "3"])
    assert message == "unknown option --training.stepz; did you mean --training.steps?"


def test_unknown_key_suggests_other_sections_holding_it(manager):
    assert error_of(manager, ["--training.lr", "1"]) == "unknown option --training.lr; did you mean --optimizer.lr?"
    message = error_of(manager, ["--training.enable"])
    assert ("did you mean --validation.enable, --eval.enable, --checkpoint.enable, --compile.enable, --fault_tolerance.enable or "
            "--guard.enable?"
            in message)


def test_unknown_section_suggests_nearest(manager):
    assert error_of(manager, ["--trainin.steps", "3"]) == (
        "unknown section 'trainin' in --trainin.steps; did you mean --training.steps?"
    )
    assert "did you mean section optimizer?" in error_of(manager, ["--optimiser.learning_rate", "3"])
    assert "sections are job, model, training" in error_of(manager, ["--zzz.q", "3"])


def test_retired_option_names_its_replacement(manager, tmp_path):
    message = error_of(manager, ["--checkpoint.last_save_model_only", "true"])
    assert message.startswith("option --checkpoint.last_save_model_only was retired; use --checkpoint.last_save (")
    recipe = write(tmp_path, "[checkpoint]\nlast_save_model_only = true\n")
    assert "checkpoint.last_save_model_only was retired" in error_of(manager, ["--job.config_file", recipe])
    # The config saved beside an older checkpoint still loads for the tools (generate, convert).
    saved = ConfigManager(skip_retired=True).parse_args(["--job.config_file", recipe])
    assert saved.checkpoint.last_save == "full"


def test_option_without_section(manager):
    message = error_of(manager, ["--seq_len", "3"])
    assert message == "option --seq_len must look like --section.key; did you mean --training.seq_len?"


def test_wrong_types(manager):
    assert error_of(manager, ["--training.steps", "ten"]) == "--training.steps expects an int, got 'ten'"
    assert error_of(manager, ["--training.steps", "1.5"]) == "--training.steps expects an int, got '1.5'"
    assert error_of(manager, ["--optimizer.lr", "fast"]) == "--optimizer.lr expects a float, got 'fast'"
    assert error_of(manager, ["--debug.seed", "x"]) == "--debug.seed expects an int or none, got 'x'"
    assert "--compile.enable expects a bool" in error_of(manager, ["--compile.enable", "maybe"])


def test_missing_value(manager):
    assert error_of(manager, ["--training.steps"]) == "--training.steps is missing its value (an int)"
    assert "--training.steps is missing its value" in error_of(manager, ["--training.steps", "--training.seq_len", "4"])


def test_positional_garbage(manager, tmp_path):
    recipe = write(tmp_path, "")
    assert "unexpected argument 'junk'" in error_of(manager, ["--training.steps", "3", "junk"])
    assert "unexpected argument 'junk'" in error_of(manager, [recipe, "junk"])
    assert "unexpected argument '-x'" in error_of(manager, ["-x"])


def test_missing_toml(manager, tmp_path):
    missing = str(tmp_path / "x.toml")
    assert error_of(manager, ["--job.config_file", missing]) == f"config file '{missing}' not found"


def test_malformed_toml(manager, tmp_path):
    recipe = write(tmp_path, "[training]\nsteps = \n")
    message = error_of(manager, ["--job.config_file", recipe])
    assert message.startswith(f"config file '{recipe}' is not valid TOML:")
    assert "line 2" in message


def test_toml_errors_name_file_and_nearest(manager, tmp_path):
    cases = {
        "[trainin]\nsteps = 1\n": "unknown section [trainin]; did you mean section training?",
        "[training]\nstepz = 1\n": "unknown option training.stepz; did you mean training.steps?",
        '[training]\nsteps = "ten"\n': "training.steps expects an int, got 'ten'",
        "[training]\nsteps = true\n": "training.steps expects an int, got True",
        '[model]\nconverters = "float8"\n': "model.converters expects a list of str, got 'float8'",
        '[training]\ndtype = "fp8"\n': "training.dtype expects one of 'float32', 'bfloat16', got 'fp8'",
        "training = 3\n": "[training] must be a table of options, got 3",
    }
    for text, expected in cases.items():
        recipe = write(tmp_path, text)
        assert error_of(manager, ["--job.config_file", recipe]) == f"config file '{recipe}': {expected}"


# --- help ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_option_with_doc_and_exits_zero(manager, capsys, flag):
    with pytest.raises(SystemExit) as info:
        manager.parse_args(["--training.steps", "3", flag])
    assert info.value.code == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the docs are re-wrapped, so compare with whitespace collapsed
    hints = typing.get_type_hints(JobConfig)
    for name, section_cls in ((f.name, hints[f.name]) for f in dataclasses.fields(JobConfig)):
        assert f"[{name}]" in out
        docs = field_docs(section_cls)
        for f in dataclasses.fields(section_cls):
            assert f"--{name}.{f.name} " in out
            assert docs[f.name], f"{name}.{f.name} has no documentation"
            assert " ".join(docs[f.name].split()) in flat
    assert "--training.dtype {float32,bfloat16} (default: \"float32\")" in flat
    assert "--debug.seed int | None (default: None)" in flat


# --- saving --------------------------------------------------------------------------------------------------


def test_to_toml_round_trip(manager, tmp_path):
    cfg = manager.parse_args(
        [
            "--job.dump_folder", "/tmp/run 1",
            "--job.description", 'quote " backslash \\ newline \n tab \t bell \x07 del \x7f unicode é',
            "--job.print_config",
            "--model.converters", "float8,other",
            "--model.tokenizer_path", "tok.json",
            "--training.steps", "123",
            "--training.max_norm", "0.5",
            "--training.global_batch_size", "-1",
            "--training.dtype", "bfloat16",
            "--optimizer.lr", "3e-4",
            "--optimizer.eps", "1e-12",
            "--lr_scheduler.decay_ratio", "0.25",
            "--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0;layers.1,norm,output",
            "--checkpoint.exclude_from_loading", "dataloader,lr_scheduler",
            "--checkpoint.last_save", "full_and_export",
            "--compile.enable",
            "--compile.components", "",
            "--debug.seed", "7",
        ]
    )  # fmt: skip
    saved = tmp_path / "out" / "config.toml"
    save_config(cfg, saved)
    assert tomllib.loads(saved.read_text())["optimizer"]["lr"] == 3e-4
    loaded = manager.parse_args(["--job.config_file", str(saved)])
    expected = to_dict(cfg)
    expected["job"]["config_file"] = str(saved)  # the loaded config records the file it came from
    assert to_dict(loaded) == expected
    assert loaded != JobConfig()


def test_to_toml_comments_out_none(manager):
    text = to_toml(manager.parse_args([]))
    assert "# seed is None (unset)" in text
    assert "\nseed =" not in text  # (eval's fewshot_seed is set)
    assert tomllib.loads(text)["compile"]["components"] == ["model", "loss"]


# --- extensibility ---------------------------------------------------------------------------------------------


@dataclass
class Extra:
    alpha: float = 0.5
    """Mixing weight of the
    auxiliary loss."""

    mode: Literal["a", "b"] = "a"
    """Which variant."""

    undocumented: int = 3
    names: list[str] = field(default_factory=list)
    """Names, comma separated."""


@dataclass
class ExtendedConfig(JobConfig):
    extra: Extra = field(default_factory=Extra)


def test_field_docs_of_custom_dataclass():
    assert field_docs(Extra) == {
        "alpha": "Mixing weight of the\nauxiliary loss.",
        "mode": "Which variant.",
        "names": "Names, comma separated.",
    }


def test_custom_config_class(tmp_path, capsys):
    manager = ConfigManager(config_cls=ExtendedConfig)
    recipe = write(tmp_path, "[extra]\nmode = \"b\"\n[training]\nsteps = 5\n")
    cfg = manager.parse_args(["--job.config_file", recipe, "--extra.alpha", "2", "--extra.names", "x,y"])
    assert isinstance(cfg, ExtendedConfig)
    assert cfg.extra == Extra(alpha=2.0, mode="b", names=["x", "y"])
    assert cfg.training.steps == 5
    assert error_of(manager, ["--extra.alpah", "1"]) == "unknown option --extra.alpah; did you mean --extra.alpha?"
    saved = tmp_path / "saved.toml"
    save_config(cfg, saved)
    assert manager.parse_args([str(saved)]).extra == cfg.extra
    with pytest.raises(SystemExit):
        manager.parse_args(["--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert "[extra]" in flat
    assert "--extra.alpha float (default: 0.5) Mixing weight of the auxiliary loss." in flat


def test_unsupported_field_type_fails_at_construction():
    @dataclass
    class Bad:
        table: dict[str, int] = field(default_factory=dict)

    @dataclass
    class BadConfig:
        bad: Bad = field(default_factory=Bad)

    with pytest.raises(TypeError, match="unsupported config field type"):
        ConfigManager(config_cls=BadConfig)
