"""The attention kernel, as a module so that context parallel can swap it for ring attention.

With `document_ids` ([B, S], equal ids = same document, documents contiguous) attention is block-causal:
a token sees the earlier tokens of its own document only. Kernels:
- CUDA: FlexAttention with a block mask (fully masked tiles are skipped).
- CPU, eager: an exact blockwise path. Queries go in blocks of DOCUMENT_BLOCK, and each block attends only
  to keys from the start of its earliest document up to its own end, so memory is O(S x (block + document
  length)) instead of O(S^2) when documents are short.
- CPU, compiled: SDPA with the full [S, S] mask (FlexAttention has no CPU backward, and the blockwise
  path's key spans depend on the data, which a full-graph compile cannot trace).
Masked scores are -inf, so a token of one document gets bit-identical outputs whatever another holds.
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.protocols.documents import document_start_index

DOCUMENT_BLOCK = 256


def document_causal_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """[B, Sq, Sk] bool: key visible to query (same document, not later). ids [B, S*]; positions [S*]."""
    return (q_ids.unsqueeze(-1) == k_ids.unsqueeze(-2)) & (q_pos.unsqueeze(-1) >= k_pos.unsqueeze(-2))


def _blockwise_document_attention(q, k, v, document_ids: torch.Tensor, enable_gqa: bool = False) -> torch.Tensor:
    seq = q.shape[2]
    starts = document_start_index(document_ids)
    pos = torch.arange(seq, device=q.device)
    out = []
    for q0 in range(0, seq, DOCUMENT_BLOCK):
        q1 = min(seq, q0 + DOCUMENT_BLOCK)
        k0 = int(starts[:, q0].min())  # the block's earliest document start over the batch
        mask = document_causal_mask(document_ids[:, q0:q1], document_ids[:, k0:q1], pos[q0:q1], pos[k0:q1])
        out.append(F.scaled_dot_product_attention(q[:, :, q0:q1], k[:, :, k0:q1], v[:, :, k0:q1],
                                                  attn_mask=mask.unsqueeze(1), enable_gqa=enable_gqa))
    return torch.cat(out, dim=2)


_compiled_flex = None
_last_block_mask: tuple = (None, None)


def _flex_document_attention(q, k, v, document_ids: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    if torch.compiler.is_compiling():
        attend = flex_attention  # inside a compiled block: compiled with the rest of the graph
    else:
        if _compiled_flex is None:  # eager: flex attention is only fast compiled
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        attend = _compiled_flex

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    global _last_block_mask
    batch, _, seq, _ = q.shape
    cached_ids, block_mask = _last_block_mask
    # Every layer of one forward gets the same document_ids tensor: build its block mask once (eager only;
    # the reference to the ids keeps their identity from being reused).
    if cached_ids is not document_ids or torch.compiler.is_compiling():
        block_mask = create_block_mask(mask_mod, batch, None, seq, seq, device=q.device)
        if not torch.compiler.is_compiling():
            _last_block_mask = (document_ids, block_mask)
    return attend(q, k, v, block_mask=block_mask)


def cpu_reads_kv_in_place(q: torch.Tensor) -> bool:
    """The CPU kernel choice for grouped-query attention: SDPA's CPU flash kernel (and its blockwise use for
    documents) with `enable_gqa`, instead of repeating the kv heads first: the same kernel on the same
    values, minus a copy of k and v forward and a reduction of their gradients backward (measured per case by
    scripts/bench_attention.py, docs/performance.md). Eager only: a compiled graph keeps the explicit repeat,
    which every backend lowers. FlexAttention is no candidate on CPU (torch has no CPU backward for it)."""
    return q.device.type == "cpu" and not torch.compiler.is_compiling()


class ScaledDotProductAttention(nn.Module):
    """Causal softmax attention over q [B, Hq, S, D] and k, v [B, Hkv, S, D], returning [B, Hq, S, D];
    block-causal within documents when `document_ids` [B, S] is given.

    Grouped-query attention (Hkv < Hq) is resolved here: query head h reads key/value head h // (Hq/Hkv).
    The kv heads are repeated explicitly rather than via `enable_gqa`, which not every fused backend accepts,
    except on CPU in eager mode (`cpu_reads_kv_in_place`), where SDPA's flash kernel reads them in place.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1 and cpu_reads_kv_in_place(q):
            if document_ids is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return _blockwise_document_attention(q, k, v, document_ids, enable_gqa=True)
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        if document_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if q.is_cuda:
            return _flex_document_attention(q, k, v, document_ids)
        if torch.compiler.is_compiling():
            # The blockwise path picks key spans from the data, which a full-graph compile cannot trace, and
            # FlexAttention has no CPU backward: a compiled CPU model uses the full [S, S] mask.
            pos = torch.arange(q.shape[2], device=q.device)
            mask = document_causal_mask(document_ids, document_ids, pos, pos).unsqueeze(1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return _blockwise_document_attention(q, k, v, document_ids)
