"""Every shipped recipe parses, names a registered model and flavor, and plans on the world it targets."""

from pathlib import Path

import pytest

from torchtitan.protocols.train_spec import config_manager
from torchtitan.distributed.parallel_dims import parallel_dims_from_config
from torchtitan.job_plan import plan_job
from torchtitan.protocols.train_spec import get_flavor, get_train_spec

RECIPES = sorted((Path(__file__).resolve().parents[2] / "train_configs").glob("*.toml"))
# The smallest world each recipe's layout is meant for.
WORLD = {"llama3_8b": 8, "llama3_70b": 64, "llama3_405b": 128, "deepseek_v3_16b": 8, "deepseek_v3_671b": 2048,
         "qwen3_moe_30b_a3b": 8, "qwen3_moe_235b_a22b": 64, "debug_moe": 2, "gpt_oss_debug": 2, "gpt_oss_20b": 8}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_is_valid(recipe):
    cfg = config_manager().parse_args(["--job.config_file", str(recipe)])
    args = get_flavor(get_train_spec(cfg.model.name), cfg.model.flavor)
    pd = parallel_dims_from_config(cfg.parallelism, WORLD.get(recipe.stem, 1))
    pd.check_model(args.divisible_by())
    pd.check_batch(seq_len=cfg.training.seq_len, global_batch_size=cfg.training.local_batch_size * pd.dp,
                   local_batch_size=cfg.training.local_batch_size)


def test_debug_recipe_plans_on_one_and_two_ranks():
    cfg = config_manager().parse_args(["--job.config_file", str(RECIPES[0].parent / "debug_model.toml")])
    for world in (1, 2):
        plan = plan_job(cfg, world)
        assert plan.model_args.vocab_size == plan.tokenizer.vocab_size == 2048
        assert plan.global_batch_size == cfg.training.local_batch_size * world
