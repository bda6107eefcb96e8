"""
Benchmarks, run on the GPU machine; every figure is a ratio against a limit measured in the same run.

    python bench.py gather [--json out.json]     # UVA gather vs contiguous pinned copy (PCIe roofline)

Record results with their command in BENCHMARKS.md.
"""
import argparse
import json
import statistics
import time

import torch

import offload


def wall(fn, reps=20, warmup=3):
    """Median wall time of fn() in seconds, the device synchronised around each call (so host-side
    work such as a CPU index_select is counted too)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_gather(store_gib=4.0, moved_mib=64, k=64):
    """Gather scattered KV units (4, 16, 64 KiB) from a pinned host store into a slot pool, four ways."""
    rows = []
    contiguous = None
    for unit_kib in (4, 16, 64):
        U = unit_kib * 1024 // 2  # bf16 elements per unit
        n = moved_mib * 1024 // unit_kib  # units moved per call
        R = max(1, n // k)
        cap = int(store_gib * 2**30 / (R * unit_kib * 1024))
        host = torch.empty(R, cap, U, dtype=torch.bfloat16, pin_memory=True)
        host.view(torch.int16).random_(-2**15, 2**15 - 1)  # random payload (never zeros)
        pool = torch.empty(R, k, U, dtype=torch.bfloat16, device="cuda")
        # each row fetches k distinct random blocks (a fresh draw per call would time the RNG)
        fetches = [torch.stack([torch.randperm(cap)[:k] for _ in range(R)]).cuda() for _ in range(4)]
        it = iter(range(10**9))

        def uva():
            offload.gather_units(host, pool, fetches[next(it) % 4])

        # correctness first: kernel == twin on one fetch list
        check = torch.empty_like(pool)
        offload.gather_units(host, check, fetches[0])
        torch.cuda.synchronize()
        r, s = R - 1, k // 2
        assert torch.equal(check[r, s].cpu().view(torch.int16), host[r, fetches[0][r, s].item()].view(torch.int16)), \
            "UVA gather is wrong"

        fetch_cpu = [f.cpu() for f in fetches]
        flat = host.view(-1, U)
        staging = torch.empty(R * k, U, dtype=torch.bfloat16, pin_memory=True)

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

        src = host.view(-1)[: R * k * U]

        def contiguous_copy():
            pool.view(-1).copy_(src, non_blocking=True)

        nbytes = R * k * U * 2
        t_contig = wall(contiguous_copy)
        contiguous = nbytes / t_contig / 1e9
        for name, fn, reps in (("contiguous pinned copy", contiguous_copy, 20), ("UVA gather kernel", uva, 20),
                               ("index_select + copy", index_select_copy, 5), ("one memcpy per block", memcpy_per_block, 3)):
            t = t_contig if fn is contiguous_copy else wall(fn, reps=reps, warmup=1)
            gbs = nbytes / t / 1e9
            rows.append(dict(unit_kib=unit_kib, blocks=R * k, variant=name, gb_s=round(gbs, 2),
                             of_contiguous=round(gbs / contiguous, 3)))
        del host, staging
    return rows


def main(what, json_path=None):
    if not torch.cuda.is_available():
        raise SystemExit("bench.py measures the GPU machine: no CUDA device here")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")
    rows = bench_gather() if what == "gather" else None
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="NOSA / NOSI benchmarks (GPU)")
    p.add_argument("what", choices=["gather"], help="which benchmark")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args()
    main(a.what, a.json)
