"""
Attention of one query per sequence (decoding): torch twins and Triton kernels.

Notation as in attention.py; R = Bz·H_kv rows (sequence, KV head).

  slot_attention   over the GPU slot pool of offload.py: k slots + the tail block
  sparse_decode    over the selected blocks of a resident cache (kvcache.KVCache); its twin is
                   attention.sparse_attention_torch
  dense_decode     full attention over a static cache (the baseline)

Kernel design (flash-decoding): one program per (row, split) over a share of the row's blocks, so a
small batch still fills the GPU; the splits' partial results are merged by log-sum-exp
(merge_splits). The slot pool and a resident cache share one kernel (_block_decode): they differ
only in where block j of a row is read.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import attention
import fast
from common import fp32, gp, n_sm

# -----------------------------------------------------------------------------
# torch twins


def slot_attention_torch(q, pool, slot_block, bias, pos, B):
    """Decode over the slot pool. q (Bz, H_q, 1, d); pool (R, k+1, 2, B, d), slot k = the tail block;
    slot_block (R, k) block id per slot, -1 free; bias (Bz, H_kv, S) per token or None; pos (Bz,).
    Every resident block is selected (transfer.set_difference evicted the rest), so the keys are the
    k slots plus the tail up to pos."""
    Bz, H_q, _, d = q.shape
    R, k1 = pool.shape[:2]
    H = R // Bz
    blk = torch.cat([slot_block, (pos // B).repeat_interleave(H)[:, None]], 1).view(Bz, H, k1)
    tok = blk[..., None] * B + torch.arange(B, device=q.device)  # (Bz, H, k+1, B) token positions
    valid = ((blk[..., None] >= 0) & (tok <= pos[:, None, None, None])).view(Bz, H, -1)
    kv = pool.view(Bz, H, k1, 2, B, d)
    keys, vals = kv[:, :, :, 0].reshape(Bz, H, -1, d), kv[:, :, :, 1].reshape(Bz, H, -1, d)
    logit_add = torch.zeros((), device=q.device, dtype=fp32(q).dtype)
    if bias is not None:
        logit_add = fp32(bias).gather(2, tok.clamp(0, bias.shape[2] - 1).view(Bz, H, -1))  # (Bz, H, (k+1)B)
    logit_add = torch.where(valid, logit_add, float("-inf"))[:, :, None]  # (Bz, H, 1, (k+1)B)
    o = attention.attend(q.view(Bz, H, H_q // H, 1, d), keys, vals, logit_add)  # (Bz, H, G, 1, d)
    return o.reshape(Bz, H_q, 1, d).to(q.dtype)


def dense_decode_torch(q, k, v, pos):
    """Full attention for one query per sequence. q (Bz, H_q, 1, d) at positions pos (Bz,); k, v
    (Bz, H_kv, S, d), keys past a sequence's position ignored. The G query heads of a KV head are G
    rows of one SDPA call, so K and V are read once, never copied G times. No host sync (the mask is
    built on the device), so it can run inside a CUDA graph where the kernel does not apply."""
    Bz, H_q, _, d = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    mask = (torch.arange(S, device=q.device) <= pos[:, None])[:, None, None]  # (Bz, 1, 1, S)
    o = F.scaled_dot_product_attention(q.reshape(Bz, H_kv, H_q // H_kv, d), k, v, attn_mask=mask)
    return o.reshape(Bz, H_q, 1, d)


# -----------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _block_decode(Q, KB, VB, IDS, C, POS, O, M, L, scale, S, ROW, BLK,
                  H_kv: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                  N: tl.constexpr, TAIL: tl.constexpr, NSPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Decode over a list of N blocks per row (flash-decoding): program (row, split) takes every
    NSPLIT-th entry. Block j's keys are read at KB + row * ROW + at * BLK (values likewise from VB),
    (B, D) each. In the slot pool (TAIL = 1) `at` is the slot j, IDS the block of each slot, and
    slot N is the tail block; in a resident cache (TAIL = 0) `at` is the block id IDS[j] itself."""
    r, sp = tl.program_id(0), tl.program_id(1)
    b = r // H_kv
    offs_g, offs_d, offs_n = tl.arange(0, GP), tl.arange(0, D), tl.arange(0, B)
    g_ok = offs_g < G
    q = tl.load(Q + (r * G + offs_g[:, None]) * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    pos = tl.load(POS + b)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for j in range(sp, N + TAIL, NSPLIT):
        blk = tl.load(IDS + r * N + tl.minimum(j, N - 1)).to(tl.int64)
        if TAIL:
            blk = tl.where(j == N, pos // B, blk)
            at = j
        else:
            at = blk
        tok = blk * B + offs_n
        ok = (tok >= 0) & (tok <= pos)  # blk = -1 gives tok < 0
        kv = r.to(tl.int64) * ROW + at * BLK + offs_n[:, None] * D + offs_d[None, :]  # caches past 2^31 elements
        kb = tl.load(KB + kv, mask=ok[:, None], other=0.0)
        vb = tl.load(VB + kv, mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kb)) * scale
        if HAS_BIAS:
            s += tl.load(C + r * S + tok, mask=ok, other=0.0)[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
    part = (r * NSPLIT + sp) * GP + offs_g  # unnormalised partial results, merged by merge_splits
    tl.store(O + part[:, None] * D + offs_d[None, :], acc)
    tl.store(M + part, m_i)
    tl.store(L + part, l_i)


@triton.jit
def _dense_decode(Q, K, V, POS, O, M, L, scale, ROW, H_kv: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  D: tl.constexpr, BN: tl.constexpr, NSPLIT: tl.constexpr):
    """Full attention of one query per row over its keys 0..pos, split over the keys (flash-decoding):
    program (row, split) takes one contiguous chunk of the row's blocks of BN keys. The length is read
    on the device, so one launch (and one CUDA graph) serves every step."""
    r, sp = tl.program_id(0), tl.program_id(1)
    offs_g, offs_d, offs_n = tl.arange(0, GP), tl.arange(0, D), tl.arange(0, BN)
    q = tl.load(Q + (r * G + offs_g[:, None]) * D + offs_d[None, :], mask=(offs_g < G)[:, None], other=0.0)
    pos = tl.load(POS + r // H_kv)
    per = tl.cdiv(pos // BN + 1, NSPLIT)  # blocks per split
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for j in range(sp * per, tl.minimum(sp * per + per, pos // BN + 1)):
        tok = j * BN + offs_n
        ok = tok <= pos
        kv = r.to(tl.int64) * ROW + tok[:, None] * D + offs_d[None, :]
        kb = tl.load(K + kv, mask=ok[:, None], other=0.0)
        vb = tl.load(V + kv, mask=ok[:, None], other=0.0)
        s = tl.where(ok[None, :], tl.dot(q, tl.trans(kb)) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
    part = (r * NSPLIT + sp) * GP + offs_g
    tl.store(O + part[:, None] * D + offs_d[None, :], acc)
    tl.store(M + part, m_i)
    tl.store(L + part, l_i)


# -----------------------------------------------------------------------------
# Launchers and dispatch


def block_decode(q, kb, vb, ids, bias, pos, B, row, blk, tail, n_split=None):
    """Launch _block_decode over R = Bz * H_kv rows of ids (R, N) and merge the splits -> (Bz, H_q, 1, D)."""
    Bz, H_q, _, D = q.shape
    R, N = ids.shape
    H_kv = R // Bz
    G = H_q // H_kv
    n_split = n_split or max(1, min(N + tail, triton.cdiv(4 * n_sm(q), R)))  # a few per multiprocessor
    GP = gp(G)
    o = torch.empty(R, n_split, GP, D, device=q.device, dtype=torch.float32)
    m = torch.empty(R, n_split, GP, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    c = fp32(bias).contiguous() if bias is not None else q.new_empty(1, dtype=torch.float32)
    _block_decode[(R, n_split)](q.contiguous(), kb, vb, ids.contiguous(), c, pos.contiguous(), o, m, l,
                                1.0 / math.sqrt(D), c.shape[-1], row, blk, H_kv=H_kv, G=G, GP=GP, D=D, B=B, N=N,
                                TAIL=tail, NSPLIT=n_split, HAS_BIAS=bias is not None)
    return merge_splits(o, m, l, G, q.dtype).reshape(Bz, H_q, 1, D)


def slot_attention_triton(q, pool, slot_block, bias, pos, B, n_split=None):
    R, k1, _, _, D = pool.shape  # (R, k + 1, 2, B, D): K then V of each slot
    return block_decode(q, pool, pool[:, :, 1], slot_block, bias, pos, B, k1 * 2 * B * D, 2 * B * D, 1, n_split)


def sparse_decode_triton(q, k, v, bias, block_mask, pos, B, k_sel, n_split=None):
    """sparse_attention for one query per sequence (decode against a resident cache): over the (at
    most k_sel) selected blocks only, split over them. k, v (Bz, H_kv, S, d) may be the first S
    positions of a longer buffer (rows are read at their stride); pos (Bz,)."""
    Bz, H_kv, _, D = k.shape
    assert k.stride() == v.stride() and k.stride()[2:] == (D, 1) and k.stride(0) == H_kv * k.stride(1)
    ids = attention.mask_to_indices(block_mask[:, :, 0], k_sel).view(Bz * H_kv, -1)  # ascending, -1 padded
    return block_decode(q, k, v, ids, bias, pos, B, k.stride(1), B * D, 0, n_split)


@fast.fused  # one kernel on a GPU instead of seven
def merge_splits(o, m, l, G, dtype):
    """Partial results of the splits (R, n_split, GP, D), their running max and sum (R, n_split, GP)
    -> (R, G, D) in dtype: each split's part weighted by exp(its max - the overall max) (log-sum-exp)."""
    w = torch.exp(m - m.amax(1, keepdim=True))  # splits that saw no key have m = -inf: weight 0
    return ((w[..., None] * o).sum(1) / (w * l).sum(1)[..., None])[:, :G].to(dtype)


def dense_decode_triton(q, k, v, pos, n_split=None, BN=64):
    """k, v may be the first S positions of a longer buffer (Bz, H_kv, capacity, d): rows are read
    at their stride."""
    Bz, H_q, _, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    assert k.stride() == v.stride() and k.stride()[2:] == (D, 1) and k.stride(0) == H_kv * k.stride(1)
    R, G = Bz * H_kv, H_q // H_kv
    n_split = n_split or max(1, min(triton.cdiv(S, BN), triton.cdiv(2 * n_sm(q), R)))  # fill the GPU
    GP = gp(G)
    o = torch.empty(R, n_split, GP, D, device=q.device, dtype=torch.float32)
    m = torch.empty(R, n_split, GP, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    _dense_decode[(R, n_split)](q.contiguous(), k, v, pos.contiguous(), o, m, l, 1.0 / math.sqrt(D), k.stride(1),
                                H_kv=H_kv, G=G, GP=GP, D=D, BN=BN, NSPLIT=n_split, num_warps=4)
    return merge_splits(o, m, l, G, q.dtype).reshape(Bz, H_q, 1, D)


def dense_decode(q, k, v, pos):
    if attention.use_triton(q, 64):
        return dense_decode_triton(q, k, v, pos)
    return dense_decode_torch(q, k, v, pos)


def slot_attention(q, pool, slot_block, bias, pos, B):
    if attention.use_triton(q, B):
        return slot_attention_triton(q, pool, slot_block, bias, pos, B)
    return slot_attention_torch(q, pool, slot_block, bias, pos, B)


def sparse_decode(q, k, v, bias, block_mask, pos, B, k_sel):
    """Decode against a resident cache (kvcache.KVCache): the kernel on a GPU, sparse_attention's twin
    elsewhere."""
    if attention.use_triton(q, B):
        return sparse_decode_triton(q, k, v, bias, block_mask, pos, B, k_sel)
    return attention.sparse_attention_torch(q, k, v, bias, block_mask, pos[:, None], B)
