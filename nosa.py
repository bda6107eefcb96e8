"""
NOSA: Native and Offloadable Sparse Attention (Huang et al., arXiv 2510.13602). Read docs/METHOD.md first.

Notation (docs/METHOD.md §2; the parameters are config.Config's fields):
  B           KV block size in tokens: the unit of selection, caching and transfer
  l_c, s_c    sub-block length and stride of the two-stage pooling (pooling.py)
  n_sink      attention-sink blocks at the start, always selected
  n_win       sliding-window blocks before the query's own block, always selected
  F(t)        forced blocks: sinks + window + the query's own block q_t = t // B;  |F| <= n_sink + n_win + 1
  k           blocks selected per (query token, KV head);  k_q query-aware budget (own block included);
              k_e = k - k_q query-agnostic budget (sinks and window included)
  Q[t, b]     query-aware block score (pooling.py);  E[b] query-agnostic eviction score (eviction.py)
  Γ_q(t)      F(t) + the k_q - 1 best other causal blocks by Q
  Γ(t)        Γ_q(t) + the best remaining causal blocks by E, up to k in all
  H_q, H_kv   query and KV heads, G = H_q / H_kv query heads share one KV head and one selection

How the budget splits (the authors' reading, which makes the theorem hold at every step; docs/METHOD.md
§3 and §5). Once more than k blocks are causal, Γ(t) is
  - k_q blocks chosen for this query: its own block q_t and the k_q - 1 best other candidates by Q
    (the authors take the top n_sink + n_win + k_q blocks by Q with F(t) set to +inf: the same set);
  - k_e = k - k_q blocks that do not depend on the query: the n_sink sinks, the n_win window blocks
    before q_t, and the *core*, the n_core = k_e - n_sink - n_win best candidates by E
    (eviction.py); core members that Q already picked are replaced by the next best by E.

Locality: γ(t) = |Γ(t) ∩ Γ(t-1)| / |Γ(t)| >= k_e / k at every step, so at most k_q - 1 blocks per
(sequence, layer, KV head) are new at a step besides the query's own (docs/METHOD.md §5 proves it).
The definition (select_blocks from E) ranks all candidates by E at every position; both paths
select from a short list of the best candidates by E instead, kept by the eviction policy
(eviction.join_core_list): the parallel forward one list per query block, block after block
(eviction.block_lists, carried from chunk to chunk through a prefill), decoding one per row, step
after step; the tests check that both select what the definition selects. The parallel forward
writes its selection as tiles of neighbouring queries (select_tiles, read by the attention kernels:
attention.Tiles), a decode step as a block mask (select); the same rules (_keys, _q_picks, _e_picks)
make every row of both in the kernels.

Attention modes (docs/METHOD.md §7), all from the same code:
  full      all causal tokens, no bias
  infllmv2  F + the best blocks by Q only, no bias
  dma       F + the best blocks by E only, bias exp(c)
  nosa      dual selection, bias c (ED-DMA)
"""
import torch
import triton
import triton.language as tl
from torch.profiler import record_function

import attention
import eviction
import fast
import pooling

# -----------------------------------------------------------------------------
# Dual selection


def select_blocks(Q, E, q_pos, cfg, core_ids=None):
    """Γ(t) for every query as a block mask.

    Q: (..., T, nb) query-aware scores, E: (..., nb) eviction scores, q_pos: (..., T) positions.
    Instead of E, a list of the best n_core + k_q - 1 candidates by E, best first (eviction.core_list)
    may come, the same for every query (core_ids (..., n): decoding, which keeps it by the eviction
    policy) or one per query (core_ids (..., T, n): select makes them per query block); E is then None.
    Returns a bool mask (..., T, nb): True where block b is selected for the query at q_pos.
    Not differentiable: top-k and pooling carry no gradient."""
    nb = Q.shape[-1]
    b = torch.arange(nb, device=Q.device)
    q_blk = (q_pos // cfg.B)[..., None]  # (..., T, 1) the query's own block
    causal = b <= q_blk  # (..., T, nb)
    forced = causal & ((b < cfg.n_sink) | (b >= q_blk - cfg.n_win))  # F(t)
    cand = causal & ~forced
    pick_q = eviction.top_desc(Q, cand, cfg.k_q_free)  # Γ_q(t) \ F(t)
    # E-picks: the core, with the core members Q already took replaced by the next best by E
    if core_ids is not None:  # the first n_core members of the list that Q did not take
        if core_ids.dim() < Q.dim():  # one list for all T queries
            core_ids = core_ids.unsqueeze(-2).expand(*Q.shape[:-1], core_ids.shape[-1])
        ids = core_ids  # (..., T, n)
        pick_e = eviction.core_picks(ids, pick_q.gather(-1, ids.clamp(min=0)), cfg.n_core, nb)
    elif E is not None:
        rest = cand & ~pick_q
        pick_e = rest & (eviction.rank_desc(E.unsqueeze(-2).expand_as(Q), rest) < cfg.n_core)
    else:  # a mode without E (n_core = 0)
        pick_e = torch.zeros_like(pick_q)
    few = causal.sum(-1, keepdim=True) <= cfg.k  # fewer than k causal blocks: take them all
    return torch.where(few, causal, forced | pick_q | pick_e)


GROUPS, CAP_PER_PICK = 128, 4  # the selection kernel's groups of blocks and its room for keys (_kth_best)
SELECT_ROWS, SELECT_SCORES = 4096, 2**23  # queries scored and selected at a time (select_rows)


def select_rows(nb):
    """Queries scored and selected at a time over nb blocks: SELECT_ROWS, or a multiple of it while the
    temporaries (rows, nb) hold at most SELECT_SCORES scores: a short sequence takes fewer, fuller
    launches (at 32K, 4 times fewer), and from 128K on the temporaries are (SELECT_ROWS, nb)."""
    return SELECT_ROWS * max(1, SELECT_SCORES // (SELECT_ROWS * nb))


def select(q, K_sub, core_ids, q_pos, nb, cfg):
    """Score, then select: the path from the pooled caches to Γ(t) as a block mask, the one a decode step
    takes (nosa_decode) and the twin of the parallel forward's (select_tiles), so both pick the same blocks.

    q (Bz, H_q, T, d) at positions q_pos (Bz, T); K̃ (Bz, H_kv, M, d) compressed keys; nb blocks to
    score; core_ids the list of the best n_core + k_q - 1 candidates by E, best first: one per query
    (Bz, H_kv, T, n), from core_lists, or one per row (Bz, H_kv, n) kept by the eviction policy (a
    decode step: kvcache.SubBlockCache); None in a mode without E-picks.
    Returns the block mask (Bz, H_kv, T, nb)."""
    Q = pooling.query_aware_scores(q, K_sub, q_pos, nb, cfg)  # (Bz, H_kv, T, nb)
    if q.shape[2] == 1 and (core_ids is None or core_ids.dim() == 3):
        return select_step(Q, core_ids, q_pos, cfg)
    return select_blocks(Q, None, q_pos[:, None], cfg, core_ids)


def query_lists(lists, q_pos, first, cfg):
    """Each query's list from its block's: lists (Bz, H_kv, n_qb, n) of blocks first.., q_pos (Bz, T)
    -> (Bz, H_kv, T, n)."""
    i = (q_pos // cfg.B - first)[:, None, :, None]
    return lists.gather(2, i.expand(*lists.shape[:2], -1, lists.shape[-1]))


def core_lists(c_sub, q_pos, cfg):
    """Each query's list of its best n_core + k_q - 1 candidates by E: c̃ (Bz, H_kv, M), q_pos (Bz, T)
    -> (Bz, H_kv, T, n)."""
    q_blk = q_pos // cfg.B
    first = int(q_blk.min())
    return query_lists(eviction.block_lists(c_sub, first, int(q_blk.max()), cfg)[0], q_pos, first, cfg)


def select_step(Q, core_ids, q_pos, cfg):
    """select_blocks for one decode step (T = 1) from each row's list of its best candidates by E:
    Q (Bz, H_kv, 1, nb), core_ids (Bz, H_kv, n) or None, q_pos (Bz, 1) -> the block mask (Bz, H_kv, 1, nb).
    One Triton kernel on a GPU (select_step_triton), the torch code (fused) elsewhere."""
    if Q.is_cuda and Q.dtype == torch.float32:
        return select_step_triton(Q, core_ids, q_pos, cfg)
    return select_step_torch(Q, core_ids, q_pos, cfg)


@fast.fused
def select_step_torch(Q, core_ids, q_pos, cfg):
    return select_blocks(Q, None, q_pos[:, None], cfg, core_ids)


def select_tiles(q, K_sub, lists, q_pos, nb, cfg, first):
    """Γ(t) of the parallel forward's queries (training, a prefill's chunk), scored and selected
    select_rows(nb) queries at a time, in the form the training kernels read (attention.Tiles: for each
    tile of BT queries the union of the blocks they selected and which of them selected each), so no
    (T, nb) tensor is ever whole. lists: eviction.block_lists of the query blocks from `first` on, or None.
    One Triton kernel on a GPU (select_tiles_triton), its twin select_tiles_torch elsewhere."""
    T, R = q.shape[2], select_rows(nb)
    BT = attention.tile_size(cfg.G, cfg.B)
    U = min(nb, BT * cfg.k)  # a tile's union holds at most BT * k blocks
    parts = []
    for t in range(0, T, R):  # a multiple of BT: chunks hold whole tiles
        pos = q_pos[:, t:t + R]
        Q = pooling.query_aware_scores(q[:, :, t:t + R], K_sub, pos, nb, cfg)  # (Bz, H_kv, R, nb)
        f = select_tiles_triton if Q.is_cuda and Q.dtype == torch.float32 else select_tiles_torch
        parts.append(f(Q, lists, first, pos, cfg, BT, U))
    idx, bits, n = parts[0] if len(parts) == 1 else (torch.cat(x, 2) for x in zip(*parts))
    return attention.Tiles(idx, bits, n, BT, T)


def select_tiles_torch(Q, lists, first, q_pos, cfg, BT, U):
    """Q (Bz, H_kv, T, nb) scores of T queries at q_pos (Bz, T) -> their tiles (idx, bits, n)."""
    ids = None if lists is None else query_lists(lists, q_pos, first, cfg)
    return attention.mask_to_tiles(select_blocks(Q, None, q_pos[:, None], cfg, ids), BT, U)


def nosa_attention(q, k, v, c, cfg, start=0, pooled=None):
    """One attention layer for the queries at positions start .. start+T-1 over the keys 0 .. S-1,
    S = start + T: the training forward (start = 0, the whole sequence) and one chunk of a prefill
    (model.Transformer.prefill), which selects and attends exactly as the whole forward would.

    q: (Bz, H_q, T, d), k, v: (Bz, H_kv, S, d) with RoPE applied, c: (Bz, H_kv, S) eviction scores
    (None in `full` and `infllmv2` modes). pooled: (K̃, lists) where the caller keeps them (a prefill's
    chunks: kvcache.PromptLayer), the compressed keys and the block_lists of the query blocks from
    start // B on (None in a mode without E-picks), else made here. Returns the output (Bz, H_q, T, d)
    and the selection (attention.Tiles; None in `full` mode)."""
    Bz, _, T, _ = q.shape
    S = k.shape[2]
    q_pos = torch.arange(start, start + T, device=q.device).expand(Bz, T)
    if cfg.attn == "full":
        return attention.sparse_attention(q, k, v, None, None, q_pos, cfg), None
    with torch.no_grad():
        first = start // cfg.B
        if pooled is None:  # K̃, and each query block's list of the best candidates by E where the mode has E-picks
            lists = None
            if c is not None and cfg.n_core > 0:
                lists = eviction.block_lists(pooling.pool_mean(c, cfg), first, (S - 1) // cfg.B, cfg)[0]
            pooled = pooling.compress_keys(k, cfg), lists
        K_sub, lists = pooled
        sel = select_tiles(q, K_sub, lists, q_pos, pooling.n_blocks(S, cfg), cfg, first)
    bias = None if c is None else eviction.attention_bias(c, cfg.attn)
    return attention.sparse_attention(q, k, v, bias, sel, q_pos, cfg), sel


def nosa_decode(q, k, v, c, layer, cache, cfg):
    """The decode half of one attention layer, beside the training half (nosa_attention): one new token
    per sequence, each at its own position cache.len. Its k, v, c join the cache (and the pooled caches
    and the eviction list, kvcache.SubBlockCache.append); Γ(t) is selected by the same select as the
    parallel forward, from K̃ and the row's list of its best candidates by E; attention runs over the
    selected blocks (the GPU slot pool of offload.OffloadCache, or a resident kvcache.KVCache).

    q (Bz, H_q, 1, d), k, v (Bz, H_kv, 1, d), c (Bz, H_kv, 1) or None -> the output (Bz, H_q, 1, d)."""
    cache.append(layer, k[:, :, 0], v[:, :, 0], None if c is None else c[:, :, 0])
    block_mask = None
    if cfg.sparse:
        with record_function("selection"):
            K_sub, core_ids = cache.sub.pooled(layer)
            block_mask = select(q, K_sub, core_ids, cache.len[:, None], cache.n_blocks(), cfg)
    return cache.attend(layer, q, block_mask)


# -----------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _ordered(s):
    """An int32 that orders as the float s does (-0.0 tied with +0.0, -inf lowest)."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


MIN_KEY, MAX_KEY = tl.constexpr(-2**63), tl.constexpr(2**63 - 1)  # below and above every candidate's key


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
def _kth_best(QS, ok, q_blk, nb, SCR, R: tl.constexpr, NBP: tl.constexpr, NG: tl.constexpr, CAP: tl.constexpr,
              N_SINK: tl.constexpr, N_WIN: tl.constexpr, KQ: tl.constexpr):
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
    kth = _kth_of(tl.load(SCR + r[:, None] * CAP + j[None, :], mask=j[None, :] < n[:, None], other=MIN_KEY), R, KQ)
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
def _q_picks(key, b, q_blk, kth, nb, N_SINK: tl.constexpr, N_WIN: tl.constexpr, K: tl.constexpr, KQ: tl.constexpr):
    """Γ(t) as select_blocks makes it, but for its E-picks, at blocks b of rows whose keys are `key`
    (_keys, which says the shapes), query's block q_blk, and KQ-th best key kth (MIN_KEY where there are
    fewer), so that the k_q - 1 best candidates by Q are those with keys >= kth (top_desc's order: ties to
    the more recent block). nb: the blocks that exist. Returns a bool mask of key's shape."""
    causal = (b <= q_blk) & (b < nb)
    forced = causal & ((b < N_SINK) | (b >= q_blk - N_WIN))
    few = tl.minimum(q_blk + 1, nb) <= K  # fewer than k causal blocks: all of them
    return tl.where(few, causal, forced | ((key > MIN_KEY) & (key >= kth) & (KQ > 0)))


@triton.jit
def _e_picks(QS, IDS, q_blk, nb, kth, N_LIST: tl.constexpr, NLP: tl.constexpr, N_SINK: tl.constexpr,
             N_WIN: tl.constexpr, K: tl.constexpr, KQ: tl.constexpr, N_CORE: tl.constexpr):
    """Γ(t)'s E-picks of one row (QS its nb scores, q_blk its query's block, kth as _q_picks): the first
    N_CORE members of its list of the best candidates by E (IDS, N_LIST, best first) that Q did not take.
    Returns (ids (NLP,), whether each is picked (NLP,))."""
    j = tl.arange(0, NLP)
    ids = tl.load(IDS + j, mask=j < N_LIST, other=-1)
    key = _keys(QS, q_blk, ids >= 0, ids, nb, N_SINK, N_WIN)
    taken = (key > MIN_KEY) & (key >= kth) & (KQ > 0)  # Q's picks at the ids
    pick = (ids >= 0) & ~taken
    many = j * 0 + tl.minimum(q_blk + 1, nb) > K  # more than k causal blocks (a vector: the interpreter's masks)
    return ids, pick & (tl.cumsum(pick.to(tl.int32), 0) <= N_CORE) & many


@triton.jit
def _select_step_kernel(QS, IDS, POS, OUT, nb, H_kv: tl.constexpr, NBP: tl.constexpr, N_LIST: tl.constexpr,
                        NLP: tl.constexpr, B: tl.constexpr, N_SINK: tl.constexpr, N_WIN: tl.constexpr,
                        K: tl.constexpr, KQ: tl.constexpr, N_CORE: tl.constexpr):
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
    tl.store(OUT + r * nb + b, _q_picks(key, b, q_blk, kth, nb, N_SINK, N_WIN, K, KQ).to(tl.int8), mask=b < nb)
    if N_CORE > 0:
        ids, pick = _e_picks(QS + r * nb, IDS + r * N_LIST, q_blk, nb, kth, N_LIST, NLP, N_SINK, N_WIN, K, KQ,
                             N_CORE)
        tl.debug_barrier()  # the mask above is written before these entries are set
        tl.store(OUT + r * nb + ids, tl.full([NLP], 1, tl.int8), mask=pick)


@triton.jit
def _select_tiles_kernel(QS, IDS, POS, SCRATCH, SCR_K, T_IDX, T_BITS, T_N, T, nb, first, NQB, U, H_kv: tl.constexpr,
                         BT: tl.constexpr, UP: tl.constexpr, NBP: tl.constexpr, NG: tl.constexpr, CAP: tl.constexpr,
                         N_LIST: tl.constexpr, NLP: tl.constexpr, B: tl.constexpr, N_SINK: tl.constexpr,
                         N_WIN: tl.constexpr, K: tl.constexpr, KQ: tl.constexpr, N_CORE: tl.constexpr):
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
        kths = _kth_best(QS + (bh * T + rows[:, None]) * nb, rows[:, None] < T, q_blks[:, None], nb,
                         SCR_K + prog * BT * CAP, BT, NBP, NG, CAP, N_SINK, N_WIN, KQ)
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
            bits = bits | (_q_picks(key, blocks, q_blk, kth, nb, N_SINK, N_WIN, K, KQ).to(tl.int32) << j)
            if N_CORE > 0:
                ids, pick = _e_picks(QS + (bh * T + t) * nb, IDS + (bh * NQB + q_blk - first) * N_LIST, q_blk, nb,
                                     kth, N_LIST, NLP, N_SINK, N_WIN, K, KQ, N_CORE)
                tl.atomic_or(row + ids, tl.zeros([NLP], tl.int32) + (1 << j), mask=pick, sem="relaxed")
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


def select_step_triton(Q, core_ids, q_pos, cfg):
    """The kernel; same arguments and result as select_step_torch."""
    Bz, H_kv, _, nb = Q.shape
    n = core_ids.shape[-1] if core_ids is not None else 0
    out = torch.empty(Bz, H_kv, 1, nb, dtype=torch.int8, device=Q.device)
    ids = core_ids.contiguous() if n else out  # not read when there is no list
    _select_step_kernel[(Bz * H_kv,)](Q.contiguous(), ids, q_pos.reshape(Bz).contiguous(), out, nb, H_kv=H_kv,
                                      NBP=triton.next_power_of_2(nb), N_LIST=n, NLP=triton.next_power_of_2(max(n, 1)),
                                      B=cfg.B, N_SINK=cfg.n_sink, N_WIN=cfg.n_win, K=cfg.k, KQ=max(cfg.k_q_free, 0),
                                      N_CORE=cfg.n_core if n else 0, num_warps=8)
    return out.view(torch.bool)


def select_tiles_triton(Q, lists, first, q_pos, cfg, BT, U):
    """The kernel; same arguments and result as select_tiles_torch."""
    Bz, H_kv, T, nb = Q.shape
    nT, NBP = triton.cdiv(T, BT), triton.next_power_of_2(nb)
    n = lists.shape[-1] if lists is not None else 0
    idx = torch.empty(Bz, H_kv, nT, U, dtype=torch.int32, device=Q.device)
    bits, count = torch.empty_like(idx), torch.empty(Bz, H_kv, nT, dtype=torch.int32, device=Q.device)
    KQ = max(cfg.k_q_free, 0)
    NG, CAP = min(NBP, GROUPS), triton.next_power_of_2(max(KQ, 1) * CAP_PER_PICK)
    scratch = torch.empty(Bz * H_kv * nT, NBP if n and cfg.n_core else 1, dtype=torch.int32, device=Q.device)
    keys = torch.empty(Bz * H_kv * nT, BT * CAP if KQ else 1, dtype=torch.int64, device=Q.device)
    ids = lists.contiguous() if n else idx  # not read when there is no list
    _select_tiles_kernel[(nT, Bz * H_kv)](
        Q.contiguous(), ids, q_pos.contiguous(), scratch, keys, idx, bits, count, T, nb, first,
        lists.shape[2] if n else 1, U, H_kv=H_kv, BT=BT, UP=triton.next_power_of_2(U), NBP=NBP, NG=NG, CAP=CAP,
        N_LIST=n, NLP=triton.next_power_of_2(max(n, 1)), B=cfg.B, N_SINK=cfg.n_sink, N_WIN=cfg.n_win, K=cfg.k,
        KQ=KQ, N_CORE=cfg.n_core if n else 0, num_warps=4)
    return idx, bits, count
