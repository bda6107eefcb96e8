"""
Two-stage block pooling, shared by both of NOSA's block scores (docs/METHOD.md §3).

Notation:
  T      tokens so far;  B  KV block size;  nb = ceil(T / B) blocks
  l_c    sub-block length;  s_c  sub-block stride;  M = (T - l_c) // s_c + 1 complete sub-blocks
  sub-block m covers tokens [m*s_c, m*s_c + l_c); it is *complete* once its last token exists
  K̃_m    compressed key = mean of k over sub-block m                   (stage 1)
  P[t,m] = Σ_g softmax_m(q_t^g · K̃_m / √d) over complete sub-blocks      (per KV group)
  Q[t,b] = max over the sub-blocks m that overlap block b of P[t,m]       (stage 2)
The query-agnostic score E[b] runs the same two stages on the eviction score c (eviction.py).

With B a multiple of s_c, block b is overlapped by sub-blocks m = b*r - p ... b*r + r - 1, where
r = B / s_c and p = (l_c - 1) // s_c (paper defaults: r = 4, p = 1, so 4b-1 ... 4b+3). The last of
them reaches l_c - s_c tokens into block b+1; the config checks that this overhang stays inside
the sliding window, so the score of every block that can be *chosen* (not forced) is final.

Kernels (pooling_kernels.py): Q for a chunk of queries and for one decode query, and the decode
step's update of K̃ and c̃.
"""

import math

import torch

import pooling_kernels
from common import fp32, use_kernels


def pool_mean(x, cfg):
    """Stage 1 along the token axis (dim -1): (..., T) -> (..., M) sub-block means."""
    if x.shape[-1] < cfg.l_c:
        return x.new_zeros(*x.shape[:-1], 0)
    return x.unfold(-1, cfg.l_c, cfg.s_c).mean(-1)  # (..., M, l_c) -> (..., M)


def compress_keys(k, cfg):
    """Stage 1 for keys: k (..., T, d) -> K̃ (..., M, d)."""
    return pool_mean(k.transpose(-1, -2), cfg).transpose(-1, -2)


def overlapping_subblocks(b, cfg):
    """The sub-blocks that overlap block b: b (...,) block ids -> (..., r+p) ids (some < 0)."""
    r, p = cfg.r, cfg.p
    return b[..., None] * r - p + torch.arange(r + p, device=b.device)


def max_to_blocks(x, nb, cfg):
    """Stage 2: sub-block scores (..., M) -> block scores (..., nb), the max over the sub-blocks
    that overlap each block; -inf for a block with no complete overlapping sub-block."""
    M = x.shape[-1]
    m = overlapping_subblocks(torch.arange(nb, device=x.device), cfg)  # (nb, r+p)
    valid = (m >= 0) & (m < M)
    if M == 0:
        return x.new_full((*x.shape[:-1], nb), float("-inf"))
    xm = x[..., m.clamp(0, M - 1)]  # (..., nb, r+p)
    return xm.masked_fill(~valid, float("-inf")).amax(-1)


@torch.amp.autocast("cuda", enabled=False)  # scores stay in fp32 under bf16 autocast
def query_aware_scores(q, K_sub, q_pos, nb, cfg):
    """Q[t, b]: q (Bz, H_q, T, d), K̃ (Bz, H_kv, M, d), q_pos (Bz, T) positions -> (Bz, H_kv, T, nb).

    A query sees sub-block m only when all of its tokens are at or before the query's position, so
    the parallel forward and step-by-step decoding score exactly the same sub-blocks.
    Kernels: pooling_kernels.query_aware_scores (a chunk), .query_aware_scores_decode (T = 1)."""
    if use_kernels(q, cfg):
        if q.shape[2] == 1:
            return pooling_kernels.query_aware_scores_decode(q, K_sub, q_pos, nb, cfg)
        return pooling_kernels.query_aware_scores(q, K_sub, q_pos, nb, cfg)
    Bz, H_q, T, d = q.shape
    H_kv, M = K_sub.shape[1], K_sub.shape[2]
    qg = fp32(q).view(Bz, H_kv, H_q // H_kv, T, d)
    # (Bz, H_kv, G, T, M)
    logits = torch.einsum("bhgtd,bhmd->bhgtm", qg, fp32(K_sub)) / math.sqrt(d)
    m_end = torch.arange(M, device=q.device) * cfg.s_c + cfg.l_c - 1  # last token of each sub-block
    visible = (m_end <= q_pos[..., None])[:, None, None]  # (Bz, 1, 1, T, M)
    P = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    P = torch.where(visible, P, 0.0).sum(2)  # rows that see nothing are NaN before the where
    return max_to_blocks(P, nb, cfg)  # (Bz, H_kv, T, nb)


def append_subblocks(ring_k, ring_c, K_sub, c_sub, k, c, *, pos, cfg):
    """Stage 1 a token at a time (a decode step), in place: k (Bz, H_kv, d) and c (Bz, H_kv) or None
    at positions pos (Bz,) go into the rings of the last l_c keys and scores (Bz, H_kv, l_c[, d]);
    where a sub-block ends at pos, its mean joins K̃ (Bz, H_kv, M, d) and c̃ (Bz, H_kv, M).
    Kernel: pooling_kernels.append_subblocks."""
    if use_kernels(k, cfg):
        return pooling_kernels.append_subblocks(
            ring_k, ring_c, K_sub, c_sub, k, c, pos=pos, cfg=cfg
        )
    seqs = torch.arange(k.shape[0], device=k.device)
    ring_k[seqs, :, pos % cfg.l_c] = k
    if c is not None:
        ring_c[seqs, :, pos % cfg.l_c] = c
    if K_sub.shape[2] == 0:  # no sub-block can be complete yet
        return
    start = pos + 1 - cfg.l_c  # first token of the sub-block that ends at pos, (Bz,)
    done = ((start >= 0) & (start % cfg.s_c == 0))[:, None]  # (Bz, 1)
    m = (start // cfg.s_c).clamp(min=0)  # (Bz,)
    order = (start[:, None] + torch.arange(cfg.l_c, device=k.device)) % cfg.l_c  # in token order
    new = ring_k[seqs[:, None], :, order].mean(1)  # (Bz, H_kv, d)
    K_sub[seqs, :, m] = torch.where(done[..., None], new, K_sub[seqs, :, m])
    if c is not None:
        new = ring_c[seqs[:, None], :, order].mean(1)  # (Bz, H_kv)
        c_sub[seqs, :, m] = torch.where(done, new, c_sub[seqs, :, m])
