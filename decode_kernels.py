"""
The kernels of attention.py for one query per sequence (decoding), in the manner of
flash-decoding: one program per (row, split) takes a share of the row's blocks, so a small batch
still fills the GPU, and the splits' partial results are merged by log-sum-exp (merge_splits).

  slot_attention   over the slot pool of offload.py: k slots + the tail block
  sparse_decode    over the selected blocks of a resident cache (kvcache.KVCache)
  dense_decode     full attention over a static cache (the baseline), split over its keys

The slot pool and a resident cache share one kernel (_block_decode): they differ only in where
block j of a row is read. R = Bz·H_kv rows (sequence, KV head).
"""

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common import fp32, gp, n_sm


def mask_to_indices(block_mask, k):
    """(…, nb) bool -> (…, k) int32 ascending block ids, -1 padded (at most k are selected)."""
    nb = block_mask.shape[-1]
    ids = torch.where(block_mask, torch.arange(nb, device=block_mask.device, dtype=torch.int32), nb)
    ids = ids.sort(-1).values[..., :k]
    if ids.shape[-1] < k:
        ids = F.pad(ids, (0, k - ids.shape[-1]), value=nb)
    return torch.where(ids < nb, ids, -1).contiguous()


@triton.jit
def _block_decode(
    Q,
    KB,
    VB,
    IDS,
    C,
    POS,
    O,
    M,
    L,
    scale,
    S,
    ROW,
    BLK,
    H_kv: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    N: tl.constexpr,
    TAIL: tl.constexpr,
    NSPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
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
        # caches past 2^31 elements
        kv = r.to(tl.int64) * ROW + at * BLK + offs_n[:, None] * D + offs_d[None, :]
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
def _dense_decode(
    Q,
    K,
    V,
    POS,
    O,
    M,
    L,
    scale,
    ROW,
    H_kv: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BN: tl.constexpr,
    NSPLIT: tl.constexpr,
):
    """Full attention of one query per row over its keys 0..pos, split over the keys (flash-decoding):
    program (row, split) takes one contiguous chunk of the row's blocks of BN keys. The length is read
    on the device, so one launch (and one CUDA graph) serves every step."""
    r, sp = tl.program_id(0), tl.program_id(1)
    offs_g, offs_d, offs_n = tl.arange(0, GP), tl.arange(0, D), tl.arange(0, BN)
    q = tl.load(
        Q + (r * G + offs_g[:, None]) * D + offs_d[None, :], mask=(offs_g < G)[:, None], other=0.0
    )
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


def block_decode(q, kb, vb, ids, bias, pos, *, B, row, blk, tail, n_split=None):
    """Launch _block_decode over R = Bz * H_kv rows of ids (R, N) and merge the splits -> (Bz, H_q, 1, D)."""
    Bz, H_q, _, D = q.shape
    R, N = ids.shape
    H_kv = R // Bz
    G = H_q // H_kv
    # a few per multiprocessor
    n_split = n_split or max(1, min(N + tail, triton.cdiv(4 * n_sm(q), R)))
    GP = gp(G)
    o = torch.empty(R, n_split, GP, D, device=q.device, dtype=torch.float32)
    m = torch.empty(R, n_split, GP, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    c = fp32(bias).contiguous() if bias is not None else q.new_empty(1, dtype=torch.float32)
    _block_decode[(R, n_split)](
        q.contiguous(),
        kb,
        vb,
        ids.contiguous(),
        c,
        pos.contiguous(),
        o,
        m,
        l,
        1.0 / math.sqrt(D),
        c.shape[-1],
        row,
        blk,
        H_kv=H_kv,
        G=G,
        GP=GP,
        D=D,
        B=B,
        N=N,
        TAIL=tail,
        NSPLIT=n_split,
        HAS_BIAS=bias is not None,
    )
    return merge_splits(o, m, l, G, q.dtype).reshape(Bz, H_q, 1, D)


def slot_attention(q, pool, slot_block, bias, pos, B, *, n_split=None):
    """attention.slot_attention (same arguments, B the block size)."""
    R, k1, _, _, D = pool.shape  # (R, k + 1, 2, B, D): K then V of each slot
    return block_decode(
        q, pool, pool[:, :, 1], slot_block, bias, pos, B=B, row=k1 * 2 * B * D, blk=2 * B * D,
        tail=1, n_split=n_split,
    )  # fmt: skip


def sparse_decode(q, k, v, bias, block_mask, pos, *, B, k_sel, n_split=None):
    """attention.sparse_decode: over the (at most k_sel) selected blocks only, split over them. k, v (Bz, H_kv, S, d) may be the first S
    positions of a longer buffer (rows are read at their stride); pos (Bz,)."""
    Bz, H_kv, _, D = k.shape
    assert (
        k.stride() == v.stride() and k.stride()[2:] == (D, 1) and k.stride(0) == H_kv * k.stride(1)
    )
    ids = mask_to_indices(block_mask[:, :, 0], k_sel).view(Bz * H_kv, -1)  # ascending, -1 padded
    return block_decode(
        q, k, v, ids, bias, pos, B=B, row=k.stride(1), blk=B * D, tail=0, n_split=n_split
    )


@triton.jit
def _merge_splits(
    O,
    M,
    L,
    OUT,
    NSPLIT: tl.constexpr,
    NSP: tl.constexpr,
    GP: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
):
    """Program (row, head): the splits' partial results, each weighted by exp(its max - the
    overall max) (log-sum-exp); splits that saw no key have max -inf and weight 0."""
    r, g = tl.program_id(0), tl.program_id(1)
    s, dd = tl.arange(0, NSP), tl.arange(0, D)
    part = (r * NSPLIT + s) * GP + g
    m = tl.load(M + part, mask=s < NSPLIT, other=float("-inf"))
    l = tl.load(L + part, mask=s < NSPLIT, other=0.0)
    o = tl.load(O + part[:, None] * D + dd[None, :], mask=(s < NSPLIT)[:, None], other=0.0)
    w = tl.exp(m - tl.max(m, 0))
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w * l, 0)
    tl.store(OUT + (r * G + g) * D + dd, out.to(OUT.dtype.element_ty))


def merge_splits(o, m, l, G, dtype):
    """Partial results of the splits (R, n_split, GP, D), their running max and sum
    (R, n_split, GP) -> (R, G, D) in dtype."""
    R, n_split, GP, D = o.shape
    out = torch.empty(R, G, D, device=o.device, dtype=dtype)
    _merge_splits[(R, G)](
        o, m, l, out, NSPLIT=n_split, NSP=triton.next_power_of_2(n_split), GP=GP, G=G, D=D
    )
    return out


def dense_decode(q, k, v, pos, n_split=None, BN=64):
    """attention.dense_decode; k, v may be the first S positions of a longer buffer (Bz, H_kv, capacity, d): rows are read
    at their stride."""
    Bz, H_q, _, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    assert (
        k.stride() == v.stride() and k.stride()[2:] == (D, 1) and k.stride(0) == H_kv * k.stride(1)
    )
    R, G = Bz * H_kv, H_q // H_kv
    # fill the GPU
    n_split = n_split or max(1, min(triton.cdiv(S, BN), triton.cdiv(2 * n_sm(q), R)))
    GP = gp(G)
    o = torch.empty(R, n_split, GP, D, device=q.device, dtype=torch.float32)
    m = torch.empty(R, n_split, GP, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    _dense_decode[(R, n_split)](
        q.contiguous(),
        k,
        v,
        pos.contiguous(),
        o,
        m,
        l,
        1.0 / math.sqrt(D),
        k.stride(1),
        H_kv=H_kv,
        G=G,
        GP=GP,
        D=D,
        BN=BN,
        NSPLIT=n_split,
        num_warps=4,
    )
    return merge_splits(o, m, l, G, q.dtype).reshape(Bz, H_q, 1, D)
