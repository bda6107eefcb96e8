"""
Block-sparse attention with a per-token additive bias: the torch twin and the Triton kernels of
training and prefill (decode.py has the kernels of one query per sequence).

    o_t = Σ_{j in Γ(t), j <= t} softmax_j(q_t·k_j/√d + bias_j) v_j        (docs/METHOD.md §3)

Notation: Bz batch, H_q / H_kv query / KV heads, G = H_q / H_kv, T queries, S keys, d head dim,
B block size, k selected blocks per (query, KV head).

  sparse_attention   training and prefill (and any T); the selection comes as a block mask
                     (Bz, H_kv, T, nb).

Every kernel has its twin here, with the same signature; the twin is the CPU path and the oracle of
the tests (tests/test_kernels.py, run under TRITON_INTERPRET=1 on CPU). Kernel design:
  - a program takes a tile of BT consecutive query tokens with all G heads of their group (about
    128 rows) and walks the union of the blocks those tokens selected: neighbours share the forced
    blocks and the query-agnostic core, so each K/V block is read once per tile for every head, and
    the dots are (BT·G, d) x (d, B); which row may see which block comes from the uint8 block mask;
  - the bias is added after the 1/√d scale, the softmax is online, in fp32;
  - backward: dq per tile as in the forward; dk, dv and dc (column sums of dS) per key block, over
    a reverse index of the tiles that selected it, in chunks that add up atomically in fp32, so the
    blocks every query selects (sink, window) do not serialise the launch.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention.bias import causal_lower_right

from common import fp32


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


# -----------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _tile_rows(t0, bh, T, H_kv: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr):
    """Row r of a query tile is (token t0 + r // GP, query head r % GP of the group)."""
    b, h = bh // H_kv, bh % H_kv
    r = tl.arange(0, ROWS)
    t, g = t0 + r // GP, r % GP
    ok = (t < T) & (g < G)
    return b, t, ok, ((b * H_kv * G + h * G + g) * T + t)  # flat (batch, head, token) index of q / o / lse


@triton.jit
def _scores(q, kb, C, QPOS, MASK, b, bh, t, row_ok, blk, T, S, NB, scale,
            B: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Logits (ROWS, B) of a query tile against key block blk, and which of them are allowed: the
    row's token selected the block (MASK) and the key is not after it."""
    tok = blk * B + tl.arange(0, B)
    pos = tl.load(QPOS + b * T + t, mask=row_ok, other=-1)
    sel = tl.load(MASK + (bh * T + t) * NB + blk, mask=row_ok & (t * 0 + blk >= 0), other=0)
    ok = (sel > 0)[:, None] & (tok[None, :] <= pos[:, None]) & (tok[None, :] >= 0) & (tok[None, :] < S)
    s = tl.dot(q, tl.trans(kb)) * scale
    if HAS_BIAS:
        s += tl.load(C + bh * S + tok, mask=(tok >= 0) & (tok < S), other=0.0)[None, :]
    return s, ok


@triton.jit
def _load_block(K, V, bh, blk, S, D: tl.constexpr, B: tl.constexpr):
    """K and V of key block blk, (B, D) each; zeros past the end, and for blk = -1, which pads lists."""
    tok = blk * B + tl.arange(0, B)
    ok = (tok >= 0) & (tok < S)
    kv = (bh * S + tok[:, None]) * D + tl.arange(0, D)[None, :]
    return tl.load(K + kv, mask=ok[:, None], other=0.0), tl.load(V + kv, mask=ok[:, None], other=0.0)


@triton.jit
def _sparse_fwd(Q, K, V, C, TILE_IDX, MASK, QPOS, O, LSE, scale, T, S, NB, U,
                H_kv: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                BT: tl.constexpr, HAS_BIAS: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1)
    b, t, row_ok, rows = _tile_rows(tile * BT, bh, T, H_kv, G, GP, BT * GP)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BT * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BT * GP], tl.float32)
    acc = tl.zeros([BT * GP, D], tl.float32)
    for i in range(U):  # the union of the blocks the tile's tokens selected, each read once for all
        blk = tl.load(TILE_IDX + ((bh * tl.num_programs(0) + tile) * U + i))
        kb, vb = _load_block(K, V, bh, blk, S, D, B)
        s, ok = _scores(q, kb, C, QPOS, MASK, b, bh, t, row_ok, blk, T, S, NB, scale, B, HAS_BIAS)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing allowed yet: add nothing
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
    l_i = tl.where(l_i > 0, l_i, 1.0)  # rows past the end of the sequence or the group
    tl.store(O + rows[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + rows, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _sparse_bwd_dq(Q, K, V, C, TILE_IDX, MASK, QPOS, DO, LSE, DELTA, DQ, scale, T, S, NB, U,
                   H_kv: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                   BT: tl.constexpr, HAS_BIAS: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1)
    b, t, row_ok, rows = _tile_rows(tile * BT, bh, T, H_kv, G, GP, BT * GP)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BT * GP, D], tl.float32)
    for i in range(U):
        blk = tl.load(TILE_IDX + ((bh * tl.num_programs(0) + tile) * U + i))
        kb, vb = _load_block(K, V, bh, blk, S, D, B)
        s, ok = _scores(q, kb, C, QPOS, MASK, b, bh, t, row_ok, blk, T, S, NB, scale, B, HAS_BIAS)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(vb)) - delta[:, None])
        dq += tl.dot(ds.to(kb.dtype), kb)
    tl.store(DQ + rows[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _sparse_bwd_dkv(Q, K, V, C, REV_IDX, REV_CNT, MASK, QPOS, DO, LSE, DELTA, DK, DV, DC, scale, T, S, NB, NT,
                    H_kv: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, B: tl.constexpr,
                    BT: tl.constexpr, CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """dK, dV, dc of one key block from one chunk of the query tiles that selected it; chunks of a
    much-selected block (the sink, the window) run in parallel and add up atomically in fp32."""
    blk, chunk, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(REV_CNT + bh * NB + blk)
    j0 = chunk * CHUNK
    if j0 < count:
        offs_d, offs_n = tl.arange(0, D), tl.arange(0, B)
        kv = (bh * S + blk * B + offs_n[:, None]) * D + offs_d[None, :]
        k_ok = blk * B + offs_n < S
        kb = tl.load(K + kv, mask=k_ok[:, None], other=0.0)
        vb = tl.load(V + kv, mask=k_ok[:, None], other=0.0)
        dk = tl.zeros([B, D], tl.float32)
        dv = tl.zeros([B, D], tl.float32)
        dc = tl.zeros([B], tl.float32)
        for j in range(j0, tl.minimum(j0 + CHUNK, count)):
            tile = tl.load(REV_IDX + (bh * NB + blk) * NT + j)
            b, t, row_ok, rows = _tile_rows(tile * BT, bh, T, H_kv, G, GP, BT * GP)
            q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(DO + rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
            s, ok = _scores(q, kb, C, QPOS, MASK, b, bh, t, row_ok, blk, T, S, NB, scale, B, HAS_BIAS)
            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)  # (ROWS, B)
            dv += tl.dot(tl.trans(p).to(do.dtype), do)
            ds = p * (tl.dot(do, tl.trans(vb)) - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q)
            dc += tl.sum(ds, 0)
        tl.atomic_add(DK + kv, dk * scale, mask=k_ok[:, None])
        tl.atomic_add(DV + kv, dv, mask=k_ok[:, None])
        if HAS_BIAS:
            tl.atomic_add(DC + bh * S + blk * B + offs_n, dc, mask=k_ok)


# -----------------------------------------------------------------------------
# Launchers and dispatch


def mask_to_indices(block_mask, k):
    """(…, T, nb) bool -> (…, T, k) int32 ascending block ids, -1 padded (at most k are selected)."""
    nb = block_mask.shape[-1]
    ids = torch.where(block_mask, torch.arange(nb, device=block_mask.device, dtype=torch.int32), nb)
    ids = ids.sort(-1).values[..., :k]
    if ids.shape[-1] < k:
        ids = F.pad(ids, (0, k - ids.shape[-1]), value=nb)
    return torch.where(ids < nb, ids, -1).contiguous()


LAUNCH = dict(num_warps=8, num_stages=3)  # for the tiled kernels: the fastest of a launch sweep at 16K


def tile_size(G, B):
    """Query tokens per tile: about 128 rows (tokens x heads of the group), within one block."""
    return max(1, min(B, 128 // triton.next_power_of_2(G)))


class SparseAttention(torch.autograd.Function):
    """The Triton path of sparse_attention, forward and backward. Tokens are processed in tiles of
    BT consecutive queries (all G heads of the group), over the union of the blocks they selected:
    neighbours share the forced blocks and the query-agnostic core, so each K/V block is read once
    per tile and the dots are (BT·G, d) x (d, B). Per-row selection comes from the uint8 block mask."""

    @staticmethod
    def forward(ctx, q, k, v, bias, block_mask, q_pos, B, k_sel=None):
        Bz, H_q, T, D = q.shape
        H_kv, S = k.shape[1], k.shape[2]
        G = H_q // H_kv
        BT = tile_size(G, B)
        nT, nb = triton.cdiv(T, BT), block_mask.shape[-1]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        mask = block_mask.to(torch.uint8).contiguous()  # (Bz, H_kv, T, nb)
        tiles = F.pad(block_mask, (0, 0, 0, nT * BT - T)).view(Bz, H_kv, nT, BT, nb).any(3)  # (Bz, H_kv, nT, nb)
        # blocks per tile: one query (decode) selects at most k, known without asking the device
        U = min(k_sel, nb) if (T == 1 and k_sel) else int(tiles.sum(-1).max())
        tile_idx = mask_to_indices(tiles, U)
        q_pos = q_pos.to(torch.int32).contiguous()
        c = fp32(bias).contiguous() if bias is not None else q.new_empty(1, dtype=torch.float32)
        o = torch.empty_like(q)
        lse = torch.empty(Bz, H_q, T, device=q.device, dtype=torch.float32)
        meta = dict(H_kv=H_kv, G=G, GP=triton.next_power_of_2(G), D=D, B=B, BT=BT, HAS_BIAS=bias is not None)
        _sparse_fwd[(nT, Bz * H_kv)](q, k, v, c, tile_idx, mask, q_pos, o, lse, 1.0 / math.sqrt(D), T, S, nb, U,
                                    **meta, **LAUNCH)
        ctx.save_for_backward(q, k, v, c, tile_idx, tiles, mask, q_pos, o, lse)
        ctx.meta = meta
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, c, tile_idx, tiles, mask, q_pos, o, lse = ctx.saved_tensors
        meta = ctx.meta
        Bz, H_q, T, D = q.shape
        H_kv, S = k.shape[1], k.shape[2]
        nT, nb, U = tiles.shape[2], tiles.shape[3], tile_idx.shape[-1]
        do = do.contiguous()
        delta = (fp32(do) * fp32(o)).sum(-1)  # (Bz, H_q, T) rowsum(dO ∘ O)
        scale = 1.0 / math.sqrt(D)
        dq = torch.empty_like(q)
        _sparse_bwd_dq[(nT, Bz * H_kv)](q, k, v, c, tile_idx, mask, q_pos, do, lse, delta, dq, scale, T, S, nb, U,
                                       **meta, **LAUNCH)
        # reverse index: for every key block, the query tiles that selected it
        rev = tiles.transpose(-1, -2)  # (Bz, H_kv, nb, nT)
        rev_cnt = rev.sum(-1).to(torch.int32).contiguous()
        rev_idx = mask_to_indices(rev, nT)
        chunk = 32
        dk, dv = (torch.zeros(Bz, H_kv, S, D, device=q.device, dtype=torch.float32) for _ in range(2))
        dc = torch.zeros(Bz, H_kv, S, device=q.device, dtype=torch.float32)
        _sparse_bwd_dkv[(nb, triton.cdiv(int(rev_cnt.max()), chunk), Bz * H_kv)](
            q, k, v, c, rev_idx, rev_cnt, mask, q_pos, do, lse, delta, dk, dv, dc, scale, T, S, nb, nT,
            CHUNK=chunk, **meta, **LAUNCH)
        return dq, dk.to(k.dtype), dv.to(v.dtype), (dc if meta["HAS_BIAS"] else None), None, None, None, None


def use_triton(x, B):
    """The kernels accumulate in fp32: fp64 (the exact tests) stays on the twin, also on a GPU; and
    tl.dot needs blocks and head dims of at least 16 (powers of two)."""
    d = x.shape[-1]
    return (x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and B >= 16 and d >= 16
            and B & (B - 1) == 0 and d & (d - 1) == 0)


def sparse_attention(q, k, v, bias, block_mask, q_pos, cfg):
    """Dispatch: Triton on CUDA tensors, the twin elsewhere. `full` mode (no mask) runs SDPA on CUDA:
    the queries are the last T of the S positions (a whole sequence, or a prefill's chunk), so the
    causal mask is the lower-right one, and flash attention applies without a mask tensor."""
    if not use_triton(q, cfg.B):
        return sparse_attention_torch(q, k, v, bias, block_mask, q_pos, cfg.B)
    if block_mask is None:
        T, S = q.shape[2], k.shape[2]
        if T < S and not torch.is_grad_enabled():
            return causal_chunk_flash(q, k, v)
        causal = causal_lower_right(T, S) if T < S else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, is_causal=T == S, enable_gqa=True)
    return SparseAttention.apply(q, k, v, bias, block_mask, q_pos, cfg.B, cfg.k)


def causal_chunk_flash(q, k, v):
    """Full attention of the last T of S positions (a prefill's chunk) by flash attention, whose causal
    mask is aligned to the last query (lower right) and which reads the H_kv heads of K and V without
    copying them G times; SDPA's lower-right mask where that kernel does not apply."""
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=q.shape[-1] ** -0.5)[0]
    except RuntimeError:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                              enable_gqa=True)
