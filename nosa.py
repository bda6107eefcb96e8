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
  E-list      the best n_e_list = n_core + k_q - 1 candidates by E, best first (eviction.e_list):
              its block ids e_list_ids and their scores e_list_E; one per query block in the
              parallel forward, one per row in decoding, kept by the eviction policy
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
(eviction.e_list_join): the parallel forward one list per query block (eviction.e_lists_by_block,
carried from chunk to chunk through a prefill), decoding one per row, step after step
(eviction.e_list_join_leaver); the tests check that both select what the definition selects.

Kernels (nosa_kernels.py): a decode step's selection (select_step), and the parallel forward's,
written as tiles of neighbouring queries for the attention kernels (select_tiles).

Attention modes (docs/METHOD.md §7), all from the same code:
  full      all causal tokens, no bias
  infllmv2  F + the best blocks by Q only, no bias
  dma       F + the best blocks by E only, bias exp(c)
  nosa      dual selection, bias c (ED-DMA)
"""

import copy

import torch
from torch.profiler import record_function

import attention
import attention_kernels
import eviction
import nosa_kernels
import pooling
from common import grow, tile_size, use_kernels

# -----------------------------------------------------------------------------
# Dual selection


def select_blocks(Q, E, q_pos, cfg, e_list_ids=None):
    """Γ(t) for every query as a block mask.

    Q: (..., T, nb) query-aware scores, E: (..., nb) eviction scores, q_pos: (..., T) positions.
    Instead of E, an E-list may come, the same for every query (e_list_ids (..., n): decoding, which
    keeps it by the eviction policy) or one per query (e_list_ids (..., T, n): select makes them per
    query block); E is then None.
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
    if e_list_ids is not None:  # the first n_core members of the list that Q did not take
        if e_list_ids.dim() < Q.dim():  # one list for all T queries
            e_list_ids = e_list_ids.unsqueeze(-2).expand(*Q.shape[:-1], e_list_ids.shape[-1])
        ids = e_list_ids  # (..., T, n)
        pick_e = eviction.core_picks(ids, pick_q.gather(-1, ids.clamp(min=0)), cfg.n_core, nb)
    elif E is not None:
        rest = cand & ~pick_q
        pick_e = rest & (eviction.rank_desc(E.unsqueeze(-2).expand_as(Q), rest) < cfg.n_core)
    else:  # a mode without E (n_core = 0)
        pick_e = torch.zeros_like(pick_q)
    few = causal.sum(-1, keepdim=True) <= cfg.k  # fewer than k causal blocks: take them all
    return torch.where(few, causal, forced | pick_q | pick_e)


def select(q, K_sub, e_list_ids, q_pos, nb, cfg):
    """Score, then select: the path from the pooled caches to Γ(t) as a block mask, the one a decode step
    takes (nosa_decode) and the twin of the parallel forward's (select_tiles), so both pick the same blocks.

    q (Bz, H_q, T, d) at positions q_pos (Bz, T); K̃ (Bz, H_kv, M, d) compressed keys; nb blocks to
    score; e_list_ids the E-list's ids: one per query (Bz, H_kv, T, n), from e_lists, or one per row
    (Bz, H_kv, n) kept by the eviction policy (a decode step: PooledState); None in a mode
    without E-picks.
    Returns the block mask (Bz, H_kv, T, nb)."""
    Q = pooling.query_aware_scores(q, K_sub, q_pos, nb, cfg)  # (Bz, H_kv, T, nb)
    if q.shape[2] == 1 and (e_list_ids is None or e_list_ids.dim() == 3):
        return select_step(Q, e_list_ids, q_pos, cfg)
    return select_blocks(Q, None, q_pos[:, None], cfg, e_list_ids)


def e_lists_of_queries(lists, q_pos, first, cfg):
    """Each query's list from its block's: lists (Bz, H_kv, n_qb, n) of blocks first.., q_pos (Bz, T)
    -> (Bz, H_kv, T, n)."""
    i = (q_pos // cfg.B - first)[:, None, :, None]
    return lists.gather(2, i.expand(*lists.shape[:2], -1, lists.shape[-1]))


def e_lists(scores, q_pos, cfg):
    """Each query's E-list: scores c̃ (Bz, H_kv, M), or
    h (Bz, H_kv, nb) in nosa-hh; q_pos (Bz, T) -> (Bz, H_kv, T, n)."""
    q_blk = q_pos // cfg.B
    first = int(q_blk.min())
    return e_lists_of_queries(
        eviction.e_lists_by_block(scores, first, int(q_blk.max()), cfg)[0], q_pos, first, cfg
    )


def select_step(Q, e_list_ids, q_pos, cfg):
    """select_blocks for one decode step (T = 1) from each row's list of its best candidates by E:
    Q (Bz, H_kv, 1, nb), e_list_ids (Bz, H_kv, n) or None, q_pos (Bz, 1) -> the block mask
    (Bz, H_kv, 1, nb). Kernel: nosa_kernels.select_step."""
    if use_kernels(Q):
        return nosa_kernels.select_step(Q, e_list_ids, q_pos, cfg)
    return select_blocks(Q, None, q_pos[:, None], cfg, e_list_ids)


def select_tiles(q, K_sub, lists, q_pos, nb, cfg, *, first):
    """The kernel path of the parallel forward's selection: Γ(t) of its queries as tiles of
    neighbouring queries (attention_kernels.Tiles), scored and selected a chunk of queries at a
    time, so no (T, nb) tensor is ever whole. Its twin is select_blocks (the tests compare)."""
    T, R = q.shape[2], nosa_kernels.select_rows(nb)
    BT = tile_size(cfg.G, cfg.B)
    U = min(nb, BT * cfg.k)  # a tile's union holds at most BT * k blocks
    parts = []
    for t in range(0, T, R):  # R is a multiple of BT: chunks hold whole tiles
        pos = q_pos[:, t : t + R]
        Q = pooling.query_aware_scores(q[:, :, t : t + R], K_sub, pos, nb, cfg)  # (Bz, H_kv, R, nb)
        parts.append(nosa_kernels.select_tiles(Q, lists, first, pos, cfg, BT=BT, U=U))
    idx, bits, n = parts[0] if len(parts) == 1 else (torch.cat(x, 2) for x in zip(*parts))
    return attention_kernels.Tiles(idx, bits, n, BT, T)


def nosa_attention(q, k, v, c, cfg, *, start=0, selects_from=None):
    """One attention layer for the queries at positions start .. start+T-1 over the keys 0 .. S-1,
    S = start + T: the training forward (start = 0, the whole sequence) and one chunk of a prefill
    (prefill.py), which selects and attends exactly as the whole forward would (it keeps what
    selection reads of the earlier chunks: selects_from).

    q: (Bz, H_q, T, d), k, v: (Bz, H_kv, S, d) with RoPE applied, c: (Bz, H_kv, S) eviction scores
    (None in `full` and `infllmv2` modes). selects_from: (K̃, lists) where the caller keeps them (a
    prefill's chunks: prefill.PromptLayer), the compressed keys and the e_lists_by_block of the
    query blocks from start // B on (None without E-picks), else made here. Returns the output
    (Bz, H_q, T, d) and Γ(t): a block mask (Bz, H_kv, T, nb), or Tiles on the kernel path (None
    in `full` mode)."""
    Bz, _, T, _ = q.shape
    S = k.shape[2]
    q_pos = torch.arange(start, start + T, device=q.device).expand(Bz, T)
    if cfg.attn == "full":
        return attention.full_attention(q, k, v, q_pos), None
    kernels = use_kernels(q, cfg)
    with torch.no_grad():
        first, nb = start // cfg.B, cfg.n_blocks(S)
        if selects_from is None:  # K̃, and each query block's list of its best candidates by E
            lists = None
            if c is not None and cfg.n_core > 0:
                scores = pooling.pool_mean(c, cfg)  # c̃; nosa-hh: h, from every query (start = 0)
                if cfg.heavy_hitters:
                    scores = eviction.hh_scores(eviction.heavy_hitters(q, k, c, cfg), cfg)
                lists = eviction.e_lists_by_block(scores, first, (S - 1) // cfg.B, cfg)[0]
            selects_from = pooling.compress_keys(k, cfg), lists
        K_sub, lists = selects_from
        if kernels:
            sel = select_tiles(q, K_sub, lists, q_pos, nb, cfg, first=first)
        else:
            Q = pooling.query_aware_scores(q, K_sub, q_pos, nb, cfg)  # (Bz, H_kv, T, nb)
            ids = None if lists is None else e_lists_of_queries(lists, q_pos, first, cfg)
            sel = select_blocks(Q, None, q_pos[:, None], cfg, ids)
    bias = None if c is None else eviction.attention_bias(c, cfg.attn)
    attend = attention_kernels.sparse_attention if kernels else attention.sparse_attention
    return attend(q, k, v, bias, sel, q_pos, B=cfg.B), sel


# -----------------------------------------------------------------------------
# Decoding: one token per sequence against a cache (kvcache.py, offload.py), which only stores


class PooledState:
    """Per layer, the pooled state selection reads: K̃ (Bz, H_kv, M, d) and c̃ (Bz, H_kv, M), the
    rings of the last l_c keys and scores they are pooled from, and each row's E-list (nosa.py's
    legend: e_list_ids, e_list_E), all a decode step needs of E; in nosa-hh also h (Bz, H_kv, nb),
    what each block got of the attention of its window's queries (eviction.py), the E-list's source
    there. The decode step changes it a token at a time (update), a prompt's is written whole
    (prefill); both caches (kvcache.py, offload.py) hold one and never change it themselves."""

    # one tensor per layer, indexed by sequence first
    BUFFERS = ("ring_k", "ring_c", "K_sub", "c_sub", "e_list_ids", "e_list_E", "h")

    def __init__(self, cfg, Bz, device, dtype, max_len=0):
        self.cfg = cfg
        L, H, d, l_c, n = cfg.n_layer, cfg.H_kv, cfg.head_dim, cfg.l_c, cfg.n_e_list
        M = cfg.n_subblocks(max_len)  # preallocated for max_len tokens; grows past it
        self.ring_k = [torch.zeros(Bz, H, l_c, d, device=device, dtype=dtype) for _ in range(L)]
        cdt = torch.promote_types(dtype, torch.float32)  # c and its pools stay in fp32 (or fp64)
        self.ring_c = [torch.zeros(Bz, H, l_c, device=device, dtype=cdt) for _ in range(L)]
        self.K_sub = [torch.zeros(Bz, H, M, d, device=device, dtype=dtype) for _ in range(L)]
        self.c_sub = [torch.zeros(Bz, H, M, device=device, dtype=cdt) for _ in range(L)]
        new = lambda fill, dt: [
            torch.full((Bz, H, n), fill, dtype=dt, device=device) for _ in range(L)
        ]
        self.e_list_ids = new(-1, torch.long) if n else None
        self.e_list_E = new(float("-inf"), cdt) if n else None
        nb = cfg.n_blocks(max_len)
        self.h = None
        if cfg.heavy_hitters:
            self.h = [torch.zeros(Bz, H, nb, device=device, dtype=cdt) for _ in range(L)]

    def seqs(self, a, b):
        """The caches of sequences a..b-1 (views; see offload.OffloadCache.split)."""
        part = copy.copy(self)
        for name in self.BUFFERS:
            if getattr(self, name) is not None:
                setattr(part, name, [t[a:b] for t in getattr(self, name)])
        return part

    def update(self, layer, k, c, pos, T):
        """A decode step's update, k (Bz, H_kv, d) and c (Bz, H_kv) or None at positions pos (Bz,),
        T the host's bound on pos + 1: when a sub-block completes (every s_c tokens, per sequence)
        its mean joins K̃ and c̃, and when a block leaves the window it joins the E-list by the
        eviction policy (eviction.e_list_join_leaver)."""
        cfg = self.cfg
        self.reserve(layer, T)
        ring_k, ring_c, K_sub, c_sub = (
            x[layer] for x in (self.ring_k, self.ring_c, self.K_sub, self.c_sub)
        )
        pooling.append_subblocks(ring_k, ring_c, K_sub, c_sub, k, c, pos=pos, cfg=cfg)
        if self.e_list_ids:  # E from c̃, or in nosa-hh from h
            scores = eviction.hh_scores(self.h[layer], cfg) if cfg.heavy_hitters else c_sub
            eviction.e_list_join_leaver(
                self.e_list_ids[layer], self.e_list_E[layer], scores, pos, cfg
            )

    def reserve(self, layer, T):
        """Room for the sub-blocks of T tokens in K̃ and c̃ (and its blocks in h)."""
        M = self.cfg.n_subblocks(T)
        self.K_sub[layer] = grow(self.K_sub[layer], M, 2)
        self.c_sub[layer] = grow(self.c_sub[layer], M, 2)
        if self.h:
            self.h[layer] = grow(self.h[layer], self.cfg.n_blocks(T), 2)

    def prefill(self, layer, seq, k, c, pooled, put):
        """k (H_kv, T, d), c (H_kv, T) or None: one whole sequence, and pooled its (K̃, c̃, E-list
        (ids, scores), h) (prefill.PromptLayer.pooled, or nosa.pooled_prompt). put: how the rings and
        the list are written (Cache)."""
        cfg, T = self.cfg, k.shape[1]
        K_sub, c_sub, e_list, h = pooled  # (H_kv, M, d), (H_kv, M), (H_kv, n) twice, (H_kv, nb)
        M = K_sub.shape[1]
        self.reserve(layer, T)
        self.K_sub[layer][seq, :, :M] = K_sub
        tail = torch.arange(max(T - cfg.l_c, 0), T, device=k.device)
        ring = (seq, slice(None), tail % cfg.l_c)
        put(self.ring_k[layer], ring, k[:, tail])
        if c is not None:
            self.c_sub[layer][seq, :, :M] = c_sub
            put(self.ring_c[layer], ring, c[:, tail])
        if self.h:  # the sequence's whole h: what a sequence before left beyond the prompt goes
            self.h[layer][seq] = 0
            self.h[layer][seq, :, : h.shape[1]] = h
        # the E-list as of the last prompt token: the next step adds what leaves the window
        if self.e_list_ids:
            put(self.e_list_ids[layer], seq, e_list[0])
            put(self.e_list_E[layer], seq, e_list[1])


def nosa_decode(q, k, v, c, cfg, *, layer, cache):
    """The decode step of one attention layer, beside the training half (nosa_attention), in
    docs/METHOD.md §6's order: one new token per sequence, each at its own position cache.len.

    q (Bz, H_q, 1, d), k, v (Bz, H_kv, 1, d), c (Bz, H_kv, 1) or None -> the output (Bz, H_q, 1, d)."""
    k, v, c, pos = k[:, :, 0], v[:, :, 0], None if c is None else c[:, :, 0], cache.len
    # 1. the new token's k, v and c into the cache (where offloaded: into the tail block), and K̃,
    # c̃ and the E-list by it; nb: the blocks selection ranges over
    nb = cache.write(layer, k, v, c)
    block_mask = None
    if cfg.sparse:
        with record_function("selection"):
            # (1.) K̃, c̃ and the E-list
            cache.sub.update(layer, k, c, pos, T=int(cache.len_cpu.max()) + 1)
            # 2. score and select Γ(t), by the same select as the parallel forward
            ids = cache.sub.e_list_ids[layer] if cache.sub.e_list_ids else None
            block_mask = select(q, cache.sub.K_sub[layer], ids, pos[:, None], nb, cfg)
    # 3.-4. the selected blocks on the device (NOSI: the set difference, the misses gathered)
    moves = "transfer" if cache.moves_blocks else "attention"  # the profiler's phases
    with record_function(moves):
        kv = cache.blocks(layer, block_mask)
    # 5. attention over them, with the bias
    with record_function("attention"):
        bias = None if kv.c is None else eviction.attention_bias(kv.c, cfg.attn)
        if kv.pool is not None:  # the slot pool
            o = attention.slot_attention(q, kv.pool, kv.slots, bias, pos, cfg)
        elif cfg.sparse:
            o = attention.sparse_decode(q, kv.k, kv.v, bias, block_mask, pos, cfg=cfg)
        else:
            o = attention.dense_decode(q, kv.k, kv.v, pos, cfg)
    # nosa-hh: what the query paid the blocks of its window joins their h (final as they leave it)
    if cfg.heavy_hitters:
        with record_function("selection"):
            keys, key_pos, key_bias = window_keys(kv, bias, pos, cfg)
            G, d = cfg.G, q.shape[-1]
            at = pos[:, None, None]  # (Bz, 1, 1): one query a sequence
            p = eviction.window_attention(
                q.view(-1, cfg.H_kv, G, 1, d), keys, key_pos, key_bias, at, cfg
            )
            eviction.add_heavy_hitters(cache.sub.h[layer], p, key_pos, at, cfg)
    # 6. a tail block the token filled goes to its place (the host store)
    with record_function(moves):
        cache.flush(layer)
    return o


def window_keys(kv, bias, pos, cfg):
    """The keys a decode step's window attention reads, as kvcache.Blocks holds them: the forced blocks
    of each row's query (sinks, window, own block) of the cached keys, or the whole slot pool (the
    forced blocks are always resident). kv: the step's Blocks; bias (Bz, H_kv, S) or None; pos (Bz,)
    -> keys (Bz, H_kv, m, d), their positions (Bz, 1 or H_kv, m) (-1: none) and bias (Bz, H_kv, m)."""
    B, dev = cfg.B, pos.device
    if kv.pool is None:  # the cached keys (Bz, H_kv, S, d)
        col = torch.arange(cfg.n_sink + cfg.n_win + 1, device=dev)
        kb = torch.where(col < cfg.n_sink, col, (pos // B)[:, None] - cfg.n_win - cfg.n_sink + col)
        kb = torch.where((kb >= 0) & ((col < cfg.n_sink) | (kb >= cfg.n_sink)), kb, -1)
        key_pos = (kb[..., None] * B + torch.arange(B, device=dev)).flatten(1)  # (Bz, m)
        S = kv.k.shape[2]
        key_pos = torch.where((kb.repeat_interleave(B, 1) >= 0) & (key_pos < S), key_pos, -1)
        at = key_pos.clamp(min=0)[:, None].expand(-1, cfg.H_kv, -1)  # (Bz, H_kv, m)
        keys = kv.k.gather(2, at[..., None].expand(-1, -1, -1, kv.k.shape[-1]))
        key_pos = key_pos[:, None]
    else:  # the slot pool, slot k the tail (the own block): (Bz, H_kv, (k + 1) B)
        keys, _, key_pos = attention.pool_tokens(kv.pool, kv.slots, pos, B)
        at = key_pos.clamp(min=0)
    key_bias = None if bias is None else bias.gather(2, at.clamp(max=bias.shape[2] - 1))
    return keys, key_pos, key_bias


def pooled_prompt(k, c, cfg, h=None):
    """What a decode cache keeps of a whole prompt's keys (PooledState.prefill), made at once
    (prefill.PromptLayer makes it a chunk at a time): k (H_kv, T, d), c (H_kv, T) or None, and in
    nosa-hh its h (H_kv, nb) (eviction.heavy_hitters: it needs the queries) -> K̃ (H_kv, M, d), c̃
    (H_kv, M) or None, the E-list as of the last token (ids, scores) (H_kv, n_e_list) or None, and
    h."""
    T = k.shape[1]
    K_sub, c_sub = pooling.compress_keys(k, cfg), None if c is None else pooling.pool_mean(c, cfg)
    if not cfg.n_e_list:
        return K_sub, c_sub, None, h
    nb = cfg.n_blocks(T)
    b = torch.arange(nb, device=k.device)
    cand = (b >= cfg.n_sink) & (b < (T - 1) // cfg.B - cfg.n_win)  # left the window
    E = (
        eviction.hh_scores(h, cfg)
        if cfg.heavy_hitters
        else eviction.eviction_block_scores(c_sub, nb, cfg)
    )  # (H_kv, nb)
    return K_sub, c_sub, eviction.e_list(E, cand.expand_as(E), cfg.n_e_list), h
