"""Context parallel for linear attention (Gated DeltaNet) by state passing.

Layout: the load-balanced one of ring attention (context_parallel.py): the sequence is cut into 2*cp pieces,
rank r holds pieces r and 2cp-1-r. A recurrent layer's pieces depend on each other only through two things
that cross a piece boundary: the conv window (K-1 tokens) and the delta rule's state [dk, dv] per head.

    1. halo      every rank all-gathers the last K-1 conv inputs (and document ids) of its two pieces; each
                 piece's conv reads the tail of the piece before it in global order (zeros before piece 0).
    2. local     each piece runs the chunked delta rule from a ZERO state, with dk extra value columns that
                 start as the identity: they carry, for free in the same scan, the piece's transition
                 A (final state = S0 + A @ S_in) and, per token, A_t^T q_t (output = o0 + (A_t^T q_t)^T S_in).
    3. pass      the (S0, A) of all 2cp pieces are all-gathered (a few [dk, dv] matrices per head) and every
                 rank folds them in global order, S_in(p+1) = S0(p) + A(p) @ S_in(p), for its own pieces.
    4. add       each token adds the incoming state's contribution: o_t += (A_t^T q_t) @ S_in.

So a cp-way run equals one process (tests/distributed/test_qwen3_5_parity.py), each rank's work stays
O(S/cp), and what crosses ranks is O(K x channels + dk x (dv + dk)) per piece, independent of the sequence.
Document masking: resets restart the state inside a piece (its transition then is zero from the reset on), and
a piece whose first token starts a document ignores the incoming state (its reset flag comes from the halo's
last document id); the conv never reads across a document start.

Both collectives are differentiable (backward: all-reduce of the gathered gradient, then this rank's slice),
so gradients flow back to the pieces that produced the halos and states.
"""

import torch
import torch.distributed as dist
from torch import nn



class _AllGather(torch.autograd.Function):
    """[cp, *x.shape] of every rank's x; backward sums the gradient over ranks and returns this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _piece_order(cp: int) -> list[tuple[int, int]]:
    """(rank, local piece 0/1) of global pieces 0..2cp-1."""
    return [(p, 0) if p < cp else (2 * cp - 1 - p, 1) for p in range(2 * cp)]


def incoming_states(all_finals: torch.Tensor, dv: int) -> list[torch.Tensor]:
    """The state entering each global piece, from every piece's (S0 | A) [cp, 2, B, H, dk, dv + dk]:
    S_in(0) = 0, S_in(p+1) = S0(p) + A(p) @ S_in(p)."""
    cp = all_finals.shape[0]
    state = torch.zeros_like(all_finals[0, 0, ..., :dv])
    incoming = []
    for r, i in _piece_order(cp):
        incoming.append(state)
        s0, trans = all_finals[r, i].split([dv, all_finals.shape[-1] - dv], dim=-1)
        state = s0 + trans @ state
    return incoming


class StatePassingLinearAttention(nn.Module):
    """Drop-in for a linear-attention kernel (models/common/gated_deltanet.GatedDeltaRuleKernel) on a
    load-balanced cp shard (see the module docstring). The kernel's math is its own: this module calls its
    steps `conv` (causal conv + SiLU, with a prefix), `heads` (split and normalise) and `scan` (the chunked
    rule from an initial state, with resets) on each piece, and does the passing."""

    kind = "linear_attention"

    def __init__(self, cp_group: dist.ProcessGroup | None, kernel: nn.Module):
        super().__init__()
        self.cp_group = cp_group
        self.kernel = kernel

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        head_dims: tuple[int, int],
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        group = self.cp_group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        bsz, seq, _ = q.shape
        if seq % 2:
            raise ValueError(f"a context-parallel shard holds two equal pieces; got {seq} tokens")
        piece = seq // 2
        width = conv_weights[0].shape[-1] - 1
        order = _piece_order(cp)
        me = [order.index((rank, 0)), order.index((rank, 1))]  # global index of my two pieces

        # 1. Halo: the last `width` conv inputs of every piece, and their document ids.
        x = torch.cat([q, k, v], dim=-1)
        tails = torch.stack([x[:, piece - width : piece], x[:, seq - width :]])  # [2, B, width, C]
        all_tails = _AllGather.apply(tails, group)  # [cp, 2, B, width, C]
        if document_ids is not None:
            id_tails = torch.stack([document_ids[:, piece - width : piece], document_ids[:, seq - width :]])
            all_id_tails = _AllGather.apply(id_tails, group)
        splits = [q.shape[-1], k.shape[-1], v.shape[-1]]

        q_pieces, k_pieces, v_pieces, resets = [], [], [], []
        for i in (0, 1):
            span = slice(i * piece, (i + 1) * piece)
            p = me[i]
            prefix = all_tails[order[p - 1]] if p > 0 else None  # [B, width, C] of the piece before
            ids = document_ids[:, span] if document_ids is not None else None
            prefix_ids = all_id_tails[order[p - 1]] if (p > 0 and ids is not None) else None
            prefixes = prefix.split(splits, dim=-1) if prefix is not None else (None, None, None)
            convolved = [self.kernel.conv(t[:, span], w, ids, pre, prefix_ids)
                         for t, w, pre in zip((q, k, v), conv_weights, prefixes)]
            qh, kh, vh = self.kernel.heads(*convolved, head_dims)
            q_pieces.append(qh), k_pieces.append(kh), v_pieces.append(vh)
            if ids is None:
                resets.append(None)
            else:
                before = prefix_ids[:, -1:] if prefix_ids is not None else ids[:, :1]
                resets.append(ids != torch.cat([before, ids[:, :-1]], dim=1))

        # 2. Each piece from a zero state, with identity columns carrying its transition.
        dk, dv = head_dims
        hv = v.shape[-1] // dv
        eye = torch.eye(dk, dtype=torch.float32, device=q.device)
        init = torch.cat([torch.zeros(bsz, hv, dk, dv, device=q.device), eye.expand(bsz, hv, dk, dk)], dim=-1)
        outs, finals = [], []
        for i in (0, 1):
            vi = v_pieces[i].float()
            vx = torch.cat([vi, vi.new_zeros(*vi.shape[:-1], dk)], dim=-1)
            o, s = self.kernel.scan(q_pieces[i], k_pieces[i], vx, g[:, i * piece : (i + 1) * piece],
                                    beta[:, i * piece : (i + 1) * piece], initial_state=init, resets=resets[i])
            outs.append(o)
            finals.append(s)

        # 3. Pass the states: (S0 | A) of every piece, folded in global order.
        incoming = incoming_states(_AllGather.apply(torch.stack(finals), group), dv)

        # 4. Add the incoming state's contribution.
        result = []
        for i in (0, 1):
            o0, reads = outs[i].split([dv, dk], dim=-1)  # reads: A_t^T q_t [B, S, H, dk]
            result.append(o0 + torch.einsum("bshk,bhkv->bshv", reads, incoming[me[i]]))
        return torch.cat(result, dim=1).to(v.dtype)

    def extra_repr(self) -> str:
        return "state passing"
