"""Fault-tolerant data-parallel replica groups with torchft (--fault_tolerance.enable).

Each replica group is a job of its own (one torchrun, any layout inside); `group_size` groups train the same
model on disjoint shards of the data and average their gradients every step through torchft's Manager, which
forms a quorum of the live groups at a lighthouse (`torchft_lighthouse`, address in TORCHFT_LIGHTHOUSE). When a
group dies, the others drop it at the next quorum and train on without a restart (the step in which it died is
not committed anywhere); when a group (re)joins, it copies the whole training state (weights, optimizer, LR
schedule, data position, step, RNG) from a live peer before its first step.

Each step: `start_step` (quorum; may heal this group) ─▶ forward/backward ─▶ `average_gradients` ─▶
`should_commit` (the optimizer steps only when every rank of the group says the step was clean).
"""

from datetime import timedelta

import torch
import torch.nn as nn

from torchtitan.config import ConfigError
from torchtitan.config.job_config import FaultTolerance
from torchtitan.tools.logging import logger


def data_coordinate(ft: FaultTolerance, dp_rank: int, dp_degree: int, global_batch_size: int) -> tuple[int, int, int]:
    """This rank's shard of the data among all replica groups (group-major, so groups read disjoint samples)
    and the batch of the whole job per step: (dp_rank, dp_degree, global_batch_size)."""
    if not ft.enable:
        return dp_rank, dp_degree, global_batch_size
    return ft.replica_id * dp_degree + dp_rank, ft.group_size * dp_degree, ft.group_size * global_batch_size


class Replicas:
    """This replica group's torchft Manager; `states` are the checkpoint's Stateful objects (what a
    rejoining group copies from a live peer)."""

    def __init__(self, ft: FaultTolerance, states: dict, rank: int, world_size: int, device: torch.device):
        try:
            import torchft
        except ImportError as e:
            raise ConfigError("--fault_tolerance.enable needs torchft: pip install torchft==0.2.0") from e
        if not 0 <= ft.replica_id < ft.group_size:
            raise ConfigError(
                f"--fault_tolerance.replica_id {ft.replica_id} is outside 0..{ft.group_size - 1} "
                f"(--fault_tolerance.group_size {ft.group_size})"
            )
        self.states = states
        self.replica_id, self.group_size = ft.replica_id, ft.group_size
        self.healed_at: int | None = None  # the step this group's state was copied at (for logs and tests)
        timeout = timedelta(seconds=ft.timeout_seconds)
        pg = torchft.ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else torchft.ProcessGroupGloo(
            timeout=timeout
        )
        self.manager = torchft.Manager(
            pg=pg,
            min_replica_size=ft.min_replica_size,
            load_state_dict=self._load,
            state_dict=self._save,
            replica_id=f"torchtitan_{ft.replica_id}",
            rank=rank,
            world_size=world_size,
            use_async_quorum=False,  # a heal lands before the step's data is read
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
        )

    def _save(self) -> dict:
        return {k: v.state_dict() for k, v in self.states.items()}

    def _load(self, sd: dict) -> None:
        for k, v in self.states.items():
            v.load_state_dict(sd[k])
        self.healed_at = self.states["train_state"].step
        logger.warning(f"Fault tolerance: copied the training state of a live replica group at step {self.healed_at}")

    def start_step(self) -> bool:
        """Joins this step's quorum; True when this group's state was just replaced by a peer's (the caller
        rebuilds its data iterator)."""
        healed = self.healed_at
        self.manager.start_quorum()
        return self.healed_at != healed

    def average_gradients(self, model_parts: list[nn.Module]) -> None:
        grads = [p.grad for m in model_parts for p in m.parameters() if p.grad is not None]
        works = [self.manager.allreduce(g.to_local() if hasattr(g, "to_local") else g) for g in grads]
        for w in works:
            w.wait()

    def gather(self, t: torch.Tensor) -> dict[int, torch.Tensor] | None:
        """`t` of the same rank in every replica group of this step's quorum, by replica id; None when a group
        failed during the exchange (the result may be torn; the caller skips what needed it). torchft's Manager
        offers only an allreduce across groups, so each group adds its row (its replica id + 1, then `t`) into
        its own slot of a zero table: an exact all-gather for integer tensors. Called by every group at the same
        step, after `should_commit`, within that step's quorum."""
        from torch.distributed import ReduceOp

        me = self.manager.participating_rank()
        table = torch.zeros(self.manager.num_participants(), 1 + t.numel(), dtype=t.dtype, device=t.device)
        if me is not None:
            table[me, 0] = self.replica_id + 1
            table[me, 1:] = t.flatten()
        self.manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return None
        return {int(row[0]) - 1: row[1:].view_as(t) for row in table if row[0] > 0}

    def should_commit(self, step: int) -> bool:
        ok = self.manager.should_commit()
        if not ok:
            logger.warning(
                f"Fault tolerance: step {step} is not committed (a replica group failed during it); "
                f"{self.manager.num_participants()} group(s) in the quorum"
            )
        return ok

    def close(self) -> None:
        self.manager.shutdown(wait=False)
