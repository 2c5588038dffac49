"""Bytes each rank sends per attention layer under each context-parallel method, as the code issues them.

Per layer and microbatch, forward + backward, for a rank holding `tokens` = B x S/cp tokens with `hq` query
heads and `hkv` key/value heads (after tensor parallel), q/k head dim `d`, value head dim `dv`, activations of
`act_bytes`. A collective's bytes per rank: all-to-all (g-1)/g of its input, all-gather (g-1) x its input,
reduce-scatter (g-1)/g of its input, a point-to-point send the tensor (what a ring algorithm moves).

  ring, rotate "alltoall" (point-to-point ring): forward cp-1 shifts of the packed local k/v (v zero-padded
       to d: 2 x hkv x d per token); backward cp-1 shifts of k/v again and cp shifts of their fp32 gradients.
  ring, rotate "allgather": one all-gather of the packed k/v; backward one fp32 reduce-scatter of the
       gathered k/v's gradients.
  ulysses (group A = cp): all-to-all of q, k, v (k/v heads repeated to lcm(hkv, A)) and of the output, and
       the same four on the gradients: 2 x (A-1)/A x (q + k + v + out).
  hierarchical (a2a groups of A, ring of R = cp/A groups): the all-to-alls of ulysses over A, then the ring
       over R on head shards of the group's sequence: per rank the same bytes as a ring of R over the rank's
       own tokens with lcm(hkv, A) k/v heads.
  document masking adds an all-gather of int64 document ids in forward: over the cp ring (cp-1 x 8 bytes
       per token), over the a2a group (A-1) and, hierarchical, the ring's gather of the group's ids (R-1) x A.

So ring moves ~(cp-1)/cp of the whole sequence's k/v through every rank per layer, growing with cp at fixed
S, while ulysses moves ~4/cp of the rank's own activations, shrinking with cp at fixed S (scripts/
bench_cp_methods.py counts both from the collectives issued and checks these formulas).
"""

import math

ID_BYTES = 8
"""Document ids are int64."""
GRAD_BYTES = 4
"""The ring accumulates and sends k/v gradients in fp32 whatever the activation dtype."""


def _ring_bytes(ring: int, kv_elems: float, act_bytes: int, rotate: str) -> float:
    """A ring of `ring` ranks each owning `kv_elems` packed k/v elements: forward + backward bytes sent."""
    if ring <= 1:
        return 0.0
    if rotate == "allgather":
        return (ring - 1) * kv_elems * act_bytes + (ring - 1) * kv_elems * GRAD_BYTES
    return 2 * (ring - 1) * kv_elems * act_bytes + ring * kv_elems * GRAD_BYTES


def cp_bytes_per_layer(method: str, cp: int, a2a_degree: int, *, tokens: int, hq: int, hkv: int, d: int,
                       dv: int | None = None, act_bytes: int = 2, rotate: str = "alltoall",
                       documents: bool = False) -> float:
    """Bytes one rank sends for one attention layer, forward and backward (see the module docstring)."""
    dv = d if dv is None else dv
    if cp <= 1:
        return 0.0
    if method == "ring":
        ids = (cp - 1) * tokens * ID_BYTES if documents else 0
        return _ring_bytes(cp, tokens * 2 * hkv * max(d, dv), act_bytes, rotate) + ids
    a = cp if method == "ulysses" else a2a_degree
    ring = cp // a
    hkv_split = math.lcm(hkv, a)
    per_token = hq * d + hkv_split * d + hkv_split * dv + hq * dv
    a2a = 2 * (a - 1) / a * tokens * per_token * act_bytes
    # The ring packs k with v zero-padded to d; each ring rank owns the group's tokens for hkv_split/a heads.
    ring_kv = tokens * 2 * hkv_split * max(d, dv)
    ids = ((a - 1) * tokens + (ring - 1) * a * tokens) * ID_BYTES if documents else 0
    return a2a + _ring_bytes(ring, ring_kv, act_bytes, rotate) + ids


# ---------------------------------------------------------------------------------------------------------
# Time, for the planner
# ---------------------------------------------------------------------------------------------------------


def cp_options(cp: int, tp: int, n_heads: int, gpus_per_node: int) -> list[tuple[str, int]]:
    """(method, a2a degree) pairs that can run: ring always; ulysses when cp divides the heads a tp rank
    holds; hierarchical for each a2a degree 1 < A < cp dividing cp and those heads whose group (A x tp ranks)
    stays inside a node, the point of the method."""
    if cp <= 1:
        return [("ring", 0)]
    heads = n_heads // tp
    options = [("ring", 0)] + ([("ulysses", 0)] if heads % cp == 0 else [])
    options += [("hierarchical", a) for a in range(2, cp)
                if cp % a == 0 and heads % a == 0 and a * tp <= gpus_per_node]
    return options


def cp_block_time(device, network, method: str, a2a_degree: int, *, cp: int, tp: int, tokens: float,
                  n_heads: int, kv_heads: int, head_dim: int, act_bytes: int) -> float:
    """Seconds of one block's CP traffic per microbatch, forward and backward, none of it hidden.

    tokens: the rank's tokens of the microbatch (B x S / cp). Ring (the default rotate method): an all-gather
    of the whole sequence's k/v and, in backward, a reduce-scatter of their gradients plus a re-gather (3
    collectives over cp, spanning cp x tp ranks). Ulysses/hierarchical: 8 all-to-alls over the group of A
    ranks (spanning A x tp) carrying q, k, v, out and their gradients, each costed like a ring collective of
    the same bytes; hierarchical adds the ring's 3 collectives over cp/A groups on the head shards."""
    from torchtitan.planning.step_time import collective_time

    hq, hkv = n_heads // tp, max(1, kv_heads // tp)
    if method == "ring":
        kv = tokens * cp * 2 * hkv * head_dim * act_bytes  # K and V of the whole sequence, this rank's heads
        return 3 * collective_time(device, cp, kv, cp * tp, network)
    a = cp if method == "ulysses" else a2a_degree
    hkv_split = math.lcm(hkv, a)
    moved = 2 * tokens * (2 * hq + 2 * hkv_split) * head_dim * act_bytes  # q, k, v, out; forward and backward
    t = 8 * collective_time(device, a, moved / 8, a * tp, network)
    ring = cp // a
    if ring > 1:
        kv = tokens * cp * 2 * (hkv_split // a) * head_dim * act_bytes
        t += 3 * collective_time(device, ring, kv, cp * tp, network)
    return t


def cp_comm_line(cfg, pd, shape, act_bytes: int) -> str | None:
    """The dry run's line: MiB one rank sends per attention layer and microbatch (forward + backward) under
    the configured CP method, and under the other methods that could run. `shape`: the model args'
    TransformerShape (None: no line). None without context parallel."""
    if pd.cp <= 1 or shape is None:
        return None
    t, p = cfg.training, cfg.parallelism
    seqs = p.pipeline_parallel_microbatch_size if pd.pp > 1 else t.local_batch_size
    f = dict(tokens=seqs * t.seq_len // pd.cp, hq=shape.n_heads // pd.tp, hkv=max(1, shape.n_kv_heads // pd.tp),
             d=shape.head_dim, act_bytes=act_bytes, rotate=p.context_parallel_rotate_method,
             documents=t.document_masking)

    def mib(method: str, a2a: int) -> str:
        return f"{cp_bytes_per_layer(method, pd.cp, a2a, **f) / 2**20:,.1f} MiB"

    chosen = (p.context_parallel_method, p.context_parallel_a2a_degree)
    others = [o for o in cp_options(pd.cp, pd.tp, shape.n_heads, pd.cp * pd.tp) if o != chosen]
    def label(method: str, a2a: int) -> str:
        return f"hierarchical a2a {a2a}" if method == "hierarchical" else method

    return (f"context parallel {label(*chosen)} (cp {pd.cp}): {mib(*chosen)} sent per rank per attention layer and "
            f"microbatch (forward + backward); " + ", ".join(f"{label(*o)} {mib(*o)}" for o in others))
