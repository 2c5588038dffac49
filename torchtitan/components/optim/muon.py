"""Muon for the transformer blocks' weight matrices, AdamW for every other parameter, as one optimizer.

Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", Liu et al. 2025) replaces a matrix's update
by the orthogonalised Nesterov momentum: the nearest semi-orthogonal matrix, computed approximately with a
few Newton-Schulz iterations. It is defined for 2-D weights that act as linear maps. Embeddings (a lookup
table whose rows see only their own tokens' gradients), the output head (its rows are per-token logits,
and it is trained best by Adam in every published Muon recipe), norm gains and biases (vectors: nothing to
orthogonalise) stay on AdamW.

Update size: an m x n semi-orthogonal matrix has RMS 1/sqrt(max(m, n)); scaling it by
`update_rms * sqrt(max(m, n))` makes its RMS `update_rms`. With the default 0.2, about the RMS of an AdamW
update, the AdamW learning rate and weight decay serve both parameter kinds unchanged (Liu et al.'s rule),
so one `--optimizer.lr` and one LR schedule drive the whole model. (The other common rule,
sqrt(max(1, m/n)), needs its own, larger learning rate for the matrices.)

Distributed: Newton-Schulz needs the whole matrix. A DTensor update (FSDP's Shard(0), TP's Shard(0) or
Shard(1), both on a 2-D mesh, HSDP) is orthogonalised ONCE per mesh: each matrix has an owner rank, chosen
to balance the ranks' Newton-Schulz FLOPs, which gathers the matrix, orthogonalises it and scatters the
result back as the other ranks' shards (components/optim/muon_distributed.py). The result is exact, equal to what
one process computes. Cost per step and rank: the Newton-Schulz FLOPs of its own matrices (at most 1/N of
the total plus the largest matrix's), and each row block to its owner and back, about the traffic of one
extra FSDP parameter all-gather in the momentum's dtype. See docs/optimizers.md.
"""

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.adamw import adamw

from torchtitan.components.optim.muon_distributed import DistributedOrthogonaliser
from torchtitan.tools.precision import DTYPES

# Quintic Newton-Schulz coefficients from Keller Jordan's Muon: they maximise the slope at zero, so five
# steps push every singular value into roughly [0.7, 1.2] (not exactly 1, which training does not need).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def default_is_muon_param(name: str, param: nn.Parameter) -> bool:
    """The default rule: 2-D parameters inside the model's `layers` (the transformer blocks) use Muon;
    everything else (embeddings, output head, norms, biases, anything outside the blocks) uses AdamW.

    `name` is the parameter's FQN in its model part, e.g. "layers.0.attention.wq.weight"."""
    return param.ndim == 2 and name.startswith("layers.")


def check_muon_config(cfg) -> None:
    """Muon's settings (the optimizer config section) are usable, or one ValueError naming the fix."""
    if cfg.name != "Muon":
        return
    if cfg.muon_ns_steps < 1:
        raise ValueError(f"--optimizer.muon_ns_steps must be at least 1, got {cfg.muon_ns_steps}")
    if not 0.0 <= cfg.muon_momentum < 1.0:
        raise ValueError(f"--optimizer.muon_momentum must be in [0, 1), got {cfg.muon_momentum}")
    if cfg.muon_update_rms <= 0:
        raise ValueError(f"--optimizer.muon_update_rms must be positive, got {cfg.muon_update_rms}")


def newton_schulz(matrix: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T of matrix = U S V^T: `steps` quintic Newton-Schulz iterations in `dtype`.

    The iteration works on the wide orientation (rows <= columns) so its Gram matrix X X^T is the smaller
    one; dividing by the Frobenius norm first bounds every singular value by 1, inside the iteration's
    basin. Returns `dtype`."""
    if matrix.ndim != 2:
        raise ValueError(f"Newton-Schulz orthogonalises matrices, got shape {tuple(matrix.shape)}")
    a, b, c = NS_COEFFICIENTS
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.to(dtype)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def ns_dtype_for(setting: str, device: torch.device) -> torch.dtype:
    """The Newton-Schulz dtype: "auto" is bfloat16 on CUDA (native bf16 matmuls; Muon is designed to
    tolerate it) and float32 elsewhere (CPUs without bf16 units emulate it, ~100x slower)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[setting]


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over two kinds of param groups: `use_muon=True` groups step with Muon, the others
    with torch's AdamW (its functional kernel, so they match torch.optim.AdamW exactly and keep its state
    names: step, exp_avg, exp_avg_sq). Muon's state is `momentum_buffer`.

    Muon step, per matrix W (m x n) with gradient G:
        B <- momentum * B + G
        U <- G + momentum * B            (Nesterov; B without it)
        O <- NewtonSchulz(U)             (the whole matrix, on one rank of its mesh when W is sharded)
        W <- W * (1 - lr * weight_decay) - lr * update_rms * sqrt(max(m, n)) * O
    """

    def __init__(
        self,
        param_groups: list[dict],
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        ns_dtype: str,
        update_rms: float,
        foreach: bool = False,
        fused: bool = False,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, ns_dtype=ns_dtype, update_rms=update_rms,
                        foreach=foreach, fused=fused, use_muon=False)
        super().__init__(param_groups, defaults)
        self.orthogonaliser = DistributedOrthogonaliser()
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.ndim != 2:
                        raise ValueError(f"Muon takes 2-D parameters only, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        params, updates = [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(momentum).add_(p.grad)
            params.append(p)
            updates.append(p.grad.add(buf, alpha=momentum) if group["nesterov"] else buf)
        steps, ns_dtype = group["ns_steps"], group["ns_dtype"]

        def ns(matrix: torch.Tensor) -> torch.Tensor:
            return newton_schulz(matrix, steps, ns_dtype_for(ns_dtype, matrix.device)).to(matrix.dtype)

        for p, ortho in zip(params, self.orthogonaliser(updates, steps, ns)):
            scale = group["update_rms"] * math.sqrt(max(p.shape))  # the global shape, also for a DTensor
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(ortho, alpha=-lr * scale)

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                # Where torch.optim.AdamW keeps its step counter: on the device for the fused kernel.
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if group["fused"]
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=group["foreach"], fused=group["fused"],
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )
