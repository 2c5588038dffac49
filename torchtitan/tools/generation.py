"""Autoregressive sampling from a model: greedy, or temperature with optional top-k."""

import torch
import torch.nn as nn


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    *,
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The new tokens after `prompt`. temperature 0 = greedy (argmax); otherwise logits / temperature, keeping
    the top_k most likely tokens when top_k > 0. Stops after eos_id. Recomputes the whole window each token (no
    KV cache): meant for checking a checkpoint, not for serving."""
    if temperature < 0 or top_k < 0:
        raise ValueError(f"temperature ({temperature}) and top_k ({top_k}) must be >= 0")
    tokens = list(prompt)
    new = []
    model.eval()
    for _ in range(max_new_tokens):
        window = torch.tensor(tokens[-max_seq_len:], dtype=torch.long)[None]
        out = model(window)  # logits, or a ModelOutput (MoE, MTP models) holding them
        logits = getattr(out, "logits", out)[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        tokens.append(nxt)
        new.append(nxt)
        if nxt == eos_id:
            break
    return new
