"""
KV caches for step-by-step decoding: the interface a decode step talks to, and the resident cache.

Notation: Bz sequences, H_kv KV heads of dim d, S cached positions, c eviction scores (eviction.py),
K̃ / c̃ the pooled caches scoring reads (pooling.py): M = complete sub-blocks.

A cache offers, per layer, what nosa.nosa_decode calls, in this order:
  append(layer, k, v, c)        write the new token of every sequence at its position `len`
  sub.pooled(layer)             K̃ and the eviction list the selection reads
  n_blocks()                    how many blocks selection ranges over
  attend(layer, q, block_mask)  attention of q over the selected blocks Γ(t)
and prefill(layer, seq, k, v, c, pooled) for a prompt, advance() after a step, finish(done) for sequences
that ended. KVCache keeps everything on the device; offload.OffloadCache keeps the blocks in host
memory and only the selected ones on the GPU (NOSI). Both share Cache (the lengths) and
SubBlockCache (the pooled caches).
"""
import copy

import torch
import triton
import triton.language as tl
from torch.profiler import record_function

import decode
import eviction
import fast
import pooling


class Cache:
    """The lengths every cache keeps: tokens per sequence on the device (read by the decode step) and
    the same on the host (read by the Python that sizes and launches it, without a device sync)."""

    def __init__(self, Bz, device):
        self.len = torch.zeros(Bz, dtype=torch.long, device=device)
        self.len_cpu = torch.zeros(Bz, dtype=torch.long)

    def set_length(self, seq, T):  # after a prefill of T tokens into row seq
        self.len[seq] = self.len_cpu[seq] = T

    def advance(self):
        self.len += 1
        self.advance_host()

    def advance_host(self):  # the host-side part of advance, which a CUDA graph replay does not run
        self.len_cpu += 1

    def finish(self, done):
        """done (Bz,): sequences that ended; a cache may stop spending on them."""

    def graphable(self, pos):
        """Whether decode steps from largest position pos on launch the same kernels on the same shapes,
        so one recorded step can be replayed (fast.GraphedDecode): the buffers hold the position
        (capacity), and every sequence's pooled caches are updated (SubBlockCache.append takes another
        path while no sequence has l_c tokens). A replay runs none of the step's Python: the caller
        advances the host's lengths (advance_host)."""
        return self.cfg.l_c <= pos + 1 and pos < self.capacity()


def grow(t, n, dim):
    """Return t with at least n entries along `dim`, doubling: no buffer is sized once up front."""
    if t.shape[dim] >= n:
        return t
    shape = list(t.shape)
    shape[dim] = max(n, 2 * t.shape[dim]) - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


class PromptLayer:
    """One layer's keys, values and eviction scores of one prompt as a chunked prefill writes them
    (model.Transformer.prefill), with what selection reads of the keys so far, kept up to date a chunk
    at a time: the compressed keys K̃, the sub-block means c̃, and each query block's list of its best
    candidates by E, carried from chunk to chunk by the eviction policy (eviction.block_lists). Once the
    layer has read the whole prompt the cache takes them (prefill)."""

    def __init__(self, cfg, T, device, dtype, with_c):
        H, d, M = cfg.H_kv, cfg.head_dim, pooling.n_subblocks(T, cfg)
        cdt = torch.promote_types(dtype, torch.float32)  # c and its pools stay in fp32 (or fp64)
        self.cfg = cfg
        self.k = torch.empty(1, H, T, d, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.c = torch.empty(1, H, T, device=device, dtype=cdt) if with_c else None
        self.K_sub = torch.empty(1, H, M, d, device=device, dtype=dtype) if cfg.sparse else None
        self.c_sub = torch.empty(1, H, M, device=device, dtype=cdt) if cfg.sparse and with_c else None
        self.carry = None  # the list of the last query block so far (eviction.block_lists)

    def write(self, start, k, v, c):
        """A chunk's k, v (1, H_kv, C, d) and c (1, H_kv, C) or None at positions start .. e-1 ->
        the keys so far: k, v, c of positions 0 .. e-1 (views), and what nosa.nosa_attention selects
        from (its `pooled`): K̃ and the lists of the chunk's query blocks (None without E-picks)."""
        cfg, e = self.cfg, start + k.shape[2]
        self.k[:, :, start:e], self.v[:, :, start:e] = k, v
        if c is not None:
            self.c[:, :, start:e] = c
        if not cfg.sparse:
            return self.k[:, :, :e], self.v[:, :, :e], None, None
        m0, m1 = pooling.n_subblocks(start, cfg), pooling.n_subblocks(e, cfg)  # the sub-blocks it completes
        if m1 > m0:
            t0 = m0 * cfg.s_c  # the first token of sub-block m0, at or before start
            self.K_sub[:, :, m0:m1] = pooling.compress_keys(self.k[:, :, t0:e], cfg)
            if c is not None:
                self.c_sub[:, :, m0:m1] = pooling.pool_mean(self.c[:, :, t0:e], cfg)
        lists = None
        if c is not None and cfg.n_core > 0:
            if start == 0:  # a new layer
                self.carry = None
            lists, self.carry = eviction.block_lists(self.c_sub[:, :, :m1], start // cfg.B, (e - 1) // cfg.B,
                                                     cfg, self.carry)
        return self.k[:, :, :e], self.v[:, :, :e], None if c is None else self.c[:, :, :e], (self.K_sub[:, :, :m1],
                                                                                              lists)

    def pooled(self):
        """What the decode cache keeps of the whole prompt (SubBlockCache.prefill's `pooled`): K̃ (H_kv, M, d),
        c̃ (H_kv, M) and the list of the last query block (ids, E) (H_kv, n), or None where the mode has none."""
        core = None if self.carry is None else (self.carry[0][0], self.carry[1][0])
        return self.K_sub[0], None if self.c_sub is None else self.c_sub[0], core


class ResidualStream:
    """A prompt's residual stream (1, T, dim) between the layers of a chunked prefill, read and
    written C positions at a time, a pass a layer (model.Transformer.prefill). The first pass reads
    the layer's input as `first(s)` makes it (the embeddings of the chunk at s), the others what the
    pass before wrote. On the device, or in pinned host memory where it does not fit beside the cache:
    then the copies run on a stream of their own, the next chunk's to the GPU and the last one's back
    while the current chunk computes (during a pass's last chunk, the next pass's first)."""

    def __init__(self, T, dim, C, device, dtype, on_host, first):
        self.T, self.C, self.device, self.first = T, C, device, first
        self.x = torch.empty(1, T, dim, dtype=dtype, device="cpu" if on_host else device, pin_memory=on_host)
        self.copies = torch.cuda.Stream(device) if on_host else None
        self.ahead = None  # the next pass's first chunk, on its way

    def chunks(self, more):
        """(start, the chunk (1, C, dim) on the device) in order, the next one already on its way.
        more: another pass follows this one."""
        first, self.first = self.first, None
        nxt, self.ahead = self.ahead, None
        for s in range(0, self.T, self.C):
            if first is not None:  # the first pass: its input as it is made
                h = first(s)
            elif self.copies is None:
                h = self.x[:, s:s + self.C]
            else:
                h, ready = nxt or self.fetch(s)
                torch.cuda.current_stream().wait_event(ready)  # this chunk is here (the copies after it may run on)
                h.record_stream(torch.cuda.current_stream())  # its memory is not reused before the compute is done
            if self.copies is not None:  # what comes next, on its way
                if s + self.C < self.T:
                    nxt = None if first is not None else self.fetch(s + self.C)
                elif more and s > 0:  # queued after this pass's writes of the chunks before, chunk 0's among them
                    self.ahead = self.fetch(0)
            yield s, h

    def fetch(self, s):  # chunk s to the device on the copy stream, after the writes before it
        with torch.cuda.stream(self.copies):
            h = self.x[:, s:s + self.C].to(self.device, non_blocking=True)
            return h, self.copies.record_event()

    def write(self, s, h):
        """The chunk at s is now h (1, C, dim), on the device."""
        if self.copies is None:
            self.x[:, s:s + h.shape[1]] = h
            return
        self.copies.wait_stream(torch.cuda.current_stream())  # once h is computed
        with torch.cuda.stream(self.copies):
            self.x[:, s:s + h.shape[1]].copy_(h, non_blocking=True)
        h.record_stream(self.copies)

    def last(self):
        """The last position (1, dim), on the device."""
        if self.copies is not None:
            torch.cuda.current_stream().wait_stream(self.copies)
        return self.x[:, -1].to(self.device)


class SubBlockCache:
    """Per layer: the pooled caches K̃ (Bz, H_kv, M, d) and c̃ (Bz, H_kv, M), kept up to date
    one token at a time from a ring of the last l_c keys and scores. Both caches use it."""

    BUFFERS = ("ring_k", "ring_c", "K_sub", "c_sub", "core_ids", "core_E")  # one tensor per layer, a row per sequence

    def __init__(self, cfg, Bz, device, dtype, max_len=0):
        self.cfg = cfg
        L, H, d, l_c = cfg.n_layer, cfg.H_kv, cfg.head_dim, cfg.l_c
        M = pooling.n_subblocks(max_len, cfg)  # preallocated for max_len tokens; grows past it
        self.ring_k = [torch.zeros(Bz, H, l_c, d, device=device, dtype=dtype) for _ in range(L)]
        cdt = torch.promote_types(dtype, torch.float32)  # c and its pools stay in fp32 (or fp64)
        self.ring_c = [torch.zeros(Bz, H, l_c, device=device, dtype=cdt) for _ in range(L)]
        self.K_sub = [torch.zeros(Bz, H, M, d, device=device, dtype=dtype) for _ in range(L)]
        self.c_sub = [torch.zeros(Bz, H, M, device=device, dtype=cdt) for _ in range(L)]
        # each row's best n = n_core + k_q - 1 candidates by E, best first (eviction.core_list): all a
        # decode step needs of E; changed only when a block leaves the window (the eviction policy)
        n = cfg.n_core + cfg.k_q_free if cfg.eviction_head and cfg.n_core > 0 else 0
        self.core_ids = [torch.full((Bz, H, n), -1, dtype=torch.long, device=device) for _ in range(L)] if n else None
        self.core_E = [torch.full((Bz, H, n), float("-inf"), dtype=cdt, device=device) for _ in range(L)] if n else None

    def pooled(self, layer):
        """What a decode step selects from: K̃ (Bz, H_kv, M, d) and each row's list of its best
        candidates by E (Bz, H_kv, n), or None in a mode without E-picks."""
        return self.K_sub[layer], self.core_ids[layer] if self.core_ids else None

    def rows(self, a, b):
        """The caches of sequences a..b-1 (views; see offload.OffloadCache.split)."""
        part = copy.copy(self)
        for name in self.BUFFERS:
            if getattr(self, name) is not None:
                setattr(part, name, [t[a:b] for t in getattr(self, name)])
        return part

    def prefill(self, layer, seq, k, c, pooled=None):
        """k (H_kv, T, d), c (H_kv, T) or None: one whole sequence. pooled: (K̃, c̃, list) of it where the
        caller has them (a chunked prefill: PromptLayer.pooled), else made here."""
        cfg, T = self.cfg, k.shape[1]
        K_sub, c_sub, core = pooled or (pooling.compress_keys(k, cfg), None if c is None else pooling.pool_mean(c, cfg),
                                        None)  # (H_kv, M, d), (H_kv, M)
        M = K_sub.shape[1]
        self.K_sub[layer] = grow(self.K_sub[layer], M, 2)
        self.c_sub[layer] = grow(self.c_sub[layer], M, 2)
        self.K_sub[layer][seq, :, :M] = K_sub
        tail = torch.arange(max(T - cfg.l_c, 0), T, device=k.device)
        self.ring_k[layer][seq][:, tail % cfg.l_c] = k[:, tail]
        if c is not None:
            self.c_sub[layer][seq, :, :M] = c_sub
            self.ring_c[layer][seq][:, tail % cfg.l_c] = c[:, tail]
        if self.core_ids:  # as of the last prompt token: the next step adds what leaves the window
            if core is None:  # from scratch
                nb = pooling.n_blocks(T, cfg)
                b = torch.arange(nb, device=k.device)
                cand = (b >= cfg.n_sink) & (b < (T - 1) // cfg.B - cfg.n_win)
                E = eviction.eviction_block_scores(c_sub, nb, cfg)  # (H_kv, nb)
                core = eviction.core_list(E, cand.expand_as(E), self.core_ids[layer].shape[-1])
            self.core_ids[layer][seq], self.core_E[layer][seq] = core

    def append(self, layer, k, c, pos, max_pos):
        """k (Bz, H_kv, d), c (Bz, H_kv) or None, written at positions pos (Bz,); when a sub-block
        completes (every s_c tokens, per sequence) its mean joins K̃ and c̃. max_pos: the largest
        position, known on the host, so that nothing here waits for the device."""
        pooled = max_pos + 1 >= self.cfg.l_c  # some sequence may have completed a sub-block
        if pooled:
            self.K_sub[layer] = grow(self.K_sub[layer], pooling.n_subblocks(max_pos + 1, self.cfg), 2)
            self.c_sub[layer] = grow(self.c_sub[layer], pooling.n_subblocks(max_pos + 1, self.cfg), 2)
        core = (self.core_ids[layer], self.core_E[layer]) if self.core_ids else (None, None)
        append_subblocks(self.ring_k[layer], self.ring_c[layer], self.K_sub[layer], self.c_sub[layer], *core, k, c, pos,
                         self.cfg, pooled)


def append_subblocks(ring_k, ring_c, K_sub, c_sub, core_ids, core_E, k, c, pos, cfg, pooled):
    """SubBlockCache.append on one layer's buffers, in place: one Triton kernel on a GPU, the torch
    code (fused) elsewhere and in fp64."""
    d = k.shape[-1]
    if k.is_cuda and k.dtype != torch.float64 and d & (d - 1) == 0:
        return append_subblocks_triton(ring_k, ring_c, K_sub, c_sub, core_ids, core_E, k, c, pos, cfg, pooled)
    return append_subblocks_torch(ring_k, ring_c, K_sub, c_sub, core_ids, core_E, k, c, pos, cfg, pooled)


@fast.fused
def append_subblocks_torch(ring_k, ring_c, K_sub, c_sub, core_ids, core_E, k, c, pos, cfg, pooled):
    rows = torch.arange(k.shape[0], device=k.device)
    ring_k[rows, :, pos % cfg.l_c] = k
    if c is not None:
        ring_c[rows, :, pos % cfg.l_c] = c
    if not pooled:
        return
    start = pos + 1 - cfg.l_c  # first token of the sub-block that ends at pos, (Bz,)
    done = ((start >= 0) & (start % cfg.s_c == 0))[:, None]  # (Bz, 1)
    m = (start // cfg.s_c).clamp(min=0)  # (Bz,)
    order = (start[:, None] + torch.arange(cfg.l_c, device=k.device)) % cfg.l_c  # ring in token order
    new = ring_k[rows[:, None], :, order].mean(1)  # (Bz, H_kv, d)
    K_sub[rows, :, m] = torch.where(done[..., None], new, K_sub[rows, :, m])
    if c is not None:
        new = ring_c[rows[:, None], :, order].mean(1)  # (Bz, H_kv)
        c_sub[rows, :, m] = torch.where(done, new, c_sub[rows, :, m])
    if core_ids is not None:
        join_window_leaver(core_ids, core_E, c_sub, pos, cfg)


def join_window_leaver(core_ids, core_E, c_sub, pos, cfg):
    """The eviction policy at a decode step, in place: at a block's first token (pos (Bz,)) the block
    n_win + 1 back leaves the window and competes with each row's list (eviction.join_core_list). Its
    E is final: the sub-blocks that overlap it are complete (the config check in config.Config)."""
    b_new = pos // cfg.B - cfg.n_win - 1
    b_new = torch.where((pos % cfg.B == 0) & (b_new >= cfg.n_sink), b_new, -1)[:, None].expand(-1, cfg.H_kv)
    ids, E = eviction.join_core_list(core_ids, core_E, b_new, eviction.block_score(c_sub, b_new.clamp(min=0), cfg))
    core_ids.copy_(ids)
    core_E.copy_(E)


class KVCache(Cache):
    """The whole cache on one device: K, V (Bz, H_kv, S, d) per layer, and what the mode needs besides:
    eviction scores c (Bz, H_kv, S) for nosa and dma, the pooled caches for the sparse modes, none of
    it for full attention. With max_len, the buffers are allocated once for max_len tokens and sparse
    modes attend over all of them (static shapes, so a decode step can be a CUDA graph:
    fast.GraphedDecode); without, they grow with the sequences."""

    def __init__(self, cfg, Bz, device, dtype, max_len=None):
        super().__init__(Bz, device)
        self.cfg, self.max_len = cfg, max_len
        L, H, d, S = cfg.n_layer, cfg.H_kv, cfg.head_dim, max_len or 0
        self.k = [torch.zeros(Bz, H, S, d, device=device, dtype=dtype) for _ in range(L)]
        self.v = [torch.zeros(Bz, H, S, d, device=device, dtype=dtype) for _ in range(L)]
        cdt = torch.promote_types(dtype, torch.float32)
        self.c = [torch.zeros(Bz, H, S if cfg.eviction_head else 0, device=device, dtype=cdt) for _ in range(L)]
        self.sub = SubBlockCache(cfg, Bz, device, dtype, S) if cfg.sparse else None

    def prefill(self, layer, seq, k, v, c, pooled=None):
        T = k.shape[1]
        self._grow(layer, T)
        self.k[layer][seq, :, :T], self.v[layer][seq, :, :T] = k, v
        if c is not None:
            self.c[layer][seq, :, :T] = c
        if self.sub:
            self.sub.prefill(layer, seq, k, c, pooled)
        if layer == self.cfg.n_layer - 1:
            self.set_length(seq, T)

    def capacity(self):
        """Positions below which a decode step keeps its shapes (fast.GraphedDecode); 0: they change every step."""
        return self.max_len or 0

    def S(self):  # tokens attention spans: all preallocated ones (static shapes), else exactly the context
        return max(self.capacity(), int(self.len_cpu.max()) + 1)

    def n_blocks(self):  # the blocks selection ranges over
        return pooling.n_blocks(self.S(), self.cfg)

    def append(self, layer, k, v, c):
        pos, rows = self.len, torch.arange(k.shape[0], device=k.device)
        max_pos = int(self.len_cpu.max())
        self._grow(layer, max_pos + 1)
        self.k[layer][rows, :, pos], self.v[layer][rows, :, pos] = k, v
        if c is not None:
            self.c[layer][rows, :, pos] = c
        if self.sub:
            self.sub.append(layer, k, c, pos, max_pos)

    def attend(self, layer, q, block_mask):
        """q (Bz, H_q, 1, d) at positions self.len -> (Bz, H_q, 1, d) over the cached tokens."""
        S = self.S()
        with record_function("attention"):
            if not self.cfg.sparse:
                return decode.dense_decode(q, self.k[layer][:, :, :S], self.v[layer][:, :, :S], self.len)
            bias = eviction.attention_bias(self.c[layer][:, :, :S], self.cfg.attn) if self.cfg.eviction_head else None
            return decode.sparse_decode(q, self.k[layer][:, :, :S], self.v[layer][:, :, :S], bias, block_mask,
                                        self.len, self.cfg.B, self.cfg.k)

    def _grow(self, layer, n):
        self.k[layer], self.v[layer] = grow(self.k[layer], n, 2), grow(self.v[layer], n, 2)
        if self.cfg.eviction_head:
            self.c[layer] = grow(self.c[layer], n, 2)


# -----------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _append_kernel(RK, RC, KS, CS, IDS, ES, K, C, POS, M, H_kv: tl.constexpr, D: tl.constexpr, L_C: tl.constexpr,
                   LP: tl.constexpr, S_C: tl.constexpr, B: tl.constexpr, N_SINK: tl.constexpr, N_WIN: tl.constexpr,
                   R_SUB: tl.constexpr, P_OVER: tl.constexpr, RPP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                   HAS_C: tl.constexpr, HAS_CORE: tl.constexpr, POOLED: tl.constexpr):
    """Program r = one row (sequence, KV head) of append_subblocks_torch: ring (R, l_c, d), K̃ (R, M, d),
    c̃ (R, M), list (R, N). Vectors over the ring (j), the head dim (dd) and the list (e); the scalars
    of the row are broadcast to them where they gate a store (the interpreter needs vector masks)."""
    r = tl.program_id(0)
    p = tl.load(POS + r // H_kv)  # the new token's position
    j, dd = tl.arange(0, LP), tl.arange(0, D)
    slot = p % L_C
    k_new = tl.load(K + r * D + dd)
    if HAS_C:
        c_new = tl.load(C + r)
    if POOLED:  # the ring as it is after this token: its mean is the sub-block ending at p, if one does
        start = p + 1 - L_C
        m = tl.maximum(start, 0) // S_C
        ring = tl.load(RK + (r * L_C + j)[:, None] * D + dd[None, :], mask=(j < L_C)[:, None], other=0.0)
        ring = tl.where((j == slot)[:, None], k_new[None, :], ring).to(tl.float32)  # (LP, D)
        sd = dd * 0 + start
        tl.store(KS + (r * M + m) * D + dd, (tl.sum(ring, 0) / L_C).to(KS.dtype.element_ty),
                 mask=(sd >= 0) & (sd % S_C == 0))
        if HAS_C:
            ring_c = tl.where(j == slot, c_new, tl.load(RC + r * L_C + j, mask=j < L_C, other=0.0))
            sj = j * 0 + start
            tl.store(CS + r * M + m + j * 0, tl.sum(ring_c, 0) / L_C + j * 0.0, mask=(j == 0) & (sj >= 0)
                     & (sj % S_C == 0))
    tl.store(RK + (r * L_C + slot) * D + dd, k_new)  # (the ring's old value there was never used)
    if HAS_C:
        tl.store(RC + r * L_C + slot + j * 0, c_new + j * 0.0, mask=j == 0)
    if HAS_CORE:  # join_window_leaver: the block leaving the window goes in at its rank
        b_new = p // B - N_WIN - 1
        i = tl.arange(0, RPP)
        m_ov = b_new * R_SUB - P_OVER + i  # eviction.block_score: the max of c̃ over its sub-blocks
        E_new = tl.max(tl.load(CS + r * M + m_ov, mask=(i < R_SUB + P_OVER) & (m_ov >= 0) & (m_ov < M),
                               other=float("-inf")), 0)
        e = tl.arange(0, NP)
        on, up = e < N, (e >= 1) & (e < N)
        ids = tl.load(IDS + r * N + e, mask=on, other=-1)
        E = tl.load(ES + r * N + e, mask=on, other=float("-inf"))
        rank = tl.sum(((ids >= 0) & (E > E_new)).to(tl.int32), 0)  # it wins ties: the most recent
        ids = tl.where(e == rank, b_new, tl.where(e > rank, tl.load(IDS + r * N + e - 1, mask=up, other=-1), ids))
        E = tl.where(e == rank, E_new, tl.where(e > rank, tl.load(ES + r * N + e - 1, mask=up, other=0.0), E))
        tl.debug_barrier()  # every entry read before any moves
        pe = e * 0 + p
        join = on & (pe % B == 0) & (pe // B - N_WIN - 1 >= N_SINK)
        tl.store(IDS + r * N + e, ids, mask=join)
        tl.store(ES + r * N + e, E, mask=join)


def append_subblocks_triton(ring_k, ring_c, K_sub, c_sub, core_ids, core_E, k, c, pos, cfg, pooled):
    """append_subblocks_torch as one kernel a layer, one program per row."""
    Bz, H_kv, l_c, d = ring_k.shape
    has_c, has_core = c is not None, core_ids is not None
    n = core_ids.shape[-1] if has_core else 1
    r, p = pooling.overlap(cfg)
    _append_kernel[(Bz * H_kv,)](
        ring_k, ring_c if has_c else ring_k, K_sub, c_sub if has_c else K_sub, core_ids if has_core else ring_k,
        core_E if has_core else ring_k, k.contiguous(), c.contiguous() if has_c else k, pos, K_sub.shape[2],
        H_kv=H_kv, D=d, L_C=l_c, LP=triton.next_power_of_2(l_c), S_C=cfg.s_c, B=cfg.B, N_SINK=cfg.n_sink,
        N_WIN=cfg.n_win, R_SUB=r, P_OVER=p, RPP=triton.next_power_of_2(r + p), N=n, NP=triton.next_power_of_2(n),
        HAS_C=has_c, HAS_CORE=has_core, POOLED=pooled)
