"""Optimisation: what turns gradients into the next weights, and how fast.

    optimizer.py        the optimizer builder (AdamW, Muon) and OptimizersContainer (one per model part)
    lr_scheduler.py     the LR schedule: warmup, stable, decay (linear / cosine / sqrt), per model part
    muon.py             Muon: Newton-Schulz orthogonalised momentum for matrices, AdamW for the rest
    muon_distributed.py Muon's step under FSDP: each matrix orthogonalised once, on its owner rank
"""
