"""Silent-corruption check: data-parallel replicas must hold bit-identical parameters and optimizer state.

Ranks that differ only in their dp_replicate coordinate (HSDP's replicate dim; DDP when the shard degree is 1)
hold the same shard of every parameter and of its optimizer state, updated by the same all-reduced gradients,
so their bytes are equal unless something went wrong silently (a flipped bit in memory, a faulty device, a
kernel that is not deterministic across devices). Every `--guard.replica_check_interval` steps each rank
computes a fingerprint of its shards: the sum, as int64, of every tensor's bytes read as integer words (exact,
so equal bytes give equal sums in any order, and any single flipped bit changes it; a pass over the state, no
copy).

torchft replica groups (--fault_tolerance.enable; separate jobs, same layout) are replicas too: rank r of every
group holds the same shards, updated by the same gradients averaged across groups. So one set of ranks that
must agree is a replicate group of the job times every replica group of the quorum: a member is (replica group,
rank). Each rank first gathers its fingerprint from the same rank of the other groups (through torchft's
Manager: `Replicas.gather`), then the job all-gathers those rows (3 int64 per rank and group), so every rank of
a job takes the same decision, and the members that disagree are named in one line. When a group fails during
the exchange (torchft drops it at the next quorum) that check compares within the job only.
"""

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.components.faults.training_error import TrainingError
from torchtitan.tools.logging import logger

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
    if parallel_dims.world_size == 1:  # a one-rank torchft group (no mesh)
        return [[0]]
    mesh = parallel_dims.world_mesh
    if "dp_replicate" not in mesh.mesh_dim_names:  # torchft groups alone: each rank is its own replicate group
        return [[r] for r in mesh.mesh.flatten().tolist()]
    axis = mesh.mesh_dim_names.index("dp_replicate")
    return mesh.mesh.movedim(axis, -1).reshape(-1, mesh.mesh.shape[axis]).tolist()


class ReplicaCheck:
    """`replicas` (fault_tolerance.Replicas, or None without torchft) adds the same rank of the other groups."""

    def __init__(self, interval: int, action: str, parallel_dims, device: torch.device, replicas=None):
        self.interval, self.restart, self.device, self.replicas = interval, action == "restart", device, replicas
        self.groups = replicate_groups(parallel_dims)
        self.group_id, self.n_groups = (0, 1) if replicas is None else (replicas.replica_id, replicas.group_size)

    def _name(self, member: tuple[int, int]) -> str:
        group, rank = member
        return str(rank) if self.replicas is None else f"{rank} of replica group {group}"

    def check(self, step: int, model_parts, optimizers) -> None:
        if step % self.interval:
            return
        mine = fingerprint(model_parts, optimizers).to(self.device)  # NCCL gathers device tensors
        across = None if self.replicas is None else self.replicas.gather(mine)
        rows = torch.zeros(self.n_groups, 3, dtype=torch.int64, device=self.device)  # [present, params, state]
        for group, fp in (across or {self.group_id: mine}).items():
            rows[group, 0], rows[group, 1:] = 1, fp
        everyone = [rows]
        if sum(map(len, self.groups)) > 1:  # the job's world size; a one-rank job has no default group
            everyone = [torch.zeros_like(rows) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, rows)
        table = {(g, r): tuple(t[g, 1:].tolist()) for r, t in enumerate(everyone) for g in range(self.n_groups)
                 if t[g, 0]}
        problems = []
        for ranks in self.groups:
            members = [(g, r) for g in range(self.n_groups) for r in ranks if (g, r) in table]
            prints = {m: table[m] for m in members}
            if len(set(prints.values())) == 1:
                continue
            what = " and ".join(n for i, n in enumerate(("parameters", "optimizer state"))
                                if len({p[i] for p in prints.values()}) > 1)
            common, votes = Counter(prints.values()).most_common(1)[0]
            if 2 * votes <= len(members):  # e.g. two replicas: nothing tells which one is wrong
                problems.append(f"rank(s) {', '.join(map(self._name, members))} disagree on their {what} "
                                f"(no majority to tell the faulty one)")
                continue
            odd = [m for m in members if prints[m] != common]
            problems.append(f"rank(s) {', '.join(map(self._name, odd))} disagree with rank(s) "
                            f"{', '.join(self._name(m) for m in members if m not in odd)} on their {what}")
        if problems:
            then = ("restarting from the last checkpoint (every replica reloads the same state)" if self.restart
                    else "stopping; check those ranks' hardware, then rerun to resume from the last checkpoint")
            raise ReplicaMismatch(
                f"silent-corruption check at step {step}: data-parallel replicas differ: {'; '.join(problems)}; "
                f"{then}", restartable=self.restart)
        if self.replicas is not None:  # which groups took part, since a failed exchange narrows the check
            groups = sorted({g for g, _ in table})
            logger.info(f"silent-corruption check at step {step}: replica groups {groups} agree")
