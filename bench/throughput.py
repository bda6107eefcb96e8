"""Steady-state decode throughput at a fixed GPU memory budget, every system at its largest batch."""

import time

import torch

import checkpoint
import common
import fast
import memory
import nosa
import offload
import offload_kernels
import tp as tp_
from bench import hbm_bandwidth, pinned_bandwidth
from bench.quality import trained_path
from config import Config
from prefill import prefill

# random-weight models: config.PRESETS
SHAPES = {"tiny": ("tiny", {}), "1b": ("paper", {}), "8b": ("paper-8b", {})}
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


def fill_random(cache, cfg, Bz, prompt_len, dev, dtype, first=0):
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


SYSTEMS = {
    "full": ("full, resident cache", "full", False),
    "infllmv2-offload": ("infllmv2 + offload", "infllmv2", True),
    "nosa-offload": ("nosa + offload", "nosa", True),
    "nosa-resident": ("nosa, resident cache", "nosa", False),
}


def bench_throughput(
    shape="tiny",
    prompt_len=4096,
    budget_gb=24.0,
    steps=256,
    warmup=8,
    batch_limit=256,
    host_gb=None,
    ckpts=None,
    eager_steps=8,
    systems=tuple(SYSTEMS),
    micro_batches=(2,),
    tp=1,
):
    """Steady-state decode tokens/s at a fixed GPU memory budget. Each system gets the largest batch
    whose weights + KV cache (memory.cache_bytes) + activations fit the budget, the activations
    measured: the peak of a graphed step at two batch sizes beyond the cache, extrapolated linearly
    (activation_bytes); the peak of the timed run is reported beside the budget; batch_limit caps
    every batch. With random weights (the default) the cache is filled with random K, V, c through the
    prefill path, so the query-aware selection is random: hit rates are then the guaranteed bound's
    worst case, not a trained model's. With ckpts (train.py's tiny models: DIR/tiny-{nosa,full,infllmv2})
    the prompts are real text run through each trained model: real selections.
    Per system: eager steps timed, then the same step as a CUDA graph (fast.GraphedDecode;
    offloading systems once per number of micro-batches asked for, their parts side by side in the
    graph), then eager steps under the profiler, split by phase (weights, selection, transfer,
    attention: the profiler's ranges) and the gathers' time and bytes. tp > 1 (under torchrun,
    bench --tp): every process keeps its share of the KV heads (tp.py), at budget_gb each; the
    counts of blocks are its own heads'."""
    from dataclasses import replace

    from model import Transformer

    rank, world = common.start_processes()[:2] if tp > 1 else (0, 1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    preset, over = SHAPES[shape]
    max_len = prompt_len + 2 * eager_steps + warmup + steps + 2
    base = Config.from_preset(preset, **over, max_seq_len=max_len)
    hbm, pcie = (hbm_bandwidth(), pinned_bandwidth()) if cuda else (None, None)
    if not ckpts:
        print(
            "random weights: the query-aware picks are random, so hit rates sit near the guaranteed bound "
            "(hit_rate_bound), not at a trained model's"
        )
    host_budget = host_gb * 2**30 if host_gb else memory.host_bytes_available()
    rows, prompts = [], None
    runs = [(SYSTEMS[s], m) for s in systems for m in (micro_batches if SYSTEMS[s][2] else (1,))]
    for (system, attn, use_offload), mb in runs:
        torch.manual_seed(0)
        if ckpts:
            model, tok = checkpoint.load(trained_path(ckpts, attn), dev, dtype, max_seq_len=max_len)
            # one tokenizer for all of them
            prompts = prompts or real_prompts(tok, batch_limit, prompt_len)
        else:
            # initialised where it runs: an 8B model would take minutes on the host
            with torch.device(dev):
                model = Transformer(replace(base, attn=attn)).to(dtype)
        model.eval()
        if world > 1:
            tp_.shard(model, rank, world)
        if cuda:  # the decode step's small operations compiled, as generate.py does for long runs
            fast.compile_model(model)
        cfg = model.cfg
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        new_cache = lambda n: offload.make_cache(
            cfg, n, dev, dtype, max_len, offload=use_offload, host_budget=host_budget
        )
        act0, act1 = activation_bytes(model, new_cache, prompt_len, mb) if cuda else (0, 0)
        Bz = memory.max_batch(
            cfg,
            max_len,
            dtype,
            budget_gb * 2**30 - weights - act0,
            host_budget if use_offload else None,
            offload=use_offload,
            limit=batch_limit,
            per_seq=act1,
        )
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
            tok_ = torch.randint(0, cfg.vocab_size, (Bz,), device=dev)
            step = lambda t: model.decode(t, cache).argmax(-1)  # the eager step
            # the first step after prefill gathers whole selections; first calls compile
            for _ in range(2):
                tok_ = step(tok_)

            def timed(fn, n):
                nonlocal tok_
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    tok_ = fn(tok_)
                if cuda:
                    torch.cuda.synchronize()
                return (time.perf_counter() - t0) / n

            eager_s = timed(step, eager_steps)  # before: every kernel launched from Python
            graphed = fast.GraphedDecode(model, cache, mb)
            gstep = lambda t: graphed(t).argmax(-1)
            timed(gstep, warmup)  # warm-up, capture
            needed0, moved0 = (
                (cache.stats.needed.sum().item(), cache.stats.moved.sum().item())
                if use_offload
                else (0, 0)
            )
            graph_s = timed(gstep, steps)  # after: one graph replay per step
            if use_offload:  # over the graphed steps
                moved1 = cache.stats.moved.sum().item()
                hit_rate = 1 - (moved1 - moved0) / max(cache.stats.needed.sum().item() - needed0, 1)
                moved0 = moved1
            # last: bench/__init__.py
            tok_, split, gather_ms = split_by_phase(step, tok_, eager_steps, cuda)
            if use_offload:  # gather kernel time and bytes over the profiled steps
                moved = (
                    (cache.stats.moved.sum().item() - moved0) * cache.stats.unit_bytes / eager_steps
                )
        row.update(
            micro_batches=len(
                graphed.parts or [None]
            ),  # fewer than asked when the batch is smaller
            tokens_s=round(Bz / graph_s, 1),
            step_ms=round(graph_s * 1e3, 2),
            eager_step_ms=round(eager_s * 1e3, 2),
            graphed=graphed.graph is not None,
            **{f"{p}_ms": round(split[p], 2) for p in PHASES},
            gpu_peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            act_mb=round((act0 + act1 * Bz) / 2**20, 1),
        )
        if use_offload:
            # guaranteed resident, of the k - 1 selected non-tail blocks: nosa's k_e query-agnostic blocks
            # (the locality theorem), infllmv2's sinks and window
            resident = cfg.k_e if attn == "nosa" else cfg.n_sink + cfg.n_win
            row.update(
                hit_rate=round(hit_rate, 3),
                hit_rate_bound=round(resident / (cfg.k - 1), 3),
                mb_per_step=round(moved / 1e6, 2),
                gather_ms=round(gather_ms, 3),
                gather_blocks=offload_kernels.gather_ctas(cache.stats.unit_bytes),
                pcie_gb_s=round(moved / gather_ms / 1e6, 1) if gather_ms > 0 else None,
            )
            if cuda:
                # bound: bytes / contiguous GB/s
                row["gather_over_bound"] = round(gather_ms / (moved / pcie / 1e6), 2)
        if cuda:  # the bound: what the step must read from HBM, and move over PCIe, at the measured bandwidths
            elt, rows_ = torch.finfo(dtype).bits // 8, Bz * cfg.n_layer * cfg.H_kv
            if not cfg.sparse:  # every cached token's K and V
                kv = rows_ * prompt_len * 2 * cfg.head_dim * elt
            else:  # the k selected blocks' K, V and bias, and the compressed keys scoring reads
                kv = rows_ * (
                    cfg.k * cfg.B * (2 * cfg.head_dim * elt + 4)
                    + prompt_len // cfg.s_c * cfg.head_dim * elt
                )
            bound_ms = (weights + kv) / hbm / 1e6 + (moved / pcie / 1e6 if use_offload else 0.0)
            row.update(
                bound_ms=round(bound_ms, 2),
                step_over_bound=round(graph_s * 1e3 / bound_ms, 2),
                hbm_share=round((weights + kv) / graph_s / 1e9 / hbm, 3),
            )
        if cuda:
            row.update(hbm_gb_s=round(hbm, 1), pcie_contiguous_gb_s=round(pcie, 1))
        print(row, flush=True)
        cache = model = graphed = None  # freed before the next system's
        if cuda:
            torch.cuda.empty_cache()
            # hand the pinned store back before the next one
            getattr(torch._C, "_host_emptyCache", lambda: None)()
    return rows
