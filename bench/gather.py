"""UVA gather of scattered KV units from pinned host memory: the CUDA kernel (one thread block per
unit, or a few looping over them), its Triton twin (the no-nvcc path), a CPU index_select + copy and
one memcpy per unit, against one contiguous copy."""

import torch

import offload
import offload_kernels
from bench import need_gpu, wall


def bench_gather(store_gib=4.0, moved_mib=64, k=64):
    """Gather scattered KV units (4, 16, 64 KiB) from a pinned host store into a slot pool, four ways."""
    need_gpu("gather")
    rows = []
    for unit_kib in (4, 16, 64):
        U = unit_kib * 1024 // 2  # bf16 elements per unit
        n = moved_mib * 1024 // unit_kib  # units moved per call
        R = max(1, n // k)
        cap = int(store_gib * 2**30 / (R * unit_kib * 1024))
        host = torch.empty(R, cap, U, dtype=torch.bfloat16, pin_memory=True)
        host.view(torch.int16).random_(-(2**15), 2**15 - 1)  # random payload (never zeros)
        pool = torch.empty(R, k, U, dtype=torch.bfloat16, device="cuda")
        # each row fetches k distinct random blocks (a fresh draw per call would time the RNG)
        fetches = [
            torch.stack([torch.randperm(cap)[:k] for _ in range(R)]).cuda() for _ in range(4)
        ]
        check_kernels(host, pool, fetches[0])
        nbytes = R * k * U * 2
        ways = gather_ways(host, pool, fetches)
        t_contig = wall(ways[0][1])
        for name, fn, reps in ways:
            t = t_contig if name == ways[0][0] else wall(fn, reps=reps, warmup=1)
            gbs = nbytes / t / 1e9
            rows.append(
                dict(
                    unit_kib=unit_kib,
                    blocks=R * k,
                    variant=name,
                    gb_s=round(gbs, 2),
                    of_contiguous=round(t_contig / t, 3),
                )
            )
    return rows


def check_kernels(host, pool, fetch):
    """Correctness first: both gather kernels == the host store on one fetch list."""
    R, k = fetch.shape
    for kernel in (offload.gather_units, offload_kernels.gather_units_triton):
        check = torch.empty_like(pool)
        kernel(host, check, fetch)
        torch.cuda.synchronize()
        for r, s in ((R - 1, k // 2), (0, 0)):
            assert torch.equal(
                check[r, s].cpu().view(torch.int16),
                host[r, fetch[r, s].item()].view(torch.int16),
            ), f"{kernel.__name__} is wrong"


def gather_ways(host, pool, fetches):
    """(name, fn, repetitions) of each way to move the fetches' units into the pool, the contiguous
    copy of as many bytes first (the limit the others are held to)."""
    R, cap, U = host.shape
    k = pool.shape[1]
    it = iter(range(10**9))
    fetch_cpu = [f.cpu() for f in fetches]
    flat, src = host.view(-1, U), host.view(-1)[: R * k * U]
    staging = torch.empty(R * k, U, dtype=torch.bfloat16, pin_memory=True)
    ext = offload_kernels.uva("cuda")

    def index_select_copy():
        f = fetch_cpu[next(it) % 4]
        idx = (torch.arange(R)[:, None] * cap + f).flatten()
        torch.index_select(flat, 0, idx, out=staging)
        pool.view(-1, U).copy_(staging, non_blocking=True)

    def memcpy_per_block():
        f = fetch_cpu[next(it) % 4]
        for r in range(R):
            for s in range(k):
                pool[r, s].copy_(host[r, f[r, s]], non_blocking=True)

    uva = lambda n: lambda: ext.gather_units(host, pool, fetches[next(it) % 4], n)
    fewer = [(f"UVA gather kernel, {n} thread blocks", uva(n), 20) for n in (16, 32, 64, 132)]
    return [
        ("contiguous pinned copy", lambda: pool.view(-1).copy_(src, non_blocking=True), 20),
        ("UVA gather kernel", uva(0), 20),  # one thread block per unit
        *(fewer if ext else []),
        (
            "UVA gather, Triton (no nvcc)",
            lambda: offload_kernels.gather_units_triton(host, pool, fetches[next(it) % 4]),
            20,
        ),
        ("index_select + copy", index_select_copy, 5),
        ("one memcpy per block", memcpy_per_block, 3),
    ]


COMMANDS = {"gather": (bench_gather, lambda p: None)}
