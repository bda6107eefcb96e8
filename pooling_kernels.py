"""
The kernels of pooling.py, each the twin of a torch function there (which says what it computes):

  query_aware_scores         Q of a chunk of queries: one program per tile of queries (all G heads
                             of the group) makes one pass over the compressed keys for the softmax
                             statistics and a second that forms P, sums it over the heads and
                             max-pools it to blocks in registers, so the T x M matrix P never
                             reaches memory (the last p sub-blocks of a block, which the next block
                             also overlaps, carried to it); it writes Q itself, 1 / r of P's size
  query_aware_scores_decode  Q of one query per sequence: two launches spread over the compressed
                             keys (statistics per chunk, then P and the max to blocks)
  append_subblocks           a decode step's new key into the ring, a completed sub-block's mean
                             into K̃ and c̃: one program per (sequence, KV head)
"""

import math

import torch
import triton
import triton.language as tl

from common import gp, tma_descriptor


# the lengths are not specialized on: one compile serves prompts of every length (serving)
@triton.jit(do_not_specialize=["T", "M", "NB"])
def _qscore_kernel(
    Q,
    KD,
    QPOS,
    OUT,
    scale,
    T,
    M,
    NB,
    Q_B,
    H_kv: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    R_SUB: tl.constexpr,
    P_OVER: tl.constexpr,
    S_C: tl.constexpr,
    L_C: tl.constexpr,
    NBT: tl.constexpr,
):
    """One program per tile of BT queries x the GP heads of a KV group (rows), over the compressed keys
    of its KV head: pass 1 the softmax statistics of every row, pass 2 P summed over the group's heads
    and max-pooled to blocks, NBT blocks (NBT * r sub-blocks) at a time. In base 2 (exp2, scores times
    log2 e), each row's log-sum-exp folded into the exponent; the sub-blocks every row of the tile sees
    are read without a mask. Each step waits for its products (Triton waits for a dot where it is used:
    issuing the next step's early overlapped nothing and cost a second tile of registers)."""
    tile, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H_kv, bh % H_kv
    ROWS: tl.constexpr = BT * GP
    BM: tl.constexpr = NBT * R_SUB
    r = tl.arange(0, ROWS)
    t, g = tile * BT + r // GP, r % GP  # row = (token, head of the group)
    row_ok = (t < T) & (g < G)
    offs_d = tl.arange(0, D)
    # q in the projections' layout (Bz, T, H_q, d), batch stride Q_B
    rows = b * Q_B + (t * (H_kv * G) + h * G + g) * D
    q = tl.load(Q + rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    pos = tl.load(QPOS + b * T + t, mask=row_ok, other=-1)
    scale2 = scale * 1.4426950408889634  # log2 e: exp(x) = exp2(x log2 e)
    # tokens the tile's last query sees: sub-blocks from M_VIS on are hidden from all
    p_last = tl.max(pos, 0) + 1
    M_VIS = tl.minimum(tl.where(p_last >= L_C, (p_last - L_C) // S_C + 1, 0), M)
    # and its first: all rows see the sub-blocks before M_ALL
    p_first = tl.min(tl.where(row_ok, pos, 2**30), 0) + 1
    M_ALL = tl.minimum(tl.where(p_first >= L_C, (p_first - L_C) // S_C + 1, 0), M)
    # tiles no mask needs to touch
    m_full = tl.where((G == GP) & (tile * BT + BT <= T), M_ALL // BM * BM, 0)
    # pass 1: each row's log-sum-exp over the sub-blocks it sees, in base 2. The exponentials are taken
    # against one reference per row, the largest of its products in the first tile, so the loop keeps
    # no running maximum; only where a later product exceeds that reference by about 2^7 (a sum of
    # exp2 overflows) does the tile take the statistics of the online softmax instead.
    m_i, l_i = _stats_first_ref(q, KD, b, h, pos, M, M_VIS, m_full, scale2, BM, D, S_C, L_C)
    if tl.max((l_i == float("inf")).to(tl.int32), 0) > 0:
        m_i, l_i = _stats_online(q, KD, b, h, pos, M, M_VIS, m_full, scale2, BM, D, S_C, L_C)
    # rows that see nothing: lse = 0 (P = 0 in pass 2)
    lse = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))
    # pass 2: P = exp2(s - lse) summed over the heads of the group, max-pooled to blocks (_pool_store);
    # up to M_VIS from the products, then P = 0 (sub-blocks no query of the tile sees: no products).
    # The products are taken transposed, K̃ q^T: a thread of the tensor cores' tile then holds a quarter
    # of a token's heads in its own registers, so the sum over the heads is mostly additions in
    # registers and two shuffles, where rows of (token, head) spread the heads over 8 threads.
    t_tok = tile * BT + tl.arange(0, BT)
    carry = tl.full([BT], float("-inf"), tl.float32)
    for m0 in range(0, tl.cdiv(M_VIS, BM) * BM, BM):
        offs_m = m0 + tl.arange(0, BM)
        sT = tl.dot(KD.load([b, h, m0, 0]).reshape(BM, D), tl.trans(q))  # (BM, ROWS)
        p = tl.exp2(sT * scale2 - lse[None, :])
        if m0 >= m_full:
            vis = (
                (offs_m[:, None] < M)
                & (offs_m[:, None] * S_C + L_C - 1 <= pos[None, :])
                & row_ok[None, :]
            )
            p = tl.where(vis, p, 0.0)
        P = tl.trans(tl.sum(tl.reshape(p, (BM, BT, GP)), 2))  # (BT, BM)
        carry = _pool_store(P, m0, carry, OUT, bh, t_tok, T, M, NB, BT, NBT, R_SUB, P_OVER)
    for m0 in range(tl.cdiv(M_VIS, BM) * BM, NB * R_SUB, BM):
        carry = _pool_store(
            tl.zeros([BT, BM], tl.float32),
            m0,
            carry,
            OUT,
            bh,
            t_tok,
            T,
            M,
            NB,
            BT,
            NBT,
            R_SUB,
            P_OVER,
        )


@triton.jit
def _masked_products(
    q,
    KD,
    b,
    h,
    pos,
    M,
    m0,
    m_full,
    BM: tl.constexpr,
    D: tl.constexpr,
    S_C: tl.constexpr,
    L_C: tl.constexpr,
):
    """q K̃^T of the sub-blocks m0 .. m0 + BM - 1 (ROWS, BM); -inf where a row's query does not see them
    (from m_full on: the tiles before it every row sees)."""
    s = tl.dot(q, tl.trans(KD.load([b, h, m0, 0]).reshape(BM, D)))  # zeros past M
    if m0 >= m_full:
        offs_m = m0 + tl.arange(0, BM)
        vis = (offs_m[None, :] < M) & (offs_m[None, :] * S_C + L_C - 1 <= pos[:, None])
        s = tl.where(vis, s, float("-inf"))
    return s


@triton.jit
def _stats_first_ref(
    q,
    KD,
    b,
    h,
    pos,
    M,
    M_VIS,
    m_full,
    scale2,
    BM: tl.constexpr,
    D: tl.constexpr,
    S_C: tl.constexpr,
    L_C: tl.constexpr,
):
    """(m, l) of each row with m its largest scaled product in the first tile (0 if it sees none there,
    and then none at all), l = sum of exp2(s scale2 - m) over every sub-block it sees. The max is taken
    of the raw products, so that scaling and subtracting it are one multiply-add."""
    s = _masked_products(q, KD, b, h, pos, M, 0, m_full, BM, D, S_C, L_C)
    m = tl.max(s, 1) * scale2
    m = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(tl.exp2(s * scale2 - m[:, None]), 1)
    for m0 in range(BM, M_VIS, BM):
        s = _masked_products(q, KD, b, h, pos, M, m0, m_full, BM, D, S_C, L_C)
        l += tl.sum(tl.exp2(s * scale2 - m[:, None]), 1)
    return m, l


@triton.jit
def _stats_online(
    q,
    KD,
    b,
    h,
    pos,
    M,
    M_VIS,
    m_full,
    scale2,
    BM: tl.constexpr,
    D: tl.constexpr,
    S_C: tl.constexpr,
    L_C: tl.constexpr,
):
    """_stats_first_ref's (m, l) with m each row's running maximum (online softmax): no sum overflows."""
    m = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l = tl.zeros([q.shape[0]], tl.float32)
    for m0 in range(0, M_VIS, BM):
        s = _masked_products(q, KD, b, h, pos, M, m0, m_full, BM, D, S_C, L_C)
        m_new = tl.maximum(m, tl.max(s, 1) * scale2)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s * scale2 - m_safe[:, None]), 1)
        m = m_new
    return tl.where(m == float("-inf"), 0.0, m), l


@triton.jit
def _pool_store(
    P,
    m0,
    carry,
    OUT,
    bh,
    t_tok,
    T,
    M,
    NB,
    BT: tl.constexpr,
    NBT: tl.constexpr,
    R_SUB: tl.constexpr,
    P_OVER: tl.constexpr,
):
    """Stage 2 of the sub-blocks m0 .. m0 + NBT * r - 1, P (BT, NBT * r), into Q of their NBT blocks:
    block b is overlapped by its own r sub-blocks and by the last p of block b - 1 (`last`, shifted by
    one block; the first of the NBT blocks takes `carry`, the last p of the block before them).
    Returns the carry of the next NBT blocks."""
    i = tl.arange(0, NBT)
    # sub-blocks that do not exist yet
    P = tl.where((m0 + tl.arange(0, NBT * R_SUB) < M)[None, :], P, float("-inf"))
    P3 = tl.reshape(P, (BT, NBT, R_SUB))
    own = tl.max(P3, 2)  # (BT, NBT): max over each block's own r sub-blocks
    # the defaults: the block's last sub-block itself, taken from its thread, not a max
    if P_OVER == 1:
        last = tl.reshape(
            tl.gather(P3, tl.full([BT, NBT, 1], R_SUB - 1, tl.int32), axis=2), (BT, NBT)
        )
    else:
        last = tl.max(
            tl.where(tl.arange(0, R_SUB)[None, None, :] >= R_SUB - P_OVER, P3, float("-inf")), 2
        )
    # last[:, j - 1]
    before = tl.gather(last, tl.maximum(i - 1, 0)[None, :] + 0 * t_tok[:, None], axis=1)
    before = tl.where(i[None, :] == 0, carry[:, None], before)
    blocks = m0 // R_SUB + i
    out = (bh * T + t_tok[:, None]) * NB + blocks[None, :]
    tl.store(OUT + out, tl.maximum(own, before), mask=(t_tok[:, None] < T) & (blocks[None, :] < NB))
    return tl.max(tl.where(i[None, :] == NBT - 1, last, float("-inf")), 1)


def query_aware_scores(q, K_sub, q_pos, nb, cfg):
    """pooling.query_aware_scores for a chunk of queries (the twin says what it computes)."""
    Bz, H_q, T, D = q.shape
    H_kv, M = K_sub.shape[1], K_sub.shape[2]
    G, GP = H_q // H_kv, triton.next_power_of_2(H_q // H_kv)
    r, p = cfg.r, cfg.p
    if M == 0:  # no sub-block complete: no block has a score
        return q.new_full((Bz, H_kv, T, nb), float("-inf"), dtype=torch.float32)
    BT = max(1, 128 // GP)  # about 128 rows x 64 sub-blocks a tile: the fastest of a sweep
    NBT = max(1, 64 // r)
    out = torch.empty(Bz, H_kv, T, nb, device=q.device, dtype=torch.float32)
    # q in the projections' layout, as the model makes it: a view, not copied
    if q.stride()[1:] != (D, H_q * D, 1):
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    # K̃ may be a view of a longer buffer (a prefill's so far)
    kd = tma_descriptor(K_sub, (1, 1, NBT * r, D))
    _qscore_kernel[(triton.cdiv(T, BT), Bz * H_kv)](
        q,
        kd,
        q_pos.to(torch.int32).contiguous(),
        out,
        1.0 / math.sqrt(D),
        T,
        M,
        nb,
        q.stride(0),
        H_kv=H_kv,
        G=G,
        GP=GP,
        D=D,
        BT=BT,
        R_SUB=r,
        P_OVER=p,
        S_C=cfg.s_c,
        L_C=cfg.l_c,
        NBT=NBT,
        num_warps=4,
        num_stages=2,
    )
    return out


@triton.jit
def _qscore1_stats(
    Q,
    KS,
    QPOS,
    S_OUT,
    MX,
    SM,
    scale,
    M,
    NC,
    H_kv: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    CM: tl.constexpr,
    S_C: tl.constexpr,
    L_C: tl.constexpr,
):
    """Decode (T = 1), pass 1, key-parallel: program (row, chunk) scores the query's G heads against
    CM compressed keys, keeps the logits and the chunk's softmax statistics (max, sum of exp) per head."""
    r, c = tl.program_id(0), tl.program_id(1)
    offs_g, offs_d, offs_m = tl.arange(0, GP), tl.arange(0, D), c * CM + tl.arange(0, CM)
    q = tl.load(
        Q + (r * G + offs_g[:, None]) * D + offs_d[None, :], mask=(offs_g < G)[:, None], other=0.0
    )
    pos = tl.load(QPOS + r // H_kv)
    ks = tl.load(
        KS + (r * M + offs_m[:, None]) * D + offs_d[None, :], mask=(offs_m < M)[:, None], other=0.0
    )
    vis = (offs_m < M) & (offs_m * S_C + L_C - 1 <= pos)  # the sub-block lies wholly in the past
    s = tl.where(vis[None, :], tl.dot(q, tl.trans(ks)) * scale, float("-inf"))  # (GP, CM)
    tl.store(
        S_OUT + (r * GP + offs_g[:, None]) * M + offs_m[None, :], s, mask=(offs_m < M)[None, :]
    )
    mx = tl.max(s, 1)
    sm = tl.sum(tl.exp(s - tl.where(mx == float("-inf"), 0.0, mx)[:, None]), 1)
    tl.store(MX + (r * NC + c) * GP + offs_g, mx)
    tl.store(SM + (r * NC + c) * GP + offs_g, sm)


@triton.jit
def _qscore1_blocks(
    S_IN,
    MX,
    SM,
    OUT,
    M,
    NB,
    NC,
    G: tl.constexpr,
    GP: tl.constexpr,
    NCP: tl.constexpr,
    NBT: tl.constexpr,
    R_SUB: tl.constexpr,
    P_OVER: tl.constexpr,
    PP: tl.constexpr,
):
    """Decode (T = 1), pass 2: program (row, block chunk) merges the softmax statistics of all chunks,
    forms P[m] = Σ_g softmax_m over the NBT * r sub-blocks of its NBT blocks (one contiguous tile)
    and max-pools them to blocks. Block b is also overlapped by the last p sub-blocks of block b - 1:
    their max is taken per block of the tile and shifted by one block; the first block's comes from
    the p sub-blocks just before the tile."""
    r, cb = tl.program_id(0), tl.program_id(1)
    offs_g, offs_c = tl.arange(0, GP), tl.arange(0, NCP)
    st = (r * NC + offs_c[:, None]) * GP + offs_g[None, :]  # (NCP, GP), contiguous over the heads
    mx = tl.load(MX + st, mask=(offs_c < NC)[:, None], other=float("-inf"))
    sm = tl.load(SM + st, mask=(offs_c < NC)[:, None], other=0.0)
    m_g = tl.max(mx, 0)
    m_g = tl.where(m_g == float("-inf"), 0.0, m_g)  # a head that sees nothing: P = 0
    l_g = tl.sum(sm * tl.exp(mx - m_g[None, :]), 0)
    l_g = tl.where(l_g > 0, l_g, 1.0)
    row = S_IN + (r * GP + offs_g) * M  # (GP,) each head's logits
    ok_g = (offs_g < G)[:, None]
    # the blocks' own sub-blocks: m = b * r ... b * r + r - 1, contiguous over the chunk
    m = cb * NBT * R_SUB + tl.arange(0, NBT * R_SUB)
    # (GP, NBT * r)
    s = tl.load(row[:, None] + m[None, :], mask=ok_g & (m < M)[None, :], other=float("-inf"))
    P = tl.sum(tl.exp(s - m_g[:, None]) / l_g[:, None], 0)
    P3 = tl.reshape(tl.where(m < M, P, float("-inf")), (NBT, R_SUB))
    own = tl.max(P3, 1)  # (NBT,)
    # (NBT,)
    last = tl.max(tl.where(tl.arange(0, R_SUB)[None, :] >= R_SUB - P_OVER, P3, float("-inf")), 1)
    # the p sub-blocks before the tile (the block before its first), then last shifted by one block
    j = tl.arange(0, PP)
    m = cb * NBT * R_SUB - P_OVER + j
    ok = (j < P_OVER) & (m >= 0) & (m < M)
    s = tl.load(row[:, None] + m[None, :], mask=ok_g & ok[None, :], other=float("-inf"))  # (GP, PP)
    first = tl.max(
        tl.where(ok, tl.sum(tl.exp(s - m_g[:, None]) / l_g[:, None], 0), float("-inf")), 0
    )
    i = tl.arange(0, NBT)
    # last[i - 1]
    before = tl.max(tl.where(i[:, None] == i[None, :] + 1, last[None, :], float("-inf")), 1)
    before = tl.where(i == 0, first, before)
    blk = cb * NBT + i
    tl.store(OUT + r * NB + blk, tl.maximum(own, before), mask=blk < NB)


def query_aware_scores_decode(q, K_sub, q_pos, nb, cfg, *, CM=128, NBT=64):
    """pooling.query_aware_scores for one query per sequence (decode), as two key-parallel kernels:
    the grid spans the compressed keys, not just the Bz * H_kv rows, so one query fills the GPU."""
    Bz, H_q, T, D = q.shape
    H_kv, M = K_sub.shape[1], K_sub.shape[2]
    R, G = Bz * H_kv, H_q // H_kv
    GP = gp(G)
    r, p = cfg.r, cfg.p
    if M == 0:
        return q.new_full((Bz, H_kv, 1, nb), float("-inf"), dtype=torch.float32)
    NC = triton.cdiv(M, CM)
    s = torch.empty(R, GP, M, device=q.device, dtype=torch.float32)
    mx = torch.empty(R, NC, GP, device=q.device, dtype=torch.float32)
    sm = torch.empty_like(mx)
    out = torch.empty(Bz, H_kv, 1, nb, device=q.device, dtype=torch.float32)
    _qscore1_stats[(R, NC)](
        q.contiguous(),
        K_sub.contiguous(),
        q_pos.contiguous(),
        s,
        mx,
        sm,
        1.0 / math.sqrt(D),
        M,
        NC,
        H_kv=H_kv,
        G=G,
        GP=GP,
        D=D,
        CM=CM,
        S_C=cfg.s_c,
        L_C=cfg.l_c,
    )
    _qscore1_blocks[(R, triton.cdiv(nb, NBT))](
        s,
        mx,
        sm,
        out,
        M,
        nb,
        NC,
        G=G,
        GP=GP,
        NCP=triton.next_power_of_2(NC),
        NBT=NBT,
        R_SUB=r,
        P_OVER=p,
        PP=triton.next_power_of_2(max(p, 1)),
    )
    return out


@triton.jit
def _append_kernel(
    RK,
    RC,
    KS,
    CS,
    K,
    C,
    POS,
    M,
    H_kv: tl.constexpr,
    D: tl.constexpr,
    L_C: tl.constexpr,
    LP: tl.constexpr,
    S_C: tl.constexpr,
    HAS_C: tl.constexpr,
    POOLED: tl.constexpr,
):
    """Program r = one row (sequence, KV head): ring (R, l_c, d), K̃ (R, M, d), c̃ (R, M). Vectors over
    the ring (j) and the head dim (dd); the row's scalars are broadcast to them where they gate a
    store (the interpreter needs vector masks)."""
    r = tl.program_id(0)
    p = tl.load(POS + r // H_kv)  # the new token's position
    j, dd = tl.arange(0, LP), tl.arange(0, D)
    slot = p % L_C
    k_new = tl.load(K + r * D + dd)
    if HAS_C:
        c_new = tl.load(C + r)
    if POOLED:  # the ring as it is after this token: its mean is the sub-block ending at p, if any
        start = p + 1 - L_C
        m = tl.maximum(start, 0) // S_C
        ring = tl.load(
            RK + (r * L_C + j)[:, None] * D + dd[None, :], mask=(j < L_C)[:, None], other=0.0
        )
        ring = tl.where((j == slot)[:, None], k_new[None, :], ring).to(tl.float32)  # (LP, D)
        sd = dd * 0 + start
        tl.store(
            KS + (r * M + m) * D + dd,
            (tl.sum(ring, 0) / L_C).to(KS.dtype.element_ty),
            mask=(sd >= 0) & (sd % S_C == 0),
        )
        if HAS_C:
            ring_c = tl.where(j == slot, c_new, tl.load(RC + r * L_C + j, mask=j < L_C, other=0.0))
            sj = j * 0 + start
            tl.store(
                CS + r * M + m + j * 0,
                tl.sum(ring_c, 0) / L_C + j * 0.0,
                mask=(j == 0) & (sj >= 0) & (sj % S_C == 0),
            )
    tl.store(RK + (r * L_C + slot) * D + dd, k_new)  # (the ring's old value there was never used)
    if HAS_C:
        tl.store(RC + r * L_C + slot + j * 0, c_new + j * 0.0, mask=j == 0)


def append_subblocks(ring_k, ring_c, K_sub, c_sub, k, c, *, pos, cfg):
    """pooling.append_subblocks as one launch, one program per row."""
    Bz, H_kv, l_c, d = ring_k.shape
    has_c = c is not None
    _append_kernel[(Bz * H_kv,)](
        ring_k,
        ring_c if has_c else ring_k,
        K_sub,
        c_sub if has_c else K_sub,
        k.contiguous(),
        c.contiguous() if has_c else k,
        pos,
        K_sub.shape[2],
        H_kv=H_kv,
        D=d,
        L_C=l_c,
        LP=triton.next_power_of_2(l_c),
        S_C=cfg.s_c,
        HAS_C=has_c,
        POOLED=K_sub.shape[2] > 0,
    )
