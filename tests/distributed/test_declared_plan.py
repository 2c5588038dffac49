"""A new family joins the parallelisms through a declared plan alone: a toy transformer (its own module
names, nothing from the shipped families) registers a TrainSpec whose parallelize_fn is
`parallelizer(TOY_PLAN)`, and trains under TP 2 x FSDP 2 and PP 2 like one process, within the parity
tolerances (tests/distributed/test_parity_2d.py: loss rtol 1e-5, grad norm rtol 5e-5; fp32, same seed, same
global batch). A plan that leaves the block's up-projection out (replicated under TP while its down-projection
is row-wise) must not pass: measured, its run dies on the shape mismatch (RuntimeError from a rank)."""

from dataclasses import dataclass

import pytest
import torch.nn as nn

from tests.distributed.test_parity_2d import assert_parity
from tests.distributed.trainer_runs import curves, train
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.datasets.dataloader import build_text_dataloader
from torchtitan.distributed.pipeline import pipeline_model
from torchtitan.distributed.parallelize import (
    COLWISE,
    ROWWISE,
    SEQUENCE_PARALLEL,
    GatherInputs,
    ParallelPlan,
    parallelizer,
)
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

pytestmark = pytest.mark.distributed


@dataclass
class ToyArgs(BaseModelArgs):
    dim: int = 32
    vocab_size: int = 2048
    max_seq_len: int = 64
    n_layers: int = 2

    def flops_per_token(self, num_non_embedding_params: int, seq_len: int) -> int:
        return 6 * num_non_embedding_params


class ToyBlock(nn.Module):
    """A pre-norm residual GELU MLP (no attention: the plan is what is under test)."""

    def __init__(self, dim: int):
        super().__init__()
        self.pre_norm = nn.RMSNorm(dim)
        self.mlp = nn.Sequential()
        self.mlp.up = nn.Linear(dim, 4 * dim, bias=False)
        self.mlp.act = nn.GELU()
        self.mlp.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.mlp(self.pre_norm(x))


class ToyTransformer(nn.Module):
    pipeline_head, pipeline_tail = ("tok_embeddings",), ("norm", "output")

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): ToyBlock(args.dim) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def init_weights(self, buffer_device=None):
        for name, p in self.named_parameters():
            if "norm" in name:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02 if p.dim() > 1 and "tok_embeddings" not in name else 1.0)

    def forward(self, tokens, positions=None):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


TOY_PLAN = ParallelPlan(block_tp={
    "pre_norm": SEQUENCE_PARALLEL,
    "mlp": GatherInputs(),
    "mlp.up": COLWISE,
    "mlp.down": ROWWISE,
})
# Wrong on purpose: `up` stays replicated, so each tp rank feeds all hidden units into its row shard of `down`.
BROKEN_PLAN = ParallelPlan(block_tp={"pre_norm": SEQUENCE_PARALLEL, "mlp": GatherInputs(), "mlp.down": ROWWISE})


def register_toy(rank=0, world_size=1, plan=TOY_PLAN, name="toy_declared"):
    try:
        get_train_spec(name)
    except ValueError:
        register_train_spec(TrainSpec(
            name=name,
            model_cls=ToyTransformer,
            flavors={"small": ToyArgs()},
            parallelize_fn=parallelizer(plan),
            pipelining_fn=pipeline_model,  # the framework's cut by the model protocol
            build_tokenizer_fn=lambda job_config: build_tokenizer(job_config.model.tokenizer_path),
            build_dataloader_fn=build_text_dataloader,
            build_loss_fn=build_cross_entropy_loss,
        ))


def register_broken(rank, world_size):
    register_toy(plan=BROKEN_PLAN, name="toy_broken_plan")


TOY = ["--model.name", "toy_declared", "--model.flavor", "small", "--training.steps", "5"]
LAYOUTS = {
    "tp2_fsdp2": (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                      "--training.local_batch_size", "4"]),
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    steps, _ = train(1, TOY + ["--training.local_batch_size", "8"], str(tmp_path_factory.mktemp("ref")),
                     setup=register_toy)
    return curves(steps)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_toy_family_matches_one_process(layout, reference, tmp_path):
    world, argv = LAYOUTS[layout]
    steps, _ = train(world, TOY + argv, str(tmp_path), setup=register_toy)
    assert_parity(curves(steps), reference)
    assert reference[0][-1] < reference[0][0]  # the toy learns, so parity is about something


def test_parity_catches_a_plan_that_misses_a_projection(reference, tmp_path):
    argv = ["--model.name", "toy_broken_plan", *TOY[2:], "--parallelism.tensor_parallel_degree", "2",
            "--training.local_batch_size", "8"]
    with pytest.raises((RuntimeError, AssertionError)):
        steps, _ = train(2, argv, str(tmp_path), setup=register_broken)
        assert_parity(curves(steps), reference)
