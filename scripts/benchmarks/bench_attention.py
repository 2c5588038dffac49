"""Attention kernels on CPU, forward + backward, per case the model meets: plain causal, document masking,
sliding window, sinks, documents with a window.

    python scripts/benchmarks/bench_attention.py [--seqs 2048,8192]
        [--cases causal,documents,window,sinks,window+sinks,documents+window]
        [--reps 2] [--dtype bfloat16] [--window 128]

Shape: Llama 3.2 1B's attention (16 query heads, 8 kv heads, head dim 128), batch 1. Document masking:
documents of 64-1024 tokens (seeded), as packed pretraining data has. Kernels (each exact: softmax over the
same visible keys; the table gives the largest difference of the output and of dq against the first kernel):
- `sdpa, kv repeated`: `F.scaled_dot_product_attention` (its CPU flash-attention kernel) on kv heads repeated
  to the query heads (the shared attention path for plain causal attention); documents: the blockwise path
  the model ran before it took the flash blocks (query blocks of 256 against the keys of their documents
  only, each an SDPA call with a mask, kv heads repeated: `blockwise_sdpa` below);
- `sdpa, enable_gqa`: causal only: the same kernel reading the kv heads in place (SDPA's `enable_gqa`), no
  repeat (the blockwise document path keeps repeating them: with `enable_gqa` it measured 1.00x, so the model
  has no such option);
- `sdpa, full mask`: documents only: one SDPA call with the whole [S, S] block-causal mask;
- `sdpa math`: SDPA's reference (math) backend, seq 2048 only (its float32 [S, S] scores per head at 8192
  would be 4 GiB);
- window / sinks / window+sinks (a sliding window of `--window` keys, GPT-OSS's 128; one learned sink logit
  per head): `plain-torch blockwise (before)` = `attention.blockwise_attention`, the exact span loop in float32
  plain torch, which the kernel ran for these kinds before; `cpu flash blocks` = the same spans through SDPA's
  CPU flash kernel and its backward (`models/common/cpu_flash_blocks.py`, what the kernel picks on CPU in
  eager mode for windows, sinks, documents and documents with a window); causal: `cpu flash blocks` as a
  candidate (blocks of 256 against every earlier key);
- FlexAttention compiled on CPU is not a candidate: torch 2.13 has no CPU backward for it.
Kernels alternate rep by rep after a warm-up call each; medians; GFLOP/s counts the visible (causal or
block-causal) part of the score matrix only, 4 x S_visible x D per head forward and 2.5x that backward.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an installed copy

from torchtitan.models.common import attention  # noqa: E402
from torchtitan.protocols.documents import document_start_index  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def documents(seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < seq:
        lengths.append(int(torch.randint(64, 1025, (1,), generator=g)))
        total += lengths[-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq]
    return ids.unsqueeze(0)


def repeated(k, v):
    n_rep = HEADS // KV_HEADS
    return k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)


def blockwise_sdpa(q, k, v, document_ids: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The CPU document path before the flash blocks: per query block, one SDPA call with a boolean mask over
    the keys from the block's earliest document start (kv heads repeated by the caller)."""
    seq = q.shape[2]
    starts = document_start_index(document_ids)
    pos = torch.arange(seq)
    out = []
    for q0 in range(0, seq, block):
        q1 = min(seq, q0 + block)
        k0 = int(starts[:, q0].min())
        mask = attention.document_causal_mask(document_ids[:, q0:q1], document_ids[:, k0:q1], pos[q0:q1], pos[k0:q1])
        out.append(F.scaled_dot_product_attention(q[:, :, q0:q1], k[:, :, k0:q1], v[:, :, k0:q1],
                                                  attn_mask=mask.unsqueeze(1)))
    return torch.cat(out, dim=2)


def kernels(case: str, doc_ids, window: int, sinks):
    """name -> fn(q, k, v) for this case (doc_ids None: no documents)."""
    if case in ("window", "sinks", "window+sinks", "documents+window"):
        w = window if "window" in case else None
        s = sinks if "sinks" in case else None
        return {"plain-torch blockwise, fp32 inside (before)": lambda q, k, v: attention.blockwise_attention(
                    q, k, v, doc_ids, w, s),
                "cpu flash blocks": lambda q, k, v: attention.cpu_flash_block_attention(q, k, v, doc_ids, w, s)}
    if doc_ids is None:
        def before(q, k, v):
            return F.scaled_dot_product_attention(q, *repeated(k, v), is_causal=True)

        def gqa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def math(q, k, v):
            with sdpa_kernel([SDPBackend.MATH]):
                return F.scaled_dot_product_attention(q, *repeated(k, v), is_causal=True)

        def flash_blocks(q, k, v):
            return attention.cpu_flash_block_attention(q, k, v)

        return {"sdpa, kv repeated (before)": before, "cpu flash blocks": flash_blocks, "sdpa, enable_gqa": gqa,
                "sdpa math": math}

    pos = torch.arange(doc_ids.shape[1])
    mask = attention.document_causal_mask(doc_ids, doc_ids, pos, pos).unsqueeze(1)

    def blockwise_before(q, k, v):
        return blockwise_sdpa(q, *repeated(k, v), doc_ids)

    def full_mask(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def math(q, k, v):
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, *repeated(k, v), attn_mask=mask)

    def flash_blocks(q, k, v):
        return attention.cpu_flash_block_attention(q, k, v, doc_ids)

    return {"blockwise sdpa, kv repeated (before)": blockwise_before, "cpu flash blocks": flash_blocks,
            "sdpa, full mask, enable_gqa": full_mask, "sdpa math": math}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="2048,8192")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--cases", default="causal,documents,window,sinks,window+sinks,documents+window")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--skip-8192", default="",
                   help="kernel names (comma-separated substrings) not run above 2048 tokens, to keep a run short")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    print(f"{HEADS} heads, {KV_HEADS} kv heads, head dim {HEAD_DIM}, batch 1, {a.dtype}, forward + backward; "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; load average at start "
          f"{os.getloadavg()[0]:.2f}, {time.strftime('%H:%M UTC', time.gmtime())}")
    print("| case | seq | kernel | fwd+bwd s (median) | GFLOP/s | vs before | max abs diff out / dq vs before |")
    print("|---|---|---|---|---|---|---|")
    for seq in map(int, a.seqs.split(",")):
        for case in a.cases.split(","):
            doc_ids = documents(seq) if case.startswith("documents") else None
            if doc_ids is not None:
                pos = torch.arange(seq)
                starts = document_start_index(doc_ids)[0]
                seen = pos - starts + 1  # keys each query sees in its document, itself included
                visible = float((seen.clamp(max=a.window) if "window" in case else seen).double().sum())
            elif "window" in case:
                visible = sum(min(i + 1, a.window) for i in range(seq))
            else:
                visible = seq * (seq + 1) / 2
            flops = 4 * visible * HEAD_DIM * HEADS * 3.5
            g = torch.Generator().manual_seed(1)
            q = torch.randn(1, HEADS, seq, HEAD_DIM, generator=g).to(dtype).requires_grad_()
            k = torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g).to(dtype).requires_grad_()
            v = torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g).to(dtype).requires_grad_()
            dout = torch.randn(1, HEADS, seq, HEAD_DIM, generator=g).to(dtype)
            sinks = torch.randn(HEADS, generator=g).requires_grad_()
            skip = [n for n in a.skip_8192.split(",") if n]
            fns = {n: f for n, f in kernels(case, doc_ids, a.window, sinks).items()
                   if not ((n == "sdpa math" or any(x in n for x in skip)) and seq > 2048)}
            times = {n: [] for n in fns}
            results = {}
            for rep in range(a.reps + 1):
                for name, fn in fns.items():
                    q.grad = k.grad = v.grad = sinks.grad = None
                    t0 = time.perf_counter()
                    out = fn(q, k, v)
                    out.backward(dout)
                    if rep:
                        times[name].append(time.perf_counter() - t0)
                    else:
                        results[name] = (out.detach().float(), q.grad.float())
            ref_out, ref_dq = next(iter(results.values()))
            base = statistics.median(next(iter(times.values())))
            for name, t in times.items():
                med = statistics.median(t)
                out, dq = results[name]
                print(f"| {case} | {seq} | {name} | {med:.3f} | {flops / med / 1e9:.0f} | {base / med:.2f}x | "
                      f"{(out - ref_out).abs().max():.1e} / {(dq - ref_dq).abs().max():.1e} |", flush=True)


if __name__ == "__main__":
    main()
