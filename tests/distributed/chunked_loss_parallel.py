"""The chunked cross entropy under TP's loss parallel (vocabulary-sharded DTensor logits on the "tp" mesh
dimension of a 2 x 2 mesh) equals the plain loss in one process: the loss and the logits' gradient (fp32,
tests/tolerances.chain_tol), the gradient still sharded over the vocabulary. Run inside test_muon_parity.py's
4-rank group (one spawn for both); one process, plain tensors: tests/unit/test_chunked_loss.py."""

import torch


def _batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 19, 64, generator=g)
    labels = torch.randint(0, 64, (2, 19), generator=g)
    labels[0, :4] = -100
    return logits, labels


def chunked_under_loss_parallel():
    """On a rank of an initialised 4-rank group: (loss, gradient still vocabulary-sharded, full gradient)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from torchtitan.components.loss import chunked_loss
    from torchtitan.components.loss import cross_entropy_sum

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    full, labels = _batch()
    logits = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
    with loss_parallel():
        loss = chunked_loss(cross_entropy_sum, 5)(logits, labels)
        loss.backward()
    return loss.full_tensor(), logits.grad.placements == (Shard(2),), logits.grad.full_tensor()


def check_against_one_process(got_loss, sharded, got_grad) -> None:
    from tests.tolerances import chain_tol
    from torchtitan.components.loss import cross_entropy_sum

    full, labels = _batch()
    logits = full.clone().requires_grad_()
    loss = cross_entropy_sum(logits, labels)
    loss.backward()
    assert sharded
    # the loss's two chained sums (the log-sum-exp over the vocabulary, the tokens), as in
    # tests/unit/test_chunked_loss.py; loss parallel splits the first over the TP ranks.
    # Measured: uses 0.0085 of it (AVX-512), 0.0085 (AVX2 caps).
    width = max(labels.numel(), full.shape[-1])
    torch.testing.assert_close(got_loss, loss.detach(), **chain_tol(loss.abs().item(), 2, width))
    torch.testing.assert_close(got_grad, logits.grad, **chain_tol(logits.grad.abs().max().item(), 2, width))
