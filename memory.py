"""
The memory model: how much GPU and host memory a generation needs, so that the batch and the
prefill's chunk are chosen before anything is allocated (plan_memory), and a budget that cannot
hold them is a one-line error that says what fits. Bounds, checked against the measured peaks on
the GPU (tests/test_generate.py).

  cache_bytes     the KV cache of a batch: offloaded (offload.OffloadCache: k + 1 slots on the GPU,
                  every block in host memory) or resident (kvcache.KVCache), with the pooled caches
  prefill_bytes   a chunked prefill's working memory beyond the weights and the cache
  decode_bytes    a decode step's activations
  plan_memory     all of it against the budgets: the chunk, and where the prompt's residual stream waits
"""

import math
from dataclasses import dataclass

import torch

import eviction
import nosa_kernels


def cache_bytes(cfg, Bz, max_len, dtype, offload=True):
    """(GPU bytes, host bytes) of the KV cache of Bz sequences of up to max_len tokens: with offload,
    k + 1 slots of K and V per (sequence, layer, KV head) on the GPU and every block in host memory;
    without, all of K and V on the GPU (kvcache.KVCache). Besides, on the GPU, what the mode needs:
    the eviction scores c (fp32; nosa, dma) and the pooled caches K̃, c̃ (sparse modes); full attention
    needs neither; nosa-hh its h. The weights are not counted."""
    L, H, B, d, k = cfg.n_layer, cfg.H_kv, cfg.B, cfg.head_dim, cfg.k
    elt = torch.empty((), dtype=dtype).element_size()
    unit = 2 * B * d * elt  # one block of K and V
    side = (
        L
        * Bz
        * H
        * (
            (max_len * 4 if cfg.eviction_head else 0)
            + ((max_len // cfg.s_c + 1) * (d * elt + 4) if cfg.sparse else 0)
            + ((max_len // B + 1) * 4 if cfg.heavy_hitters else 0)  # h
        )
    )
    if not offload:
        return L * Bz * H * max_len * 2 * d * elt + side, 0
    return L * Bz * H * (k + 1) * unit + side, L * Bz * H * math.ceil(max_len / B) * unit


def check_offload(cfg, Bz, max_len, dtype, device, *, gpu_budget=None, host_budget=None):
    """An offloaded cache (offload.OffloadCache) against the budgets, before anything is allocated:
    the host store against host_budget (default: what host_bytes_available says), the GPU's part
    against gpu_budget (default: the device's free memory). A MemoryError that says what to lower."""
    need_gpu = cache_bytes(cfg, Bz, max_len, dtype)[0]
    host_budget = host_budget or host_bytes_available()
    if gpu_budget is None and torch.device(device).type == "cuda":
        gpu_budget = torch.cuda.mem_get_info(device)[0]
    check_host(cfg, Bz, max_len, dtype, host_budget)
    if gpu_budget is not None and need_gpu > gpu_budget:
        raise MemoryError(
            f"the GPU slot pool needs {gib(need_gpu)} for batch {Bz} (k={cfg.k} slots per row "
            f"and layer), but the budget is {gib(gpu_budget)}: lower the batch"
        )


def check_host(cfg, Bz, max_len, dtype, host_budget, offload=True):
    """The host store of Bz sequences of max_len tokens against host_budget (None: not checked); a
    MemoryError that says how many fit."""
    need_host = cache_bytes(cfg, Bz, max_len, dtype, offload)[1]
    if host_budget is not None and need_host > host_budget:
        n = max_batch(cfg, max_len, dtype, None, host_budget, offload)
        raise MemoryError(
            f"the host KV store needs {gib(need_host)} for batch {Bz} x {max_len} tokens, but "
            f"{gib(host_budget)} is available: at most {n} sequences of that length fit; lower the "
            f"batch or the length (the default budget leaves a tenth of the free memory to the "
            f"process; a larger one may hold more)"
        )


def largest(fits, limit):
    """The largest n in 0 .. limit with fits(n), for a test that holds up to some n and not beyond
    (memory grows with the batch): a binary search. 0 if none fits."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def max_batch(
    cfg, max_len, dtype, gpu_budget, host_budget=None, offload=True, *, limit=4096, per_seq=0
):
    """The largest batch up to limit whose cache fits both budgets (None: not checked), with per_seq
    bytes of activations a sequence beside it on the GPU (0 if none fits)."""

    def fits(n):
        gpu, host = cache_bytes(cfg, n, max_len, dtype, offload)
        return (gpu_budget is None or gpu + per_seq * n <= gpu_budget) and (
            host_budget is None or host <= host_budget
        )

    return largest(fits, limit)


# the chunk sizes a prefill may take, largest first
PREFILL_CHUNKS = (8192, 4096, 2048, 1024, 512, 256)


def prefill_bytes(cfg, T, C, dtype, stream_on_host=False):
    """GPU bytes a chunked prefill of a T-token prompt needs beyond the weights and the cache
    (prefill.prefill), C tokens a chunk: the prompt's residual stream (T, dim), or the next
    chunk of it when it is kept in host memory, one layer's K, V, c and pooled caches and a copy of
    them (the cache's prefill stacks K and V), the RoPE tables of every position, and the largest
    of one chunk's activations: RoPE in fp32, scoring and selection (nosa_kernels.select_rows
    queries at a time, over nb blocks; the selection kept as tiles), the MLP. A bound checked
    against the measured peak on the GPU."""
    H, H_q, d, dim = cfg.H_kv, cfg.H_q, cfg.head_dim, cfg.dim
    elt, C = torch.empty((), dtype=dtype).element_size(), min(C, T)
    nb = math.ceil(T / cfg.B)
    # and RoPE's cos and sin (T, d/2) in fp32
    whole = (
        (0 if stream_on_host else T * dim * elt)
        + 2 * H * T * (2 * d * elt + 4)
        + H * (T // cfg.s_c + 1) * (d * elt + 4)
        + T * d * 4
    )
    # q, k, v; the selection as tiles (attention_kernels.Tiles: at most k block ids and bits a query, int32)
    live = 2 * (H_q + 2 * H) * d * elt + 4 * dim * elt + (H * 8 * cfg.k if cfg.sparse else 0)
    # the scores Q and their parts, fp32
    select = min(C, nosa_kernels.select_rows(nb)) * H * nb * 20 if cfg.sparse else 0
    peak = max(16 * H_q * d, 4 * cfg.hidden_dim * elt + dim * (8 + 2 * elt)) * C
    if cfg.heavy_hitters:  # a pass of eviction.heavy_hitters: logits, probabilities, masks
        peak = max(peak, 16 * eviction.HH_PASS)
    # the next chunk of the stream, on its way (prefill.ResidualStream)
    ahead = C * dim * elt if stream_on_host else 0
    return whole + C * live + ahead + max(select, peak) + 2**27  # and 128 MiB for workspaces


def decode_bytes(cfg, Bz, max_len, dtype):
    """GPU bytes a decode step needs beyond the weights and the cache, its activations (a bound
    checked against the step's measured peak on the GPU): per sequence the scores of the compressed
    keys and of the blocks, the logits, the MLP; two micro-batches' worth, and 512 MiB besides."""
    elt, M, nb = (
        torch.empty((), dtype=dtype).element_size(),
        max_len // cfg.s_c + 1,
        math.ceil(max_len / cfg.B),
    )
    per_seq = (
        cfg.H_kv * (16 * M * 4 + nb * 16)
        + cfg.vocab_size * 8
        + 4 * cfg.hidden_dim * elt
        + 8 * cfg.dim * 4
        + (cfg.H_q * (cfg.k + 1) * cfg.B * 16 if cfg.heavy_hitters else 0)  # the window's attention
    )
    return 2**29 + 2 * Bz * per_seq


def gib(n):
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class Plan:
    """A generation's memory plan (plan_memory), settled before anything is allocated and passed
    whole: the sequences, the longest prompt P and sequence max_len, the dtype, the weights' bytes, the
    GPU and host budgets in bytes (None: not bounded), whether the cache is offloaded and whether a
    prompt prefills beside the decoding batch (served), the prefill's chunk and whether its residual
    stream waits in host memory; then, where the caller settles them, the device and the
    micro-batches of a decode step (fast.GraphedDecode)."""

    batch: int
    P: int
    max_len: int
    dtype: torch.dtype
    weights: int = 0
    gpu: float = None
    host: float = None
    offload: bool = True
    served: bool = False
    chunk: int = None
    on_host: bool = False
    device: torch.device = None
    micro: int = 1


def plan_memory(
    cfg,
    weights,
    Bz,
    prompt_len,
    max_len,
    dtype,
    *,
    gpu_budget=None,
    host_budget=None,
    offload=True,
    chunk=None,
    served=False,
):
    """Check a generation against the memory budgets before anything is allocated: the weights, the
    cache of Bz sequences of up to max_len tokens (cache_bytes), and the larger of a prefill's working
    memory (prompts of up to prompt_len tokens) and a decode step's, or both where a prompt prefills
    beside the decoding batch (served: serve.py). Returns the Plan, with the prefill's chunk
    (`chunk`, or the largest of PREFILL_CHUNKS that fits) and whether the prompt's residual stream
    must wait in host memory (when it does not fit on the GPU beside the cache). A budget that does
    not fit is a MemoryError that says what does."""
    fits = lambda c, on_host: Plan(
        Bz,
        prompt_len,
        max_len,
        dtype,
        weights,
        gpu_budget,
        host_budget,
        offload,
        served,
        c,
        on_host,
    )
    need_gpu, _ = cache_bytes(cfg, Bz, max_len, dtype, offload)
    check_host(cfg, Bz, max_len, dtype, host_budget, offload)
    chunks = [chunk] if chunk else [c for c in PREFILL_CHUNKS if c < prompt_len] or [prompt_len]
    if gpu_budget is None:
        return fits(chunks[0], False)
    room = gpu_budget - weights - need_gpu
    both = lambda prefill, step: prefill + step if served else max(prefill, step)
    if room >= decode_bytes(cfg, Bz, max_len, dtype):
        for c in chunks:  # large chunks first (fewer, larger matrix products), then the residual stream on the GPU
            for on_host in (False, True):
                if (
                    both(
                        prefill_bytes(cfg, prompt_len, c, dtype, on_host),
                        decode_bytes(cfg, Bz, max_len, dtype),
                    )
                    <= room
                ):
                    return fits(c, on_host)
    least = prefill_bytes(cfg, prompt_len, min(chunks), dtype, True)
    n = largest(
        lambda n: (
            weights
            + cache_bytes(cfg, n, max_len, dtype, offload)[0]
            + both(least, decode_bytes(cfg, n, max_len, dtype))
            <= gpu_budget
        ),
        Bz,
    )
    raise MemoryError(
        f"a GPU budget of {gib(gpu_budget)} does not fit: the weights take {gib(weights)}, the cache of "
        f"batch {Bz} x {max_len} tokens {gib(need_gpu)}, which leaves {gib(room)} where a prefill of "
        f"{prompt_len} tokens needs {gib(least)} (chunks of {min(chunks)}) and a decode step "
        f"{gib(decode_bytes(cfg, Bz, max_len, dtype))}: "
        + (f"at most {n} sequences fit" if n else "not even one sequence fits; raise the budget")
    )


def mem_available():
    """The host memory the OS reports available, in bytes (None where it does not say)."""
    try:
        with open("/proc/meminfo") as f:
            return int(next(l for l in f if l.startswith("MemAvailable")).split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def host_bytes_available():
    """What the host store may take by default: the memory the OS reports available, less a margin
    for the process itself (a tenth of it, at least 4 GiB, at most half)."""
    avail = mem_available()
    return None if avail is None else avail - min(max(avail // 10, 4 * 2**30), avail // 2)


# host memory a run should leave the process and the OS beside the pinned store
HOST_LEFT = 6 * 2**30


def host_warning(need_host):
    """A one-line warning where a host store of need_host bytes leaves the process and the OS less than
    HOST_LEFT of the memory available (the store is pinned: nothing else can be paged out to make room),
    else None (below that, a long prefill runs markedly slower: docs/LOG.md)."""
    avail = mem_available()
    if avail is None or avail - need_host >= HOST_LEFT:
        return None
    return (
        f"warning: the host KV store takes {gib(need_host)} of the {gib(avail)} available, which leaves "
        f"{gib(avail - need_host)} to this process and the OS; below {gib(HOST_LEFT)} runs slow down: a "
        f"smaller --host-budget or batch avoids it"
    )
