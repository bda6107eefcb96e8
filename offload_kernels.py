"""
The kernels of offload.py, each the twin of a torch function there, and uva_copy.cu's entry points.

  set_difference, gather_units, flush_tails   uva_copy.cu (CUDA, built once with nvcc), through
                   ctypes: the gather reads pinned host memory through its device pointer (UVA);
                   without nvcc, Triton kernels gather and flush the same way, and the torch twin of
                   the set difference (which needs no host sync) runs on the GPU
  needed_blocks    a row's selected blocks besides the tail, in order (a prefix sum)
  write_tail       the new token's k, v into the tail slot and its c into the cache
  count_moves      the transfer statistics of a step
  turn_issued, turn_wait   the micro-batches' turns in a graphed step (fast.Turns): order only, so
                   their torch twin is nothing at all
"""

import ctypes
import os
import warnings

import torch
import triton
import triton.language as tl


@triton.jit
def _needed_blocks_kernel(
    SEL,
    POS,
    ACTIVE,
    IDS,
    N_NEED,
    nb,
    H_kv: tl.constexpr,
    B: tl.constexpr,
    K: tl.constexpr,
    NBP: tl.constexpr,
    KP: tl.constexpr,
):
    """One program per row: the i-th selected non-tail block (a prefix sum over the row) to column i."""
    r = tl.program_id(0)
    b = tl.arange(0, NBP)
    seq_on = tl.load(ACTIVE + r // H_kv + b * 0) != 0  # a vector (the interpreter's masks must be)
    need = (
        (tl.load(SEL + r * nb + b, mask=b < nb, other=0) != 0)
        & (b != tl.load(POS + r // H_kv) // B)
        & seq_on
    )
    col = tl.cumsum(need.to(tl.int32), 0) - 1
    tl.store(IDS + r * K + col, b.to(tl.int64), mask=need & (col < K))
    n = tl.sum(need.to(tl.int32), 0)
    j = tl.arange(0, KP)
    tl.store(IDS + r * K + j, tl.full([KP], -1, tl.int64), mask=(j >= n) & (j < K))
    tl.store(N_NEED + r, n.to(tl.int64))


def needed_blocks(sel, pos, active, H_kv, B, k):
    """offload.needed_blocks (same arguments and result)."""
    R, nb = sel.shape
    ids = torch.empty(R, k, dtype=torch.long, device=sel.device)
    n_need = torch.empty(R, dtype=torch.long, device=sel.device)
    _needed_blocks_kernel[(R,)](
        sel.contiguous().view(torch.uint8),
        pos.contiguous(),
        active.view(torch.uint8),
        ids,
        n_need,
        nb,
        H_kv=H_kv,
        B=B,
        K=k,
        NBP=triton.next_power_of_2(nb),
        KP=triton.next_power_of_2(k),
    )
    return ids, n_need


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
def _flush_tails_kernel(
    HOST,
    POOL,
    SLOT_BLOCK,
    BLOCK_SLOT,
    POS,
    H_kv,
    B,
    k,
    cap,
    U,
    BLOCK: tl.constexpr,
    KP: tl.constexpr,
):
    row = tl.program_id(0)
    p = tl.load(POS + row // H_kv)
    if p % B == B - 1:
        b = p // B
        offs_k = tl.arange(0, KP)
        sb = tl.load(SLOT_BLOCK + row * k + offs_k, mask=offs_k < k, other=0)
        # the first free slot (k: none, which cannot happen)
        s = tl.min(tl.where(sb < 0, offs_k, k), 0)
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
    """gather_units without nvcc: Triton reads the pinned store through its device pointer."""
    R, k = fetch.shape
    h, p = _words(host, R), _words(pool, R)
    _gather_units_kernel[(R * k,)](h, p, fetch, k, p.shape[1], h.shape[1], h.shape[2], BLOCK=1024)


def flush_tails_triton(host, pool, slot_block, block_slot, pos, *, H_kv, B):
    """flush_tails without nvcc."""
    R, k = slot_block.shape
    h, p = _words(host, R), _words(pool, R)
    _flush_tails_kernel[(R,)](
        h,
        p,
        slot_block,
        block_slot,
        pos,
        H_kv,
        B,
        k,
        h.shape[1],
        h.shape[2],
        BLOCK=1024,
        KP=triton.next_power_of_2(k),
    )


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
            raise RuntimeError(
                f"uva_copy: {fn.__name__} failed: {self.lib.uva_error_string(e).decode()}"
            )

    @staticmethod
    def _check(tensors, dtype=None):
        for name, t in tensors.items():
            if not t.is_contiguous() or (dtype is not None and t.dtype != dtype):
                raise ValueError(f"uva_copy: {name} must be a contiguous {dtype or 'tensor'}")

    @staticmethod
    def _unit_words(host, pool, R, n_slots):
        """16-byte words per unit, and the store's allocation base and offset (pinned, UVA)."""
        if host.is_cuda or not host.is_pinned() or host.dtype != pool.dtype or not pool.is_cuda:
            raise ValueError(
                "uva_copy: the host store must be pinned CPU memory, the pool CUDA memory, same dtype"
            )
        unit = host.numel() // (R * host.shape[1]) * host.element_size()
        if (
            unit % 16
            or pool.numel() // (R * n_slots) * pool.element_size() != unit
            or unit // 16 * 1024 >= 2**31
        ):
            raise ValueError(
                f"uva_copy: units of the store and the pool must be equal multiples of 16 bytes up to "
                f"32 MiB (got {unit} bytes)"
            )
        base = host.untyped_storage().data_ptr()
        return unit // 16, ctypes.c_void_p(base), host.data_ptr() - base

    def set_difference(self, need, slot_block, block_slot, fetch):
        self._check(
            dict(need=need, slot_block=slot_block, block_slot=block_slot, fetch=fetch), torch.int64
        )
        R, k = slot_block.shape
        self._run(
            self.lib.uva_set_difference,
            need.data_ptr(),
            slot_block.data_ptr(),
            block_slot.data_ptr(),
            fetch.data_ptr(),
            R,
            need.shape[1],
            k,
            block_slot.shape[1],
        )

    def gather_units(self, host, pool, fetch, ctas=0):
        self._check(dict(host=host, pool=pool))
        self._check(dict(fetch=fetch), torch.int64)
        R, k = fetch.shape
        U16, base, offset = self._unit_words(host, pool, R, pool.shape[1])
        if pool.shape[0] != R or host.shape[0] != R or pool.shape[1] < k:
            raise ValueError(
                "uva_copy: the shapes of the store, the pool and the fetch list disagree"
            )
        self._run(
            self.lib.uva_gather_units,
            base,
            offset,
            pool.data_ptr(),
            fetch.data_ptr(),
            R,
            k,
            pool.shape[1],
            host.shape[1],
            U16,
            ctas,
        )

    def flush_tails(self, host, pool, slot_block, block_slot, pos, *, H_kv, B):
        self._check(dict(host=host, pool=pool))
        self._check(dict(slot_block=slot_block, block_slot=block_slot, pos=pos), torch.int64)
        R, k = slot_block.shape
        U16, base, offset = self._unit_words(host, pool, R, k + 1)
        if (
            pool.shape[:2] != (R, k + 1)
            or block_slot.shape[1] != host.shape[1]
            or pos.shape[0] * H_kv != R
        ):
            raise ValueError(
                "uva_copy: the shapes of the store, the pool, the tables and the positions disagree"
            )
        self._run(
            self.lib.uva_flush_tails,
            base,
            offset,
            pool.data_ptr(),
            slot_block.data_ptr(),
            block_slot.data_ptr(),
            pos.data_ptr(),
            R,
            H_kv,
            B,
            k,
            host.shape[1],
            U16,
        )


_ext = None


def uva(device):
    """The compiled uva_copy library on CUDA, or None: then the Triton kernels move the blocks.
    Built once per machine by nvcc (torch caches it, a few seconds; no torch headers in it); one
    warning if it cannot be."""
    global _ext
    if torch.device(device).type != "cuda":
        return None
    if _ext is None:
        try:
            from torch.utils.cpp_extension import load

            src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "uva_copy.cu")
            _ext = UvaCopy(
                load(
                    name="uva_copy",
                    sources=[src],
                    extra_cuda_cflags=["-O3"],
                    is_python_module=False,
                )
            )
        except Exception as e:  # no nvcc, a CPU-only torch, a compiler error
            warnings.warn(
                f"uva_copy.cu did not build ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                f"the Triton gather runs instead (see BENCHMARKS.md for the difference)"
            )
            _ext = False
    return _ext or None


@triton.jit
def _write_tail_kernel(
    POOL,
    C_ALL,
    K,
    V,
    C,
    POS,
    S,
    H_kv: tl.constexpr,
    KS: tl.constexpr,
    B: tl.constexpr,
    D: tl.constexpr,
    HAS_C: tl.constexpr,
):
    r = tl.program_id(0)  # (sequence, KV head)
    p = tl.load(POS + r // H_kv)
    dd = tl.arange(0, D)
    # K of slot k, row p % B; V after B rows
    tail = POOL + ((r * (KS + 1) + KS) * 2 * B + p % B) * D
    tl.store(tail + dd, tl.load(K + r * D + dd))
    tl.store(tail + B * D + dd, tl.load(V + r * D + dd))
    if HAS_C:
        tl.store(C_ALL + r * S + p + dd * 0, tl.load(C + r + dd * 0), mask=dd == 0)


def write_tail(pool, c_all, k, v, c, pos, *, B):
    """offload.write_tail (same arguments)."""
    Bz, H_kv, d = k.shape
    has_c = c is not None
    _write_tail_kernel[(Bz * H_kv,)](
        pool,
        c_all if has_c else pool,
        k.contiguous(),
        v.contiguous(),
        c.contiguous() if has_c else k,
        pos,
        c_all.shape[-1],
        H_kv=H_kv,
        KS=pool.shape[1] - 1,
        B=B,
        D=d,
        HAS_C=has_c,
    )


@triton.jit
def _count_moves_kernel(
    FETCH, N_NEED, FRESH, NEEDED, MOVED, COLD, STEPS, ROW_MAX, K: tl.constexpr, KP: tl.constexpr
):
    r = tl.program_id(0)
    j = tl.arange(0, KP)
    n_moved = tl.sum((tl.load(FETCH + r * K + j, mask=j < K, other=-1) >= 0).to(tl.int64), 0)
    fresh = tl.load(FRESH + r) != 0
    tl.store(NEEDED + r, tl.load(NEEDED + r) + tl.where(fresh, 0, tl.load(N_NEED + r)))
    tl.store(MOVED + r, tl.load(MOVED + r) + tl.where(fresh, 0, n_moved))
    tl.store(COLD + r, tl.load(COLD + r) + tl.where(fresh, n_moved, 0))
    tl.store(STEPS + r, tl.load(STEPS + r) + tl.where(fresh, 0, 1))
    tl.store(ROW_MAX + r, tl.maximum(tl.load(ROW_MAX + r), tl.where(fresh, 0, n_moved)))
    tl.store(FRESH + r, 0)


def count_moves(fetch, n_need, fresh, *, needed, moved, cold, steps, row_max):
    """offload.count_moves (same arguments)."""
    R, k = fetch.shape
    _count_moves_kernel[(R,)](
        fetch,
        n_need,
        fresh.view(torch.uint8),
        needed,
        moved,
        cold,
        steps,
        row_max,
        K=k,
        KP=triton.next_power_of_2(k),
    )


def gather_ctas(unit_bytes, beside=False):
    """Thread blocks for the gather: 16, and 256 KiB / unit for units under 16 KiB (64 for 4 KiB): about
    256 KiB of loads in flight keep PCIe busy. Beside a micro-batch's compute (fast.GraphedDecode),
    12 for units of 16 KiB and more: the fastest of 8-24 there (docs/LOG.md), fewer blocks leaving
    more multiprocessors to the kernels the next gather waits on."""
    if beside and unit_bytes >= 2**14:
        return 12
    return max(16, 2**18 // min(unit_bytes, 2**14))


def gather_units(host, pool, fetch, *, beside=False):
    """offload.gather_units (same arguments): uva_copy.cu, or Triton without nvcc."""
    ext = uva(pool.device)
    if ext:
        unit = host.stride(1) * host.element_size()
        ext.gather_units(host, pool, fetch, gather_ctas(unit, beside))
    else:
        gather_units_triton(host, pool, fetch)


def flush_tails(host, pool, slot_block, block_slot, pos, *, H_kv, B):
    """offload.flush_tails: uva_copy.cu, or Triton without nvcc."""
    ext = uva(pool.device)
    (ext.flush_tails if ext else flush_tails_triton)(
        host, pool, slot_block, block_slot, pos, H_kv=H_kv, B=B
    )


# -----------------------------------------------------------------------------
# Turns of the micro-batches inside one graphed step (fast.Turns). Order only: what a kernel after
# a wait computes does not depend on the wait, so the eager step (and the CPU) runs neither.


@triton.jit(do_not_specialize=["p", "value"])
def _turn_issued_kernel(COUNT, p, value):
    tl.atomic_xchg(COUNT + p, value, sem="release")  # every thread the same value: idempotent


@triton.jit(do_not_specialize=["q", "at_least"])
def _turn_wait_kernel(COUNT, q, at_least, POLLS: tl.constexpr):
    seen, n = tl.load(COUNT + q, volatile=True), 0
    while (seen < at_least) & (n < POLLS):
        seen, n = tl.load(COUNT + q, volatile=True), n + 1


def turn_issued(count, p, value):
    """count[p] = value (int32 on the device), once the kernels before it on this stream are done."""
    _turn_issued_kernel[(1,)](count, p, value, num_warps=1)


def turn_wait(count, q, at_least, polls=2**16):
    """Hold this stream until count[q] >= at_least, or for `polls` reads of it (a few tens of ms on a
    GPU): a schedule that went wrong costs time, never a hang."""
    _turn_wait_kernel[(1,)](count, q, at_least, POLLS=polls, num_warps=1)
