"""Parameter counts, used for FLOP accounting and the start-up summary."""

import torch.nn as nn


def count_params(model: nn.Module) -> tuple[int, int]:
    """(total, non-embedding) parameter counts. Embedding tables are lookups, not matmuls, so they carry no
    6N training FLOPs; the output projection is a matmul and counts."""
    total = sum(p.numel() for p in model.parameters())
    embedding = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    return total, total - embedding
