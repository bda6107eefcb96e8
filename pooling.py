"""
Two-stage block pooling, shared by both of NOSA's block scores (METHOD.md §3.3).

Notation:
  T      tokens so far;  B  KV block size;  nb = ceil(T / B) blocks
  l_c    sub-block length;  s_c  sub-block stride;  M = (T - l_c) // s_c + 1 complete sub-blocks
  sub-block m covers tokens [m*s_c, m*s_c + l_c); it is *complete* once its last token exists
  K̃_m    compressed key = mean of k over sub-block m                   (stage 1)
  P[t,m] = Σ_g softmax_m(q_t^g · K̃_m / √d) over complete sub-blocks      (query-aware, per KV group)
  Q[t,b] = max over the sub-blocks m that overlap block b of P[t,m]       (stage 2)
The query-agnostic score E[b] reuses the same two stages on the eviction score c (eviction.py).

With B a multiple of s_c, block b is overlapped by sub-blocks m = b*r - p ... b*r + r - 1, where
r = B / s_c and p = (l_c - 1) // s_c (paper defaults: r = 4, p = 1, so 4b-1 ... 4b+3). The last of
them reaches l_c - s_c tokens into block b+1; the config checks that this overhang stays inside
the sliding window, so the score of every block that can be *chosen* (not forced) is final.
"""
import math

import torch


def fp32(x):
    """x in at least fp32 (bf16/fp16 -> fp32; fp64 stays fp64, for exact tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def n_subblocks(T, cfg):
    """M: how many sub-blocks are complete after T tokens."""
    return 0 if T < cfg.l_c else (T - cfg.l_c) // cfg.s_c + 1


def n_blocks(T, cfg):
    """nb: how many (possibly partial) KV blocks T tokens occupy."""
    return math.ceil(T / cfg.B)


def pool_mean(x, cfg):
    """Stage 1 along the token axis (dim -1): (..., T) -> (..., M) sub-block means."""
    if x.shape[-1] < cfg.l_c:
        return x.new_zeros(*x.shape[:-1], 0)
    return x.unfold(-1, cfg.l_c, cfg.s_c).mean(-1)  # (..., M, l_c) -> (..., M)


def compress_keys(k, cfg):
    """Stage 1 for keys: k (..., T, d) -> K̃ (..., M, d)."""
    return pool_mean(k.transpose(-1, -2), cfg).transpose(-1, -2)


def max_to_blocks(x, nb, cfg):
    """Stage 2: sub-block scores (..., M) -> block scores (..., nb), max over overlapping sub-blocks.
    A block with no complete overlapping sub-block gets -inf."""
    M = x.shape[-1]
    r, p = cfg.B // cfg.s_c, (cfg.l_c - 1) // cfg.s_c
    m = torch.arange(nb, device=x.device)[:, None] * r - p + torch.arange(r + p, device=x.device)  # (nb, r+p)
    valid = (m >= 0) & (m < M)
    xm = x[..., m.clamp(0, max(M - 1, 0))] if M > 0 else x.new_zeros(*x.shape[:-1], nb, r + p)  # (..., nb, r+p)
    return xm.masked_fill(~valid, float("-inf")).amax(-1)  # (..., nb)


@torch.amp.autocast("cuda", enabled=False)  # scores, bias and softmax stay in fp32 under bf16 autocast
def query_aware_scores(q, K_sub, q_pos, nb, cfg):
    """Q[t, b]: q (Bz, H_q, T, d), K̃ (Bz, H_kv, M, d), q_pos (Bz, T) absolute positions -> (Bz, H_kv, T, nb).

    A query sees sub-block m only when all of its tokens are at or before the query's position,
    so the parallel forward and step-by-step decoding score exactly the same sub-blocks."""
    Bz, H_q, T, d = q.shape
    H_kv, M = K_sub.shape[1], K_sub.shape[2]
    G = H_q // H_kv
    qg = fp32(q).view(Bz, H_kv, G, T, d)
    logits = torch.einsum("bhgtd,bhmd->bhgtm", qg, fp32(K_sub)) / math.sqrt(d)  # (Bz, H_kv, G, T, M)
    m_end = torch.arange(M, device=q.device) * cfg.s_c + cfg.l_c - 1  # last token of each sub-block
    visible = (m_end <= q_pos[..., None])[:, None, None]  # (Bz, 1, 1, T, M)
    P = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    P = torch.where(visible, P, 0.0).sum(2)  # rows with nothing visible are NaN before the where; (Bz, H_kv, T, M)
    return max_to_blocks(P, nb, cfg)
