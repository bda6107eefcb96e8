"""
The kernels of attention.sparse_attention for T queries (training and a prefill's chunk), forward
and backward (dq, dk, dv and dc, the bias's gradient), and the flash kernel of full attention.

Γ(t) comes as Tiles: the queries in tiles of BT consecutive tokens, and for each tile the union of
the blocks its tokens selected with one bit per token (O(T · k) memory, never (T, nb)).
  - a program takes a tile with all G heads of its group (about 64 rows) and walks the union:
    neighbours share the forced blocks and the query-agnostic core, so each K/V block is read once
    per tile for every head, and the dots are (BT·G, d) x (d, B); a row sees a block by its bit;
  - K and V blocks come through TMA descriptors (common.tma_descriptor), as do the backward's
    tiles of q, dO, lse and rowsum(dO ∘ O);
  - the bias is added after the 1/√d scale and the softmax is online, in fp32; logits are kept in
    base 2 (times log2 e), so each exponential is one exp2, and a score is masked by one
    comparison: its key against the last key its row may see (-1 where the row's token did not
    select the block);
  - backward: dq per tile as in the forward; dk, dv and dc (column sums of dS) per key block, over
    the tiles that selected it, a range of tiles at a time so that the programs running together
    read the same q and dO from L2, in chunks that add up atomically in fp32 (the blocks every
    query selects, sink and window, do not serialise the launch); its products are taken as
    (keys, rows), so p^T and dS^T feed dV and dK without a transpose.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common import fp32, tma_descriptor


class Tiles(NamedTuple):
    """Γ(t) of T queries as the training kernels read it: the queries in tiles of BT consecutive tokens;
    for each tile the union of the blocks its tokens selected, ascending and -1 padded (idx), for each
    of those which tokens selected it, bit j for the tile's token j (bits), and how many there are (n)."""

    idx: torch.Tensor  # (Bz, H_kv, nT, U) int32 block ids
    bits: torch.Tensor  # (Bz, H_kv, nT, U) int32
    n: torch.Tensor  # (Bz, H_kv, nT) int32
    BT: int
    T: int

    def mask(self, nb):
        """The block mask (Bz, H_kv, T, nb) bool."""
        Bz, H_kv, nT, U = self.idx.shape
        j = torch.arange(self.BT, device=self.idx.device, dtype=torch.int32)
        sel = (self.bits[..., None] >> j) & 1 > 0  # (Bz, H_kv, nT, U, BT)
        at = torch.where(self.idx >= 0, self.idx, nb).long()[..., None].expand_as(sel)
        m = torch.zeros(
            Bz, H_kv, nT, nb + 1, self.BT, dtype=torch.bool, device=sel.device
        ).scatter_(3, at, sel)
        return m[:, :, :, :nb].transpose(3, 4).reshape(Bz, H_kv, nT * self.BT, nb)[:, :, : self.T]

    @classmethod
    def from_mask(cls, block_mask, BT, U):
        """The Tiles of a block mask (Bz, H_kv, T, nb), a tile's union at most U blocks."""
        Bz, H_kv, T, nb = block_mask.shape
        nT = triton.cdiv(T, BT)
        m = F.pad(block_mask, (0, 0, 0, nT * BT - T)).view(Bz, H_kv, nT, BT, nb).to(torch.int32)
        bits = (m << torch.arange(BT, device=m.device, dtype=torch.int32)[:, None]).sum(
            3, dtype=torch.int32
        )
        ids = torch.where(bits != 0, torch.arange(nb, device=m.device, dtype=torch.int32), nb)
        ids = ids.sort(-1).values[..., :U]
        ids = F.pad(ids, (0, U - ids.shape[-1]), value=nb)
        idx = torch.where(ids < nb, ids, -1).contiguous()
        bits = torch.where(idx >= 0, bits.gather(-1, idx.clamp(min=0).long()), 0)
        return cls(idx, bits, (idx >= 0).sum(-1, dtype=torch.int32), BT, T)


@triton.jit
def _tile_rows(
    t0, bh, T, H_kv: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr
):
    """Row r of a query tile is (token t0 + r // GP, query head r % GP of the group). Returns the batch,
    the tokens, which rows exist and their flat (batch, token, head) index: that of lse and rowsum(dO ∘ O)
    in (Bz, T, H_q), and times d that of q, o, dO in the projections' layout (Bz, T, H_q, d)."""
    b, h = bh // H_kv, bh % H_kv
    r = tl.arange(0, ROWS)
    t, g = t0 + r // GP, r % GP
    ok = (t < T) & (g < G)
    return b, t, ok, (b * T + t) * (H_kv * G) + h * G + g


# logits in base 2: exp2 is the GPU's own exponential
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _scores(q, kb, C, c_row, tok, S, scale2, HAS_BIAS: tl.constexpr):
    """Logits (ROWS, B) of a query tile against the keys tok, times log2 e (scale2 = log2 e / √d):
    exp2 of them is the softmax's exp. c_row: where the KV head's bias starts in C."""
    s = tl.dot(q, tl.trans(kb)) * scale2
    if HAS_BIAS:
        s += tl.load(C + c_row + tok, mask=tok < S, other=0.0)[None, :] * LOG2E
    return s


# the lengths are not specialized on: one compile serves prompts of every length (serving)
@triton.jit(do_not_specialize=["T", "S", "U", "C_B", "C_H"])
def _sparse_fwd(
    Q,
    KD,
    VD,
    C,
    T_IDX,
    T_BITS,
    T_N,
    QPOS,
    O,
    LSE,
    scale2,
    T,
    S,
    U,
    C_B,
    C_H,
    H_kv: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    BT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """q and o in the projections' layout (Bz, T, H_q, d); K and V as TMA descriptors of (Bz, H_kv, S, d)
    in (1, 1, B, d) tiles (common.tma_descriptor: any aligned strides, a prefill's keys so far are a view
    of a longer buffer); C_B, C_H the batch and head strides of C."""
    tile, bh = tl.program_id(0), tl.program_id(1)
    t0, prog = tile * BT, bh * tl.num_programs(0) + tile
    b, t, row_ok, rows = _tile_rows(t0, bh, T, H_kv, G, GP, BT * GP)
    h = bh % H_kv
    qo_row = rows * D
    offs_d = tl.arange(0, D)
    q = tl.load(Q + qo_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    # the last key a row may see
    pos = tl.minimum(tl.load(QPOS + b * T + t, mask=row_ok, other=-1), S - 1)
    c_row = b * C_B + h * C_H
    m_i = tl.full([BT * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BT * GP], tl.float32)
    acc = tl.zeros([BT * GP, D], tl.float32)
    # the union of the blocks the tile's tokens selected, each read once for all
    for i in range(tl.load(T_N + prog)):
        blk, bits = tl.load(T_IDX + prog * U + i), tl.load(T_BITS + prog * U + i)
        kb = KD.load([b, h, blk * B, 0]).reshape(B, D)  # zeros past S
        vb = VD.load([b, h, blk * B, 0]).reshape(B, D)
        tok = blk * B + tl.arange(0, B)
        s = _scores(q, kb, C, c_row, tok, S, scale2, HAS_BIAS)
        # the row's token selected the block, or none
        last = tl.where(((bits >> (t - t0)) & 1) > 0, pos, -1)
        s = tl.where(tok[None, :] <= last[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing allowed yet: add nothing
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
    l_i = tl.where(l_i > 0, l_i, 1.0)  # rows past the end of the sequence or the group
    tl.store(
        O + qo_row[:, None] + offs_d[None, :],
        (acc / l_i[:, None]).to(O.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(LSE + rows, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)


@triton.jit
def _sparse_bwd_dq(
    Q,
    KD,
    VD,
    C,
    T_IDX,
    T_BITS,
    T_N,
    QPOS,
    O,
    DO,
    LSE,
    DELTA,
    DQ,
    scale2,
    T,
    S,
    U,
    H_kv: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    BT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """dq of a query tile, as the forward walks its blocks; it also writes rowsum(dO ∘ O), which the
    dK/dV kernel reads. q, dO, o and dq in the projections' layout (Bz, T, H_q, d), as in the forward."""
    tile, bh = tl.program_id(0), tl.program_id(1)
    t0, prog = tile * BT, bh * tl.num_programs(0) + tile
    b, t, row_ok, rows = _tile_rows(t0, bh, T, H_kv, G, GP, BT * GP)
    qo_row = rows * D
    offs_d = tl.arange(0, D)
    q = tl.load(Q + qo_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + qo_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    o = tl.load(O + qo_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + rows, delta, mask=row_ok)
    lse2 = tl.load(LSE + rows, mask=row_ok, other=0.0) * LOG2E
    pos = tl.minimum(tl.load(QPOS + b * T + t, mask=row_ok, other=-1), S - 1)
    dq = tl.zeros([BT * GP, D], tl.float32)
    for i in range(tl.load(T_N + prog)):
        blk, bits = tl.load(T_IDX + prog * U + i), tl.load(T_BITS + prog * U + i)
        kb = KD.load([b, bh % H_kv, blk * B, 0]).reshape(B, D)
        vb = VD.load([b, bh % H_kv, blk * B, 0]).reshape(B, D)
        tok = blk * B + tl.arange(0, B)
        last = tl.where(((bits >> (t - t0)) & 1) > 0, pos, -1)
        p = tl.exp2(_scores(q, kb, C, bh * S, tok, S, scale2, HAS_BIAS) - lse2[:, None])
        p = tl.where(tok[None, :] <= last[:, None], p, 0.0)
        ds = p * (tl.dot(do, tl.trans(vb)) - delta[:, None])
        dq += tl.dot(ds.to(kb.dtype), kb)
    dq *= scale2 * LN2  # 1/√d
    tl.store(
        DQ + qo_row[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None]
    )


@triton.jit
def _sparse_bwd_dkv(
    QD,
    K,
    V,
    C,
    REV_OFF,
    REV_TILE,
    REV_BITS,
    QPOS,
    DOD,
    LSE,
    DELTA,
    DK,
    DV,
    DC,
    scale2,
    T,
    S,
    NB,
    NR,
    H_kv: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    BT: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROW_TMA: tl.constexpr,
):
    """dK, dV, dc of one key block from one chunk of the query tiles of one range (of NR) that selected
    it; the programs of a range run side by side, so the tiles' q and dO they read stay in L2, and the
    ranges and chunks of a block add up atomically in fp32. q and dO come as TMA boxes (1, BT, GP, d) of
    the projections' layout (Bz, T, H_q, d): a tile's rows ordered (token, head)."""
    seg, chunk, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # seg: (range, block)
    blk = seg % NB
    lo, hi = tl.load(REV_OFF + bh * NR * NB + seg), tl.load(REV_OFF + bh * NR * NB + seg + 1)
    j0 = lo + chunk * CHUNK
    if j0 < hi:
        b, h = bh // H_kv, bh % H_kv
        offs_d, offs_n = tl.arange(0, D), tl.arange(0, B)
        tok = blk * B + offs_n
        kv = (bh * S + tok[:, None]) * D + offs_d[None, :]
        k_ok = tok < S
        kb = tl.load(K + kv, mask=k_ok[:, None], other=0.0)
        vb = tl.load(V + kv, mask=k_ok[:, None], other=0.0)
        c_blk = (
            tl.load(C + bh * S + tok, mask=k_ok, other=0.0) * LOG2E
            if HAS_BIAS
            else tl.zeros([B], tl.float32)
        )
        dk = tl.zeros([B, D], tl.float32)
        dv = tl.zeros([B, D], tl.float32)
        dc = tl.zeros([B], tl.float32)
        r = tl.arange(0, BT * GP)
        g = r % GP
        for j in range(j0, tl.minimum(j0 + CHUNK, hi)):
            t0, bits = tl.load(REV_TILE + j) * BT, tl.load(REV_BITS + j)
            t = t0 + r // GP
            q = QD.load([b, t0, h * G, 0]).reshape(BT * GP, D)  # zeros past T and past the heads
            do = DOD.load([b, t0, h * G, 0]).reshape(BT * GP, D)
            if ROW_TMA:  # LSE, DELTA, QPOS as TMA descriptors, boxes (1, BT, GP) and (1, BT): pipelined as q, dO
                lse2 = LSE.load([b, t0, h * G]).reshape(BT * GP) * LOG2E
                delta = DELTA.load([b, t0, h * G]).reshape(BT * GP)
                pos = tl.reshape(
                    tl.broadcast_to(QPOS.load([b, t0]).reshape(BT)[:, None], (BT, GP)), (BT * GP,)
                )
            else:
                row_ok = (t < T) & (g < G)
                # lse and delta (Bz, T, H_q): the tile's are contiguous
                rows = (b * T + t) * (H_kv * G) + h * G + g
                lse2 = tl.load(LSE + rows, mask=row_ok, other=0.0) * LOG2E
                delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)
                pos = tl.load(QPOS + b * T + t, mask=row_ok, other=-1)
            # transposed, (keys, rows): p^T and dS^T are the left operands of dV and dK as they come
            pT = tl.exp2(tl.dot(kb, tl.trans(q)) * scale2 + c_blk[:, None] - lse2[None, :])
            # the row's token selected the block; not a padded head
            sel = (((bits >> (t - t0)) & 1) > 0) & (g < G)
            last = tl.where(sel, pos, -1)  # the last key each row may see here
            pT = tl.where(tok[:, None] <= last[None, :], pT, 0.0)
            dv += tl.dot(pT.to(do.dtype), do)
            dsT = pT * (tl.dot(vb, tl.trans(do)) - delta[None, :])
            dk += tl.dot(dsT.to(q.dtype), q)
            dc += tl.sum(dsT, 1)
        tl.atomic_add(DK + kv, dk * (scale2 * LN2), mask=k_ok[:, None])
        tl.atomic_add(DV + kv, dv, mask=k_ok[:, None])
        if HAS_BIAS:
            tl.atomic_add(DC + bh * S + tok, dc, mask=k_ok)


# launch sizes, each the fastest of a sweep (docs/LOG.md)
LAUNCH = dict(num_warps=4, num_stages=3)  # the tiled forward
LAUNCH_BWD = dict(num_warps=4, num_stages=2)  # the backward's two kernels
DKV_CHUNK = 256  # query tiles per program of the dK/dV kernel: fewer atomic adds
DKV_RANGE = 1024  # query tiles per range of the dK/dV kernel's grid: their q, dO stay in L2


def log2e_rsqrt(d):
    """The kernels' logit scale, log2 e / √d: their logits are in base 2, for exp2."""
    return 1 / (math.sqrt(d) * math.log(2))


def tiles_by_block(sel, nb, span):
    """The reverse of the tiles' lists: for every range of `span` tiles and every key block, the tiles
    of the range that selected it (ascending) and their bits, as one list sorted by (row, range, block,
    tile) with the offsets where each (range, block) part starts (the unused places of the tiles' lists
    sort last, so nothing here waits for the GPU). Returns those and the ranges' count."""
    Bz, H_kv, nT, U = sel.idx.shape
    n_r = triton.cdiv(nT, span)
    n_seg = Bz * H_kv * n_r * nb
    row = torch.arange(Bz * H_kv, device=sel.idx.device).view(Bz, H_kv, 1, 1)
    tile = torch.arange(nT, device=sel.idx.device).view(1, 1, nT, 1)
    seg = (row * n_r + tile // span) * nb + sel.idx
    key, order = torch.where(sel.idx >= 0, seg * nT + tile, n_seg * nT).flatten().sort()
    off = torch.searchsorted(key, torch.arange(n_seg + 1, device=key.device) * nT).to(torch.int32)
    return off, (key % nT).to(torch.int32), sel.bits.flatten()[order], n_r


class SparseAttention(torch.autograd.Function):
    """attention.sparse_attention, forward and backward. Tokens are processed in tiles of
    BT consecutive queries (all G heads of the group), over the union of the blocks they selected:
    neighbours share the forced blocks and the query-agnostic core, so each K/V block is read once
    per tile and the dots are (BT·G, d) x (d, B). Which rows selected a block comes from its bits."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sel, q_pos, B):
        Bz, H_q, T, D = q.shape
        H_kv, S = k.shape[1], k.shape[2]
        G = H_q // H_kv
        nT, U = sel.idx.shape[2], sel.idx.shape[3]
        # q and o in the projections' layout (Bz, T, H_q, d), as the model makes and reads them: not copied;
        # K and V (a prefill's keys so far, any aligned layout) through TMA descriptors, not copied either
        # a view where q already is in that layout
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        q_pos = q_pos.to(torch.int32).contiguous()
        c = fp32(bias) if bias is not None else q.new_empty(1, 1, 1, dtype=torch.float32)
        c = c if c.stride(-1) == 1 else c.contiguous()  # read through its batch and head strides
        o = torch.empty_like(q)  # (Bz, H_q, T, d) in q's layout
        # as q, so a tile's rows are contiguous
        lse = torch.empty(Bz, T, H_q, device=q.device, dtype=torch.float32)
        meta = dict(
            H_kv=H_kv,
            G=G,
            GP=triton.next_power_of_2(G),
            D=D,
            B=B,
            BT=sel.BT,
            HAS_BIAS=bias is not None,
        )
        kd, vd = (tma_descriptor(x, (1, 1, B, D)) for x in (k, v))
        _sparse_fwd[(nT, Bz * H_kv)](
            q,
            kd,
            vd,
            c,
            sel.idx,
            sel.bits,
            sel.n,
            q_pos,
            o,
            lse,
            log2e_rsqrt(D),
            T,
            S,
            U,
            c.stride(0),
            c.stride(1),
            **meta,
            **LAUNCH,
        )
        ctx.save_for_backward(q, k, v, c, sel.idx, sel.bits, sel.n, q_pos, o, lse)
        ctx.meta, ctx.BT = meta, sel.BT
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, c, idx, bits, n, q_pos, o, lse = ctx.saved_tensors
        k, v, c = k.contiguous(), v.contiguous(), c.contiguous()
        # q's layout (Bz, T, H_q, d), as q and o are
        do = do.transpose(1, 2).contiguous().transpose(1, 2)
        meta = ctx.meta
        Bz, H_q, T, D = q.shape
        H_kv, S, G = k.shape[1], k.shape[2], meta["G"]
        nT, U, nb = idx.shape[2], idx.shape[3], triton.cdiv(S, meta["B"])
        # rowsum(dO ∘ O), by the dq kernel
        delta = torch.empty(Bz, T, H_q, device=q.device, dtype=torch.float32)
        scale2 = log2e_rsqrt(D)
        dq = torch.empty_like(q)
        kd, vd = (tma_descriptor(x, (1, 1, meta["B"], D)) for x in (k, v))
        _sparse_bwd_dq[(nT, Bz * H_kv)](
            q,
            kd,
            vd,
            c,
            idx,
            bits,
            n,
            q_pos,
            o,
            do,
            lse,
            delta,
            dq,
            scale2,
            T,
            S,
            U,
            **meta,
            **LAUNCH_BWD,
        )
        span = min(nT, DKV_RANGE)
        off, rev_tile, rev_bits, n_r = tiles_by_block(Tiles(idx, bits, n, ctx.BT, T), nb, span)
        dk, dv = (
            torch.zeros(Bz, H_kv, S, D, device=q.device, dtype=torch.float32) for _ in range(2)
        )
        dc = torch.zeros(Bz, H_kv, S, device=q.device, dtype=torch.float32)
        qd, dod = (tma_descriptor(x.transpose(1, 2), (1, ctx.BT, meta["GP"], D)) for x in (q, do))
        # TMA: boxes' rows of at least 16 bytes, starting 16-byte aligned
        row_tma = G % 4 == 0 and ctx.BT >= 4
        if row_tma:
            lse, delta = (tma_descriptor(x, (1, ctx.BT, meta["GP"])) for x in (lse, delta))
            q_pos = tma_descriptor(F.pad(q_pos, (0, -T % 4), value=-1), (1, ctx.BT))
        _sparse_bwd_dkv[(n_r * nb, triton.cdiv(span, DKV_CHUNK), Bz * H_kv)](
            qd,
            k,
            v,
            c,
            off,
            rev_tile,
            rev_bits,
            q_pos,
            dod,
            lse,
            delta,
            dk,
            dv,
            dc,
            scale2,
            T,
            S,
            nb,
            n_r,
            CHUNK=DKV_CHUNK,
            ROW_TMA=row_tma,
            **meta,
            **LAUNCH_BWD,
        )
        return (
            dq,
            dk.to(k.dtype),
            dv.to(v.dtype),
            (dc if meta["HAS_BIAS"] else None),
            None,
            None,
            None,
        )


def sparse_attention(q, k, v, bias, sel, q_pos, *, B):
    """attention.sparse_attention with Γ(t) as Tiles (sel)."""
    return SparseAttention.apply(q, k, v, bias, sel, q_pos, B)


def causal_sdpa(q, k, v):
    """Full attention of the last T of S positions (a whole sequence or a prefill's chunk) by
    torch's flash kernel, whose causal mask is aligned to the last query (lower right) and which
    reads the H_kv heads of K and V without copying them G times."""
    T, S = q.shape[2], k.shape[2]
    if T < S and not torch.is_grad_enabled():
        try:
            scale = q.shape[-1] ** -0.5
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True, scale=scale
            )[0]
        except RuntimeError:  # where that kernel does not apply: SDPA's lower-right mask
            pass
    from torch.nn.attention.bias import causal_lower_right  # (its import takes seconds: here)

    causal = causal_lower_right(T, S) if T < S else None
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal, is_causal=T == S, enable_gqa=True
    )
