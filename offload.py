"""
NOSI: decoding with the KV cache offloaded to host memory (docs/METHOD.md §6).

Notation: R = Bz * H_kv rows, one per (sequence, KV head), per layer; k slots per row;
a *unit* = one KV block, K then V: (2, B, d), contiguous (one PCIe burst); q_t = pos // B the
tail block, the one being written.

  host store   (R, cap, 2, B, d)  every completed block of every row; pinned when CUDA is present
                                  (pinned_empty); nothing is ever deleted; grows by doubling
  slot pool    (R, k+1, 2, B, d)  on the GPU: slots 0..k-1 hold the selected blocks other than the tail,
                                  slot k the tail: the block being written
  slot_block   (R, k)             slot -> block id, -1 = free
  block_slot   (R, cap)           block -> slot, -1 = not resident
  c            (Bz, H_kv, S)      the eviction score of every token stays on the GPU (1/2d of K+V),
                                  as do the pooled caches K̃ and c̃ that scoring reads (nosa.PooledState)

Per decode step and layer, nosa.nosa_decode runs the step and calls this store for three parts:
  write     k, v into the tail, c into its cache (write_tail); nosa_decode then updates K̃, c̃ and
            the E-list and selects Γ(t), exactly as in training (nosa.select)
  blocks    set_difference: the selected non-tail blocks against the resident ones: free the slots
            of blocks no longer selected, give each missed block a free slot; on the device, no
            sync. Then gather: the missed units from the host store into their slots (UVA: a
            kernel reads pinned host memory through its device pointer). nosa_decode attends over
            the slots and the tail, with the bias (attention.slot_attention)
  flush     when the tail block is full: write it to the host store, and keep it in a free slot,
            so the window needs no transfer.
By the locality theorem (nosa.py) step 4 moves at most k_q - 1 units per row and step.
Kernels: offload_kernels.py and uva_copy.cu.
"""

import copy
import math
import weakref

import torch

import memory
import nosa
import offload_kernels
from common import grow, use_kernels
from kvcache import Blocks, Cache, KVCache, write_now


def needed_blocks(sel, pos, active, H_kv, B, k):
    """What a step needs from the slot pool: sel (R, nb) the selected blocks of every row, pos (Bz,),
    active (Bz,). Returns the ascending ids of the selected blocks other than the tail, -1 padded,
    (R, k) (at most k - 1 of them), and their number (R,). Ended sequences need nothing.
    Kernel: offload_kernels.needed_blocks."""
    if use_kernels(sel):
        return offload_kernels.needed_blocks(sel, pos, active, H_kv, B, k)
    R, nb = sel.shape
    q_blk = (pos // B).repeat_interleave(H_kv)[:, None]  # (R, 1)
    b = torch.arange(nb, device=sel.device)
    # the tail is always on the device
    need = sel & (b != q_blk) & active.repeat_interleave(H_kv)[:, None]
    # the i-th needed block goes to column i; k is a spare
    col = torch.where(need, need.cumsum(1) - 1, k)
    ids = torch.full((R, k + 1), -1, dtype=torch.long, device=sel.device).scatter_(
        1, col, torch.where(need, b, -1)
    )
    return ids[:, :k].contiguous(), need.sum(1)


def write_tail(pool, c_all, k, v, c, pos, *, B):
    """The new token into the tail blocks (the pool's last slot), in place: pool (R, k + 1, 2, B, d),
    c_all (Bz, H_kv, S); k, v (Bz, H_kv, d), c (Bz, H_kv) or None at positions pos (Bz,).
    Kernel: offload_kernels.write_tail."""
    if use_kernels(k):
        return offload_kernels.write_tail(pool, c_all, k, v, c, pos, B=B)
    Bz, H_kv, d = k.shape
    rows, slot = torch.arange(Bz * H_kv, device=k.device), (pos % B).repeat_interleave(H_kv)  # (R,)
    tail = torch.full_like(rows, pool.shape[1] - 1)
    kv = torch.stack([k.reshape(-1, d), v.reshape(-1, d)], 1)  # (R, 2, d)
    pool.index_put_(
        (rows[:, None], tail[:, None], torch.arange(2, device=k.device), slot[:, None]), kv
    )
    if c is not None:
        c_all[torch.arange(Bz, device=k.device), :, pos] = c


# -----------------------------------------------------------------------------
# Transfers between the host store and the slot pool


def set_difference(need, slot_block, block_slot, fetch):
    """need (R, n <= k) ascending block ids, -1 padded; updates
    the tables slot_block (R, k) and block_slot (R, cap) in place; writes fetch (R, k): the block each
    slot must load, or -1. The i-th missed block (ascending) takes the i-th free slot (ascending).
    Written without a host sync (scatters into a spare last column instead of nonzero()), so on a
    GPU without nvcc it runs inside a CUDA graph too. Kernel: uva_copy.cu's set_difference."""
    if use_kernels(need) and offload_kernels.uva(need.device):
        return offload_kernels.uva(need.device).set_difference(need, slot_block, block_slot, fetch)
    R, k = slot_block.shape
    cap = block_slot.shape[1]
    pad = lambda t, n: t.masked_fill(t < 0, n)  # -1 -> the spare column n
    # 1. evict: resident blocks that are not needed any more free their slots
    needed = torch.zeros(R, cap + 1, dtype=torch.bool, device=need.device).scatter_(
        1, pad(need, cap), True
    )
    keep = (slot_block >= 0) & needed.gather(1, pad(slot_block, cap))  # (R, k)
    slot_block.masked_fill_(~keep, -1)
    # 2. misses, in ascending block order, take the free slots in ascending slot order
    resident = torch.zeros(R, cap + 1, dtype=torch.bool, device=need.device).scatter_(
        1, pad(slot_block, cap), True
    )
    miss = (need >= 0) & ~resident.gather(1, pad(need, cap))  # (R, n)
    free_first = torch.sort((slot_block >= 0).to(torch.uint8), dim=1, stable=True).indices  # (R, k)
    # (R, n), k = spare
    slot = torch.where(miss, free_first.gather(1, (miss.cumsum(1) - 1).clamp(min=0)), k)
    new = torch.full((R, k + 1), -1, dtype=need.dtype, device=need.device)
    new = new.scatter_(1, slot, torch.where(miss, need, -1))
    fetch.copy_(new[:, :k])
    slot_block.copy_(torch.where(fetch >= 0, fetch, slot_block))
    # 3. block -> slot, rebuilt from slot -> block
    table = torch.full((R, cap + 1), -1, dtype=block_slot.dtype, device=need.device)
    table.scatter_(
        1, pad(slot_block, cap), torch.arange(k, device=need.device).expand(R, k).contiguous()
    )
    block_slot.copy_(table[:, :cap])


def flush_tails(host, pool, slot_block, block_slot, pos, *, H_kv, B):
    """pos (Bz,) the position just written; a row whose tail block (pool slot k) is now full writes
    it to host[r, pos // B] and copies it into its first free slot (there is always one: at most
    k - 1 other blocks are selected). Kernel: uva_copy.cu's flush_tails (Triton without nvcc)."""
    if use_kernels(pool) and host.is_pinned():
        return offload_kernels.flush_tails(host, pool, slot_block, block_slot, pos, H_kv=H_kv, B=B)
    k = slot_block.shape[1]
    p = pos.repeat_interleave(H_kv)  # (R,)
    r = torch.nonzero(p % B == B - 1)[:, 0]  # a device sync: the kernel needs none
    if r.numel() == 0:
        return
    b = p[r] // B
    tail = pool[r, k]
    host[r.to(host.device), b.to(host.device)] = tail.to(host.device)
    free = torch.argmax((slot_block[r] < 0).to(torch.uint8), 1)  # first free slot: there is one
    pool[r, free] = tail
    slot_block[r, free] = b
    block_slot[r, b] = free


def gather_units(host, pool, fetch, *, beside=False):
    """pool[r, s] = host[r, fetch[r, s]] where fetch >= 0: the missed blocks from the host store
    into their slots; beside: while another micro-batch computes. Kernel: uva_copy.cu's
    gather_units (Triton without nvcc)."""
    if use_kernels(pool) and host.is_pinned():
        return offload_kernels.gather_units(host, pool, fetch, beside=beside)
    f = fetch.to(host.device)
    r, s = torch.nonzero(f >= 0, as_tuple=True)
    if r.numel():
        pool[r.to(pool.device), s.to(pool.device)] = host[r, f[r, s]].to(
            pool.device, non_blocking=True
        )


# -----------------------------------------------------------------------------
# Statistics


def count_moves(fetch, n_need, fresh, *, needed, moved, cold, steps, row_max):
    """Stats of one layer's step, in place, per row: fetch (R, k) the blocks gathered, n_need (R,)
    the blocks selected, fresh (R,) rows at their first step after prefill (cleared here).
    Kernel: offload_kernels.count_moves."""
    if use_kernels(fetch):
        return offload_kernels.count_moves(
            fetch,
            n_need,
            fresh,
            needed=needed,
            moved=moved,
            cold=cold,
            steps=steps,
            row_max=row_max,
        )
    n_moved = (fetch >= 0).sum(1)  # (R,)
    needed += torch.where(fresh, 0, n_need)
    moved += torch.where(fresh, 0, n_moved)
    cold += torch.where(fresh, n_moved, 0)
    steps += ~fresh
    row_max.copy_(torch.maximum(row_max, torch.where(fresh, 0, n_moved)))
    fresh.zero_()


class Stats:
    """Counters per (layer, row) kept on the device (no sync while decoding; rows apart, so micro-
    batches never add into the same entry), read once at the end. The first step after a row's
    prefill gathers its whole selection (nothing is resident yet): those cold gathers are counted
    apart, so the hit rate is the steady state the locality theorem bounds. Times are for the
    profiler (generate.py --profile, python -m bench): the step's parts are ranges."""

    def __init__(self, n_layer, R, unit_bytes, device):
        self.unit_bytes = unit_bytes
        new = lambda: torch.zeros(n_layer, R, dtype=torch.long, device=device)
        # selected non-tail blocks; of those, gathered from host
        self.needed, self.moved = new(), new()
        self.cold = new()  # gathered at a row's first step
        self.stepped = new()  # steps after the first
        # most one row gathered in one step
        self.row_max = torch.zeros(R, dtype=torch.long, device=device)

    def rows(self, a, b):
        """The counters of rows a..b-1 (views: they count into these)."""
        part = Stats.__new__(Stats)
        part.unit_bytes = self.unit_bytes
        for name in ("needed", "moved", "cold", "stepped"):
            setattr(part, name, getattr(self, name)[:, a:b])
        part.row_max = self.row_max[a:b]
        return part

    @property
    def steps(self):  # decode steps after the first (the longest-running row's)
        return int(self.stepped[0].max()) if self.stepped.numel() else 0

    def summary(self):
        needed, moved = self.needed.sum().item(), self.moved.sum().item()
        per_layer = (1 - self.moved.sum(1) / self.needed.sum(1).clamp(min=1)).tolist()
        steps = max(self.steps, 1)
        return (
            f"hit rate: {100 * (1 - moved / max(needed, 1)):.1f}% (per layer: "
            f"{' '.join(f'{100 * h:.1f}' for h in per_layer)}) | blocks moved per step: {moved / steps:.1f} | "
            f"bytes moved per step: {moved * self.unit_bytes / steps / 1e6:.3f} MB | most blocks one row "
            f"moved in a step: {self.row_max.max().item()} | after prefill: {self.cold.sum().item()} blocks"
        )


# -----------------------------------------------------------------------------
# The offloaded cache


def check_mode(cfg):
    if cfg.attn == "full":
        raise ValueError(
            "--offload needs a sparse attention mode (nosa, infllmv2 or dma); full attention "
            "reads every block at every step"
        )


def pinned_empty(shape, dtype):
    """Page-locked host memory that GPU kernels read directly (UVA), of exactly its size. torch's
    pinned allocator rounds each request up to a power of two (a 1.4 GiB layer store pins 2 GiB),
    so the store is plain memory registered with CUDA instead, and unregistered when it is freed."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 3)  # portable | mapped
        if int(err) != 0:
            raise MemoryError(
                f"could not pin {nbytes / 2**30:.2f} GiB of host memory for the KV store ({err}); "
                f"lower the batch or the length, or pass a smaller host budget"
            )
        weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


class OffloadCache(Cache):
    """The cache interface of kvcache.py with the KV blocks in host memory and only the selected ones
    on the device. max_len (default cfg.max_seq_len) sizes every buffer once, and selection ranges
    over all its blocks at every step (static shapes for fast.GraphedDecode): size it to the
    job, as generate.py does."""

    # the buffers, one tensor per layer each: those with a row per (sequence, KV head), and those
    # indexed by sequence (split slices both; the memory model, memory.cache_bytes, counts them; a test checks both)
    moves_blocks = True
    ROWS = ("host", "pool", "tail", "slot_block", "block_slot", "fetch", "fresh")
    SEQS = ("c",)

    def __init__(self, cfg, Bz, device, dtype, max_len=None, gpu_budget=None, host_budget=None):
        check_mode(cfg)
        self.device, self.Bz = torch.device(device), Bz
        L, H, B, d, k = cfg.n_layer, cfg.H_kv, cfg.B, cfg.head_dim, cfg.k
        R, elt = Bz * H, torch.empty((), dtype=dtype).element_size()
        self.max_len = max_len = max_len or cfg.max_seq_len
        cap = math.ceil(max_len / B)
        unit = 2 * B * d * elt
        memory.check_offload(
            cfg, Bz, max_len, dtype, self.device, gpu_budget=gpu_budget, host_budget=host_budget
        )
        super().__init__(cfg, Bz, device)
        self.pin = self.device.type == "cuda"
        # a prefill's copies to the store
        self.writes = torch.cuda.Stream(self.device) if self.pin else None
        self.host = [self._host_alloc(R, cap, dtype) for _ in range(L)]
        self.pool = [torch.zeros(R, k + 1, 2, B, d, dtype=dtype, device=device) for _ in range(L)]
        self.tail = [p[:, k] for p in self.pool]  # the last slot holds the tail block
        self.slot_block = [
            torch.full((R, k), -1, dtype=torch.long, device=device) for _ in range(L)
        ]
        self.block_slot = [
            torch.full((R, cap), -1, dtype=torch.long, device=device) for _ in range(L)
        ]
        self.fetch = [torch.full((R, k), -1, dtype=torch.long, device=device) for _ in range(L)]
        # prefilled, not decoded
        self.fresh = [torch.zeros(R, dtype=torch.bool, device=device) for _ in range(L)]
        cdt = torch.promote_types(dtype, torch.float32)
        self.c = [
            torch.zeros(Bz, H, max_len if cfg.eviction_head else 0, dtype=cdt, device=device)
            for _ in range(L)
        ]
        self.sub = nosa.PooledState(cfg, Bz, device, dtype, max_len)
        self.stats = Stats(L, R, unit, device)
        # micro-batches (split): views; the stream of their gathers; (fast.Turns, p) while recorded in turns
        self.part, self.pcie, self.turn = False, None, None

    def _host_alloc(self, R, cap, dtype):
        cfg = self.cfg
        shape = (R, cap, 2, cfg.B, cfg.head_dim)  # read only once written
        return pinned_empty(shape, dtype) if self.pin else torch.empty(shape, dtype=dtype)

    def _ensure_blocks(self, layer, n):
        """Room for n blocks per row in the host store and the block table (doubling, copying)."""
        old = self.host[layer]
        R, cap = old.shape[:2]
        if cap >= n:
            return
        if self.pin:  # write-backs into the old store may still be in flight (flush_tails, prefill)
            torch.cuda.current_stream(self.device).synchronize()
            self.writes.synchronize()
        self.host[layer] = self._host_alloc(R, max(n, 2 * cap), old.dtype)
        self.host[layer][:, :cap] = old
        table = torch.full((R, self.host[layer].shape[1]), -1, dtype=torch.long, device=self.device)
        table[:, :cap] = self.block_slot[layer]
        self.block_slot[layer] = table

    def prefill(self, layer, seq, k, v, c, pooled=None, *, put=write_now):
        """One sequence's prompt: k, v (H_kv, T, d), c (H_kv, T), and where the caller has them its
        pooled caches (nosa.PooledState.prefill); put: how the sequence's decode state is written (Cache).
        Whole blocks go to the host store, the rest to the tail; nothing is resident yet, so the
        first step gathers its selection."""
        cfg, T = self.cfg, k.shape[1]
        n_full, r = T // cfg.B, slice(seq * cfg.H_kv, (seq + 1) * cfg.H_kv)  # its rows
        self._ensure_blocks(layer, n_full + 1)
        whole = [
            x[:, : n_full * cfg.B].reshape(cfg.H_kv, n_full, cfg.B, cfg.head_dim) for x in (k, v)
        ]
        blocks = torch.stack(whole, 2)  # (H_kv, n_full, 2, B, d): the store's layout
        # to the pinned store on a stream of its own: the next layer computes meanwhile
        if self.pin:
            self.writes.wait_stream(torch.cuda.current_stream(self.device))
            blocks.record_stream(self.writes)  # its memory is not reused before the copies are done
        with torch.cuda.stream(self.writes):  # (None: the current stream)
            for h in range(cfg.H_kv):  # one contiguous copy each
                self.host[layer][r.start + h, :n_full].copy_(blocks[h], non_blocking=self.pin)
        # what reads the store on the device comes after every copy
        if self.pin and layer == cfg.n_layer - 1:
            torch.cuda.current_stream(self.device).wait_stream(self.writes)
        tail = torch.stack([k[:, n_full * cfg.B :], v[:, n_full * cfg.B :]], 1)
        put(self.tail[layer], (r, slice(None), slice(0, T - n_full * cfg.B)), tail)
        put(self.slot_block[layer], r, -1)
        put(self.block_slot[layer], r, -1)
        put(self.fresh[layer], r, True)
        if c is not None:
            self.c[layer] = grow(self.c[layer], T, 2)
            self.c[layer][seq, :, 1:T] = c[:, 1:]
            # position 0, where a held-back sequence's steps write
            put(self.c[layer], (seq, slice(None), 0), c[:, 0])
        self.sub.prefill(layer, seq, k, c, pooled, put)
        if layer == cfg.n_layer - 1:
            self.set_length(seq, T, put)

    def reset_stats(self):  # count from here on (generate.py: after its warm-up)
        self.stats = Stats(
            self.cfg.n_layer, self.Bz * self.cfg.H_kv, self.stats.unit_bytes, self.device
        )

    def split(self, n):
        """n caches over consecutive slices of the batch that share this one's memory (views): micro-
        batches whose decode steps can run side by side, one's gathers under the other's compute
        (fast.GraphedDecode). Only while every position is below capacity(): no buffer may grow."""
        parts, H = [], self.cfg.H_kv
        # every part's gathers on one stream, in the order they were issued, at high priority: their thread
        # blocks take the next free multiprocessors ahead of the other part's compute, so PCIe does not wait
        pcie = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        for seqs in torch.arange(self.Bz).tensor_split(n):
            a, b = int(seqs[0]), int(seqs[-1]) + 1
            part = copy.copy(self)
            part.Bz, part.len, part.len_cpu = b - a, self.len[a:b], self.len_cpu[a:b]
            part.active, part.active_cpu = self.active[a:b], self.active_cpu[a:b]
            for name in self.ROWS:
                setattr(part, name, [t[a * H : b * H] for t in getattr(self, name)])
            for name in self.SEQS:
                setattr(part, name, [t[a:b] for t in getattr(self, name)])
            part.sub, part.stats, part.part, part.pcie = (
                self.sub.seqs(a, b),
                self.stats.rows(a * H, b * H),
                True,
                pcie,
            )
            parts.append(part)
        return parts

    def capacity(self):  # positions below which a decode step keeps its shapes (fast.GraphedDecode)
        return self.max_len

    def write(self, layer, k, v, c):
        """k, v (Bz, H_kv, d), c (Bz, H_kv) or None: the new token of every sequence, into its tail
        -> the blocks selection ranges over: every block the store holds room for (static shapes)."""
        cfg, pos = self.cfg, self.len
        max_pos = int(self.len_cpu.max())
        if self.part and max_pos >= self.max_len:
            raise ValueError(
                f"position {max_pos} is past the max_len={self.max_len} a micro-batch (split) was made "
                "for: its buffers are views and cannot grow; size max_len to the whole job"
            )
        self._ensure_blocks(layer, max_pos // cfg.B + 1)
        if c is not None:
            self.c[layer] = grow(self.c[layer], max_pos + 1, 2)
        write_tail(self.pool[layer], self.c[layer], k, v, c, pos, B=cfg.B)
        return self.host[layer].shape[1]

    def blocks(self, layer, block_mask):
        """block_mask (Bz, H_kv, 1, nb) = Γ(t) -> the slot pool holding the selected blocks: the
        set difference against what is resident, and the missed blocks gathered from the host."""
        cfg, R, k, B = self.cfg, self.Bz * self.cfg.H_kv, self.cfg.k, self.cfg.B
        host, pool, slot_block, fetch = (
            x[layer] for x in (self.host, self.pool, self.slot_block, self.fetch)
        )
        need_ids, n_need = needed_blocks(
            block_mask.reshape(R, -1), self.len, self.active, cfg.H_kv, B, k
        )
        set_difference(need_ids, slot_block, self.block_slot[layer], fetch)
        if self.pcie is None:
            gather_units(host, pool, fetch)
        else:  # micro-batches: the parts' gathers take turns on PCIe (split)
            here = torch.cuda.current_stream()
            self.pcie.wait_stream(here)
            with torch.cuda.stream(self.pcie):
                gather_units(host, pool, fetch, beside=True)
            if self.turn:
                self.turn[0].issued(self.turn[1], layer)
        s = self.stats  # counted while the gather runs: off the path from selection to PCIe
        count_moves(
            fetch,
            n_need,
            self.fresh[layer],
            needed=s.needed[layer],
            moved=s.moved[layer],
            cold=s.cold[layer],
            steps=s.stepped[layer],
            row_max=s.row_max,
        )
        if self.pcie is not None:
            here.wait_stream(self.pcie)
            if self.turn:
                self.turn[0].wait(self.turn[1], layer)
        return Blocks(c=self.c[layer] if cfg.eviction_head else None, pool=pool, slots=slot_block)

    def flush(self, layer):
        """After the attention: a row whose tail block is now full writes it to the host store."""
        cfg = self.cfg
        flush_tails(
            self.host[layer],
            self.pool[layer],
            self.slot_block[layer],
            self.block_slot[layer],
            self.len,
            H_kv=cfg.H_kv,
            B=cfg.B,
        )


def make_cache(cfg, Bz, device, dtype, max_len, *, offload, host_budget=None):
    """The decode cache of Bz sequences a system runs: offloaded to pinned host memory (NOSI,
    OffloadCache, host_budget checked) or resident on the device (kvcache.KVCache)."""
    if offload:
        return OffloadCache(cfg, Bz, device, dtype, max_len=max_len, host_budget=host_budget)
    return KVCache(cfg, Bz, device, dtype, max_len)
