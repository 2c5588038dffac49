"""LoRA changes what trains, never what a layout computes: the same tiny fp32 recipe (trainer_runs.PARITY_ARGS,
3 steps, adapters of rank 4 on every linear of the blocks, so both TP styles carry adapters) under FSDP 2, TP 2
and PP 2 logs the losses and grad norms of one process within the parity tolerances of test_parity_2d.py
(tests/tolerances.py). In every layout the frozen base is bitwise the same after training as
before it (its sha256 fingerprint, over full tensors, is unchanged and equal to the one-process run's), and
the optimizer holds state for the adapters only (its tensor bytes are measured and printed)."""

import pytest
import torch

from tests.distributed.trainer_runs import PARITY_ARGS, curves, read_metrics, train
from tests.multiprocess import run_ranks
from tests.tolerances import assert_curves_close

pytestmark = pytest.mark.distributed

LORA = ["--model.name", "qwen3", "--model.flavor", "debugmodel_tiny_untied", "--training.steps", "3",
        "--model.converters", "lora", "--lora.rank", "4", "--lora.target_modules", "layers.*"]
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"],
}


def _probe(trainer) -> dict:
    from torchtitan.components.checkpoint.manager import base_fingerprint

    parts = trainer.model_parts
    adapters = {id(p) for m in parts for n, p in m.named_parameters() if n.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    in_optimizer = {id(p) for opt in trainer.optimizers.optimizers for g in opt.param_groups for p in g["params"]}
    state_bytes = sum(
        t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
        for opt in trainer.optimizers.optimizers for s in opt.state.values() for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731
    return {
        "base_before": trainer.checkpointer.base_ref["fingerprint"],
        "base_after": base_fingerprint(parts),
        "optimizer_holds_adapters_only": in_optimizer == adapters,
        "frozen_grads": [n for m in parts for n, p in m.named_parameters() if not p.requires_grad and p.grad is not None],
        "state_bytes": state_bytes,
        "adapter_bytes": sum(local(p).nbytes for m in parts for p in m.parameters() if id(p) in adapters),
        "all_param_bytes": sum(local(p).nbytes for m in parts for p in m.parameters()),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    steps, (probe,) = train(1, LORA + ["--training.local_batch_size", "4"], str(tmp_path_factory.mktemp("one")),
                            probe=_probe)
    assert len(steps) == 3
    return curves(steps), probe


def _check_probe(name, probes, fingerprint):
    for p in probes:
        assert p["base_after"] == p["base_before"] == fingerprint  # base bitwise unchanged, same in every layout
        assert p["optimizer_holds_adapters_only"] and not p["frozen_grads"]
        assert p["state_bytes"] == 2 * p["adapter_bytes"]  # AdamW: exp_avg + exp_avg_sq of the adapters
    state = sum(p["state_bytes"] for p in probes)
    print(f"{name}: optimizer state {state:,} bytes over all ranks; a full fine-tune's AdamW state would be "
          f"{2 * sum(p['all_param_bytes'] for p in probes):,}")


def test_one_process_trains_adapters_only(reference):
    (loss, _), probe = reference
    assert loss[-1] < loss[0]
    _check_probe("one process", [probe], probe["base_before"])


def _every_layout(rank, world_size, root):
    """The three 2-rank layouts one after another in the same two processes (one spawn, one process group)."""
    from torchtitan.protocols.train_spec import config_manager
    from torchtitan.trainer import Trainer

    probes = {}
    for name, layout in LAYOUTS.items():
        cfg = config_manager().parse_args(PARITY_ARGS + LORA + layout + ["--job.dump_folder", f"{root}/{name}"])
        trainer = Trainer(cfg)
        trainer.train()
        probes[name] = _probe(trainer)
        trainer.checkpointer.close()  # not trainer.close(): the process group serves the next layout
        trainer.metrics.close()
    return probes


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("layouts"))
    probes = run_ranks(_every_layout, 2, root)
    return {name: ([m for m in read_metrics(f"{root}/{name}") if "loss" in m], [p[name] for p in probes])
            for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_matches_one_process(layout, reference, layouts):
    (ref_loss, ref_gnorm), ref_probe = reference
    steps, probes = layouts[layout]
    assert_curves_close(curves(steps), (ref_loss, ref_gnorm))
    _check_probe(layout, probes, ref_probe["base_before"])
