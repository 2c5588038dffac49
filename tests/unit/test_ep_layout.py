"""Expert-parallel layout validation: one line naming the numbers and degrees that fit; the ep split of
the data-parallel ranks (experts' FSDP over the rest)."""

import pytest

from torchtitan.distributed.parallel_dims import LayoutError, ParallelDims

MOE = {"ep": {"n_routed_experts": 8}}


def dims(world, ep, dp_shard=-1, cp=1, tp=1, pp=1):
    return ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world, ep=ep)


def test_ep_splits_the_shard_ranks():
    pd = dims(8, ep=2)
    assert (pd.dp_shard, pd.dp_shard_in_ep, pd.dp_shard_mod_ep) == (8, 2, 4)
    pd = dims(8, ep=4, cp=2)  # ep = dp_shard_in_ep 2 x cp 2
    assert (pd.dp_shard, pd.dp_shard_in_ep, pd.dp_shard_mod_ep) == (4, 2, 2)
    pd = dims(4, ep=2, tp=2)  # ep = tp: the experts are split over the tp ranks' sequence shards
    assert (pd.dp_shard_in_ep, pd.dp_shard_mod_ep) == (1, 2)


def test_ep_must_divide_the_token_ranks():
    with pytest.raises(LayoutError, match=r"expert_parallel_degree 3 must divide .* = 4 .*; degrees that fit: \[2, 4\]"):
        dims(4, ep=3)


def test_ep_must_be_a_multiple_of_cp_x_tp():
    with pytest.raises(LayoutError, match=r"multiple of context_parallel x tensor_parallel = 4"):
        dims(8, ep=2, cp=2, tp=2)


def test_experts_must_divide_by_ep():
    with pytest.raises(LayoutError, match=r"expert_parallel_degree 16 does not divide the model's n_routed_experts \(8\)"):
        dims(16, ep=16).check_model(MOE)
    dims(8, ep=8).check_model(MOE)


def test_dense_model_refuses_ep():
    with pytest.raises(LayoutError, match=r"needs a model with routed experts"):
        dims(2, ep=2).check_model({"tp": {"n_heads": 4}})


def test_moe_under_tp_alone_splits_each_expert_over_tp():
    """EP 1 under TP: expert tensor parallel, whose hidden sizes ("etp") tp must divide; under EP x TP the experts
    are whole and only their number must divide."""
    hidden = {**MOE, "etp": {"moe.hidden_dim": 100, "shared experts' hidden size": 36}}
    assert (dims(2, ep=1, tp=2).etp, dims(4, ep=2, tp=2).etp, dims(2, ep=1).etp) == (2, 1, 1)
    dims(2, ep=1, tp=2).check_model(hidden)
    dims(4, ep=1, tp=4).check_model(hidden)
    with pytest.raises(LayoutError, match=r"^tensor_parallel_degree 8 does not divide the model's moe.hidden_dim "
                                          r"\(100\); .* --parallelism.expert_parallel_degree 8$"):
        dims(8, ep=1, tp=8).check_model(hidden)
    with pytest.raises(LayoutError, match=r"shared experts' hidden size \(36\)"):
        dims(8, ep=1, tp=8).check_model({**MOE, "etp": {"shared experts' hidden size": 36}})
    dims(8, ep=8, tp=8).check_model(hidden)  # EP x TP: whole experts, 8 of them


def test_plan_job_refuses_the_balance_loss_under_pp_and_an_expert_split_that_does_not_fit():
    from torchtitan.job_plan import plan_job
    from torchtitan.protocols.train_spec import config_manager

    base = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_tiny", "--training.local_batch_size", "2"]
    cfg = config_manager().parse_args(base + ["--moe.aux_loss_alpha", "0.01", "--parallelism.pipeline_parallel_degree", "2"])
    with pytest.raises(ValueError, match=r"aux_loss_alpha needs the whole model in one stage"):
        plan_job(cfg, 2)
    cfg = config_manager().parse_args(base + ["--parallelism.expert_parallel_degree", "16"])
    with pytest.raises(LayoutError, match=r"expert_parallel_degree 16 does not divide the model's n_routed_experts \(8\)"):
        plan_job(cfg, 16)
    plan = plan_job(config_manager().parse_args(base + ["--parallelism.expert_parallel_degree", "2"]), 2)
    assert plan.parallel_dims.ep == 2 and plan.model_args.moe.load_balance_coeff == 1e-3
