"""
The decode step's small operations, fused: chains of torch operations (norms, RoPE, cache writes,
ranks, masks, lists, counters) that would each be a kernel launch are compiled by torch.compile into
a few Triton kernels on a GPU. The torch code is its own twin: off the GPU, or with NOSA_FUSE=0, it
runs as written.
"""
import functools
import os
import warnings

import torch

# NOSA_FUSE=0: run fused functions op by op, as their twins; unset, generate.py compiles for long decodes only
FUSE = os.environ.get("NOSA_FUSE", "1") != "0"


def fused(fn):
    """fn, on CUDA tensors, compiled by torch.compile into a few Triton kernels (its chains of small
    ops fused; matrix products stay cuBLAS calls), elsewhere run as written: the torch code is its own
    twin. For the decode step, whose shapes are static, so it compiles once per shape (generate.py's
    warm-up); modules may be arguments (their weights are inputs: one compile serves every layer)."""
    compiled = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled
        if not (FUSE and next(a for a in args if hasattr(a, "is_cuda")).is_cuda):  # the first tensor's device
            return fn(*args)
        if compiled is None:  # the first call compiles (before any CUDA graph capture)
            limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
            if getattr(torch._dynamo.config, limit) < 64:  # one compile per shape: batches, configs
                setattr(torch._dynamo.config, limit, 64)
            try:
                compiled = torch.compile(fn, dynamic=None)  # a second shape (batch) compiles a dynamic one
                return compiled(*args)
            except Exception as e:  # an inductor or toolchain problem: run unfused, slower, but right
                warnings.warn(f"torch.compile of {fn.__name__} failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}); it runs unfused")
                compiled = fn
        return compiled(*args)
    return run
