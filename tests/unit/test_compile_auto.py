"""`compile.auto`: the blocks compile when the run repays the compile, short runs stay eager, the log says why."""

import pytest

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import compile_auto
from torchtitan.distributed.compile_auto import choose


def _cfg(steps: int) -> JobConfig:
    cfg = JobConfig()
    cfg.training.steps = steps
    return cfg


# 1 TFLOP a step at 400 GFLOP/s x 60% eager: ~4.2 s a step, ~0.19 s saved a step against a 45 s cold compile.
STEP = dict(step_flops=1e12, peak_flops=4e11, device_type="cpu", world_size=1)


@pytest.mark.parametrize("steps, cached, on", [(10, False, False), (1000, False, True), (100, False, False),
                                               (100, True, True)])
def test_compiles_exactly_when_the_saved_time_exceeds_the_compile(steps, cached, on):
    choice = choose(_cfg(steps), cached=cached, **STEP)
    saved = steps * compile_auto.GAIN * 1e12 / (4e11 * compile_auto.EAGER_MFU["cpu"])
    cost = (compile_auto.WARM_COMPILE_S if cached else compile_auto.COLD_COMPILE_S)["cpu"]
    assert (saved > cost) == on  # the cases straddle the rule: cold 10 / 1000 steps, 100 steps cold / warm
    assert choice.enable is on
    assert "\n" not in choice.reason and f"{saved:.0f} s saved" in choice.reason
    assert ("warm" if cached else "cold") in choice.reason


def test_explicit_settings_and_layouts_it_cannot_judge_win():
    cfg = _cfg(10)
    cfg.compile.enable = True  # the user's enable stands even for a short run
    assert choose(cfg, cached=False, **STEP).enable
    cfg = _cfg(10**6)
    cfg.compile.auto = False
    assert not choose(cfg, cached=False, **STEP).enable
    cfg.compile.auto = True
    assert not choose(cfg, cached=False, **{**STEP, "world_size": 2}).enable  # CPU ranks share the cores
    assert choose(cfg, cached=False, **{**STEP, "world_size": 8, "device_type": "cuda"}).enable


def test_plan_job_keeps_the_debug_recipe_eager_and_compiles_the_blocks_of_a_long_run(tmp_path, monkeypatch):
    """Through plan_job, with the machine's own peak: the shipped debug recipe (100 steps, the suite's kind of
    run) stays eager and as configured; the same recipe run 100x longer compiles its blocks (not the loss:
    what was measured). A run of these shapes that compiled before counts as a warm cache."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torchtitan.job_plan import plan_job
    from torchtitan.protocols.train_spec import config_manager

    recipe = ["--job.config_file", "train_configs/debug_model.toml"]
    short = config_manager().parse_args(recipe)
    choice = plan_job(short, 1).compile_choice
    assert not choice.enable and not short.compile.enable and "too short" in choice.reason
    assert short.compile.components == ["model", "loss"]
    long = config_manager().parse_args([*recipe, "--training.steps", "10000"])
    choice = plan_job(long, 1).compile_choice
    assert choice.enable and long.compile.enable and long.compile.components == ["model"]
    assert "cold cache" in choice.reason
    compile_auto.remember_compiled(choice.key)
    again = config_manager().parse_args([*recipe, "--training.steps", "10000"])
    assert "warm cache" in plan_job(again, 1).compile_choice.reason
