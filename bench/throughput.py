"""Steady-state decode throughput at a fixed GPU memory budget, every system at its largest batch."""

import time

import torch

import bench
import checkpoint
import common
import fast
import memory
import nosa
import offload
import offload_kernels
import tp as tp_
from bench import SHAPES, SYSTEMS, hbm_bandwidth, pinned_bandwidth
from bench.quality import trained_path
from config import Config
from model import random_model
from prefill import prefill

PHASES = ("weights", "selection", "transfer", "attention")


def split_by_phase(step, tok, n, cuda):
    """n eager decode steps under torch.profiler: the time of the ranges the step marks
    (record_function: selection, transfer, attention; the rest is the weights), per step in ms, as
    the host spends it issuing them (an eager step is launch-bound), and the device time of the
    gather kernels alone. Returns (tok, {phase: ms}, gather ms)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            tok = step(tok)
        if cuda:
            torch.cuda.synchronize()
        total = (time.perf_counter() - t0) * 1e3 / n
    # on a GPU each range is listed twice: the host's and the device's (no host time)
    ev = prof.key_averages()
    ms = {
        p: max((e.cpu_time_total for e in ev if e.key == p), default=0.0) / 1e3 / n
        for p in PHASES[1:]
    }
    ms["weights"] = max(total - sum(ms.values()), 0.0)
    gather = sum(
        (e.device_time_total if cuda else e.cpu_time_total) / 1e3 / n
        for e in ev
        if "gather_units" in e.key and (not cuda or "kernel" in e.key)
    )
    return tok, ms, gather


def fill_random(cache, cfg, Bz, prompt_len, dev, dtype, *, first=0):
    """Prompts of random K, V and c in rows first .. Bz-1, through the cache's prefill, as if the model
    had read them."""
    for seq in range(first, Bz):
        for layer in range(cfg.n_layer):
            k, v = torch.randn(2, cfg.H_kv, prompt_len, cfg.head_dim, device=dev, dtype=dtype)
            c = torch.randn(cfg.H_kv, prompt_len, device=dev) if cfg.eviction_head else None
            pooled = nosa.pooled_prompt(k, c, cfg) if cfg.sparse else None
            cache.prefill(layer, seq, k, v, c, pooled)


@torch.no_grad()
def activation_bytes(model, new_cache, prompt_len, micro_batches=1):
    """(a0, a1): GPU memory a graphed decode step needs beyond weights and cache, a0 + a1 * batch,
    from the measured peaks at batch m and 2m, m micro-batches (prefill, eager steps, capture, replay)."""
    peaks, ns = [], (micro_batches, 2 * micro_batches)
    for n in ns:
        cache = new_cache(n)
        fill_random(cache, model.cfg, n, prompt_len, "cuda", model.embed_tokens.weight.dtype)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step, tok = (
            fast.GraphedDecode(model, cache, micro_batches),
            torch.zeros(n, dtype=torch.long, device="cuda"),
        )
        for _ in range(4):  # eager, eager (warm-up), capture + replay, replay
            tok = step(tok).argmax(-1)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del cache, step
        torch.cuda.empty_cache()
    a1 = max(peaks[1] - peaks[0], 0) / (ns[1] - ns[0])
    return peaks[0] - a1 * ns[0], a1


def real_prompts(tok, n, T):
    """n windows of T tokens from the default corpus (train.py), spread over it."""
    import data as corpus

    ids = [i for _, text in corpus.documents() for i in tok.encode(text).ids]
    starts = torch.linspace(0, len(ids) - T - 1, n).long().tolist()
    return [ids[s : s + T] for s in starts]


def bench_throughput(
    shape="tiny", prompt_len=4096, *, gpu_budget=24.0, host_budget=None, steps=256, warmup=8,
    max_batch=256, ckpts=None, eager_steps=8, systems=tuple(SYSTEMS), micro_batches=(2,), tp=1,
):  # fmt: skip
    """Steady-state decode tokens/s at a fixed GPU memory budget, every system at its largest batch.
    The batch is the largest whose weights + KV cache (memory.cache_bytes) + activations fit
    gpu_budget (GiB), the activations measured: the peak of a graphed step at two batch sizes beyond
    the cache, extrapolated linearly (activation_bytes); the peak of the timed run is reported
    beside the budget; max_batch caps every batch. With random weights (the default) the cache is
    filled with random K, V, c through the prefill path, so the query-aware selection is random:
    hit rates are then the guaranteed bound's worst case, not a trained model's. With ckpts
    (train.py's tiny models: DIR/tiny-{nosa,full,infllmv2}) the prompts are real text run through
    each trained model: real selections. Per system: timed_decode, offload_figures, bounds. tp > 1
    (under torchrun, bench --tp): every process keeps its share of the KV heads (tp.py), at
    gpu_budget each; the counts of blocks are its own heads'."""
    if not ckpts:  # (random weights: the query-aware picks random, hit rates near the bound)
        bench.check_decode_run(shape, gpu_budget)
    rank, world = common.start_processes()[:2] if tp > 1 else (0, 1)
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    max_len = prompt_len + 2 * eager_steps + warmup + steps + 2
    limits = (hbm_bandwidth(), pinned_bandwidth()) if cuda else None
    host = host_budget * 2**30 if host_budget else memory.host_bytes_available()
    rows, prompts = [], None
    runs = [(SYSTEMS[s], m) for s in systems for m in (micro_batches if SYSTEMS[s][2] else (1,))]
    for (system, attn, use_offload), mb in runs:
        torch.manual_seed(0)
        if ckpts:  # one tokenizer for all of them
            model, tok = checkpoint.load(trained_path(ckpts, attn), dev, dtype, max_seq_len=max_len)
            prompts = prompts or real_prompts(tok, max_batch, prompt_len)
        else:  # initialised where it runs: an 8B model would take minutes on the host
            preset, over = SHAPES[shape]
            model = random_model(
                Config.from_preset(preset, **over, attn=attn, max_seq_len=max_len), dev, dtype
            )
        if world > 1:
            tp_.shard(model, rank, world)
        if cuda:  # the decode step's small operations compiled, as generate.py does for long runs
            fast.compile_model(model)
        cfg = model.cfg
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        new_cache = lambda n: offload.make_cache(
            cfg, n, dev, dtype, max_len, offload=use_offload, host_budget=host
        )
        act0, act1 = activation_bytes(model, new_cache, prompt_len, mb) if cuda else (0, 0)
        room = gpu_budget * 2**30 - weights - act0
        Bz = memory.max_batch(
            cfg, max_len, dtype, room, host if use_offload else None, offload=use_offload,
            limit=max_batch, per_seq=act1,
        )  # fmt: skip
        row = dict(system=system, micro_batches=mb, batch=Bz) | ({"tp": world} if world > 1 else {})
        rows.append(row)
        if Bz == 0:
            continue
        cache = new_cache(Bz)
        with torch.no_grad():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            if ckpts:
                for seq, p in enumerate(prompts[:Bz]):
                    prefill(model, torch.tensor([p], device=dev), cache, seq)
            else:
                fill_random(cache, cfg, Bz, prompt_len, dev, dtype)
            figures = timed_decode(
                model, cache, Bz, mb, steps=steps, warmup=warmup, eager_steps=eager_steps
            )
        counts = figures.pop("_graphed"), figures.pop("_profiled")
        row.update(figures, act_mb=round((act0 + act1 * Bz) / 2**20, 1))
        if use_offload:
            row.update(offload_figures(cfg, cache, attn, counts, limits))
        if cuda:
            row.update(bounds(row, cfg, weights, prompt_len, dtype, limits))
        print(row, flush=True)
        cache = model = None  # freed before the next system's
        bench.free(cuda)
    return rows


def timed_decode(model, cache, Bz, micro_batches, *, steps, warmup, eager_steps):
    """One system's decode timed: eager steps, then the same step as a CUDA graph
    (fast.GraphedDecode; offloading systems once per number of micro-batches asked for, their parts
    side by side in the graph), then eager steps under the profiler, split by phase (weights,
    selection, transfer, attention: the profiler's ranges) with the gathers' time. Returns the row's figures; `_moved` and `_needed` (the
    offload engine's counts over the graphed steps, units a step and gather ms over the profiled
    ones) are for offload_figures."""
    cuda = model.embed_tokens.weight.is_cuda
    stats = getattr(cache, "stats", None)
    count = lambda: (stats.moved.sum().item(), stats.needed.sum().item()) if stats else (0, 0)
    tok = torch.randint(0, model.cfg.vocab_size, (Bz,), device=model.embed_tokens.weight.device)
    step = lambda t: model.decode(t, cache).argmax(-1)  # the eager step
    # the first step after prefill gathers whole selections; first calls compile
    for _ in range(2):
        tok = step(tok)

    def timed(fn, n):
        nonlocal tok
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            tok = fn(tok)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    eager_s = timed(step, eager_steps)  # before: every kernel launched from Python
    graphed = fast.GraphedDecode(model, cache, micro_batches)
    gstep = lambda t: graphed(t).argmax(-1)
    timed(gstep, warmup)  # warm-up, capture
    c0 = count()
    graph_s = timed(gstep, steps)  # after: one graph replay per step
    c1 = count()
    tok, split, gather_ms = split_by_phase(step, tok, eager_steps, cuda)  # last: the profiler
    c2 = count()
    return dict(
        micro_batches=len(graphed.parts or [None]),  # fewer than asked when the batch is smaller
        tokens_s=round(Bz / graph_s, 1),
        step_ms=round(graph_s * 1e3, 2),
        eager_step_ms=round(eager_s * 1e3, 2),
        graphed=graphed.graph is not None,
        **{f"{p}_ms": round(split[p], 2) for p in PHASES},
        gpu_peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        _graphed=(c1[0] - c0[0], c1[1] - c0[1]),
        _profiled=((c2[0] - c1[0]) / eager_steps, gather_ms),
    )


def offload_figures(cfg, cache, attn, counts, limits):
    """The offload engine's figures: hit rate over the graphed steps against its guaranteed bound,
    bytes and gather time a step over the profiled ones (counts: timed_decode's)."""
    (moved, needed), (units, gather_ms) = counts
    moved_bytes = units * cache.stats.unit_bytes
    # guaranteed resident, of the k - 1 selected non-tail blocks: nosa's k_e query-agnostic blocks
    # (the locality theorem), infllmv2's sinks and window
    resident = cfg.k_e if attn == "nosa" else cfg.n_sink + cfg.n_win
    out = dict(
        hit_rate=round(1 - moved / max(needed, 1), 3),
        hit_rate_bound=round(resident / (cfg.k - 1), 3),
        mb_per_step=round(moved_bytes / 1e6, 2),
        gather_ms=round(gather_ms, 3),
        gather_blocks=offload_kernels.gather_ctas(cache.stats.unit_bytes),
        pcie_gb_s=round(moved_bytes / gather_ms / 1e6, 1) if gather_ms > 0 else None,
    )
    if limits:  # bound: bytes / contiguous GB/s
        out["gather_over_bound"] = round(gather_ms / (moved_bytes / limits[1] / 1e6), 2)
    return out


def bounds(row, cfg, weights, prompt_len, dtype, limits):
    """The step's bounds at the measured bandwidths: what it must read from HBM (weights, and the
    selected blocks' K, V and bias with the compressed keys scoring reads, or every cached token's
    K and V) and move over PCIe; serial (their sum, what a step that overlaps nothing can reach)
    and overlapped (the larger of the two)."""
    hbm, pcie = limits
    elt, rows_ = torch.finfo(dtype).bits // 8, row["batch"] * cfg.n_layer * cfg.H_kv
    if not cfg.sparse:
        kv = rows_ * prompt_len * 2 * cfg.head_dim * elt
    else:
        per_block = cfg.B * (2 * cfg.head_dim * elt + 4)
        kv = rows_ * (cfg.k * per_block + prompt_len // cfg.s_c * cfg.head_dim * elt)
    hbm_ms = (weights + kv) / hbm / 1e6
    pcie_ms = row.get("mb_per_step", 0.0) / pcie  # MB / (GB/s) = ms
    serial, overlapped = hbm_ms + pcie_ms, max(hbm_ms, pcie_ms)
    return dict(
        bound_ms=round(serial, 2),
        step_over_bound=round(row["step_ms"] / serial, 2),
        overlapped_bound_ms=round(overlapped, 2),
        step_over_overlapped=round(row["step_ms"] / overlapped, 2),
        hbm_share=round((weights + kv) / (row["step_ms"] / 1e3) / 1e9 / hbm, 3),
        hbm_gb_s=round(hbm, 1),
        pcie_contiguous_gb_s=round(pcie, 1),
    )


def flags(p):
    bench.add_shape(p)
    bench.add_budgets(p)
    bench.add_systems(p, SYSTEMS)
    p.add_argument(
        "--steps", type=bench.at_least_one, help="timed decode steps (default: %(default)s)"
    )
    p.add_argument(
        "--max-batch",
        type=bench.at_least_one,
        help="no system runs a larger batch (e.g. 1: every system at batch 1; default: %(default)s)",
    )
    p.add_argument(
        "--micro-batches",
        type=bench.positive_ints,
        help="offloading systems once per count, e.g. 1,2 (parts decoded side by side; default: "
        "%(default)s)",
    )
    bench.add_ckpts(
        p, "the trained tiny models train.py wrote there, real prompts (default: random weights)"
    )
    p.add_argument(
        "--tp",
        type=bench.at_least_one,
        help="tensor parallelism over the KV heads in this many processes (tp.py; one GPU each, "
        "started with torchrun)",
    )


COMMANDS = {"throughput": (bench_throughput, flags)}
