"""The parallel layout: degrees per named dimension, their validation, and the one world DeviceMesh.

Mesh dimension order (outermost first): pp, dp_replicate, dp_shard, cp, tp. TP is innermost so its
frequent collectives stay within a node; PP outermost because its point-to-point traffic is lightest.
Flattened views the trainer uses:
  dp          = dp_replicate x dp_shard        data loading: ranks that see different samples
  dp_shard_cp = dp_shard x cp                  FSDP shards parameters over these
  dp_cp       = dp_replicate x dp_shard x cp   loss and token-count reduction
  batch       = every dimension but pp         ranks that route different tokens (MoE load sums)

Expert parallel (ep > 1) borrows its ranks from those holding different tokens, as upstream torchtitan
does: dp_shard is split into dp_shard_mod_ep (outer) x dp_shard_in_ep (inner), and
  ep          = dp_shard_in_ep x cp x tp       the routed experts are split over these (all-to-all)
  dp_shard_mod_ep (x dp_replicate)             FSDP shards each rank's experts over these
The dense parameters are still sharded over dp_shard_cp (= dp_shard_mod_ep x dp_shard_in_ep x cp).

With ep 1 under tensor parallel, the tp ranks split every routed expert by its hidden units instead (expert
tensor parallel, `etp` = tp): no mesh dimension of its own, the experts live on the tp mesh.
"""

import warnings
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the numbers and a layout that would fit."""


# The config option of each mesh dimension's degree, for messages.
_DEGREE_NAMES = {
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "cp": "context_parallel_degree",
    "tp": "tensor_parallel_degree",
    "pp": "pipeline_parallel_degree",
    "ep": "expert_parallel_degree",
    "etp": "tensor_parallel_degree",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    _flat: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        keys = {"dp_replicate": "data_parallel_replicate_degree", "cp": "context_parallel_degree",
                "tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree"}
        for name, key in keys.items():
            if getattr(self, name) < 1:
                raise LayoutError(f"--parallelism.{key} {getattr(self, name)} must be >= 1")
        shard_auto = self.dp_shard in (-1, 0)  # the world decides dp_shard, so more ranks can fit a degree
        if self.dp_shard == -1 or self.dp_shard == 0:
            others = self.dp_replicate * self.cp * self.tp * self.pp
            if self.world_size % others:
                raise LayoutError(
                    f"world size {self.world_size} is not divisible by replicate x cp x tp x pp = {others}; "
                    f"choose degrees whose product divides {self.world_size}"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise LayoutError(f"data_parallel_shard_degree={self.dp_shard} must be >= 1 or -1")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise LayoutError(
                f"parallel degrees multiply to {product} (replicate {self.dp_replicate} x shard {self.dp_shard} "
                f"x cp {self.cp} x tp {self.tp} x pp {self.pp}) but the world size is {self.world_size}; "
                f"set --parallelism.data_parallel_shard_degree -1 to use the ranks left over"
            )
        if self.ep < 1:
            raise LayoutError(f"--parallelism.expert_parallel_degree {self.ep} must be >= 1")
        token_ranks = self.dp_shard * self.cp * self.tp
        if self.ep > 1 and (self.ep % (self.cp * self.tp) or token_ranks % self.ep):
            fits = [d for d in _divisors(token_ranks) if d % (self.cp * self.tp) == 0 and d > 1]
            raise LayoutError(
                f"expert_parallel_degree {self.ep} must divide data_parallel_shard x context_parallel x "
                f"tensor_parallel = {token_ranks} and be a multiple of context_parallel x tensor_parallel = "
                f"{self.cp * self.tp}; degrees that fit: {fits}" + self._ep_world_hint(shard_auto)
            )

    def _ep_world_hint(self, shard_auto: bool) -> str:
        """What to do when the world is what is too small for the expert-parallel degree (e.g. an EP 2 recipe
        started on one process): the world size that fits it, and how to turn EP off."""
        if not shard_auto or self.ep % (self.cp * self.tp):
            return ""
        world = self.ep * self.pp * self.dp_replicate  # the smallest whose dp_shard x cp x tp ep divides
        return (f"; to keep expert_parallel_degree {self.ep}, run a multiple of {world} processes "
                f"(NGPU={world} ./run_train.sh), "
                f"or set --parallelism.expert_parallel_degree 1 (no expert parallel) for {self.world_size} "
                f"process{'es' if self.world_size > 1 else ''}")

    # ---- derived degrees -------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model: sharding over dp_shard x cp, or replicate-only data parallel."""
        return self.dp_shard > 1 or self.cp > 1 or self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp(self) -> int:
        """Expert tensor parallel degree: the tp ranks split each routed expert's hidden units when expert
        parallel is off (ep 1); under EP the experts are split over ep (which includes tp) instead."""
        return self.tp if self.ep == 1 else 1

    @property
    def dp_shard_in_ep(self) -> int:
        return self.ep // (self.cp * self.tp) if self.ep > 1 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.dp_shard_in_ep

    # ---- validation against the model and data -----------------------------------------------------------
    def check_model(self, divisible_by: dict[str, dict[str, int]]) -> None:
        """The model's shapes that a parallel degree splits must divide by it: `divisible_by` maps a mesh
        dimension (e.g. "tp") to {field: value} (the model args' `divisible_by()`). A model that declares
        "ep" has routed experts; under tensor parallel they are split over ep (a multiple of tp) or, with ep 1,
        each over the tp ranks by its hidden units: "etp" lists the hidden sizes that tp must then divide."""
        if self.ep > 1 and "ep" not in divisible_by:
            raise LayoutError(
                f"expert_parallel_degree {self.ep} needs a model with routed experts (e.g. deepseek_v3); this "
                f"model has none: set --parallelism.expert_parallel_degree 1"
            )
        for dim, shape in divisible_by.items():
            degree = getattr(self, dim)
            if degree <= 1:
                continue
            for what, n in shape.items():
                if n % degree:
                    fits = [d for d in _divisors(n) if d <= self.world_size and self.world_size % d == 0]
                    hint = "" if dim != "etp" else (
                        f" (with expert_parallel_degree 1, tensor parallel splits each expert's hidden units); or "
                        f"split the experts over ranks instead: --parallelism.expert_parallel_degree {self.tp}")
                    raise LayoutError(
                        f"{_DEGREE_NAMES.get(dim, dim)} {degree} does not divide the model's {what} ({n}); "
                        f"degrees that fit: {fits}{hint}"
                    )

    def check_batch(self, *, seq_len: int, global_batch_size: int, local_batch_size: int) -> int:
        """Validates sequence/batch divisibility; returns the gradient-accumulation steps."""
        # CP cuts each sequence into 2 x cp chunks (two per cp rank, for causal load balance); sequence
        # parallel then splits a rank's slice over the tp ranks.
        factors = ([f"2 x context_parallel_degree {self.cp}"] if self.cp > 1 else []) + (
            [f"tensor_parallel_degree {self.tp}"] if self.tp > 1 else []
        )
        seq_div = (2 * self.cp if self.cp > 1 else 1) * self.tp
        if seq_len % seq_div:
            lower = seq_len // seq_div * seq_div
            fits = f"{lower} or {lower + seq_div}" if lower else f"{seq_div}"
            raise LayoutError(
                f"seq_len {seq_len} must be divisible by {seq_div} = {' x '.join(factors)}; "
                f"e.g. --training.seq_len {fits}"
            )
        per_step = local_batch_size * self.dp
        if global_batch_size % per_step:
            near = max(per_step, global_batch_size // per_step * per_step)
            raise LayoutError(
                f"global_batch_size {global_batch_size} is not a multiple of local_batch_size {local_batch_size} x "
                f"data-parallel degree {self.dp} = {per_step}; e.g. --training.global_batch_size {near}"
            )
        return global_batch_size // per_step

    # ---- the mesh --------------------------------------------------------------------------------------
    _FLAT = {
        "dp": ("dp_replicate", "dp_shard"),
        "dp_shard_cp": ("dp_shard", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard", "cp"),
        "batch": ("dp_replicate", "dp_shard", "cp", "tp"),
    }
    # With expert parallel, dp_shard is two mesh dimensions (see the module docstring).
    _FLAT_EP = {
        "dp": ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"),
        "dp_shard_cp": ("dp_shard_mod_ep", "dp_shard_in_ep", "cp"),
        "dp_cp": ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp"),
        "batch": ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp"),
        "ep": ("dp_shard_in_ep", "cp", "tp"),
    }

    def _dims(self) -> dict[str, tuple[int, bool]]:
        """Mesh dimension -> (size, whether the mesh holds it), outermost first."""
        shard = {"dp_shard": (self.dp_shard, self.dp_shard > 1 or self.dp_replicate > 1)}
        if self.ep > 1:
            shard = {
                "dp_shard_mod_ep": (self.dp_shard_mod_ep, self.dp_shard_mod_ep > 1 or self.dp_replicate > 1),
                "dp_shard_in_ep": (self.dp_shard_in_ep, self.dp_shard_in_ep > 1),
            }
        return {
            "pp": (self.pp, self.pp > 1),
            "dp_replicate": (self.dp_replicate, self.dp_replicate > 1),
            **shard,
            "cp": (self.cp, self.cp > 1),
            "tp": (self.tp, self.tp > 1),
        }

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One world mesh over the dimensions in use, plus the flattened views.

        dp_shard stays in the mesh (possibly of size 1) whenever dp_replicate is used, so that HSDP and
        replicate-only data parallel both get a 2-D (replicate, shard) mesh."""
        dims = self._dims()
        names = tuple(n for n, (_, on) in dims.items() if on) or ("dp_shard",)
        shape = tuple(dims[n][0] if n in dims else self.dp_shard for n in names)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            self._flat = {}
            for flat, parts in (self._FLAT_EP if self.ep > 1 else self._FLAT).items():
                present = tuple(p for p in parts if p in names)
                if present:
                    self._flat[flat] = mesh[present]._flatten(flat)
        self._mesh = mesh
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("build_mesh() has not been called")
        return self._mesh

    def submesh(self, name: str) -> DeviceMesh | None:
        """The mesh of a named or flattened dimension; None when its degree is 1 (nothing to communicate)."""
        mesh = self.world_mesh
        flat = self._FLAT_EP if self.ep > 1 else self._FLAT
        m = self._flat.get(name) if name in flat else (mesh[name] if name in mesh.mesh_dim_names else None)
        return m if m is not None and m.size() > 1 else None

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over: 1-D (dp_shard x cp) for FSDP, 2-D (replicate, dp_shard x cp) for HSDP
        and for replicate-only data parallel (shard size 1); None without data parallelism or cp."""
        if self.dp_replicate > 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return self.world_mesh[("dp_replicate", "dp_shard_cp")]
        return self.submesh("dp_shard_cp")

    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards each rank's routed experts over under expert parallel: dp_shard_mod_ep
        (2-D with dp_replicate for HSDP); None when no rank shares this rank's experts."""
        if self.dp_replicate > 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return self.world_mesh[("dp_replicate", "dp_shard_mod_ep")]
        return self.submesh("dp_shard_mod_ep")

    def coordinate(self, name: str) -> tuple[int, int]:
        """(rank within, size of) a named or flattened dimension; (0, 1) when the dimension is absent."""
        m = self.submesh(name) if self._mesh is not None else None
        return (0, 1) if m is None else (m.get_local_rank(), m.size())


def parallel_dims_from_config(p, world_size: int) -> ParallelDims:
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        world_size=world_size,
        ep=p.expert_parallel_degree,
    )


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
