"""Routed experts between our stacked weights and the per-expert tensors of Hugging Face checkpoints.

Ours: `{prefix}.w1` [E, hidden, dim] (likewise w3; w2 [E, dim, hidden]). HF (DeepSeek, Qwen3-MoE
safetensors): `{hf_prefix}.{e}.gate_proj.weight` [hidden, dim], `up_proj` (w3), `down_proj` (w2).
"""

import re

import torch

EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HF_EXPERT = re.compile(r"(.+)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def unstack_experts(hf_prefix: str, ours: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One stacked weight (`ours` is w1/w2/w3) -> its per-expert HF tensors."""
    return {f"{hf_prefix}.{e}.{EXPERT_PROJ[ours]}.weight": w[e] for e in range(w.shape[0])}


def stack_experts(hf: dict[str, torch.Tensor]) -> dict[tuple[str, str], torch.Tensor]:
    """Every per-expert HF tensor of `hf` grouped into stacked weights: (hf prefix, w1/w2/w3) -> [E, ...].
    Refuses a layer whose expert indices are not exactly 0..E-1."""
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    by_proj = {v: k for k, v in EXPERT_PROJ.items()}
    for key, t in hf.items():
        m = _HF_EXPERT.fullmatch(key)
        if m:
            groups.setdefault((m.group(1), by_proj[m.group(3)]), {})[int(m.group(2))] = t
    out = {}
    for (prefix, ours), per in groups.items():
        if sorted(per) != list(range(len(per))):
            raise ValueError(f"{prefix}: expert indices {sorted(per)[:8]}... are not 0..{len(per) - 1}; incomplete checkpoint?")
        out[(prefix, ours)] = torch.stack([per[e] for e in range(len(per))])
    return out


def is_expert_key(key: str) -> bool:
    return _HF_EXPERT.fullmatch(key) is not None
