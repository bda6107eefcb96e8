"""
Block-sparse attention with a per-token additive bias: torch twins and Triton kernels.

    o_t = Σ_{j in Γ(t), j <= t} softmax_j(q_t·k_j/√d + bias_j) v_j        (METHOD.md §3.5)

Notation: Bz batch, H_q / H_kv query / KV heads, G = H_q / H_kv, T queries, S keys, d head dim,
B block size, k selected blocks per (query, KV head), R = Bz·H_kv rows of the slot pool.

  sparse_attention   training, prefill, and decode against a resident cache. Selection given as a
                     block mask (the twin) or as k block ids per query (the kernels).
  slot_attention     decode against the GPU slot pool of offload.py: k slots + the tail block.

Every kernel has its twin here, with the same signature; the twin is the CPU path and the oracle of
the tests (tests/test_kernels.py, run under TRITON_INTERPRET=1 on CPU). Kernel design:
  - one program per (query token, KV head) carries the G query heads of the group, so each K/V
    block a token selected is read once for all of them ((G, d) x (d, B) dots, G padded to 16);
  - the bias is added after the 1/√d scale, the softmax is online, in fp32;
  - backward: dq per (token, KV head) as in the forward; dk, dv and dc = column sums of dS per
    (key block, KV head), walking the query tiles that can see the block and skipping the tiles in
    which no query selected it (a uint8 block mask tells, T x nb bytes);
  - decode: one program per (row, split) over the resident slots, partial results merged by
    log-sum-exp (flash-decoding), so a small batch still fills the GPU.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pooling import fp32


# -----------------------------------------------------------------------------
# torch twins


@torch.amp.autocast("cuda", enabled=False)  # scores, bias and softmax stay in fp32 under bf16 autocast
def attend(q, k, v, logit_add):
    """softmax(q·k/√d + logit_add) v for G query heads per KV head, in fp32 (or fp64).

    q: (Bz, H_kv, G, T, d); k, v: (Bz, H_kv, S, d); logit_add: (Bz, H_kv, T, S), the bias where a key
    may be attended and -inf where not. Returns (Bz, H_kv, G, T, d)."""
    d = q.shape[-1]
    s = fp32(q) * (1.0 / math.sqrt(d)) @ fp32(k)[:, :, None].transpose(-1, -2)  # (Bz, H_kv, G, T, S)
    p = torch.softmax(s + logit_add[:, :, None], dim=-1)
    return p @ fp32(v)[:, :, None]


def sparse_attention_torch(q, k, v, bias, block_mask, q_pos, B):
    """q: (Bz, H_q, T, d); k, v: (Bz, H_kv, S, d) keys at positions 0..S-1; bias: (Bz, H_kv, S) or None;
    block_mask: (Bz, H_kv, T, nb) or None (all causal); q_pos: (Bz, T). Returns (Bz, H_q, T, d)."""
    Bz, H_q, T, d = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    j = torch.arange(S, device=q.device)
    allowed = (j <= q_pos[..., None])[:, None]  # (Bz, 1, T, S) causal
    if block_mask is not None:
        allowed = allowed & block_mask[..., j // B]  # (Bz, H_kv, T, S)
    bias = fp32(bias)[:, :, None, :] if bias is not None else torch.zeros((), device=q.device, dtype=fp32(q).dtype)
    logit_add = torch.where(allowed, bias, float("-inf"))  # (Bz, H_kv, T, S)
    o = attend(q.view(Bz, H_kv, H_q // H_kv, T, d), k, v, logit_add)  # (Bz, H_kv, G, T, d)
    return o.reshape(Bz, H_q, T, d).to(q.dtype)


def slot_attention_torch(q, pool, slot_block, bias, pos, B):
    """Decode over the slot pool. q (Bz, H_q, 1, d); pool (R, k+1, 2, B, d), slot k = the tail block;
    slot_block (R, k) block id per slot, -1 free; bias (Bz, H_kv, S) per token or None; pos (Bz,).
    Every resident block is selected (offload.set_difference evicted the rest), so the keys are the
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
    o = attend(q.view(Bz, H, H_q // H, 1, d), keys, vals, logit_add)  # (Bz, H, G, 1, d)
    return o.reshape(Bz, H_q, 1, d).to(q.dtype)


# -----------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _sparse_fwd(Q, K, V, C, IDX, QPOS, O, LSE, scale, T, S,
                H_kv: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                K_SEL: tl.constexpr, HAS_BIAS: tl.constexpr):
    t, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H_kv, bh % H_kv
    offs_g, offs_d, offs_n = tl.arange(0, GP), tl.arange(0, D), tl.arange(0, B)
    g_ok = offs_g < G
    rows = (b * H_kv * G + h * G + offs_g) * T + t  # (GP,) rows of q / o / lse
    q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    pos = tl.load(QPOS + b * T + t)
    kv = K + (bh * S) * D
    vv = V + (bh * S) * D
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for i in range(K_SEL):
        blk = tl.load(IDX + (bh * T + t) * K_SEL + i)
        tok = blk * B + offs_n
        ok = (tok >= 0) & (tok <= pos)  # blk = -1 gives tok < 0
        kb = tl.load(kv + tok[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        vb = tl.load(vv + tok[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kb)) * scale  # (GP, B) fp32
        if HAS_BIAS:
            s += tl.load(C + bh * S + tok, mask=ok, other=0.0)[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing valid adds nothing
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
    tl.store(O + rows[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty), mask=g_ok[:, None])
    tl.store(LSE + rows, m_i + tl.log(l_i), mask=g_ok)


@triton.jit
def _sparse_bwd_dq(Q, K, V, C, IDX, QPOS, DO, LSE, DELTA, DQ, scale, T, S,
                   H_kv: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                   K_SEL: tl.constexpr, HAS_BIAS: tl.constexpr):
    t, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H_kv, bh % H_kv
    offs_g, offs_d, offs_n = tl.arange(0, GP), tl.arange(0, D), tl.arange(0, B)
    g_ok = offs_g < G
    rows = (b * H_kv * G + h * G + offs_g) * T + t
    q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    do = tl.load(DO + rows[:, None] * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    lse = tl.load(LSE + rows, mask=g_ok, other=0.0)
    delta = tl.load(DELTA + rows, mask=g_ok, other=0.0)
    pos = tl.load(QPOS + b * T + t)
    dq = tl.zeros([GP, D], tl.float32)
    for i in range(K_SEL):
        blk = tl.load(IDX + (bh * T + t) * K_SEL + i)
        tok = blk * B + offs_n
        ok = (tok >= 0) & (tok <= pos)  # blk = -1 gives tok < 0
        kb = tl.load(K + (bh * S + tok[:, None]) * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        vb = tl.load(V + (bh * S + tok[:, None]) * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kb)) * scale
        if HAS_BIAS:
            s += tl.load(C + bh * S + tok, mask=ok, other=0.0)[None, :]
        p = tl.where(ok[None, :], tl.exp(s - lse[:, None]), 0.0)  # (GP, B)
        dp = tl.dot(do, tl.trans(vb))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kb.dtype), kb)
    tl.store(DQ + rows[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _sparse_bwd_dkv(Q, K, V, C, MASK, QPOS, DO, LSE, DELTA, DK, DV, DC, scale, T, S, NB,
                    H_kv: tl.constexpr, G: tl.constexpr, D: tl.constexpr, B: tl.constexpr, BT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, CAUSAL_START: tl.constexpr):
    kb_id, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H_kv, bh % H_kv
    offs_d, offs_n, offs_t = tl.arange(0, D), tl.arange(0, B), tl.arange(0, BT)
    tok = kb_id * B + offs_n
    k_ok = tok < S
    kb = tl.load(K + (bh * S + tok[:, None]) * D + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    vb = tl.load(V + (bh * S + tok[:, None]) * D + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    bias = tl.zeros([B], tl.float32)
    if HAS_BIAS:
        bias = tl.load(C + bh * S + tok, mask=k_ok, other=0.0)
    dk = tl.zeros([B, D], tl.float32)
    dv = tl.zeros([B, D], tl.float32)
    dc = tl.zeros([B], tl.float32)
    start = 0
    if CAUSAL_START:  # queries at positions 0..T-1: none before this block can see it
        start = (kb_id * B // BT) * BT
    for t0 in range(start, T, BT):
        ts = t0 + offs_t
        t_ok = ts < T
        sel = tl.load(MASK + (bh * T + ts) * NB + kb_id, mask=t_ok, other=0)  # did query t select this block?
        if tl.max(sel, 0) > 0:
            pos = tl.load(QPOS + b * T + ts, mask=t_ok, other=-1)
            valid = (sel > 0)[:, None] & (tok[None, :] <= pos[:, None]) & k_ok[None, :]  # (BT, B)
            for g in tl.static_range(G):
                rows = (b * H_kv * G + h * G + g) * T + ts
                q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=t_ok[:, None], other=0.0)
                do = tl.load(DO + rows[:, None] * D + offs_d[None, :], mask=t_ok[:, None], other=0.0)
                lse = tl.load(LSE + rows, mask=t_ok, other=0.0)
                delta = tl.load(DELTA + rows, mask=t_ok, other=0.0)
                s = tl.dot(q, tl.trans(kb)) * scale + bias[None, :]
                p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)  # (BT, B)
                dv += tl.dot(tl.trans(p).to(do.dtype), do)
                ds = p * (tl.dot(do, tl.trans(vb)) - delta[:, None])
                dk += tl.dot(tl.trans(ds).to(q.dtype), q)
                dc += tl.sum(ds, 0)
    out = (bh * S + tok[:, None]) * D + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=k_ok[:, None])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=k_ok[:, None])
    if HAS_BIAS:
        tl.store(DC + bh * S + tok, dc, mask=k_ok)


@triton.jit
def _slot_decode(Q, POOL, SLOT_BLOCK, C, POS, O, M, L, scale, S,
                 H_kv: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                 K_SLOTS: tl.constexpr, NSPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    r, sp = tl.program_id(0), tl.program_id(1)
    b = r // H_kv
    offs_g, offs_d, offs_n = tl.arange(0, GP), tl.arange(0, D), tl.arange(0, B)
    g_ok = offs_g < G
    q = tl.load(Q + (r * G + offs_g[:, None]) * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    pos = tl.load(POS + b)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for j in range(sp, K_SLOTS + 1, NSPLIT):  # slot K_SLOTS is the tail block
        blk = tl.load(SLOT_BLOCK + r * K_SLOTS + tl.minimum(j, K_SLOTS - 1))
        blk = tl.where(j == K_SLOTS, pos // B, blk)
        tok = blk * B + offs_n
        ok = (tok >= 0) & (tok <= pos)  # blk = -1 gives tok < 0
        base = POOL + (r * (K_SLOTS + 1) + j) * 2 * B * D
        kb = tl.load(base + offs_n[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        vb = tl.load(base + B * D + offs_n[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
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
    part = (r * NSPLIT + sp) * GP + offs_g  # unnormalised partial results, merged in slot_attention
    tl.store(O + part[:, None] * D + offs_d[None, :], acc)
    tl.store(M + part, m_i)
    tl.store(L + part, l_i)


# -----------------------------------------------------------------------------
# Launchers and dispatch


def _gp(G):
    return max(16, triton.next_power_of_2(G))  # tl.dot needs at least 16 rows


def mask_to_indices(block_mask, k):
    """(…, T, nb) bool -> (…, T, k) int32 ascending block ids, -1 padded (at most k are selected)."""
    nb = block_mask.shape[-1]
    ids = torch.where(block_mask, torch.arange(nb, device=block_mask.device, dtype=torch.int32), nb)
    ids = ids.sort(-1).values[..., :k]
    if ids.shape[-1] < k:
        ids = F.pad(ids, (0, k - ids.shape[-1]), value=nb)
    return torch.where(ids < nb, ids, -1).contiguous()


class SparseAttention(torch.autograd.Function):
    """The Triton path of sparse_attention, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, bias, block_mask, q_pos, B, k_sel):
        Bz, H_q, T, D = q.shape
        H_kv, S = k.shape[1], k.shape[2]
        G = H_q // H_kv
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        idx = mask_to_indices(block_mask, k_sel)
        q_pos = q_pos.to(torch.int32).contiguous()
        c = fp32(bias).contiguous() if bias is not None else q.new_empty(1, dtype=torch.float32)
        o = torch.empty_like(q)
        lse = torch.empty(Bz, H_q, T, device=q.device, dtype=torch.float32)
        scale = 1.0 / math.sqrt(D)
        _sparse_fwd[(T, Bz * H_kv)](q, k, v, c, idx, q_pos, o, lse, scale, T, S, H_kv=H_kv, G=G, GP=_gp(G), D=D,
                                    B=B, K_SEL=k_sel, HAS_BIAS=bias is not None)
        ctx.save_for_backward(q, k, v, c, idx, block_mask, q_pos, o, lse)
        ctx.meta = (B, k_sel, bias is not None)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, c, idx, block_mask, q_pos, o, lse = ctx.saved_tensors
        B, k_sel, has_bias = ctx.meta
        Bz, H_q, T, D = q.shape
        H_kv, S = k.shape[1], k.shape[2]
        G = H_q // H_kv
        do = do.contiguous()
        delta = (fp32(do) * fp32(o)).sum(-1)  # (Bz, H_q, T) rowsum(dO ∘ O)
        scale = 1.0 / math.sqrt(D)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dc = torch.zeros(Bz, H_kv, S, device=q.device, dtype=torch.float32)
        _sparse_bwd_dq[(T, Bz * H_kv)](q, k, v, c, idx, q_pos, do, lse, delta, dq, scale, T, S, H_kv=H_kv, G=G,
                                       GP=_gp(G), D=D, B=B, K_SEL=k_sel, HAS_BIAS=has_bias)
        nb = block_mask.shape[-1]
        mask = block_mask.to(torch.uint8).contiguous()
        causal_start = bool(torch.equal(q_pos, torch.arange(T, device=q.device, dtype=torch.int32).expand(Bz, T)))
        _sparse_bwd_dkv[(triton.cdiv(S, B), Bz * H_kv)](q, k, v, c, mask, q_pos, do, lse, delta, dk, dv, dc, scale,
                                                        T, S, nb, H_kv=H_kv, G=G, D=D, B=B, BT=16,
                                                        HAS_BIAS=has_bias, CAUSAL_START=causal_start)
        return dq, dk, dv, (dc if has_bias else None), None, None, None, None


def use_triton(x):
    """The kernels accumulate in fp32: fp64 (the exact tests) stays on the twin, also on a GPU."""
    return x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def sparse_attention(q, k, v, bias, block_mask, q_pos, cfg):
    """Dispatch: Triton on CUDA tensors, the twin elsewhere; `full` mode (no mask) uses SDPA on CUDA."""
    if not use_triton(q):
        return sparse_attention_torch(q, k, v, bias, block_mask, q_pos, cfg.B)
    if block_mask is None:
        T, S = q.shape[2], k.shape[2]
        j = torch.arange(S, device=q.device)
        causal = (j <= q_pos[..., None])[:, None]  # (Bz, 1, T, S)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal if T < S else None, is_causal=T == S,
                                              enable_gqa=True)
    return SparseAttention.apply(q, k, v, bias, block_mask, q_pos, cfg.B, cfg.k)


def slot_attention_triton(q, pool, slot_block, bias, pos, B, n_split=None):
    Bz, H_q, _, D = q.shape
    R, k1 = pool.shape[:2]
    H_kv = R // Bz
    G = H_q // H_kv
    n_split = n_split or max(1, min(k1, triton.cdiv(4 * 132, R)))  # a few programs per SM of an H100/H200
    GP = _gp(G)
    o = torch.empty(R, n_split, GP, D, device=q.device, dtype=torch.float32)
    m = torch.empty(R, n_split, GP, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    c = fp32(bias).contiguous() if bias is not None else q.new_empty(1, dtype=torch.float32)
    _slot_decode[(R, n_split)](q.contiguous(), pool, slot_block.contiguous(), c, pos.contiguous(), o, m, l,
                               1.0 / math.sqrt(D), c.shape[-1], H_kv=H_kv, G=G, GP=GP, D=D, B=B, K_SLOTS=k1 - 1,
                               NSPLIT=n_split, HAS_BIAS=bias is not None)
    w = torch.exp(m - m.amax(1, keepdim=True))  # (R, n_split, GP) log-sum-exp merge of the splits
    out = (w[..., None] * o).sum(1) / (w * l).sum(1)[..., None]  # (R, GP, D)
    return out[:, :G].reshape(Bz, H_q, 1, D).to(q.dtype)


def slot_attention(q, pool, slot_block, bias, pos, B):
    if use_triton(q):
        return slot_attention_triton(q, pool, slot_block, bias, pos, B)
    return slot_attention_torch(q, pool, slot_block, bias, pos, B)
