"""Silent-corruption check: data-parallel replicas must hold bit-identical parameters and optimizer state.

Ranks that differ only in their dp_replicate coordinate (HSDP's replicate dim; DDP when the shard degree is 1)
hold the same shard of every parameter and of its optimizer state, updated by the same all-reduced gradients,
so their bytes are equal unless something went wrong silently (a flipped bit in memory, a faulty device, a
kernel that is not deterministic across devices). Every `--guard.replica_check_interval` steps each rank
computes a fingerprint of its shards: the sum, as int64, of every tensor's bytes read as integer words (exact,
so equal bytes give equal sums in any order, and any single flipped bit changes it; a pass over the state, no
copy). The fingerprints of all ranks are all-gathered (2 int64 per rank), so every rank takes the same
decision, and a replicate group whose members disagree is named, rank by rank, in one line. torchft replica
groups (separate jobs) are not compared here.
"""

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.errors import TrainingError

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaMismatch(TrainingError):
    """Replicas disagree; `restartable` tells the restart supervisor whether a restart (every replica reloaded
    from the same checkpoint) is wanted."""

    def __init__(self, message: str, restartable: bool):
        super().__init__(message)
        self.restartable = restartable


def _word_sum(tensors) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.int64)
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.numel() == 0:
            continue
        words = t.detach().contiguous().view(-1).view(_WORDS[t.element_size()])
        total += words.sum(dtype=torch.int64).cpu()
    return total


def fingerprint(model_parts, optimizers) -> torch.Tensor:
    """[parameters, optimizer state] of this rank's shards, as two int64 word sums."""
    params = [p for m in model_parts for p in m.parameters()]
    states = [v for opt in optimizers.optimizers for s in opt.state.values() for v in s.values()
              if isinstance(v, torch.Tensor)]
    return torch.stack([_word_sum(params), _word_sum(states)])


def replicate_groups(parallel_dims) -> list[list[int]]:
    """Global ranks that must hold identical state: one list per shard, across the dp_replicate dim."""
    mesh = parallel_dims.world_mesh
    axis = mesh.mesh_dim_names.index("dp_replicate")
    return mesh.mesh.movedim(axis, -1).reshape(-1, mesh.mesh.shape[axis]).tolist()


class ReplicaCheck:
    def __init__(self, interval: int, action: str, parallel_dims, device: torch.device):
        self.interval, self.restart, self.device = interval, action == "restart", device
        self.groups = replicate_groups(parallel_dims)

    def check(self, step: int, model_parts, optimizers) -> None:
        if step % self.interval:
            return
        mine = fingerprint(model_parts, optimizers).to(self.device)  # NCCL gathers device tensors
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        problems = []
        for group in self.groups:
            prints = {r: tuple(everyone[r].tolist()) for r in group}
            if len(set(prints.values())) == 1:
                continue
            common = Counter(prints.values()).most_common(1)[0][0]  # the majority; with two, the first rank's
            odd = [r for r in group if prints[r] != common]
            what = " and ".join(n for i, n in enumerate(("parameters", "optimizer state"))
                                if len({p[i] for p in prints.values()}) > 1)
            problems.append(f"rank(s) {', '.join(map(str, odd))} disagree with rank(s) "
                            f"{', '.join(str(r) for r in group if r not in odd)} on their {what}")
        if problems:
            then = ("restarting from the last checkpoint (every replica reloads the same state)" if self.restart
                    else "stopping; check those ranks' hardware, then rerun to resume from the last checkpoint")
            raise ReplicaMismatch(
                f"silent-corruption check at step {step}: data-parallel replicas differ: {'; '.join(problems)}; "
                f"{then}", restartable=self.restart)
