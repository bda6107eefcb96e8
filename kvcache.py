"""
KV caches for step-by-step decoding, as stores: a decode step (nosa.nosa_decode) writes the new
token into them and asks them for the blocks it selected, and they run no part of the method. The
contract (Cache) and the cache kept whole on the GPU (KVCache); the pooled state selection reads
(nosa.PooledState) lives beside the method that updates it, and the caches hold it.

Notation: Bz sequences, H_kv KV heads of dim d, S cached positions, c eviction scores (eviction.py),
K̃ / c̃ the pooled caches scoring reads (pooling.py): M = complete sub-blocks.

KVCache keeps everything on the device; offload.OffloadCache keeps the blocks in host memory and
only the selected ones on the GPU (NOSI). Both keep the lengths (Cache) and the pooled state
(nosa.PooledState).
"""

from typing import NamedTuple

import torch

import nosa
from common import grow


class Blocks(NamedTuple):
    """The blocks a decode step attends over, as a cache hands them back (Cache.blocks), in one of
    two forms: a resident cache's keys and values k, v (Bz, H_kv, S, d), which attention masks by
    Γ(t); or an offloaded cache's slot pool (R, k + 1, 2, B, d: K then V of each slot's block, the
    tail last), every slot selected, with its table slot -> block in slots (R, k). c (Bz, H_kv, S):
    the eviction scores where the mode has them."""

    k: torch.Tensor = None
    v: torch.Tensor = None
    c: torch.Tensor = None
    pool: torch.Tensor = None
    slots: torch.Tensor = None


def write_now(t, index, value):
    """t[index] = value: how a prefill writes a sequence's decode state unless serving defers it."""
    t[index] = value


class Cache:
    """The contract of a decode cache, a store. Per layer, what nosa.nosa_decode calls, in this order:
      write(layer, k, v, c)       the new token of every sequence at its position `len`; returns
                                  nb, how many blocks selection ranges over
      blocks(layer, block_mask)   the selected blocks Γ(t) on the device, to attend over (Blocks)
      flush(layer)                after the attention: a tail block the token filled goes to its place
    and prefill(layer, seq, k, v, c, pooled, put) for a prompt (prefill.py), advance() after a step,
    finish(done) for sequences that ended. Every cache keeps the lengths: tokens per sequence on the
    device (read by the decode step) and on the host (read by the Python that sizes and launches it,
    without a device sync; never below the device's). A sequence that is not active does not advance
    (serve.Parked holds one back while a new prompt prefills into it).
    capacity(): the positions below which a step keeps its shapes (fast.GraphedDecode).

    A prefill writes a sequence's decode state (what a step writes for it too: its entries at position
    0, the rings, the E-list, the tail and the tables, the length) through `put(t, index, value)`:
    at once by default (write_now), later where serving holds the sequence back (serve.Parked)."""

    moves_blocks = False  # whether blocks() and flush() move blocks (offload.OffloadCache)

    def __init__(self, cfg, Bz, device):
        self.cfg = cfg
        self.len = torch.zeros(Bz, dtype=torch.long, device=device)
        self.len_cpu = torch.zeros(Bz, dtype=torch.long)
        self.active = torch.ones(Bz, dtype=torch.bool, device=device)  # sequences that advance
        self.active_cpu = torch.ones(Bz, dtype=torch.bool)
        self.sub = None  # the pooled state (nosa.PooledState) of a sparse mode

    # what each cache defines (KVCache below, offload.OffloadCache), as the docstring says
    def write(self, layer, k, v, c):  # -> nb
        raise NotImplementedError

    def blocks(self, layer, block_mask):  # -> Blocks
        raise NotImplementedError

    def flush(self, layer):
        raise NotImplementedError

    def prefill(self, layer, seq, k, v, c, pooled=None, *, put=write_now):
        raise NotImplementedError

    def capacity(self):
        raise NotImplementedError

    # the lengths and which sequences advance are written here only, the device's and the host's
    # copy together (finish, which the device decides, excepted: the host's stays an upper bound)
    def set_length(self, seq, T, put):  # after a prefill of T tokens into sequence seq
        put(self.len, seq, T)
        put(self.len_cpu, seq, T)

    def set_active(self, seq, on):  # seq: an index or a slice of sequences
        self.active[seq] = self.active_cpu[seq] = on

    def hold(self, seq):  # back to position 0, not advancing (serve.Parked)
        self.len[seq] = self.len_cpu[seq] = 0
        self.set_active(seq, False)

    def advance(self):
        self.len += self.active
        self.advance_host()

    def advance_host(self):  # the host-side part of advance, which a CUDA graph replay does not run
        self.len_cpu += self.active_cpu

    def finish(self, done):
        """done (Bz,): sequences that ended, on the device: they stop advancing, and a cache may stop
        spending on them."""
        self.active.copy_(~done)

    def graphable(self, pos):
        """Whether decode steps from largest position pos on launch the same kernels on the same
        shapes, so one recorded step can be replayed (fast.GraphedDecode): the buffers hold the
        position (capacity), and a sequence has l_c tokens (before, the pooled caches may be
        empty). A replay runs none of the step's Python: the caller advances the host's lengths
        (advance_host)."""
        return self.cfg.l_c <= pos + 1 and pos < self.capacity()


class KVCache(Cache):
    """The whole cache on one device: K, V (Bz, H_kv, S, d) per layer, and what the mode needs besides:
    eviction scores c (Bz, H_kv, S) for nosa and dma, the pooled caches for the sparse modes, none of
    it for full attention. With max_len, the buffers are allocated once for max_len tokens and sparse
    modes attend over all of them (static shapes, so a decode step can be a CUDA graph:
    fast.GraphedDecode); without, they grow with the sequences."""

    def __init__(self, cfg, Bz, device, dtype, max_len=None):
        super().__init__(cfg, Bz, device)
        self.max_len = max_len
        L, H, d, S = cfg.n_layer, cfg.H_kv, cfg.head_dim, max_len or 0
        self.k = [torch.zeros(Bz, H, S, d, device=device, dtype=dtype) for _ in range(L)]
        self.v = [torch.zeros(Bz, H, S, d, device=device, dtype=dtype) for _ in range(L)]
        cdt = torch.promote_types(dtype, torch.float32)
        self.c = [
            torch.zeros(Bz, H, S if cfg.eviction_head else 0, device=device, dtype=cdt)
            for _ in range(L)
        ]
        self.sub = nosa.PooledState(cfg, Bz, device, dtype, S) if cfg.sparse else None

    def prefill(self, layer, seq, k, v, c, pooled=None, *, put=write_now):
        T = k.shape[1]
        self._grow(layer, T)
        self.k[layer][seq, :, 1:T], self.v[layer][seq, :, 1:T] = k[:, 1:], v[:, 1:]
        put(
            self.k[layer], (seq, slice(None), 0), k[:, 0]
        )  # where a held-back sequence's steps write
        put(self.v[layer], (seq, slice(None), 0), v[:, 0])
        if c is not None:
            self.c[layer][seq, :, 1:T] = c[:, 1:]
            put(self.c[layer], (seq, slice(None), 0), c[:, 0])
        if self.sub:
            self.sub.prefill(layer, seq, k, c, pooled, put)
        if layer == self.cfg.n_layer - 1:
            self.set_length(seq, T, put)

    def capacity(self):
        """Positions below which a decode step keeps its shapes (fast.GraphedDecode); 0: they change every step."""
        return self.max_len or 0

    # tokens attention spans: all preallocated ones (static shapes), else exactly the context
    def S(self):
        return max(self.capacity(), int(self.len_cpu.max()) + 1)

    def write(self, layer, k, v, c):
        """k, v (Bz, H_kv, d), c (Bz, H_kv) or None: the new token of every sequence, at its
        position -> the blocks selection ranges over: those of the tokens attention spans (S)."""
        pos, seqs = self.len, torch.arange(k.shape[0], device=k.device)
        max_pos = int(self.len_cpu.max())
        self._grow(layer, max_pos + 1)
        self.k[layer][seqs, :, pos], self.v[layer][seqs, :, pos] = k, v
        if c is not None:
            self.c[layer][seqs, :, pos] = c
        return self.cfg.n_blocks(max(self.capacity(), max_pos + 1))  # (S)

    def blocks(self, layer, block_mask):
        """Everything is resident: the cached tokens, which attention masks by Γ(t)."""
        S = self.S()
        c = self.c[layer][:, :, :S] if self.cfg.eviction_head else None
        return Blocks(k=self.k[layer][:, :, :S], v=self.v[layer][:, :, :S], c=c)

    def flush(self, layer):  # nothing to move: the tail is where every block is
        pass

    def _grow(self, layer, n):
        self.k[layer], self.v[layer] = grow(self.k[layer], n, 2), grow(self.v[layer], n, 2)
        if self.cfg.eviction_head:
            self.c[layer] = grow(self.c[layer], n, 2)
