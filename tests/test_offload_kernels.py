"""The offload's transfer kernels against their torch twins: the set difference of a step's blocks,
the list of blocks a step needs, the gather from host memory and the tail flush; uva_copy.cu on a
GPU (its refusals, a gather on few thread blocks), the Triton path everywhere (interpreted on CPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import common
import offload
import offload_kernels

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=40, deadline=None)
@given(data=st.data(), R=st.integers(1, 4), k=st.integers(2, 8), n_steps=st.integers(1, 12))
def test_set_difference_random_sequences(data, R, k, n_steps):
    cap = 3 * k
    slot_block = torch.full((R, k), -1, dtype=torch.long)
    block_slot = torch.full((R, cap), -1, dtype=torch.long)
    fetch = torch.empty(R, k, dtype=torch.long)
    for _ in range(n_steps):
        rows = [sorted(data.draw(st.sets(st.integers(0, cap - 1), max_size=k))) for _ in range(R)]
        need = torch.full((R, k), -1, dtype=torch.long)
        for r, ids in enumerate(rows):
            need[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        was = [{b for b in slot_block[r].tolist() if b >= 0} for r in range(R)]
        offload.set_difference(need, slot_block, block_slot, fetch)
        for r, ids in enumerate(rows):
            res = [b for b in slot_block[r].tolist() if b >= 0]
            assert sorted(res) == ids  # exactly the needed blocks, none twice, none leaked
            assert sorted(b for b in fetch[r].tolist() if b >= 0) == sorted(set(ids) - was[r])
            assert all(fetch[r, s] in (-1, slot_block[r, s]) for s in range(k))
            assert {(b, s) for s, b in enumerate(slot_block[r].tolist()) if b >= 0} == {
                (b, s) for b, s in enumerate(block_slot[r].tolist()) if s >= 0
            }


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    Bz=st.integers(1, 3),
    H_kv=st.integers(1, 2),
    k=st.integers(2, 9),
    nb=st.integers(1, 40),
)
def test_needed_blocks_kernel_equals_twin(data, Bz, H_kv, k, nb):
    """The list of selected non-tail blocks as one Triton kernel (interpreted on CPU) == the torch code:
    ragged positions (the tail anywhere, or past the selection), ended sequences, 0 to k - 1 blocks."""
    B, R = 4, Bz * H_kv
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    pos = torch.randint(0, nb * B, (Bz,), generator=g)
    active = torch.rand(Bz, generator=g) < 0.7
    sel = torch.zeros(R, nb, dtype=torch.bool)
    for r in range(R):
        sel[r, torch.randperm(nb, generator=g)[: int(torch.randint(0, k, (), generator=g))]] = True
        sel[r, int(pos[r // H_kv]) // B] = True  # the tail block is always selected
    want = offload.needed_blocks(sel, pos, active, H_kv, B, k)  # the twin, on the CPU
    got = offload_kernels.needed_blocks(sel.to(DEV), pos.to(DEV), active.to(DEV), H_kv, B, k)
    for w, x in zip(want, got):
        assert torch.equal(x.cpu(), w)


@pytest.mark.gpu
def test_cuda_kernels_match_twins():
    assert offload_kernels.uva("cuda"), "uva_copy.cu did not build"
    R, k, cap, U = 6, 8, 40, (2, 16, 64)
    host = torch.randn(R, cap, *U, dtype=torch.bfloat16).pin_memory()
    tables = [torch.full((R, k), -1, dtype=torch.long), torch.full((R, cap), -1, dtype=torch.long)]
    dev_tables = [t.cuda() for t in tables]
    pool = torch.randn(R, k, *U, dtype=torch.bfloat16)
    dev_pool = pool.cuda()
    for step in range(20):
        need = torch.full((R, k), -1, dtype=torch.long)
        for r in range(R):
            n = int(torch.randint(0, k, ()))
            need[r, :n] = torch.randperm(cap)[:n].sort().values
        f, df = (
            torch.empty(R, k, dtype=torch.long),
            torch.empty(R, k, dtype=torch.long, device="cuda"),
        )
        offload.set_difference(need, *tables, f)  # the twin, on the CPU
        offload.set_difference(need.cuda().contiguous(), *dev_tables, df)
        assert torch.equal(f, df.cpu()) and all(
            torch.equal(a, b.cpu()) for a, b in zip(tables, dev_tables)
        )
        offload.gather_units(host, pool, f)
        offload.gather_units(host, dev_pool, df)
        torch.cuda.synchronize()
        assert torch.equal(pool, dev_pool.cpu())
    # flush: rows (H_kv = 2 per sequence) whose tail is full write it back and keep it in a free slot
    tails = torch.randn(R, 1, *U, dtype=torch.bfloat16)
    pool, dev_pool = torch.cat([pool, tails], 1), torch.cat([dev_pool, tails.cuda()], 1)
    for b in range(R):  # make sure some rows have a free slot before the flush
        tables[0][b, b % k] = -1
    tables[1].fill_(-1)
    for r in range(R):
        for s, b in enumerate(tables[0][r].tolist()):
            if b >= 0:
                tables[1][r, b] = s
    dev_tables = [t.cuda() for t in tables]
    pos = torch.tensor([2 * 16 - 1, 5, 7 * 16 - 1])  # sequences 0 and 2 full (B = 16)
    dev_host = host.clone().pin_memory()
    offload.flush_tails(host, pool, *tables, pos, H_kv=2, B=16)
    offload.flush_tails(dev_host, dev_pool, *dev_tables, pos.cuda(), H_kv=2, B=16)
    torch.cuda.synchronize()
    assert torch.equal(pool, dev_pool.cpu()) and torch.equal(host, dev_host)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(tables, dev_tables))
    assert torch.equal(host[0, 1], tails[0, 0]) and torch.equal(host[5, 6], tails[5, 0])


@pytest.mark.gpu
def test_cuda_kernels_refuse_what_they_cannot_read():
    """The library gets raw pointers: its Python side refuses an unpinned store, a wrong dtype or a
    unit that is no multiple of 16 bytes before any launch, and a launch error becomes a RuntimeError."""
    ext = offload_kernels.uva("cuda")
    host = torch.randn(2, 4, 2, 8, 32, dtype=torch.bfloat16).pin_memory()
    pool = torch.zeros(2, 3, 2, 8, 32, dtype=torch.bfloat16, device="cuda")
    fetch = torch.full((2, 2), -1, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        ext.gather_units(torch.randn(2, 4, 2, 8, 32, dtype=torch.bfloat16), pool, fetch)
    with pytest.raises(ValueError, match="int64"):
        ext.gather_units(host, pool, fetch.int())
    with pytest.raises(ValueError, match="16 bytes"):
        ext.gather_units(
            torch.randn(2, 4, 3, dtype=torch.bfloat16).pin_memory(),
            torch.zeros(2, 3, 3, dtype=torch.bfloat16, device="cuda"),
            fetch,
        )
    need = torch.full((2, 2000), -1, device="cuda")  # more needed blocks than the kernel takes
    with pytest.raises(RuntimeError, match="set_difference failed"):
        ext.set_difference(
            need,
            torch.full((2, 2000), -1, device="cuda"),
            torch.full((2, 9), -1, device="cuda"),
            torch.empty(2, 2000, dtype=torch.int64, device="cuda"),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("ctas", [0, 1, 3, 16, 5000])
# 1 KiB: 32 units a round of loads; 40 KiB: 1.25 rounds
@pytest.mark.parametrize("unit", [(2, 8, 32), (2, 64, 160)])
def test_cuda_gather_with_few_blocks(ctas, unit):
    """The gather on fewer thread blocks than units shares out the misses of a mostly-hit fetch list
    (several chunks of 1024 entries), each block's misses copied as one stream of words: every miss
    copied once, nothing else written."""
    ext = offload_kernels.uva("cuda")
    R, k, cap = 40, 64, 300
    host = torch.randn(R, cap, *unit, dtype=torch.bfloat16).pin_memory()
    for _ in range(2):
        fetch = torch.stack([torch.randperm(cap)[:k] for _ in range(R)])
        fetch[torch.rand(R, k) < 0.75] = -1  # hits
        pool = torch.randn(R, k + 1, *unit, dtype=torch.bfloat16)  # + the tail slot, never written
        dev_pool = pool.cuda()
        offload.gather_units(host, pool, fetch)
        ext.gather_units(host, dev_pool, fetch.cuda(), ctas)
        torch.cuda.synchronize()
        assert torch.equal(pool, dev_pool.cpu())


def test_triton_transfer_kernels_match_twins():
    """The no-nvcc path: Triton gather and tail flush against their twins (interpreter on CPU)."""
    R, k, cap, U, H_kv, B = 6, 5, 12, (2, 4, 8), 2, 4
    host = torch.randn(R, cap, *U, dtype=torch.float64)
    pool = torch.randn(R, k + 1, *U, dtype=torch.float64)
    # compiled: the kernels reach the pinned host store through its device pointer
    if DEV == "cuda":
        host, pool = offload.pinned_empty(host.shape, host.dtype).copy_(host), pool.to(DEV)
    slot_block = torch.full((R, k), -1, dtype=torch.long)
    for r in range(R):
        n = r % k  # rows with 0 .. k-1 resident blocks: a free slot in each
        slot_block[r, torch.randperm(k)[:n]] = torch.randperm(cap)[:n]
    block_slot = torch.full((R, cap), -1, dtype=torch.long)
    for r in range(R):
        for s, b in enumerate(slot_block[r].tolist()):
            if b >= 0:
                block_slot[r, b] = s
    fetch = torch.where(torch.rand(R, k) < 0.5, torch.randint(0, cap, (R, k)), -1).to(DEV)
    pos = torch.tensor([2 * B - 1, 5, 3 * B - 1], device=DEV)  # sequences 0 and 2 have a full tail
    slot_block, block_slot = slot_block.to(DEV), block_slot.to(DEV)
    a = [t.clone() for t in (host, pool, slot_block, block_slot)]
    b = [
        t.clone().pin_memory() if t.is_pinned() else t.clone()
        for t in (host, pool, slot_block, block_slot)
    ]
    with common.kernels(False):
        offload.gather_units(a[0], a[1], fetch)
        offload.flush_tails(*a, pos, H_kv=H_kv, B=B)
    offload_kernels.gather_units_triton(b[0], b[1], fetch)
    offload_kernels.flush_tails_triton(*b, pos, H_kv=H_kv, B=B)
    if DEV == "cuda":
        torch.cuda.synchronize()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], host) and not torch.equal(a[1], pool)  # both moved something
