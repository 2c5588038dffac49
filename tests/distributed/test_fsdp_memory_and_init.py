"""FSDP holds 1/N of the training state per rank, and every layout starts from the same weights."""

import pytest
import torch

from tests.distributed.trainer_runs import train

pytestmark = pytest.mark.distributed


def _state_after_backward(trainer):
    """Per-rank bytes of params + grads + optimizer state after a step and one more backward."""
    from torchtitan.tools.memory import local_state_bytes

    inputs, labels = next(iter(trainer.dataloader))
    with trainer._loss_context():
        (trainer.loss_fn(trainer.model_parts[0](inputs), labels) / labels.numel()).backward()
    return local_state_bytes(trainer.model_parts, trainer.optimizers)


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp_state_per_rank_is_one_nth(n, tmp_path):
    steps = ["--training.steps", "1"]
    _, [single] = train(1, steps + ["--training.local_batch_size", "8"], str(tmp_path / "single"),
                        probe=_state_after_backward)
    _, per_rank = train(n, steps + ["--parallelism.data_parallel_shard_degree", str(n),
                                    "--training.local_batch_size", str(8 // n)],
                        str(tmp_path / f"fsdp{n}"), probe=_state_after_backward)
    assert single["grads"] == single["params"] and single["optimizer"] >= 2 * single["params"]
    for rank_bytes in per_rank:
        assert rank_bytes["grads"] > 0 and rank_bytes["optimizer"] > 0
        assert rank_bytes["total"] <= single["total"] * (1 / n + 0.05), (rank_bytes, single)
    # Shards partition the state: together the ranks hold the single-process total (Adam's step
    # counters are replicated scalars, hence the small allowance).
    assert abs(sum(r["total"] for r in per_rank) - single["total"]) <= 8 * 64 * n


def _full_initial_weights(trainer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(trainer.model_parts[0], options=StateDictOptions(full_state_dict=True))
    return {k: v.clone() for k, v in sd.items()}


@pytest.mark.parametrize("layout", [
    (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
])
def test_every_layout_starts_from_the_single_process_weights(layout, tmp_path):
    """Catches duplicated shards: on CPU a sharded random init would give every rank the same numbers."""
    world, argv = layout
    no_steps = ["--training.steps", "1", "--optimizer.lr", "0", "--training.local_batch_size", "4"]  # weights stay put
    _, [ref] = train(1, no_steps, str(tmp_path / "single"), probe=_full_initial_weights)
    _, got = train(world, no_steps + argv, str(tmp_path / "sharded"), probe=_full_initial_weights)
    for rank_sd in got:
        assert rank_sd.keys() == ref.keys()
        for k in ref:
            assert torch.equal(rank_sd[k], ref[k]), k
