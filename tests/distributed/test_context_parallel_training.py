"""Context parallel changes memory, never the numbers.

The real Trainer with CP (alone, with FSDP, with replicate, with TP+SP) must log the same per-step loss and
pre-clipping grad norm as one process, under the parity protocol of test_parity_2d (same recipe, same
tolerances: loss rtol 1e-5, grad norm rtol 5e-5). Each cp rank sees a load-balanced slice (two chunks) of
every sequence; the ring attention, the RoPE positions, the label slice, the token count and the gradient
sum over dp x cp all have to be right for the curves to agree. One step's gradients are also compared
parameter by parameter.

The negative control drops the true RoPE positions (every cp rank rotates its slice as if it started at
0): the model still trains, so only a parity check can notice, and it must.
"""


import pytest
import torch

from tests.distributed.test_parity_2d import assert_parity, masked_reference  # noqa: F401 (a fixture)
from torchtitan.distributed.context_parallel import shard_batch
from tests.distributed.trainer_runs import DOCUMENT_MASKING, curves, train
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.distributed

SEQ_LEN, GLOBAL_BATCH = 64, 8  # from PARITY_ARGS: the token count every step must see

CP2 = ["--parallelism.context_parallel_degree", "2"]
# name: (world size, layout arguments)
LAYOUTS = {
    "cp2_allgather": (2, CP2 + ["--parallelism.context_parallel_rotate_method", "allgather",
                                "--training.local_batch_size", "4"]),
    "cp2_alltoall": (2, CP2 + ["--parallelism.context_parallel_rotate_method", "alltoall",
                               "--training.local_batch_size", "4"]),
    "cp2_fsdp2": (4, CP2 + ["--parallelism.context_parallel_rotate_method", "alltoall",
                            "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]),
    # dp_replicate 2 x cp 2: FSDP's 2-D mesh (replicate, dp_shard x cp) with a shard size of cp alone.
    "cp2_ddp2": (4, CP2 + ["--parallelism.context_parallel_rotate_method", "alltoall",
                           "--parallelism.data_parallel_replicate_degree", "2",
                           "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "2"]),
    "cp2_tp2": (4, CP2 + ["--parallelism.context_parallel_rotate_method", "allgather",
                          "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
}
# One step's parameter gradients: fp32 reordering noise is ~5e-7 of each gradient's largest entry.
GRAD_RTOL_OF_MAX = 1e-5


def _probe(trainer) -> dict:
    """The step's global token count, and the meshes the parameters are sharded over."""
    meshes = {p.device_mesh.mesh_dim_names for m in trainer.model_parts for p in m.parameters()
              if hasattr(p, "device_mesh")}
    batch = trainer._next_microbatches(iter(trainer.dataloader))
    sharded = [shard_batch(mb, *trainer.parallel_dims.coordinate("cp")) for mb in batch]
    return {"global_tokens": float(trainer.global_token_count(sharded)), "meshes": sorted(meshes)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    steps, _ = train(1, ["--training.local_batch_size", "4"], str(tmp_path_factory.mktemp("single")))
    assert len(steps) == 10
    return curves(steps)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference, tmp_path):
    world, argv = LAYOUTS[layout]
    steps, extras = train(world, argv, str(tmp_path), probe=_probe)
    assert_parity(curves(steps), reference)
    for extra in extras:
        # The cp slices' label counts add up to the whole global batch (not cp times it, not a slice of it).
        assert extra["global_tokens"] == SEQ_LEN * GLOBAL_BATCH
        # FSDP shards (and reduces gradients) over dp_shard x cp: one copy of the weights for the cp group.
        assert extra["meshes"] and all("dp_shard_cp" in names for names in extra["meshes"]), extra["meshes"]


def _one_step_gradients(rank: int, world_size: int, rotate_method: str) -> dict[str, float]:
    """Per parameter, max |CP gradient summed over cp ranks - full-sequence gradient| / max |full gradient|.

    Every rank computes the reference on the whole batch, then the CP model on its slice; the loss is the
    slice's token-loss sum over the GLOBAL token count, so summing gradients over the cp ranks (what FSDP
    does over dp_shard x cp) must give the full gradient."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.components.loss import cross_entropy_sum
    from torchtitan.distributed.context_parallel import shard_batch
    from torchtitan.models.llama3.flavors import llama3_flavors
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.parallelize import apply_cp

    torch.manual_seed(0)
    model = Transformer(llama3_flavors["debugmodel_tiny"])
    model.init_weights()
    gen = torch.Generator().manual_seed(1)
    inputs, labels = (torch.randint(0, 2048, (2, SEQ_LEN), generator=gen) for _ in range(2))
    (cross_entropy_sum(model(inputs), labels) / labels.numel()).backward()

    cp_model = copy.deepcopy(model)
    cp_model.zero_grad()
    apply_cp(cp_model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)), seq_len=SEQ_LEN,
             rotate_method=rotate_method)
    local_inputs, local_labels = shard_batch((inputs, labels), rank, world_size)
    (cross_entropy_sum(cp_model(local_inputs), local_labels) / labels.numel()).backward()
    errors = {}
    for (name, p), ref in zip(cp_model.named_parameters(), model.parameters(), strict=True):
        dist.all_reduce(p.grad)
        errors[name] = float((p.grad - ref.grad).abs().max() / ref.grad.abs().max())
    return errors


@pytest.mark.parametrize("cp_size,rotate_method", [(2, "allgather"), (2, "alltoall"), (4, "alltoall")])
def test_gradients_summed_over_cp_equal_full_sequence_gradients(cp_size, rotate_method):
    for errors in run_ranks(_one_step_gradients, cp_size, rotate_method):
        worst = max(errors, key=errors.get)
        assert errors[worst] < GRAD_RTOL_OF_MAX, f"{worst}: {errors[worst]:.2e}"


def _positions_from_zero(rank, world_size):
    """Breaks CP on purpose: the ring attention is right but RoPE sees local positions 0..S/cp-1."""
    import torchtitan.models.llama3.parallelize as par

    real = par.apply_cp

    def broken(model, *args, **kwargs):
        real(model, *args, **kwargs)
        model.fixed_positions = None

    par.apply_cp = broken


def test_parity_check_catches_wrong_positions(reference, tmp_path):
    world, argv = LAYOUTS["cp2_alltoall"]
    steps, _ = train(world, argv, str(tmp_path), setup=_positions_from_zero)
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), reference)


def test_4d_pp2_tp2_cp2_matches_single_process(reference, tmp_path):
    argv = CP2 + ["--parallelism.context_parallel_rotate_method", "alltoall",
                  "--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                  "--training.local_batch_size", "4"]
    steps, extras = train(8, argv, str(tmp_path), probe=_probe)
    assert_parity(curves(steps), reference)
    assert all(e["global_tokens"] == SEQ_LEN * GLOBAL_BATCH for e in extras)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process_with_document_masking(layout, masked_reference, tmp_path):
    world, argv = LAYOUTS[layout]
    steps, _ = train(world, argv + DOCUMENT_MASKING, str(tmp_path))
    assert_parity(curves(steps), masked_reference)


def _ring_attention_ignoring_documents(rank, world_size):
    """Breaks document masking under CP on purpose: ring attention drops the document ids."""
    import torchtitan.distributed.context_parallel as cp

    real = cp.ring_attention
    def without_documents(q, k, v, group, rotate, document_ids=None, *kinds):  # window and sinks kept
        return real(q, k, v, group, rotate, None, *kinds)

    cp.ring_attention = without_documents


def test_masked_parity_catches_ring_attention_ignoring_documents(masked_reference, tmp_path):
    world, argv = LAYOUTS["cp2_alltoall"]
    steps, _ = train(world, argv + DOCUMENT_MASKING, str(tmp_path), setup=_ring_attention_ignoring_documents)
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), masked_reference)
