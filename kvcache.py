"""
KV caches for step-by-step decoding: the contract a decode step talks to (Cache), the pooled state
selection reads (SubBlockCache), and the cache kept whole on the GPU (KVCache).

Notation: Bz sequences, H_kv KV heads of dim d, S cached positions, c eviction scores (eviction.py),
K̃ / c̃ the pooled caches scoring reads (pooling.py): M = complete sub-blocks.

KVCache keeps everything on the device; offload.OffloadCache keeps the blocks in host memory and
only the selected ones on the GPU (NOSI). Both keep the lengths (Cache) and the pooled state
(SubBlockCache).
"""

import copy

import torch
from torch.profiler import record_function

import attention
import eviction
import pooling


class Cache:
    """The contract of a decode cache. Per layer, what nosa.nosa_decode calls, in this order:
      append(layer, k, v, c)        write the new token of every sequence at its position `len`
      pooled(layer)                 K̃ and each row's list of its best candidates by E
      n_blocks()                    how many blocks selection ranges over
      attend(layer, q, block_mask)  attention of q over the selected blocks Γ(t)
    and prefill(layer, seq, k, v, c, pooled) for a prompt (prefill.py), advance() after a step,
    finish(done) for sequences that ended. Every cache keeps the lengths: tokens per sequence on the
    device (read by the decode step) and on the host (read by the Python that sizes and launches it,
    without a device sync; never below the device's). A row that is not active does not advance.

    Continuous batching (serve.py) parks a row while a new prompt prefills into it beside the
    decoding batch: park(seq), the prefill, start(seq). A parked row waits at position 0, so a step
    costs it one key; what a step writes for it (its entries at position 0, the rings, the lists,
    the tail and the tables: the row's decode state) its prefill writes at start (put)."""

    def __init__(self, Bz, device):
        self.len = torch.zeros(Bz, dtype=torch.long, device=device)
        self.len_cpu = torch.zeros(Bz, dtype=torch.long)
        self.active = torch.ones(Bz, dtype=torch.bool, device=device)  # rows that advance
        self.active_cpu = torch.ones(Bz, dtype=torch.bool)
        self.parked = {}  # row -> the writes of its decode state that wait for start(row)

    def set_length(self, seq, T):  # after a prefill of T tokens into row seq
        self.put(seq, self.len, seq, T)
        self.put(seq, self.len_cpu, seq, T)

    def advance(self):
        self.len += self.active
        self.advance_host()

    def advance_host(self):  # the host-side part of advance, which a CUDA graph replay does not run
        self.len_cpu += self.active_cpu

    def finish(self, done):
        """done (Bz,): sequences that ended, on the device: they stop advancing, and a cache may stop
        spending on them."""
        self.active.copy_(~done)

    def park(self, seq):
        """Row seq stops decoding, at position 0, for a new prompt (or none)."""
        self.len[seq] = self.len_cpu[seq] = 0
        self.active[seq] = self.active_cpu[seq] = False
        self.parked[seq] = []

    def put(self, seq, t, index, value):
        """t[index] = value, a write of row seq's decode state: now, or at start(seq) if it is parked."""
        if seq in self.parked:
            self.parked[seq].append((t, index, value.clone() if torch.is_tensor(value) else value))
        else:
            t[index] = value

    def start(self, seq):
        """Row seq decodes from its prefill on: the writes that waited, on the current stream (after
        the prefill's, where it ran on another)."""
        for t, index, value in self.parked.pop(seq):
            if torch.is_tensor(value) and value.is_cuda:  # memory not reused before the copy ran
                value.record_stream(torch.cuda.current_stream(value.device))
            t[index] = value
        self.active[seq] = self.active_cpu[seq] = True

    def pooled(self, layer):
        return self.sub.pooled(layer)

    def graphable(self, pos):
        """Whether decode steps from largest position pos on launch the same kernels on the same
        shapes, so one recorded step can be replayed (fast.GraphedDecode): the buffers hold the
        position (capacity), and a sequence has l_c tokens (before, the pooled caches may be
        empty). A replay runs none of the step's Python: the caller advances the host's lengths
        (advance_host)."""
        return self.cfg.l_c <= pos + 1 and pos < self.capacity()


def grow(t, n, dim):
    """Return t with at least n entries along `dim`, doubling: no buffer is sized once up front."""
    if t.shape[dim] >= n:
        return t
    shape = list(t.shape)
    shape[dim] = max(n, 2 * t.shape[dim]) - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


class SubBlockCache:
    """Per layer: the pooled caches K̃ (Bz, H_kv, M, d) and c̃ (Bz, H_kv, M), kept up to date
    one token at a time from a ring of the last l_c keys and scores. Both caches use it."""

    BUFFERS = (
        "ring_k",
        "ring_c",
        "K_sub",
        "c_sub",
        "core_ids",
        "core_E",
    )  # one tensor per layer, a row per sequence

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
        self.core_ids = (
            [torch.full((Bz, H, n), -1, dtype=torch.long, device=device) for _ in range(L)]
            if n
            else None
        )
        self.core_E = (
            [torch.full((Bz, H, n), float("-inf"), dtype=cdt, device=device) for _ in range(L)]
            if n
            else None
        )

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

    def prefill(self, layer, seq, k, c, pooled=None, put=None):
        """k (H_kv, T, d), c (H_kv, T) or None: one whole sequence. pooled: (K̃, c̃, list) of it where the
        caller has them (a chunked prefill: PromptLayer.pooled), else made here. put: how the rings
        and the list are written (Cache.put), else at once."""
        cfg, T = self.cfg, k.shape[1]
        K_sub, c_sub, core = pooled or (
            pooling.compress_keys(k, cfg),
            None if c is None else pooling.pool_mean(c, cfg),
            None,
        )  # (H_kv, M, d), (H_kv, M)
        M = K_sub.shape[1]
        self.K_sub[layer] = grow(self.K_sub[layer], M, 2)
        self.c_sub[layer] = grow(self.c_sub[layer], M, 2)
        self.K_sub[layer][seq, :, :M] = K_sub
        put = put or (lambda seq, t, index, value: t.__setitem__(index, value))
        tail = torch.arange(max(T - cfg.l_c, 0), T, device=k.device)
        ring = (seq, slice(None), tail % cfg.l_c)
        put(seq, self.ring_k[layer], ring, k[:, tail])
        if c is not None:
            self.c_sub[layer][seq, :, :M] = c_sub
            put(seq, self.ring_c[layer], ring, c[:, tail])
        if self.core_ids:  # as of the last prompt token: the next step adds what leaves the window
            if core is None:  # from scratch
                nb = pooling.n_blocks(T, cfg)
                b = torch.arange(nb, device=k.device)
                cand = (b >= cfg.n_sink) & (b < (T - 1) // cfg.B - cfg.n_win)
                E = eviction.eviction_block_scores(c_sub, nb, cfg)  # (H_kv, nb)
                core = eviction.core_list(E, cand.expand_as(E), self.core_ids[layer].shape[-1])
            put(seq, self.core_ids[layer], seq, core[0])
            put(seq, self.core_E[layer], seq, core[1])

    def append(self, layer, k, c, pos, max_pos):
        """k (Bz, H_kv, d), c (Bz, H_kv) or None, written at positions pos (Bz,); when a sub-block
        completes (every s_c tokens, per sequence) its mean joins K̃ and c̃, and when a block leaves
        the window it joins the list by the eviction policy. max_pos: the largest position, known on
        the host, so that nothing here waits for the device."""
        M = pooling.n_subblocks(max_pos + 1, self.cfg)
        self.K_sub[layer] = grow(self.K_sub[layer], M, 2)
        self.c_sub[layer] = grow(self.c_sub[layer], M, 2)
        pooling.append_subblocks(
            self.ring_k[layer],
            self.ring_c[layer],
            self.K_sub[layer],
            self.c_sub[layer],
            k,
            c,
            pos,
            self.cfg,
        )
        if self.core_ids:
            eviction.join_leaver(
                self.core_ids[layer], self.core_E[layer], self.c_sub[layer], pos, self.cfg
            )


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
        self.c = [
            torch.zeros(Bz, H, S if cfg.eviction_head else 0, device=device, dtype=cdt)
            for _ in range(L)
        ]
        self.sub = SubBlockCache(cfg, Bz, device, dtype, S) if cfg.sparse else None

    def prefill(self, layer, seq, k, v, c, pooled=None):
        T = k.shape[1]
        self._grow(layer, T)
        self.k[layer][seq, :, 1:T], self.v[layer][seq, :, 1:T] = k[:, 1:], v[:, 1:]
        self.put(seq, self.k[layer], (seq, slice(None), 0), k[:, 0])  # where a parked row writes
        self.put(seq, self.v[layer], (seq, slice(None), 0), v[:, 0])
        if c is not None:
            self.c[layer][seq, :, 1:T] = c[:, 1:]
            self.put(seq, self.c[layer], (seq, slice(None), 0), c[:, 0])
        if self.sub:
            self.sub.prefill(layer, seq, k, c, pooled, self.put)
        if layer == self.cfg.n_layer - 1:
            self.set_length(seq, T)

    def capacity(self):
        """Positions below which a decode step keeps its shapes (fast.GraphedDecode); 0: they change every step."""
        return self.max_len or 0

    def S(
        self,
    ):  # tokens attention spans: all preallocated ones (static shapes), else exactly the context
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
        cfg, k, v = self.cfg, self.k[layer][:, :, :S], self.v[layer][:, :, :S]
        with record_function("attention"):
            if not cfg.sparse:
                return attention.dense_decode(q, k, v, self.len, cfg)
            bias = (
                eviction.attention_bias(self.c[layer][:, :, :S], cfg.attn)
                if cfg.eviction_head
                else None
            )
            return attention.sparse_decode(q, k, v, bias, block_mask, self.len, cfg)

    def _grow(self, layer, n):
        self.k[layer], self.v[layer] = grow(self.k[layer], n, 2), grow(self.v[layer], n, 2)
        if self.cfg.eviction_head:
            self.c[layer] = grow(self.c[layer], n, 2)
