"""The attention kernels at the paper's defaults: training / prefill forward + backward and the fused
scoring against dense SDPA; one decode step against HBM bandwidth; dense decode per SDPA backend."""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

import attention
import decode
import nosa
import pooling
from bench import graph_time, hbm_bandwidth
from nosa import Config


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


def bench_decode(H_q=32, H_kv=2, d=128):
    """One decode step of one layer's attention at the paper defaults: the slot-pool kernel (offload)
    and, over a resident cache, the training kernel and the decode kernel (split over the selected
    blocks) read k blocks per row; dense SDPA reads the context."""
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
            t_slot = do_bench(lambda: decode.slot_attention(q, pool, slot_block, bias, pos, cfg.B),
                              warmup=20, rep=200, return_mode="median")
            t_graph = graph_time(lambda: decode.slot_attention(q, pool, slot_block, bias, pos, cfg.B))
            kk, vv = (torch.randn(Bz, H_kv, ctx, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            nb = ctx // cfg.B
            mask = torch.zeros(Bz, H_kv, 1, nb, dtype=torch.bool, device="cuda")
            mask.scatter_(-1, torch.stack([torch.randperm(nb - 1, device="cuda")[:cfg.k - 1] for _ in range(R)]).view(
                Bz, H_kv, 1, -1), True)
            mask[..., -1] = True  # the query's own block
            qpos = pos[:, None]
            t_res = do_bench(lambda: attention.SparseAttention.apply(q, kk, vv, bias, mask, qpos, cfg.B),
                             warmup=20, rep=200, return_mode="median")  # the training kernel
            t_res_dec = graph_time(lambda: decode.sparse_decode_triton(q, kk, vv, bias, mask, pos, cfg.B, cfg.k))
            t_sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True),
                              warmup=20, rep=200, return_mode="median")
            sel_bytes = R * (cfg.k + 1) * 2 * cfg.B * d * 2  # K and V of the selected blocks, bf16
            rows.append(dict(batch=Bz, context=ctx, slot_us=round(t_slot * 1e3, 1),
                             slot_graph_us=round(t_graph * 1e3, 1), slot_graph_GB_s=round(sel_bytes / t_graph / 1e6, 1),
                             slot_graph_of_hbm=round(sel_bytes / t_graph / 1e6 / hbm, 3),
                             resident_kernel_us=round(t_res * 1e3, 1),
                             resident_decode_graph_us=round(t_res_dec * 1e3, 1), sdpa_full_us=round(t_sdpa * 1e3, 1),
                             hbm_GB_s=round(hbm, 1)))
    return rows


def bench_sdpa(Bz=12, H_kv=2, G=16, S=131073, d=128):
    """One dense decode call (the G query heads of a KV head as G rows) under each SDPA backend:
    the SDPA baselines beside the split-key kernel of decode.dense_decode."""
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
