"""How a GPU run's tensors get their memory: PyTorch's CUDA caching allocator with expandable segments.

With its default settings the caching allocator carves tensors out of fixed segments, one cudaMalloc each,
and never merges two segments: once a step has freed a large block mid-way and later asks for a larger one,
a new segment is reserved while the old one sits idle, so reserved memory (what an OOM counts against) drifts
above the live tensors. Training steps do exactly that (a block's recomputation, FSDP's gathers, a pipeline
stage's microbatches of activations freed out of order). Expandable segments map physical pages into one
growing virtual range per stream instead, so freed pages are reused whatever the shape that comes next.
The PyTorch team's torchtitan exports it in its launch script; here the trainer's entry point sets it
(`choose_at_start`), so ./run_train.sh, Slurm and a bare `torchrun -m torchtitan.train` alike get it.

The user's choice wins: with PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF set (to anything, e.g.
`expandable_segments:False`) nothing is changed. The allocator reads its settings once, at the first CUDA
allocation, so this must run before any; on a machine without CUDA the setting is never read.
"""

import os

ALLOC_CONF_ENVS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch >= 2.9 reads the first, then the second
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def choose_at_start(environ: dict | None = None) -> bool:
    """Expandable segments unless the environment configures the allocator already; True when it set them.
    Sets PYTORCH_CUDA_ALLOC_CONF, the name every torch 2.x reads (2.9 added PYTORCH_ALLOC_CONF, read first)."""
    env = os.environ if environ is None else environ
    if any(name in env for name in ALLOC_CONF_ENVS):
        return False
    env["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_ALLOC_CONF
    return True
