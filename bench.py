"""
Benchmarks, run on the GPU machine; every figure is a ratio against a limit measured in the same run.

    python bench.py gather [--json out.json]     # UVA gather vs contiguous pinned copy (PCIe roofline)
    python bench.py prefill                      # sparse attention fwd+bwd vs dense SDPA (flash), paper defaults
    python bench.py decode                       # decode kernels vs HBM bandwidth, batch 1..64
    python bench.py sdpa                         # dense decode under each SDPA backend
    python bench.py quality                      # out/tiny-{nosa,full,infllmv2,dma} from train.py: long-context quality
    python bench.py throughput --shape 8b --prompt-len 32768 --budget-gb 24   # decode at a fixed GPU budget
    python bench.py throughput --trained --prompt-len 8192                     # the same, trained tiny models

Record results with their command in BENCHMARKS.md.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import attention
import checkpoint
import nosa
import offload
import pooling
from nosa import Config


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

        def uva_triton():
            offload.gather_units_triton(host, pool, fetches[next(it) % 4])

        # correctness first: both kernels == the host store on one fetch list
        for kernel in (offload.gather_units, offload.gather_units_triton):
            check = torch.empty_like(pool)
            kernel(host, check, fetches[0])
            torch.cuda.synchronize()
            for r, s in ((R - 1, k // 2), (0, 0)):
                assert torch.equal(check[r, s].cpu().view(torch.int16),
                                   host[r, fetches[0][r, s].item()].view(torch.int16)), f"{kernel.__name__} is wrong"

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
                               ("UVA gather, Triton (no nvcc)", uva_triton, 20),
                               ("index_select + copy", index_select_copy, 5), ("one memcpy per block", memcpy_per_block, 3)):
            t = t_contig if fn is contiguous_copy else wall(fn, reps=reps, warmup=1)
            gbs = nbytes / t / 1e9
            rows.append(dict(unit_kib=unit_kib, blocks=R * k, variant=name, gb_s=round(gbs, 2),
                             of_contiguous=round(gbs / contiguous, 3)))
    return rows


def paper_mask(Bz, H_kv, T, cfg, device, seed=0):
    """The real selection (nosa.select_blocks) on synthetic scores with the structure of real ones:
    E fixed per block; Q a smooth random field over (query block, key block) plus per-token noise, so
    neighbouring queries prefer similar blocks, as the queries of adjacent tokens do."""
    g = torch.Generator(device=device).manual_seed(seed)
    nb, nq = T // cfg.B, T // cfg.B
    E = torch.rand(Bz, H_kv, nb, device=device, generator=g)
    field = torch.rand(Bz, H_kv, nq, nb, device=device, generator=g)
    Q = field.repeat_interleave(cfg.B, 2) + 0.3 * torch.rand(Bz, H_kv, T, nb, device=device, generator=g)
    return nosa.select_blocks(Q, E, torch.arange(T, device=device)[None, None], cfg)


def bench_prefill(H_q=32, H_kv=2, d=128):
    """Training / prefill attention, forward + backward, bf16: NOSA kernel vs dense causal SDPA."""
    cfg = Config.from_preset("paper")
    rows = []
    for T in (8192, 16384, 32768):
        q = torch.randn(1, H_q, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, H_kv, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        c = torch.randn(1, H_kv, T, device="cuda", requires_grad=True)
        mask, pos = paper_mask(1, H_kv, T, cfg, "cuda"), torch.arange(T, device="cuda")[None]
        do = torch.randn_like(q)

        def nosa_fb():
            attention.SparseAttention.apply(q, k, v, c, mask, pos, cfg.B).backward(do)

        def nosa_f():
            attention.SparseAttention.apply(q, k, v, c, mask, pos, cfg.B)

        def sdpa_fb():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)

        def sdpa_f():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        K_sub = pooling.compress_keys(k.detach(), cfg)

        def score_kernel():
            pooling.query_aware_scores_triton(q.detach(), K_sub, pos, T // cfg.B, cfg)

        def score_torch():
            pooling.query_aware_scores_torch(q.detach(), K_sub, pos, T // cfg.B, cfg)

        t = {n: do_bench(f, warmup=50, rep=300, return_mode="median") for n, f in
             (("nosa_fwd", nosa_f), ("nosa_fwd_bwd", nosa_fb), ("sdpa_fwd", sdpa_f), ("sdpa_fwd_bwd", sdpa_fb),
              ("score_kernel", score_kernel), ("score_torch", score_torch))}
        rows.append(dict(T=T, **{f"{n}_ms": round(x, 3) for n, x in t.items()},
                         speedup_fwd_bwd=round(t["sdpa_fwd_bwd"] / t["nosa_fwd_bwd"], 2)))
    return rows


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


def bench_decode(H_q=32, H_kv=2, d=128):
    """One decode step of one layer's attention at the paper defaults: the slot-pool kernel (offload)
    and the sparse kernel over a resident cache read k blocks per row; dense SDPA reads the context."""
    cfg = Config.from_preset("paper")
    hbm = hbm_bandwidth()
    rows = []
    for Bz in (1, 4, 16, 64):
        for ctx in (32768, 131072):
            if Bz * ctx > 64 * 32768 * 2:  # keep the resident cache within a few GB
                continue
            R = Bz * H_kv
            q = torch.randn(Bz, H_q, 1, d, device="cuda", dtype=torch.bfloat16)
            pool = torch.randn(R, cfg.k + 1, 2, cfg.B, d, device="cuda", dtype=torch.bfloat16)
            slot_block = torch.stack([torch.randperm(ctx // cfg.B - 1, device="cuda")[:cfg.k] for _ in range(R)])
            pos = torch.full((Bz,), ctx - 1, device="cuda")
            bias = torch.randn(Bz, H_kv, ctx, device="cuda")
            t_slot = do_bench(lambda: attention.slot_attention(q, pool, slot_block, bias, pos, cfg.B),
                              warmup=20, rep=200, return_mode="median")
            t_graph = graph_time(lambda: attention.slot_attention(q, pool, slot_block, bias, pos, cfg.B))
            kk, vv = (torch.randn(Bz, H_kv, ctx, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            nb = ctx // cfg.B
            mask = torch.zeros(Bz, H_kv, 1, nb, dtype=torch.bool, device="cuda")
            mask.scatter_(-1, torch.stack([torch.randperm(nb - 1, device="cuda")[:cfg.k - 1] for _ in range(R)]).view(
                Bz, H_kv, 1, -1), True)
            mask[..., -1] = True  # the query's own block
            qpos = pos[:, None]
            t_res = do_bench(lambda: attention.SparseAttention.apply(q, kk, vv, bias, mask, qpos, cfg.B),
                             warmup=20, rep=200, return_mode="median")
            t_sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True),
                              warmup=20, rep=200, return_mode="median")
            sel_bytes = R * (cfg.k + 1) * 2 * cfg.B * d * 2  # K and V of the selected blocks, bf16
            rows.append(dict(batch=Bz, context=ctx, slot_us=round(t_slot * 1e3, 1),
                             slot_graph_us=round(t_graph * 1e3, 1), slot_graph_GB_s=round(sel_bytes / t_graph / 1e6, 1),
                             slot_graph_of_hbm=round(sel_bytes / t_graph / 1e6 / hbm, 3),
                             resident_kernel_us=round(t_res * 1e3, 1), sdpa_full_us=round(t_sdpa * 1e3, 1),
                             hbm_GB_s=round(hbm, 1)))
    return rows


def bench_sdpa(Bz=12, H_kv=2, G=16, S=131073, d=128):
    """One dense decode call (the G query heads of a KV head as G rows) under each SDPA backend:
    why model.KVCache excludes cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(Bz, H_kv, G, d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(Bz, H_kv, S, d, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, backends in (("default", None), ("flash", [SDPBackend.FLASH_ATTENTION]),
                           ("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                           ("math", [SDPBackend.MATH])):
        def call():
            if backends is None:
                return F.scaled_dot_product_attention(q, kv, kv)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, kv, kv)
        try:
            t = do_bench(call, warmup=5, rep=50, return_mode="median")
            rows.append(dict(backend=name, ms=round(t, 3), gb_s=round(2 * kv.numel() * 2 / t / 1e6)))
        except RuntimeError as e:
            rows.append(dict(backend=name, error=str(e).splitlines()[0][:80]))
    return rows


def trained_path(ckpts, attn):
    """Where train.py --attn ATTN puts its tiny model: ckpts/tiny-ATTN (ckpts = out/ by default)."""
    path = os.path.join(ckpts, f"tiny-{attn}")
    if not checkpoint.is_checkpoint(path):
        raise FileNotFoundError(f"{path}: no trained {attn} model; train it with `python train.py --attn {attn} "
                                f"--out {path}` (BENCHMARKS.md gives the settings), or point --ckpts elsewhere")
    return path


def bench_quality(ckpts, windows=16, T=1024, n_prompts=8, prompt_len=128, gen_len=1024):
    """Long-sequence quality of the tiny models trained by train.py (ckpts/tiny-{nosa,full,infllmv2,dma}):
    teacher-forced loss on held-out windows (by position: the first k·B tokens are dense for every
    model), and free generations of gen_len tokens scored by the full-attention model. 'full as
    infllmv2' is the training-free baseline: the full-attention model decoded with InfLLMv2-style
    selection at the same budget k."""
    import train
    from generate import generate
    from kvcache import KVCache
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    systems = [("nosa", "nosa", None), ("full", "full", None), ("infllmv2", "infllmv2", None),
               ("dma", "dma", None), ("full as infllmv2 (training-free)", "full", "infllmv2")]
    paths = {ck: trained_path(ckpts, ck) for _, ck, _ in systems}  # all there before any work
    judge, tok = checkpoint.load(paths["full"], dev, torch.float32)
    eot = tok.token_to_id(train.EOT)  # the held-out files of the default corpus, as train.py splits them
    val = torch.tensor([i for name, text in train.documents() if train.is_val(name)
                        for i in tok.encode(text).ids + [eot]])
    kB = judge.cfg.k * judge.cfg.B
    starts = torch.linspace(0, len(val) - T - 1, windows).long()
    x = torch.stack([val[s:s + T] for s in starts]).to(dev)
    prompts = [val[s:s + prompt_len].tolist() for s in starts[:n_prompts]]
    rows = []
    for name, ck, attn in systems:
        model, _ = checkpoint.load(paths[ck], dev, torch.float32, **({"attn": attn} if attn else {}))
        with torch.no_grad():
            nll = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(windows, -1)
            torch.manual_seed(0)
            gen = generate(model, prompts, gen_len, temperature=0.8, top_k=50,
                           cache=KVCache(model.cfg, n_prompts, dev, torch.float32))
            full = torch.tensor([p + g for p, g in zip(prompts, gen)], device=dev)
            judged = F.cross_entropy(judge(full[:, :-1]).flatten(0, 1), full[:, 1:].flatten(), reduction="none")
            judged = judged.view(n_prompts, -1)[:, prompt_len - 1:]
        tail = [g[-kB:] for g in gen]  # repetition: share of distinct 4-grams in the last k·B tokens
        distinct = sum(len({tuple(t[i:i + 4]) for i in range(len(t) - 3)}) / (len(t) - 3) for t in tail) / len(tail)
        rows.append(dict(system=name, val_loss_dense_part=round(nll[:, :kB].mean().item(), 3),
                         val_loss_sparse_part=round(nll[:, kB:].mean().item(), 3),
                         gen_judge_loss_first_kB=round(judged[:, :kB].mean().item(), 3),
                         gen_judge_loss_last_kB=round(judged[:, -kB:].mean().item(), 3),
                         gen_distinct_4grams_last_kB=round(distinct, 3)))
        print(rows[-1], flush=True)
    return rows


SHAPES = {  # random-weight model shapes for the throughput benchmark
    "tiny": ("tiny", {}),
    "1b": ("paper", {}),
    "8b": ("paper", dict(n_layer=32, dim=4096, H_q=32, H_kv=2, head_dim=128, hidden_dim=14336)),
}
PHASES = ("weights", "selection", "transfer", "attention")


def split_by_phase(step, tok, n, cuda):
    """n eager decode steps under torch.profiler: the device time (CPU time on a CPU) of the ranges the
    step marks (record_function: selection, transfer, attention; the rest is the weights), per step in
    ms, and the time of the gather kernels alone. Returns (tok, {phase: ms}, gather ms)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            tok = step(tok)
        if cuda:
            torch.cuda.synchronize()
        total = (time.perf_counter() - t0) * 1e3 / n
    ev = {e.key: e for e in prof.key_averages()}
    dev = lambda e: (e.device_time_total if cuda else e.cpu_time_total) / 1e3 / n
    ms = {p: dev(ev[p]) if p in ev else 0.0 for p in PHASES[1:]}
    ms["weights"] = max(total - sum(ms.values()), 0.0) if not cuda else \
        sum(dev(e) for k, e in ev.items() if e.device_type.name == "CUDA") - sum(ms.values())
    gather = sum(dev(e) for k, e in ev.items() if "gather_units" in k and (not cuda or e.device_type.name == "CUDA"))
    return tok, ms, gather


def pinned_bandwidth(nbytes=256 * 2**20):
    """Contiguous pinned host -> device copy, GB/s: the PCIe limit the gathers are held to."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / wall(lambda: dst.copy_(src, non_blocking=True)) / 1e9


def real_prompts(tok, n, T):
    """n windows of T tokens from the default corpus (train.py), spread over it."""
    import train
    ids = [i for _, text in train.documents() for i in tok.encode(text).ids]
    starts = torch.linspace(0, len(ids) - T - 1, n).long().tolist()
    return [ids[s:s + T] for s in starts]


SYSTEMS = {"full": ("full, resident cache", "full", False),
           "infllmv2-offload": ("infllmv2 + offload", "infllmv2", True),
           "nosa-offload": ("nosa + offload", "nosa", True), "nosa-resident": ("nosa, resident cache", "nosa", False)}


def bench_throughput(shape="tiny", prompt_len=4096, budget_gb=24.0, steps=256, warmup=8, batch_limit=256,
                     host_gb=None, ckpts=None, eager_steps=8, systems=tuple(SYSTEMS)):
    """Steady-state decode tokens/s at a fixed GPU memory budget. Each system gets the largest batch
    whose weights + KV cache fit the budget (offload.max_batch, a 2 GiB margin for activations on a
    GPU). With random weights (the default) the cache is filled with random K, V, c through the
    prefill path, so the query-aware selection is random: hit rates are then the guaranteed bound's
    worst case, not a trained model's. With ckpts (train.py's tiny models: DIR/tiny-{nosa,full,infllmv2})
    the prompts are real text run through each trained model: real selections.
    Per system: eager steps split by phase (weights, selection, transfer, attention: the profiler's
    ranges), then the same step as a CUDA graph (generate.GraphedDecode)."""
    from dataclasses import replace
    from generate import GraphedDecode
    from kvcache import KVCache
    from model import Transformer
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    preset, over = SHAPES[shape]
    max_len = prompt_len + 2 * eager_steps + warmup + steps + 2
    base = Config.from_preset(preset, **over, max_seq_len=max_len)
    hbm, pcie = (hbm_bandwidth(), pinned_bandwidth()) if cuda else (None, None)
    if not ckpts:
        print("random weights: the query-aware picks are random, so hit rates sit near the guaranteed bound "
              "(hit_rate_bound), not at a trained model's")
    host_budget = host_gb * 2**30 if host_gb else offload.host_bytes_available()
    rows, prompts = [], None
    for system, attn, use_offload in (SYSTEMS[s] for s in systems):
        torch.manual_seed(0)
        if ckpts:
            model, tok = checkpoint.load(trained_path(ckpts, attn), dev, dtype, max_seq_len=max_len)
            prompts = prompts or real_prompts(tok, batch_limit, prompt_len)  # one tokenizer for all of them
        else:
            with torch.device(dev):  # initialised where it runs: an 8B model would take minutes on the host
                model = Transformer(replace(base, attn=attn)).to(dtype)
        model.eval()
        cfg = model.cfg
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        free = budget_gb * 2**30 - weights - (2 * 2**30 if cuda else 0)
        Bz = min(batch_limit, offload.max_batch(cfg, max_len, dtype, free, host_budget if use_offload else None,
                                                offload=use_offload))
        row = dict(system=system, batch=Bz)
        rows.append(row)
        if Bz == 0:
            continue
        cache = (offload.OffloadCache(cfg, Bz, dev, dtype, max_len=max_len, host_budget=host_budget) if use_offload
                 else KVCache(cfg, Bz, dev, dtype, max_len))
        with torch.no_grad():
            if ckpts:
                for seq, p in enumerate(prompts[:Bz]):
                    model(torch.tensor([p], device=dev), cache, seq=seq)
            else:
                for seq in range(Bz):
                    for layer in range(cfg.n_layer):
                        k, v = torch.randn(2, cfg.H_kv, prompt_len, cfg.head_dim, device=dev, dtype=dtype)
                        c = torch.randn(cfg.H_kv, prompt_len, device=dev) if attn == "nosa" else None
                        cache.prefill(layer, seq, k, v, c)
            tok_ = torch.randint(0, cfg.vocab_size, (Bz,), device=dev)
            step = lambda t: model.decode(t, cache).argmax(-1)
            for _ in range(2):  # the first step after prefill gathers whole selections; first calls compile
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
            moved0 = cache.stats.moved.sum().item() if use_offload else 0
            tok_, split, gather_ms = split_by_phase(step, tok_, eager_steps, cuda)
            if use_offload:  # gather kernel time and bytes over the profiled steps
                moved = (cache.stats.moved.sum().item() - moved0) * cache.stats.unit_bytes / eager_steps
            graphed = GraphedDecode(model, cache)
            gstep = lambda t: graphed(t).argmax(-1)
            timed(gstep, warmup)  # warm-up, capture
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            needed0, moved0 = ((cache.stats.needed.sum().item(), cache.stats.moved.sum().item()) if use_offload
                               else (0, 0))
            graph_s = timed(gstep, steps)  # after: one graph replay per step
        row.update(tokens_s=round(Bz / graph_s, 1), step_ms=round(graph_s * 1e3, 2),
                   eager_step_ms=round(eager_s * 1e3, 2),
                   graphed=graphed.graph is not None,
                   **{f"{p}_ms": round(split[p], 2) for p in PHASES},
                   gpu_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)
        if use_offload:
            needed = cache.stats.needed.sum().item() - needed0
            # guaranteed resident, of the k - 1 selected non-tail blocks: nosa's k_e query-agnostic blocks
            # (the locality theorem), infllmv2's sinks and window
            resident = cfg.k_e if attn == "nosa" else cfg.n_sink + cfg.n_win
            row.update(hit_rate=round(1 - (cache.stats.moved.sum().item() - moved0) / max(needed, 1), 3),
                       hit_rate_bound=round(resident / (cfg.k - 1), 3),
                       mb_per_step=round(moved / 1e6, 2), gather_ms=round(gather_ms, 3),
                       pcie_gb_s=round(moved / gather_ms / 1e6, 1) if gather_ms > 0 else None)
            if cuda:
                row["gather_over_bound"] = round(gather_ms / (moved / pcie / 1e6), 2)  # bound: bytes / contiguous GB/s
        if cuda and attn == "full":  # no full-attention step can beat reading the weights and the context once
            kv = Bz * prompt_len * cfg.n_layer * cfg.H_kv * 2 * cfg.head_dim * torch.finfo(dtype).bits // 8
            row["hbm_roofline_tokens_s"] = round(Bz / ((weights + kv) / hbm / 1e9), 1)
        if cuda:
            row.update(hbm_gb_s=round(hbm, 1), pcie_contiguous_gb_s=round(pcie, 1))
        print(row, flush=True)
        del cache, model, graphed
        if cuda:
            torch.cuda.empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()  # hand the pinned store back before the next one
    return rows


def main(what, json_path=None, ckpts=os.path.join(checkpoint.ROOT, "out"), trained=False, **throughput):
    if what == "quality":
        rows = bench_quality(ckpts)
    elif what == "throughput":
        rows = bench_throughput(**throughput, ckpts=ckpts if trained else None)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench.py measures the GPU machine: no CUDA device here")
        print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")
        rows = dict(gather=bench_gather, prefill=bench_prefill, decode=bench_decode, sdpa=bench_sdpa)[what]()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="NOSA / NOSI benchmarks (GPU)")
    p.add_argument("what", choices=["gather", "prefill", "decode", "sdpa", "quality", "throughput"],
                   help="which benchmark")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--ckpts", default=os.path.join(checkpoint.ROOT, "out"),
                   help="quality, throughput --trained: where train.py wrote tiny-nosa/, tiny-full/, ... (default: out/)")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="throughput: model shape")
    p.add_argument("--prompt-len", type=int, default=4096, help="throughput: context before decoding")
    p.add_argument("--budget-gb", type=float, default=24.0, help="throughput: GPU memory budget")
    p.add_argument("--steps", type=int, default=256, help="throughput: timed decode steps")
    p.add_argument("--host-gb", type=float, help="throughput: host memory budget (default: what is available)")
    p.add_argument("--trained", action="store_true", help="throughput: the trained models in --ckpts, real prompts")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"throughput: some of {','.join(SYSTEMS)}")
    a = p.parse_args()
    kw = dict(shape=a.shape, prompt_len=a.prompt_len, budget_gb=a.budget_gb, steps=a.steps, host_gb=a.host_gb,
              trained=a.trained, systems=a.systems.split(",")) if a.what == "throughput" else {}
    checkpoint.run_cli(main, a.what, a.json, a.ckpts, **kw)
