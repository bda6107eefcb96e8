"""
Benchmarks, run on the GPU machine; every figure is a ratio against a limit measured in the same run.

    python -m bench gather [--json out.json]    # UVA gather (CUDA, Triton) vs contiguous pinned copy (PCIe roofline)
    python -m bench prefill                     # sparse attention fwd+bwd vs dense SDPA (flash), paper defaults
    python -m bench decode                      # decode kernels vs HBM bandwidth, batch 1..64
    python -m bench sdpa                        # dense decode under each SDPA backend
    python -m bench quality                     # out/tiny-{nosa,full,infllmv2,dma} from train.py: long-context quality
    python -m bench eviction [--checkpoint DIR] # how much attention Γ(t) holds, per rule for E (CPU)
    python -m bench throughput --shape 8b --prompt-len 32768 --budget-gb 24   # decode at a fixed GPU budget
    python -m bench throughput --trained --prompt-len 8192                     # the same, trained tiny models
    python -m bench requests --shape 8b --prompt-len 131072 --budget-gb 24    # whole requests: prefill + decode
    python -m bench requests --served --shape 8b --prompt-len 131072          # the same, served (serve.py)
    python -m bench requests --served --rate 0.05,0.1 --prompt-lens 65536:131072   # arriving over time
    python -m bench pretrained --checkpoint out/smollm2-135m   # an imported model and the recipe's runs
    python -m bench recall --ckpts out/                 # long-range recall (tasks.py) of the tiny models, by distance
    python -m bench head [--checkpoint DIR]             # can the eviction head alone learn to keep a fact? (CPU)
    python -m bench plot                                # BENCHMARKS.md's figures from bench/results/*.json

One file per benchmark; the timing helpers and the machine's limits are here. Record results with
their command in BENCHMARKS.md.
"""

import os
import statistics
import time

# torch.profiler leaves CUPTI attached after a profile unless told to tear it down, which is known
# to slow what runs later in the process; a benchmark that profiles one system must not slow the
# timings of the next
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch
from triton.testing import do_bench


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


def hbm_bandwidth():
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    return 2 * x.numel() / (t * 1e-3) / 1e9  # bytes read + written


def graph_time(fn, n=20):
    """Median time (ms) of fn captured n times in one CUDA graph, per call: launch overhead removed."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return do_bench(g.replay, warmup=5, rep=100, return_mode="median") / n


def pinned_bandwidth(nbytes=256 * 2**20):
    """Contiguous pinned host -> device copy, GB/s: the PCIe limit the gathers are held to."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / wall(lambda: dst.copy_(src, non_blocking=True)) / 1e9
