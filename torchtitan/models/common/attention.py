"""The attention kernel, as a module so that context parallel can swap it for ring attention.

With `document_ids` ([B, S], equal ids = same document, documents contiguous) attention is block-causal:
a token sees the earlier tokens of its own document only. Kernels:
- CUDA: FlexAttention with a block mask (fully masked tiles are skipped).
- CPU, eager: an exact blockwise path through SDPA's CPU flash kernel (cpu_flash_block_attention). Queries
  go in blocks of DOCUMENT_BLOCK, and each block attends only to keys from the start of its earliest document
  up to its own end, so memory is O(S x (block + document length)) instead of O(S^2) when documents are short
  (measured 1.15x / 2.18x faster fwd+bwd at 2048 / 8192 tokens than one SDPA call per block, bit-identical,
  and it saves what the memory estimator's formula counts: docs/performance.md).
- CPU, compiled (or DTensor inputs): SDPA with the full [S, S] mask (FlexAttention has no CPU backward, and
  the blockwise path's key spans depend on the data, which a full-graph compile cannot trace).
Masked scores are -inf, so a token of one document gets bit-identical outputs whatever another holds.

Attention kinds are data the kernel reads, for any family:
- `window` (a constructor argument, None = full): query i sees keys i-window+1 .. i only (a sliding window,
  transformers' `sliding_window` convention).
- `sinks` (a forward argument, [Hq], a parameter of the calling attention module so that TP shards it with
  its heads): a learned logit per head added to the softmax denominator with a zero value, so a query may
  attend "nowhere" (GPT-OSS). Merged through the log-sum-exp: out' = out * sigmoid(lse - sink).
A kernel with either runs, on CPU in eager mode, the CPU flash blocks (as documents do), else
`blockwise_attention`, an exact flash-style loop in plain torch (fp32, any device):
query blocks of DOCUMENT_BLOCK read only the key span their window (and, eager, their documents) can reach,
so no [S, S] mask or score matrix exists, only O(block x span) per step; backward recomputes each block's
probabilities from the saved (out, lse), like context parallel's ring attention, whose block math it shares.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.distributed.context_parallel import (
    _block_backward,
    _block_forward,
    fold_sinks_,
    sink_grad,
    window_block_state,
    window_causal_mask,
)
from torchtitan.models.common.cpu_flash_blocks import FlashBlockAttention
from torchtitan.protocols.documents import document_start_index

DOCUMENT_BLOCK = 256


def document_causal_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """[B, Sq, Sk] bool: key visible to query (same document, not later). ids [B, S*]; positions [S*]."""
    return (q_ids.unsqueeze(-1) == k_ids.unsqueeze(-2)) & (q_pos.unsqueeze(-1) >= k_pos.unsqueeze(-2))


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


def check_window(window: int | None) -> None:
    """A sliding window counts keys, the query's own included: it must be a positive integer (or None)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"sliding window {window!r}: a window counts the keys a query sees, itself included, so it must be "
            f"an integer >= 1; set sliding_window to 1 or more (e.g. GPT-OSS's 128)"
        )


def _spans(seq: int, block: int, window: int | None, document_ids: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(q0, q1, k0) per query block [q0, q1): its keys are [k0, q1). Key spans shrink to the window and, in
    eager mode, to the block's earliest document start (data-dependent, so a compiled graph keeps the window's
    span and masks)."""
    starts = None
    if document_ids is not None and not torch.compiler.is_compiling():
        starts = document_start_index(document_ids)
    out = []
    for q0 in range(0, seq, block):
        q1 = min(seq, q0 + block)
        k0 = 0 if window is None else max(0, q0 - window + 1)
        if starts is not None:
            k0 = max(k0, int(starts[:, q0].min()))
        out.append((q0, q1, k0))
    return out


def _span_mask(q0: int, q1: int, k0: int, window: int | None, document_ids: torch.Tensor | None, device):
    """[B or 1, 1, 1, q1-q0, q1-k0] bool visibility of a span, or None when every pair is visible. Built when
    needed (forward and again in backward), never kept: a full-attention layer's masks would add up to S^2."""
    mask = None
    if window_block_state(q0, k0, q1 - q0, q1 - k0, window) != "full":
        mask = window_causal_mask(torch.arange(q0, q1, device=device), torch.arange(k0, q1, device=device),
                                  window)[None, None, None]
    if document_ids is not None:
        same = (document_ids[:, q0:q1].unsqueeze(-1) == document_ids[:, k0:q1].unsqueeze(-2))[:, None, None]
        mask = same if mask is None else same & mask
    return mask


class _BlockwiseAttention(torch.autograd.Function):
    """Exact causal attention with a window, documents and sinks, in the 5-D GQA layout of context parallel
    (q [B, Hkv, G, S, D], k/v [B, Hkv, 1, S, D]); fp32 inside, the inputs' dtype outside."""

    @staticmethod
    def forward(ctx, q, k, v, document_ids, window, sinks, block):  # type: ignore[override]
        batch, hq, seq, dim = q.shape
        hkv = k.shape[1]
        q5 = q.float().reshape(batch, hkv, hq // hkv, seq, dim)
        k5, v5 = k.float().unsqueeze(2), v.float().unsqueeze(2)
        scale = dim**-0.5
        spans = _spans(seq, block, window, document_ids)
        out = q5.new_empty(*q5.shape[:-1], v.shape[-1])  # values may be narrower than q/k heads (MLA)
        lse = torch.empty(q5.shape[:-1], dtype=torch.float32, device=q.device)
        for q0, q1, k0 in spans:
            mask = _span_mask(q0, q1, k0, window, document_ids, q.device)
            o, l = _block_forward(q5[..., q0:q1, :], k5[..., k0:q1, :], v5[..., k0:q1, :], scale, mask)
            out[..., q0:q1, :], lse[..., q0:q1] = o, l
        if sinks is not None:
            lse = fold_sinks_(out, lse, sinks)
        out_q = out.reshape(batch, hq, seq, v.shape[-1]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out_q, lse, sinks, document_ids)
        ctx.spans, ctx.window = spans, window
        return out_q

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, sinks, document_ids = ctx.saved_tensors
        batch, hq, seq, dim = q.shape
        hkv = k.shape[1]
        shape5, shape5_v = (batch, hkv, hq // hkv, seq, dim), (batch, hkv, hq // hkv, seq, v.shape[-1])
        q5, do5 = q.float().reshape(shape5), dout.float().reshape(shape5_v)
        k5, v5 = k.float().unsqueeze(2), v.float().unsqueeze(2)
        delta = (do5 * out.float().reshape(shape5_v)).sum(dim=-1)
        dq5, dk5, dv5 = torch.zeros_like(q5), torch.zeros_like(k5), torch.zeros_like(v5)
        scale = dim**-0.5
        for q0, q1, k0 in ctx.spans:
            mask = _span_mask(q0, q1, k0, ctx.window, document_ids, q.device)
            dq, dk, dv = _block_backward(q5[..., q0:q1, :], k5[..., k0:q1, :], v5[..., k0:q1, :],
                                         do5[..., q0:q1, :], lse[..., q0:q1], delta[..., q0:q1], scale, mask)
            dq5[..., q0:q1, :] += dq
            dk5[..., k0:q1, :] += dk
            dv5[..., k0:q1, :] += dv
        dsinks = sink_grad(lse, delta, sinks) if sinks is not None else None
        return (dq5.reshape(q.shape).to(q.dtype), dk5.squeeze(2).to(k.dtype), dv5.squeeze(2).to(v.dtype),
                None, None, dsinks, None)


def cpu_flash_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
    window: int | None = None, sinks: torch.Tensor | None = None, block: int = DOCUMENT_BLOCK,
) -> torch.Tensor:
    """blockwise_attention's spans and math through SDPA's CPU flash kernel (models/common/cpu_flash_blocks.py):
    eager CPU only (its key spans may depend on the documents, and it calls the kernel's aten ops)."""
    check_window(window)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must hold one logit per query head, shape ({q.shape[1]},), got {tuple(sinks.shape)}")
    return FlashBlockAttention.apply(q, k, v, document_ids, window, sinks, _spans(q.shape[2], block, window,
                                                                                   document_ids))


def _is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def blockwise_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
    window: int | None = None, sinks: torch.Tensor | None = None, block: int = DOCUMENT_BLOCK,
) -> torch.Tensor:
    """Causal attention of q [B, Hq, S, D] over k, v [B, Hkv, S, D] with an optional sliding `window`,
    `document_ids` [B, S] and per-head `sinks` [Hq]; exact (see the module docstring)."""
    check_window(window)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must hold one logit per query head, shape ({q.shape[1]},), got {tuple(sinks.shape)}")
    return _BlockwiseAttention.apply(q, k, v, document_ids, window, sinks, block)


class ScaledDotProductAttention(nn.Module):
    """Causal softmax attention over q [B, Hq, S, D] and k, v [B, Hkv, S, D], returning [B, Hq, S, D];
    block-causal within documents when `document_ids` [B, S] is given; of the attention kind given by
    `window` and the `sinks` of each call (see the module docstring).

    Grouped-query attention (Hkv < Hq) is resolved here: query head h reads key/value head h // (Hq/Hkv).
    The kv heads are repeated explicitly rather than via `enable_gqa`, which not every fused backend accepts
    (on CPU `enable_gqa` was measured, docs/performance.md, and not adopted: see there).
    """

    KINDS = frozenset({"window", "sinks"})
    """The attention kinds this kernel computes (check_attention_kernels)."""

    def __init__(self, window: int | None = None):
        super().__init__()
        check_window(window)
        self.window = window

    def extra_repr(self) -> str:
        return f"window={self.window}" if self.window is not None else ""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        masked = self.window is not None or sinks is not None or document_ids is not None
        if masked and q.device.type == "cpu" and not torch.compiler.is_compiling() and not _is_dtensor(q):
            if q.shape[-1] == v.shape[-1]:  # the flash kernel takes one head size for q, k and v
                # Windows, sinks, documents and their mixes: their key spans through SDPA's CPU flash kernel,
                # the fastest exact kernel measured for each (docs/performance.md: 1.14-3.0x at 2048 and 8192).
                return cpu_flash_block_attention(q, k, v, document_ids, self.window, sinks, block=DOCUMENT_BLOCK)
            return blockwise_attention(q, k, v, document_ids, self.window, sinks)  # e.g. MLA's narrower values
        if self.window is not None or sinks is not None:
            return blockwise_attention(q, k, v, document_ids, self.window, sinks)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        if document_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if q.is_cuda:
            return _flex_document_attention(q, k, v, document_ids)
        # Compiled (or DTensor) on CPU: the blockwise path picks key spans from the data, which a full-graph
        # compile cannot trace, and FlexAttention has no CPU backward, so the full [S, S] mask.
        pos = torch.arange(q.shape[2], device=q.device)
        mask = document_causal_mask(document_ids, document_ids, pos, pos).unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class AttentionSinks(nn.Module):
    """One learned sink logit per query head (`weight` [n_heads]), held by the attention module that calls the
    kernel (a kernel may be swapped, e.g. for ring attention; the parameter stays). Tensor parallel shards it
    with the heads (distributed/parallelize.py's HEAD_PARAMS); calling it gives this rank's heads' logits."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def init_weights(self, std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self) -> torch.Tensor:
        w = self.weight
        return w.to_local() if isinstance(w, DTensor) else w


def kinds_needed(attention: nn.Module) -> set[str]:
    """The attention kinds an attention module (one with an `inner_attention` kernel) asks of its kernel."""
    needed = set()
    if getattr(attention.inner_attention, "window", None) is not None:
        needed.add("window")
    if isinstance(getattr(attention, "sinks", None), AttentionSinks):
        needed.add("sinks")
    return needed


def check_attention_kernels(model: nn.Module, kernel: type | None = None, why: str = "") -> None:
    """Refuses, in one line, a model whose attention asks a kind (window, sinks) of a kernel that cannot compute
    it. `kernel`: the kernel class the job's layout swaps in (e.g. context parallel's), else each module's own;
    a kernel declares what it computes in `KINDS`."""
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "inner_attention", None), nn.Module):
            continue
        cls = kernel or type(module.inner_attention)
        missing = sorted(kinds_needed(module) - getattr(cls, "KINDS", frozenset()))
        if missing:
            raise ValueError(
                f"{name}: the attention kernel {cls.__name__}{why} cannot compute {' / '.join(missing)}, which this "
                f"model's attention needs; use a layout whose kernel takes them (the plain kernel and ring context "
                f"parallel do) or a model without them"
            )
