"""The attention kernels at the paper's defaults: training / prefill forward + backward and the fused
scoring against dense SDPA; one decode step against HBM bandwidth; dense decode per SDPA backend."""

import contextlib

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import attention_kernels
import decode_kernels
import eviction
import nosa
import nosa_kernels
import pooling
from bench import graph_time, hbm_bandwidth, need_gpu
from config import Config


def bench_prefill(
    H_q=32,
    H_kv=2,
    d=128,
    lengths=(16384, 32768, 65536, 131072),
    forward_only=(262144,),
    modes=("nosa", "infllmv2"),
):
    """One layer's training / prefill attention at the paper defaults, bf16, batch 1, random q, k, v, c:
    nosa_attention (scoring, selection, attention) in each mode against causal SDPA at its best (the
    fastest backend and K/V layout: sdpa_at_its_best) in the same run, forward for every length and
    forward + backward for `lengths`; the share of each phase, the TFLOP/s of useful work (the keys
    each query attends to: min(t + 1, k·B)) and the mean union of blocks a tile of queries reads
    (tile_union; a query selects k)."""
    need_gpu("prefill")
    rows = []
    for T in lengths + forward_only:
        torch.manual_seed(0)
        bwd = T in lengths
        # q in the projections' layout (1, T, H_q, d), as the model makes it; k, v contiguous, as a prefill keeps them
        q = (
            torch.randn(1, T, H_q, d, device="cuda", dtype=torch.bfloat16)
            .transpose(1, 2)
            .requires_grad_(bwd)
        )
        k, v = (
            torch.randn(1, H_kv, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=bwd)
            for _ in range(2)
        )
        c0 = torch.randn(1, H_kv, T, device="cuda", requires_grad=bwd)
        do = torch.randn_like(q)
        reps = max(3, 2**17 // T * 4)
        ms = lambda f: timed(f, reps)
        # SDPA reads a contiguous q
        q_c, do_c = (q.detach().contiguous().requires_grad_(bwd), do.contiguous())
        t_sdpa, sdpa_fwd, t_fa2 = sdpa_at_its_best(q_c, k, v, None, reps)
        t_sdpa_fb, sdpa_fb, t_fa2_fb = (
            sdpa_at_its_best(q_c, k, v, do_c, reps) if bwd else (None, None, None)
        )
        for mode in modes:
            cfg = Config.from_preset("paper", attn=mode)
            c = c0 if cfg.eviction_head else None
            t_score, t_select, t_attn, t_fwd, peak, tiles = nosa_phases(q, k, v, c, cfg, ms)
            keys = torch.arange(1, T + 1, device="cuda").clamp(max=cfg.k * cfg.B).sum().item()
            useful, dense = 4 * d * H_q * keys, 4 * d * H_q * T * (T + 1) / 2  # FLOP: q·k and p·v
            row = dict(
                T=T,
                mode=mode,
                nosa_fwd_ms=round(t_fwd, 2),
                sdpa_fwd_ms=round(t_sdpa, 2),
                sdpa_fwd=sdpa_fwd,
                sdpa_over_nosa_fwd=round(t_sdpa / t_fwd, 2),
                fa2_fwd_ms=round(t_fa2, 2),
                fa2_over_nosa_fwd=round(t_fa2 / t_fwd, 2),
                score_ms=round(t_score, 2),
                select_ms=round(t_select - t_score, 2),
                attention_ms=round(t_attn, 2),
                attention_tflops=round(useful / t_attn / 1e9, 1),
                sdpa_tflops=round(dense / t_sdpa / 1e9, 1),
                nosa_fwd_peak_gb=round(peak / 2**30, 2),
                tile_union=round(tiles.n.float().mean().item(), 1),
            )
            if bwd:
                t_fb = ms(lambda: nosa.nosa_attention(q, k, v, c, cfg)[0].backward(do))
                row.update(
                    nosa_fwd_bwd_ms=round(t_fb, 2),
                    sdpa_fwd_bwd_ms=round(t_sdpa_fb, 2),
                    sdpa_fwd_bwd=sdpa_fb,
                    sdpa_over_nosa_fwd_bwd=round(t_sdpa_fb / t_fb, 2),
                    fa2_fwd_bwd_ms=round(t_fa2_fb, 2),
                    fa2_over_nosa_fwd_bwd=round(t_fa2_fb / t_fb, 2),
                )
            rows.append(row)
            print(row, flush=True)
            torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def nosa_phases(q, k, v, c, cfg, ms):
    """The forward's phases, each timed by ms: scoring, selection (scoring included), attention
    over the selected tiles, the whole nosa_attention and its peak memory beyond the inputs.
    Returns those and the tiles."""
    T = q.shape[2]
    pos, nb = torch.arange(T, device="cuda")[None], cfg.n_blocks(T)
    K_sub = pooling.compress_keys(k, cfg)
    R = nosa_kernels.select_rows(nb)
    t_score = ms(
        lambda: [
            pooling.query_aware_scores(q[:, :, t : t + R], K_sub, pos[:, t : t + R], nb, cfg)
            for t in range(0, T, R)
        ]
    )

    def sel():  # nosa_attention's selection
        lists = None
        if c is not None:
            lists = eviction.e_lists_by_block(pooling.pool_mean(c, cfg), 0, nb - 1, cfg)[0]
        return nosa.select_tiles(q, K_sub, lists, pos, nb, cfg, first=0)

    t_select = ms(sel)
    tiles = sel()
    t_attn = ms(lambda: attention_kernels.SparseAttention.apply(q, k, v, c, tiles, pos, cfg.B))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t_fwd = ms(lambda: nosa.nosa_attention(q, k, v, c, cfg))
    peak = torch.cuda.max_memory_allocated() - base
    return t_score, t_select, t_attn, t_fwd, peak, tiles


def sdpa_at_its_best(q, k, v, do, reps):
    """Causal SDPA as fast as a user could run it: each backend (PyTorch's own choice, flash, cuDNN,
    memory-efficient), K and V read per KV head (enable_gqa) or expanded to the query heads beforehand
    (and their gradients taken there), forward (do None) or forward + backward. Returns the fastest
    time, its name, and the flash backend's best time (FlashAttention-2, the baseline of the published
    sparse kernels' speed-ups); the combinations a backend does not support are skipped."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = dict(
        default=None,
        flash=SDPBackend.FLASH_ATTENTION,
        cudnn=SDPBackend.CUDNN_ATTENTION,
        efficient=SDPBackend.EFFICIENT_ATTENTION,
    )
    G, best, fa2 = q.shape[1] // k.shape[1], (float("inf"), None), float("inf")
    for layout in ("gqa", "expanded"):
        kv = [
            (x if layout == "gqa" else x.repeat_interleave(G, 1))
            .detach()
            .requires_grad_(do is not None)
            for x in (k, v)
        ]
        for name, backend in backends.items():

            def call():
                with (
                    sdpa_kernel([backend]) if backend else contextlib.nullcontext(),
                    torch.set_grad_enabled(do is not None),
                ):
                    o = F.scaled_dot_product_attention(
                        q, *kv, is_causal=True, enable_gqa=layout == "gqa"
                    )
                    if do is not None:
                        o.backward(do)

            try:
                t = timed(call, reps)
            except RuntimeError:  # not supported for this shape or layout
                continue
            best = min(best, (t, f"{name}, {layout}"), key=lambda x: x[0])
            fa2 = min(fa2, t) if name == "flash" else fa2
    return (*best, fa2)


def timed(fn, reps):
    """Median milliseconds of fn over reps calls after one warm-up, CUDA events around each."""
    fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def bench_decode(H_q=32, H_kv=2, d=128):
    """One decode step of one layer's attention at the paper defaults: the slot-pool kernel (offload)
    and, over a resident cache, the training kernel and the decode kernel (split over the selected
    blocks) read k blocks per row; dense SDPA reads the context."""
    need_gpu("decode")
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
            slot_block = torch.stack(
                [torch.randperm(ctx // cfg.B - 1, device="cuda")[: cfg.k] for _ in range(R)]
            )
            pos = torch.full((Bz,), ctx - 1, device="cuda")
            bias = torch.randn(Bz, H_kv, ctx, device="cuda")
            t_slot = do_bench(
                lambda: decode_kernels.slot_attention(q, pool, slot_block, bias, pos, cfg.B),
                warmup=20,
                rep=200,
                return_mode="median",
            )
            t_graph = graph_time(
                lambda: decode_kernels.slot_attention(q, pool, slot_block, bias, pos, cfg.B)
            )
            kk, vv = (
                torch.randn(Bz, H_kv, ctx, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)
            )
            nb = ctx // cfg.B
            mask = torch.zeros(Bz, H_kv, 1, nb, dtype=torch.bool, device="cuda")
            mask.scatter_(
                -1,
                torch.stack(
                    [torch.randperm(nb - 1, device="cuda")[: cfg.k - 1] for _ in range(R)]
                ).view(Bz, H_kv, 1, -1),
                True,
            )
            mask[..., -1] = True  # the query's own block
            qpos = pos[:, None]
            tiles = attention_kernels.Tiles.from_mask(mask, 1, cfg.k)
            # the training kernel
            t_res = do_bench(
                lambda: attention_kernels.SparseAttention.apply(
                    q, kk, vv, bias, tiles, qpos, cfg.B
                ),
                warmup=20,
                rep=200,
                return_mode="median",
            )
            t_res_dec = graph_time(
                lambda: decode_kernels.sparse_decode(
                    q, kk, vv, bias, mask, pos, B=cfg.B, k_sel=cfg.k
                )
            )
            t_sdpa = do_bench(
                lambda: F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True),
                warmup=20,
                rep=200,
                return_mode="median",
            )
            sel_bytes = R * (cfg.k + 1) * 2 * cfg.B * d * 2  # K and V of the selected blocks, bf16
            rows.append(
                dict(
                    batch=Bz,
                    context=ctx,
                    slot_us=round(t_slot * 1e3, 1),
                    slot_graph_us=round(t_graph * 1e3, 1),
                    slot_graph_GB_s=round(sel_bytes / t_graph / 1e6, 1),
                    slot_graph_of_hbm=round(sel_bytes / t_graph / 1e6 / hbm, 3),
                    resident_kernel_us=round(t_res * 1e3, 1),
                    resident_decode_graph_us=round(t_res_dec * 1e3, 1),
                    sdpa_full_us=round(t_sdpa * 1e3, 1),
                    hbm_GB_s=round(hbm, 1),
                )
            )
    return rows


def bench_sdpa(Bz=12, H_kv=2, G=16, S=131073, d=128):
    """One dense decode call (the G query heads of a KV head as G rows) under each SDPA backend:
    the SDPA baselines beside the split-key kernel of decode_kernels.dense_decode."""
    need_gpu("sdpa")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(Bz, H_kv, G, d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(Bz, H_kv, S, d, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, backends in (
        ("default", None),
        ("flash", [SDPBackend.FLASH_ATTENTION]),
        ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
        ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
        ("math", [SDPBackend.MATH]),
    ):

        def call():
            if backends is None:
                return F.scaled_dot_product_attention(q, kv, kv)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, kv, kv)

        try:
            t = do_bench(call, warmup=5, rep=50, return_mode="median")
            rows.append(
                dict(backend=name, ms=round(t, 3), gb_s=round(2 * kv.numel() * 2 / t / 1e6))
            )
        except RuntimeError as e:
            rows.append(dict(backend=name, error=str(e).splitlines()[0][:80]))
    return rows


no_flags = lambda p: None
COMMANDS = {
    "prefill": (bench_prefill, no_flags),
    "decode": (bench_decode, no_flags),
    "sdpa": (bench_sdpa, no_flags),
}
