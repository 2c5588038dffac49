"""A run that leaves compile off is told, in one line, what --compile.enable was measured to give."""

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.compile import compile_advice


def test_one_line_with_the_measured_gain_only_when_the_model_is_not_compiled():
    cfg = JobConfig()
    line = compile_advice(cfg, "cpu")
    assert line is not None and "\n" not in line
    assert "--compile.enable" in line and "1.14x" in line
    assert "not measured on cuda" in compile_advice(cfg, "cuda")  # no figure claimed where none was measured
    cfg.compile.enable = True
    assert compile_advice(cfg, "cpu") is None
    cfg.compile.components = ["loss"]  # the loss alone compiled: the blocks are still eager
    assert compile_advice(cfg, "cpu") is not None
