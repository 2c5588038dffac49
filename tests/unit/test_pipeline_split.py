"""Pipeline planning: which modules each stage holds, where stages sit, and one clear error per bad layout."""

import dataclasses

import pytest
import torch

from torchtitan.config.job_config import JobConfig, Parallelism
from torchtitan.distributed.parallel_dims import LayoutError, ParallelDims
from torchtitan.distributed.pipeline import (
    SCHEDULES,
    module_order,
    plan_pipeline,
    schedule_name,
    split_stage,
)
from torchtitan.models.llama3 import Transformer, llama3_flavors

HEAD, TAIL = ("tok_embeddings",), ("norm", "output")


def order(n_layers: int) -> list[str]:
    return ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]


def plan(n_layers=4, local_batch_size=8, **kw):
    p = Parallelism(**{"pipeline_parallel_degree": 2, **kw})
    return plan_pipeline(p, order(n_layers), 1, 2, local_batch_size)


def test_module_order_follows_the_model():
    with torch.device("meta"):
        model = Transformer(llama3_flavors["debugmodel_tiny"])
    assert module_order(model, HEAD, TAIL) == order(2)


def test_one_stage_per_rank_splits_by_compute():
    # 2 layers + 1 (embedding) + 1 (output) = 4 units over 2 stages.
    assert plan(n_layers=2).stages == (("tok_embeddings", "layers.0"), ("layers.1", "norm", "output"))


def test_uneven_remainder_goes_after_the_first_stage():
    # 7 layers + 2 = 9 units over 2 stages: 4 and 5.
    assert plan(n_layers=7).stages == (
        ("tok_embeddings", "layers.0", "layers.1", "layers.2"),
        ("layers.3", "layers.4", "layers.5", "layers.6", "norm", "output"),
    )


def test_less_layers_options_shift_blocks():
    p = plan(n_layers=4, pipeline_parallel_first_stage_less_layers=0, pipeline_parallel_last_stage_less_layers=0)
    assert p.stages == (("tok_embeddings", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "output"))


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"])
def test_looped_schedules_get_two_stages_per_rank_placed_round_robin(schedule):
    p = plan(n_layers=6, pipeline_parallel_schedule=schedule)
    assert p.num_stages == 4 and p.stages_per_rank == 2
    assert [p.rank_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert p.local_stages(0) == [0, 2] and p.local_stages(1) == [1, 3]


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_schedules_put_first_and_last_stage_on_rank_0(schedule):
    p = plan(n_layers=6, pipeline_parallel_schedule=schedule)
    assert [p.rank_of(s) for s in range(4)] == [0, 1, 1, 0]
    assert p.local_stages(0) == [0, 3]


def test_layers_per_stage_sets_the_stage_count():
    # 6 layers + 1 + 1 = 8 units, 2 per stage: 4 stages, 2 per rank.
    p = plan(n_layers=6, pipeline_parallel_schedule="Interleaved1F1B", pipeline_parallel_layers_per_stage=2)
    assert p.stages == (
        ("tok_embeddings", "layers.0"),
        ("layers.1", "layers.2"),
        ("layers.3", "layers.4"),
        ("layers.5", "norm", "output"),
    )


def test_explicit_split_is_used_as_given():
    stages = [["tok_embeddings"], ["layers.0", "layers.1", "norm", "output"]]
    assert plan(n_layers=2, module_fqns_per_model_part=stages).stages == tuple(map(tuple, stages))


def test_every_stage_covers_the_model_exactly_once():
    for schedule in SCHEDULES:
        p = plan(n_layers=8, local_batch_size=8, pipeline_parallel_schedule=schedule)
        assert [m for s in p.stages for m in s] == order(8), schedule


def test_microbatch_count_is_local_batch_over_microbatch_size():
    assert plan(local_batch_size=8, pipeline_parallel_microbatch_size=2).n_microbatches == 4


def test_schedule_names_are_case_insensitive():
    assert schedule_name("zbvzerobubble") == "ZBVZeroBubble"
    assert schedule_name("gpipe") == "GPipe"


def test_stage_state_dicts_keep_the_whole_model_names():
    """Checkpoints move between PP and non-PP runs: the stages' keys are exactly the model's keys."""
    with torch.device("meta"):
        model = Transformer(llama3_flavors["debugmodel_tiny4"])
    p = plan(n_layers=4, pipeline_parallel_schedule="ZBVZeroBubble")
    keys = [k for stage in p.stages for k in split_stage(model, stage, HEAD, TAIL).state_dict()]
    assert sorted(keys) == sorted(model.state_dict())
    assert len(keys) == len(set(keys))


def test_split_stage_leaves_the_model_untouched():
    with torch.device("meta"):
        model = Transformer(llama3_flavors["debugmodel_tiny"])
    before = sorted(model.state_dict())
    stage = split_stage(model, ("layers.1", "norm", "output"), HEAD, TAIL)
    assert stage.tok_embeddings is None and list(stage.layers.keys()) == ["1"]
    assert sorted(model.state_dict()) == before


# ---- bad layouts: one LayoutError naming the problem and the fix ----------------------------------------
BAD = {
    "unknown schedule": (dict(pipeline_parallel_schedule="OneFOneB"), "unknown pipeline schedule"),
    "V schedule with one stage per rank": (
        dict(pipeline_parallel_schedule="ZBVZeroBubble", module_fqns_per_model_part=[order(4)[:3], order(4)[3:]]),
        "exactly 2 stages per rank",
    ),
    "looped schedule with one stage per rank": (
        dict(pipeline_parallel_schedule="Interleaved1F1B", pipeline_parallel_layers_per_stage=3),
        "at least 2 stages per rank",
    ),
    "single-stage schedule with two stages per rank": (
        dict(pipeline_parallel_schedule="1F1B", pipeline_parallel_layers_per_stage=1, pipeline_parallel_first_stage_less_layers=1),
        "one stage per rank",
    ),
    "DualPipeV with fewer than 2 x pp microbatches": (
        dict(pipeline_parallel_schedule="DualPipeV", pipeline_parallel_microbatch_size=4),
        "at least 2 x pipeline_parallel_degree = 4 microbatches",
    ),
    "1F1B with fewer microbatches than stages": (
        dict(pipeline_parallel_microbatch_size=8),
        "at least pipeline_parallel_degree = 2 microbatches",
    ),
    "interleaved rounds that do not divide the microbatches": (
        dict(pipeline_parallel_schedule="Interleaved1F1B", local_batch_size=5),
        "rounds of microbatches // pipeline_parallel_degree = 2, which must divide the microbatch count",
    ),
    "microbatch size not dividing the local batch": (
        dict(pipeline_parallel_microbatch_size=3),
        "is not a multiple of --parallelism.pipeline_parallel_microbatch_size 3",
    ),
    "layers per stage not dividing the model": (
        dict(pipeline_parallel_layers_per_stage=4),
        "must divide 4 layers + 1 (embedding) + 1 (output) = 6",
    ),
    "more stages than layers": (
        dict(pipeline_parallel_degree=4, pipeline_parallel_schedule="Interleaved1F1B"),
        "cannot fill 8 pipeline stages",
    ),
    "explicit split missing a layer": (
        dict(module_fqns_per_model_part=[["tok_embeddings", "layers.0"], ["layers.2", "layers.3", "norm", "output"]]),
        "['layers.1'] missing",
    ),
    "explicit split listing a module twice": (
        dict(module_fqns_per_model_part=[order(4)[:3], order(4)[2:]]),
        "listed more than once",
    ),
    "explicit split out of order": (
        dict(module_fqns_per_model_part=[["tok_embeddings", "layers.1"], ["layers.0", "layers.2", "layers.3", "norm", "output"]]),
        "not in model order",
    ),
    "explicit split naming an unknown module": (
        dict(module_fqns_per_model_part=[["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "lm_head"]]),
        "unknown module(s) ['lm_head']",
    ),
    "explicit split with an empty stage": (
        dict(module_fqns_per_model_part=[order(4), []]),
        "hold no modules",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_layout_gets_one_clear_error(case):
    kw, expected = BAD[case]
    with pytest.raises(LayoutError) as e:
        plan(**{"n_layers": 4, **kw})
    message = str(e.value)
    assert expected in message, message
    assert "\n" not in message
    assert "--" in message or "pipeline_parallel" in message or "schedule" in message, "the message names the knob"


def _job(**parallelism):
    cfg = JobConfig()
    cfg.parallelism = dataclasses.replace(cfg.parallelism, pipeline_parallel_degree=2, **parallelism)
    cfg.training.local_batch_size = 4
    return cfg


def _pipeline_llama(cfg, parallel_dims=None):
    from torchtitan.distributed.pipeline import plan_model_pipeline

    with torch.device("meta"):
        model = Transformer(llama3_flavors["debugmodel_tiny4"])
    parallel_dims = parallel_dims or ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, world_size=2)
    return plan_model_pipeline(model, parallel_dims, cfg)


def test_pipeline_plan_checks_the_layout_before_building_anything():
    """The plan of a model's pipeline (run by the job planner) fails before any stage or collective exists."""
    with pytest.raises(LayoutError, match="DualPipeV needs at least 2 x pipeline_parallel_degree"):
        _pipeline_llama(_job(pipeline_parallel_schedule="DualPipeV", pipeline_parallel_microbatch_size=2))


def test_validation_batch_must_split_into_the_microbatches():
    cfg = _job()
    cfg.validation.enable, cfg.validation.local_batch_size = True, 6
    with pytest.raises(LayoutError, match="--validation.local_batch_size 6 must be a multiple of the 4"):
        _pipeline_llama(cfg)


def test_zero_bubble_refuses_fsdp_resharding_after_forward():
    pd = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=2, world_size=4)
    cfg = _job(pipeline_parallel_schedule="ZBVZeroBubble", fsdp_reshard_after_forward="always")
    with pytest.raises(LayoutError, match="ZBVZeroBubble cannot run with --parallelism.fsdp_reshard_after_forward"):
        _pipeline_llama(cfg, pd)
