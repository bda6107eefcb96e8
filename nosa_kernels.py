"""
The kernels of nosa.py: Γ(t) as select_blocks defines it, for one decode step (select_step: a
block mask) and for the queries of a parallel forward (select_tiles: tiles of neighbouring queries,
the form the attention kernels read, so no (T, nb) tensor is ever whole).

Both find the k_q - 1 best candidates by Q without sorting: keys put the score above the block id
(ties go to the more recent block), and each round takes the largest key below the last (_kth_of);
select_tiles first narrows every row to a few keys (_kth_best). The E-picks come from each row's
list of its best candidates by E (_e_picks).
"""

import torch
import triton
import triton.language as tl

GROUPS, CAP_PER_PICK = 128, 4  # the tile selection's groups of blocks and its room for keys
SELECT_ROWS, SELECT_SCORES = 4096, 2**23  # queries scored and selected at a time (select_rows)


def select_rows(nb):
    """Queries scored and selected at a time over nb blocks: SELECT_ROWS, or a multiple of it while
    the (rows, nb) scores hold at most SELECT_SCORES: a short sequence takes fewer, fuller launches."""
    return SELECT_ROWS * max(1, SELECT_SCORES // (SELECT_ROWS * nb))


@triton.jit
def _ordered(s):
    """An int32 that orders as the float s does (-0.0 tied with +0.0, -inf lowest)."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# below and above every candidate's key
MIN_KEY, MAX_KEY = (tl.constexpr(-(2**63)), tl.constexpr(2**63 - 1))


@triton.jit
def _keys(QS, q_blk, ok, b, nb, N_SINK: tl.constexpr, N_WIN: tl.constexpr):
    """The keys of blocks b in rows (query token, KV head) of scores QS (each row's first of nb scores),
    q_blk their query's block, ok where they exist (one row: QS and q_blk scalars, b and ok (N,); R rows:
    (R, 1), b (1, N)): int64 that order as (score, block), ties to the more recent block; MIN_KEY where b
    is not a candidate (causal, not forced)."""
    cand = ok & (b >= N_SINK) & (b < q_blk - N_WIN) & (b < nb)
    s = tl.load(QS + b, mask=cand, other=float("-inf"))
    return tl.where(cand, (_ordered(s).to(tl.int64) << 32) | b.to(tl.int64), MIN_KEY)


@triton.jit
def _kth_of(x, R: tl.constexpr, KQ: tl.constexpr):
    """The KQ-th largest of each row of x (R, N), whose values are distinct but for MIN_KEY: (R,), MIN_KEY
    where a row has fewer. KQ rounds, each taking the largest below the last."""
    kth = tl.full([R], MAX_KEY, tl.int64)
    for _ in range(KQ):
        kth = tl.max(tl.where(x < kth[:, None], x, MIN_KEY), 1)
    return kth


@triton.jit
def _kth_best(
    QS,
    ok,
    q_blk,
    nb,
    SCR,
    R: tl.constexpr,
    NBP: tl.constexpr,
    NG: tl.constexpr,
    CAP: tl.constexpr,
    N_SINK: tl.constexpr,
    N_WIN: tl.constexpr,
    KQ: tl.constexpr,
):
    """The KQ-th best candidate key of each of R rows (_keys' arguments, (R, 1)), (R,), in a few passes rather
    than KQ rounds over every block:
      1. the best key of each of NG groups (group g: blocks g, g + NG, g + 2 NG, ...);
      2. L, the KQ-th best of those group bests; each of the row's KQ best keys is >= L (KQ group bests
         are, so a key below L has KQ keys above it);
      3. the keys >= L, written to SCR (R, CAP) in order, and KQ rounds over those.
    A row with more than CAP keys >= L (ties on ties) takes KQ rounds over all its blocks instead."""
    g = tl.arange(0, NG)[None, :]
    best = tl.full([R, NG], MIN_KEY, tl.int64)
    for i in range(0, NBP, NG):
        best = tl.maximum(best, _keys(QS, q_blk, ok, i + g, nb, N_SINK, N_WIN))
    L = _kth_of(best, R, KQ)
    r, n = tl.arange(0, R), tl.zeros([R], tl.int32)
    for i in range(0, NBP, NG):
        key = _keys(QS, q_blk, ok, i + g, nb, N_SINK, N_WIN)
        take = (key > MIN_KEY) & (key >= L[:, None])
        at = n[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
        tl.store(SCR + r[:, None] * CAP + at, key, mask=take & (at < CAP))
        n += tl.sum(take.to(tl.int32), 1)
    tl.debug_barrier()  # written before read back
    j = tl.arange(0, CAP)
    kth = _kth_of(
        tl.load(SCR + r[:, None] * CAP + j[None, :], mask=j[None, :] < n[:, None], other=MIN_KEY),
        R,
        KQ,
    )
    if tl.max(n, 0) > CAP:
        every = tl.full([R], MAX_KEY, tl.int64)
        for _ in range(KQ):
            m = tl.full([R, NG], MIN_KEY, tl.int64)
            for i in range(0, NBP, NG):
                key = _keys(QS, q_blk, ok, i + g, nb, N_SINK, N_WIN)
                m = tl.maximum(m, tl.where(key < every[:, None], key, MIN_KEY))
            every = tl.max(m, 1)
        kth = tl.where(n > CAP, every, kth)
    return kth


@triton.jit
def _q_picks(
    key,
    b,
    q_blk,
    kth,
    nb,
    N_SINK: tl.constexpr,
    N_WIN: tl.constexpr,
    K: tl.constexpr,
    KQ: tl.constexpr,
):
    """Γ(t) as select_blocks makes it, but for its E-picks, at blocks b of rows whose keys are `key`
    (_keys, which says the shapes), query's block q_blk, and KQ-th best key kth (MIN_KEY where there are
    fewer), so that the k_q - 1 best candidates by Q are those with keys >= kth (top_desc's order: ties to
    the more recent block). nb: the blocks that exist. Returns a bool mask of key's shape."""
    causal = (b <= q_blk) & (b < nb)
    forced = causal & ((b < N_SINK) | (b >= q_blk - N_WIN))
    few = tl.minimum(q_blk + 1, nb) <= K  # fewer than k causal blocks: all of them
    return tl.where(few, causal, forced | ((key > MIN_KEY) & (key >= kth) & (KQ > 0)))


@triton.jit
def _e_picks(
    QS,
    IDS,
    q_blk,
    nb,
    kth,
    N_LIST: tl.constexpr,
    NLP: tl.constexpr,
    N_SINK: tl.constexpr,
    N_WIN: tl.constexpr,
    K: tl.constexpr,
    KQ: tl.constexpr,
    N_CORE: tl.constexpr,
):
    """Γ(t)'s E-picks of one row (QS its nb scores, q_blk its query's block, kth as _q_picks): the first
    N_CORE members of its list of the best candidates by E (IDS, N_LIST, best first) that Q did not take.
    Returns (ids (NLP,), whether each is picked (NLP,))."""
    j = tl.arange(0, NLP)
    ids = tl.load(IDS + j, mask=j < N_LIST, other=-1)
    key = _keys(QS, q_blk, ids >= 0, ids, nb, N_SINK, N_WIN)
    taken = (key > MIN_KEY) & (key >= kth) & (KQ > 0)  # Q's picks at the ids
    pick = (ids >= 0) & ~taken
    # more than k causal blocks (a vector: the interpreter's masks)
    many = j * 0 + tl.minimum(q_blk + 1, nb) > K
    return ids, pick & (tl.cumsum(pick.to(tl.int32), 0) <= N_CORE) & many


@triton.jit
def _select_step_kernel(
    QS,
    IDS,
    POS,
    OUT,
    nb,
    H_kv: tl.constexpr,
    NBP: tl.constexpr,
    N_LIST: tl.constexpr,
    NLP: tl.constexpr,
    B: tl.constexpr,
    N_SINK: tl.constexpr,
    N_WIN: tl.constexpr,
    K: tl.constexpr,
    KQ: tl.constexpr,
    N_CORE: tl.constexpr,
):
    """One program per row (sequence, KV head) of a decode step: its mask (nb int8), the KQ-th best key
    found by KQ rounds over the row, each taking the best key left."""
    r = tl.program_id(0)
    q_blk = tl.load(POS + r // H_kv) // B
    b = tl.arange(0, NBP)
    key = _keys(QS + r * nb, q_blk, b >= 0, b, nb, N_SINK, N_WIN)
    kth, rest = tl.full([], MIN_KEY, tl.int64), key
    for _ in range(KQ):  # the keys are distinct: each round takes the best that is left
        kth = tl.max(rest, 0)
        rest = tl.where(rest == kth, MIN_KEY, rest)
    tl.store(
        OUT + r * nb + b,
        _q_picks(key, b, q_blk, kth, nb, N_SINK, N_WIN, K, KQ).to(tl.int8),
        mask=b < nb,
    )
    if N_CORE > 0:
        ids, pick = _e_picks(
            QS + r * nb, IDS + r * N_LIST, q_blk, nb, kth, N_LIST, NLP, N_SINK, N_WIN, K, KQ, N_CORE
        )
        tl.debug_barrier()  # the mask above is written before these entries are set
        tl.store(OUT + r * nb + ids, tl.full([NLP], 1, tl.int8), mask=pick)


# the lengths are not specialized on: one compile serves prompts of every length (serving)
@triton.jit(do_not_specialize=["T", "nb", "first", "NQB", "U"])
def _select_tiles_kernel(
    QS,
    IDS,
    POS,
    SCRATCH,
    SCR_K,
    T_IDX,
    T_BITS,
    T_N,
    T,
    nb,
    first,
    NQB,
    U,
    H_kv: tl.constexpr,
    BT: tl.constexpr,
    UP: tl.constexpr,
    NBP: tl.constexpr,
    NG: tl.constexpr,
    CAP: tl.constexpr,
    N_LIST: tl.constexpr,
    NLP: tl.constexpr,
    B: tl.constexpr,
    N_SINK: tl.constexpr,
    N_WIN: tl.constexpr,
    K: tl.constexpr,
    KQ: tl.constexpr,
    N_CORE: tl.constexpr,
):
    """One program per tile of BT queries and KV head: the KQ-th best keys of all its queries at once
    (_kth_best), then each query's mask in turn, one bit per query and block, its E-picks OR-ed into the
    program's scratch row; then the union, compacted."""
    tile, bh = tl.program_id(0), tl.program_id(1)
    prog = bh * tl.num_programs(0) + tile
    row = SCRATCH + prog * NBP
    blocks = tl.arange(0, NBP)
    r = tl.arange(0, BT)
    rows = tile * BT + r
    q_blks = tl.load(POS + (bh // H_kv) * T + rows, mask=rows < T, other=0) // B
    kths = tl.full([BT], MIN_KEY, tl.int64)
    if KQ > 0:
        kths = _kth_best(
            QS + (bh * T + rows[:, None]) * nb,
            rows[:, None] < T,
            q_blks[:, None],
            nb,
            SCR_K + prog * BT * CAP,
            BT,
            NBP,
            NG,
            CAP,
            N_SINK,
            N_WIN,
            KQ,
        )
    if N_CORE > 0:
        tl.store(row + blocks, tl.zeros([NBP], tl.int32))
        tl.debug_barrier()  # zero before the E-picks are OR-ed in
    bits = tl.zeros([NBP], tl.int32)
    for j in range(BT):
        t = tile * BT + j
        if t < T:
            q_blk = tl.load(POS + (bh // H_kv) * T + t) // B
            kth = tl.max(tl.where(r == j, kths, MIN_KEY), 0)
            key = _keys(QS + (bh * T + t) * nb, q_blk, blocks >= 0, blocks, nb, N_SINK, N_WIN)
            bits = bits | (
                _q_picks(key, blocks, q_blk, kth, nb, N_SINK, N_WIN, K, KQ).to(tl.int32) << j
            )
            if N_CORE > 0:
                ids, pick = _e_picks(
                    QS + (bh * T + t) * nb,
                    IDS + (bh * NQB + q_blk - first) * N_LIST,
                    q_blk,
                    nb,
                    kth,
                    N_LIST,
                    NLP,
                    N_SINK,
                    N_WIN,
                    K,
                    KQ,
                    N_CORE,
                )
                tl.atomic_or(
                    row + ids, tl.zeros([NLP], tl.int32) + (1 << j), mask=pick, sem="relaxed"
                )
    if N_CORE > 0:
        tl.debug_barrier()
        bits = bits | tl.load(row + blocks, cache_modifier=".cg")
    bits = tl.where(blocks < nb, bits, 0)
    union = bits != 0
    at = tl.cumsum(union.to(tl.int32), 0) - 1  # place in the tile's list, ascending by block
    tl.store(T_IDX + prog * U + at, blocks, mask=union)
    tl.store(T_BITS + prog * U + at, bits, mask=union)
    n = tl.sum(union.to(tl.int32), 0)
    tl.store(T_N + prog, n)
    pad = tl.arange(0, UP)  # the rest of the list: -1, no bits
    tl.store(T_IDX + prog * U + pad, tl.full([UP], -1, tl.int32), mask=(pad >= n) & (pad < U))
    tl.store(T_BITS + prog * U + pad, tl.zeros([UP], tl.int32), mask=(pad >= n) & (pad < U))


def select_step(Q, e_list_ids, q_pos, cfg):
    """nosa.select_step (same arguments and result)."""
    Bz, H_kv, _, nb = Q.shape
    n = e_list_ids.shape[-1] if e_list_ids is not None else 0
    out = torch.empty(Bz, H_kv, 1, nb, dtype=torch.int8, device=Q.device)
    ids = e_list_ids.contiguous() if n else out  # not read when there is no list
    _select_step_kernel[(Bz * H_kv,)](
        Q.contiguous(),
        ids,
        q_pos.reshape(Bz).contiguous(),
        out,
        nb,
        H_kv=H_kv,
        NBP=triton.next_power_of_2(nb),
        N_LIST=n,
        NLP=triton.next_power_of_2(max(n, 1)),
        B=cfg.B,
        N_SINK=cfg.n_sink,
        N_WIN=cfg.n_win,
        K=cfg.k,
        KQ=max(cfg.k_q_free, 0),
        N_CORE=cfg.n_core if n else 0,
        num_warps=8,
    )
    return out.view(torch.bool)


def select_tiles(Q, lists, first, q_pos, cfg, *, BT, U):
    """Γ(t) of T queries at q_pos (Bz, T) from their scores Q (Bz, H_kv, T, nb) and each query
    block's list (eviction.e_lists_by_block of the blocks from `first` on, or None), as
    nosa.select_blocks makes it, written as tiles of BT queries (attention_kernels.Tiles: each
    tile's union of at most U blocks, ascending, and a bit per query). Returns (idx, bits, n)."""
    Bz, H_kv, T, nb = Q.shape
    nT, NBP = triton.cdiv(T, BT), triton.next_power_of_2(nb)
    n = lists.shape[-1] if lists is not None else 0
    idx = torch.empty(Bz, H_kv, nT, U, dtype=torch.int32, device=Q.device)
    bits, count = (
        torch.empty_like(idx),
        torch.empty(Bz, H_kv, nT, dtype=torch.int32, device=Q.device),
    )
    KQ = max(cfg.k_q_free, 0)
    NG, CAP = min(NBP, GROUPS), triton.next_power_of_2(max(KQ, 1) * CAP_PER_PICK)
    scratch = torch.empty(
        Bz * H_kv * nT, NBP if n and cfg.n_core else 1, dtype=torch.int32, device=Q.device
    )
    keys = torch.empty(Bz * H_kv * nT, BT * CAP if KQ else 1, dtype=torch.int64, device=Q.device)
    ids = lists.contiguous() if n else idx  # not read when there is no list
    _select_tiles_kernel[(nT, Bz * H_kv)](
        Q.contiguous(),
        ids,
        q_pos.contiguous(),
        scratch,
        keys,
        idx,
        bits,
        count,
        T,
        nb,
        first,
        lists.shape[2] if n else 1,
        U,
        H_kv=H_kv,
        BT=BT,
        UP=triton.next_power_of_2(U),
        NBP=NBP,
        NG=NG,
        CAP=CAP,
        N_LIST=n,
        NLP=triton.next_power_of_2(max(n, 1)),
        B=cfg.B,
        N_SINK=cfg.n_sink,
        N_WIN=cfg.n_win,
        K=cfg.k,
        KQ=KQ,
        N_CORE=cfg.n_core if n else 0,
        num_warps=4,
    )
    return idx, bits, count
