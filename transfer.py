"""
NOSI's transfers between the host store and the GPU slot pool (offload.py), and their bookkeeping
(docs/METHOD.md §6). Notation as in offload.py: R rows, k slots per row, a *unit* = one KV block.

Three implementations of each primitive, chosen per call:
  uva_copy.cu   CUDA kernels, built once with nvcc (torch.utils.cpp_extension), on a GPU
  Triton        the same transfers where nvcc is missing (a GPU machine without the CUDA toolkit)
  torch twins   the reference on any device; on a CPU the path that runs

  set_difference   the selected blocks against the resident ones: free slots, give each miss one
  gather_units     the missed units from pinned host memory into their slots (UVA: a kernel reads
                   host memory through its device pointer)
  flush_tails      full tail blocks written back to the host store and kept in a free slot
"""
import ctypes
import os
import warnings

import torch
import triton
import triton.language as tl


def set_difference_torch(need, slot_block, block_slot, fetch):
    """Twin of uva_copy.cu:set_difference. need (R, n <= k) ascending block ids, -1 padded; updates
    the tables slot_block (R, k) and block_slot (R, cap) in place; writes fetch (R, k): the block each
    slot must load, or -1. The i-th missed block (ascending) takes the i-th free slot (ascending).
    Written without a host sync (scatters into a spare last column instead of nonzero()), so on a
    GPU without the extension it runs inside a CUDA graph too."""
    R, k = slot_block.shape
    cap = block_slot.shape[1]
    pad = lambda t, n: t.masked_fill(t < 0, n)  # -1 -> the spare column n
    # 1. evict: resident blocks that are not needed any more free their slots
    needed = torch.zeros(R, cap + 1, dtype=torch.bool, device=need.device).scatter_(1, pad(need, cap), True)
    keep = (slot_block >= 0) & needed.gather(1, pad(slot_block, cap))  # (R, k)
    slot_block.masked_fill_(~keep, -1)
    # 2. misses, in ascending block order, take the free slots in ascending slot order
    resident = torch.zeros(R, cap + 1, dtype=torch.bool, device=need.device).scatter_(1, pad(slot_block, cap), True)
    miss = (need >= 0) & ~resident.gather(1, pad(need, cap))  # (R, n)
    free_first = torch.sort((slot_block >= 0).to(torch.uint8), dim=1, stable=True).indices  # (R, k)
    slot = torch.where(miss, free_first.gather(1, (miss.cumsum(1) - 1).clamp(min=0)), k)  # (R, n), k = spare
    new = torch.full((R, k + 1), -1, dtype=need.dtype, device=need.device)
    new = new.scatter_(1, slot, torch.where(miss, need, -1))
    fetch.copy_(new[:, :k])
    slot_block.copy_(torch.where(fetch >= 0, fetch, slot_block))
    # 3. block -> slot, rebuilt from slot -> block
    table = torch.full((R, cap + 1), -1, dtype=block_slot.dtype, device=need.device)
    table.scatter_(1, pad(slot_block, cap), torch.arange(k, device=need.device).expand(R, k).contiguous())
    block_slot.copy_(table[:, :cap])


def flush_tails_torch(host, pool, slot_block, block_slot, pos, H_kv, B):
    """Twin of uva_copy.cu:flush_tails. pos (Bz,) the position just written; a row whose tail block
    (pool slot k) is now full writes it to host[r, pos // B] and copies it into its first free slot."""
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


def gather_units_torch(host, pool, fetch):
    """Twin of uva_copy.cu:gather_units: pool[r, s] = host[r, fetch[r, s]] where fetch >= 0."""
    f = fetch.to(host.device)
    r, s = torch.nonzero(f >= 0, as_tuple=True)
    if r.numel():
        pool[r.to(pool.device), s.to(pool.device)] = host[r, f[r, s]].to(pool.device, non_blocking=True)


# Triton versions of the two kernels that touch pinned host memory: Triton reads and writes it
# through the device pointer of the pinned store, as the CUDA kernels do, and needs no nvcc, so
# they are what a GPU machine without the CUDA toolkit runs (python -m bench gather compares the two).


@triton.jit
def _gather_units_kernel(HOST, POOL, FETCH, k, n_slots, cap, U, BLOCK: tl.constexpr):
    rs = tl.program_id(0)  # (row, slot)
    b = tl.load(FETCH + rs)
    if b >= 0:
        src = HOST + ((rs // k) * cap + b) * U
        dst = POOL + ((rs // k) * n_slots + rs % k) * U
        for i in range(0, U, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < U), mask=offs < U)


@triton.jit
def _flush_tails_kernel(HOST, POOL, SLOT_BLOCK, BLOCK_SLOT, POS, H_kv, B, k, cap, U, BLOCK: tl.constexpr,
                        KP: tl.constexpr):
    row = tl.program_id(0)
    p = tl.load(POS + row // H_kv)
    if p % B == B - 1:
        b = p // B
        offs_k = tl.arange(0, KP)
        sb = tl.load(SLOT_BLOCK + row * k + offs_k, mask=offs_k < k, other=0)
        s = tl.min(tl.where(sb < 0, offs_k, k), 0)  # the first free slot (k: none, which cannot happen)
        tail = POOL + (row * (k + 1) + k) * U
        U_slot = tl.where(s < k, U, 0)  # what to copy into the slot
        for i in range(0, U, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            x = tl.load(tail + offs, mask=offs < U)
            tl.store(HOST + (row * cap + b) * U + offs, x, mask=offs < U)
            tl.store(POOL + (row * (k + 1) + s) * U + offs, x, mask=offs < U_slot)
        if s < k:
            tl.store(SLOT_BLOCK + row * k + s, b)
            tl.store(BLOCK_SLOT + row * cap + b, s)


def _words(t, R):
    """A store or pool (R, n, ...) as 32-bit words (R, n, U): the kernels copy bits, not values."""
    return t.view(R, t.shape[1], -1).view(torch.int32)


def gather_units_triton(host, pool, fetch):
    R, k = fetch.shape
    h, p = _words(host, R), _words(pool, R)
    _gather_units_kernel[(R * k,)](h, p, fetch, k, p.shape[1], h.shape[1], h.shape[2], BLOCK=1024)


def flush_tails_triton(host, pool, slot_block, block_slot, pos, H_kv, B):
    R, k = slot_block.shape
    h, p = _words(host, R), _words(pool, R)
    _flush_tails_kernel[(R,)](h, p, slot_block, block_slot, pos, H_kv, B, k, h.shape[1], h.shape[2], BLOCK=1024,
                              KP=triton.next_power_of_2(k))


class UvaCopy:
    """uva_copy.cu's entry points through ctypes: the checks its kernels rely on, then one launch on
    the current CUDA stream (so a CUDA graph captures it)."""

    def __init__(self, path):
        self.lib = lib = ctypes.CDLL(path)
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.uva_error_string.restype = ctypes.c_char_p
        lib.uva_error_string.argtypes = [ctypes.c_int]
        lib.uva_set_difference.argtypes = [p, p, p, p, i, i, i, i, p]
        lib.uva_gather_units.argtypes = [p, i, p, p, i, i, i, i, i, i, p]
        lib.uva_flush_tails.argtypes = [p, i, p, p, p, p, i, i, i, i, i, i, p]

    def _run(self, fn, *args):
        e = fn(*args, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if e:
            raise RuntimeError(f"uva_copy: {fn.__name__} failed: {self.lib.uva_error_string(e).decode()}")

    @staticmethod
    def _check(tensors, dtype=None):
        for name, t in tensors.items():
            if not t.is_contiguous() or (dtype is not None and t.dtype != dtype):
                raise ValueError(f"uva_copy: {name} must be a contiguous {dtype or 'tensor'}")

    @staticmethod
    def _unit_words(host, pool, R, n_slots):
        """16-byte words per unit, and the store's allocation base and offset (pinned, UVA)."""
        if host.is_cuda or not host.is_pinned() or host.dtype != pool.dtype or not pool.is_cuda:
            raise ValueError("uva_copy: the host store must be pinned CPU memory, the pool CUDA memory, same dtype")
        unit = host.numel() // (R * host.shape[1]) * host.element_size()
        if unit % 16 or pool.numel() // (R * n_slots) * pool.element_size() != unit or unit // 16 * 1024 >= 2**31:
            raise ValueError(f"uva_copy: units of the store and the pool must be equal multiples of 16 bytes up to "
                             f"32 MiB (got {unit} bytes)")
        base = host.untyped_storage().data_ptr()
        return unit // 16, ctypes.c_void_p(base), host.data_ptr() - base

    def set_difference(self, need, slot_block, block_slot, fetch):
        self._check(dict(need=need, slot_block=slot_block, block_slot=block_slot, fetch=fetch), torch.int64)
        R, k = slot_block.shape
        self._run(self.lib.uva_set_difference, need.data_ptr(), slot_block.data_ptr(), block_slot.data_ptr(),
                  fetch.data_ptr(), R, need.shape[1], k, block_slot.shape[1])

    def gather_units(self, host, pool, fetch, ctas=0):
        self._check(dict(host=host, pool=pool))
        self._check(dict(fetch=fetch), torch.int64)
        R, k = fetch.shape
        U16, base, offset = self._unit_words(host, pool, R, pool.shape[1])
        if pool.shape[0] != R or host.shape[0] != R or pool.shape[1] < k:
            raise ValueError("uva_copy: the shapes of the store, the pool and the fetch list disagree")
        self._run(self.lib.uva_gather_units, base, offset, pool.data_ptr(), fetch.data_ptr(), R, k, pool.shape[1],
                  host.shape[1], U16, ctas)

    def flush_tails(self, host, pool, slot_block, block_slot, pos, H_kv, B):
        self._check(dict(host=host, pool=pool))
        self._check(dict(slot_block=slot_block, block_slot=block_slot, pos=pos), torch.int64)
        R, k = slot_block.shape
        U16, base, offset = self._unit_words(host, pool, R, k + 1)
        if pool.shape[:2] != (R, k + 1) or block_slot.shape[1] != host.shape[1] or pos.shape[0] * H_kv != R:
            raise ValueError("uva_copy: the shapes of the store, the pool, the tables and the positions disagree")
        self._run(self.lib.uva_flush_tails, base, offset, pool.data_ptr(), slot_block.data_ptr(), block_slot.data_ptr(),
                  pos.data_ptr(), R, H_kv, B, k, host.shape[1], U16)


_ext = None


def _kernels(device):
    """The compiled uva_copy library on CUDA, or None: then the Triton kernels move the blocks on a
    GPU, the twins on a CPU. Built once per machine by nvcc (torch caches it, a few seconds; no torch
    headers in it); one warning if it cannot be."""
    global _ext
    if torch.device(device).type != "cuda":
        return None
    if _ext is None:
        try:
            from torch.utils.cpp_extension import load
            src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "uva_copy.cu")
            _ext = UvaCopy(load(name="uva_copy", sources=[src], extra_cuda_cflags=["-O3"], is_python_module=False))
        except Exception as e:  # no nvcc, a CPU-only torch, a compiler error
            warnings.warn(f"uva_copy.cu did not build ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          f"the Triton gather runs instead (see BENCHMARKS.md for the difference)")
            _ext = False
    return _ext or None


def set_difference(need, slot_block, block_slot, fetch):
    ext = _kernels(need.device)
    (ext.set_difference if ext else set_difference_torch)(need, slot_block, block_slot, fetch)


def gather_ctas(unit_bytes):
    """Thread blocks for the gather: 16, and 256 KiB / unit for units under 16 KiB (64 for 4 KiB): about
    256 KiB of loads in flight keep PCIe busy, and few blocks leave the other multiprocessors to the
    kernels of a micro-batch running beside the gather (fast.GraphedDecode)."""
    return max(16, 2**18 // min(unit_bytes, 2**14))


def gather_units(host, pool, fetch):
    if not (pool.is_cuda and host.is_pinned()):
        return gather_units_torch(host, pool, fetch)
    ext = _kernels(pool.device)
    if ext:
        ext.gather_units(host, pool, fetch, gather_ctas(host.stride(1) * host.element_size()))
    else:
        gather_units_triton(host, pool, fetch)


def flush_tails(host, pool, slot_block, block_slot, pos, H_kv, B):
    if not (pool.is_cuda and host.is_pinned()):
        return flush_tails_torch(host, pool, slot_block, block_slot, pos, H_kv, B)
    ext = _kernels(pool.device)
    (ext.flush_tails if ext else flush_tails_triton)(host, pool, slot_block, block_slot, pos, H_kv, B)
