"""Triton kernels against their torch twins (attention.py, pooling.py, eviction.py), forward and
all gradients, on fresh random inputs. On CPU they run in the Triton interpreter (fp32, small
shapes); on a GPU compiled, in fp32 and bf16. common.kernels(False) runs a twin on the GPU."""

import pytest
import torch

import attention
import attention_kernels
import common
import decode_kernels
import eviction
import eviction_kernels
import fast
import pooling
import pooling_kernels
from config import Config

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 dots run as TF32 on a GPU (about 3e-4 relative error), exactly in the interpreter
FP32_TOL = 2e-3 if DEV == "cuda" else 2e-4


def random_block_mask(Bz, H_kv, T, B, k, q_pos):
    """At most k causal blocks per query, always its own block: any valid selection."""
    nb = (T + B - 1) // B if q_pos is None else int(q_pos.max()) // B + 1
    score = torch.rand(Bz, H_kv, T, nb, device=q_pos.device)
    b = torch.arange(nb, device=q_pos.device)
    q_blk = (q_pos // B)[:, None, :, None]
    score = torch.where(b == q_blk, 2.0, score).masked_fill(b > q_blk, -1.0)
    top = score.topk(min(k, nb), -1).indices
    mask = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True)
    return mask & (b <= q_blk) & (torch.rand_like(score) < 0.8) | (b == q_blk)


def tiles(mask, BT, k):
    """The training kernels' form of a block mask (attention_kernels.Tiles)."""
    return attention_kernels.Tiles.from_mask(mask, BT, min(mask.shape[-1], BT * k))


TINY = Config.from_preset("tiny")  # B = 16: what the decode twins read of a config


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


CASES = [  # (G, d, T, B, k, BT): T not a multiple of B nor of the tile BT; T < k*B (all blocks fit) and T > k*B
    (1, 64, 37, 16, 4, 16),
    (2, 128, 70, 16, 2, 32),
    (4, 64, 100, 16, 3, 8),
    (16, 64, 45, 16, 8, 8),
    (
        3,
        32,
        50,
        16,
        3,
        8,
    ),  # G not a power of two: the tiles' padded heads read the next group's rows
    (
        12,
        32,
        50,
        16,
        3,
        4,
    ),  # and with the rows of lse, rowsum(dO ∘ O) and positions read by TMA (G = 4n)
]


@pytest.mark.parametrize("G, d, T, B, k, BT", CASES)
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else []))
def test_sparse_attention_kernel_matches_twin(G, d, T, B, k, BT, dtype):
    Bz, H_kv = 2, 2
    tol = 2e-2 if dtype == torch.bfloat16 else FP32_TOL
    # q in the projections' layout, as the model makes it: a view (Bz, H_q, T, d) the kernel reads as is
    if G >= 4:
        q = (
            torch.randn(Bz, T, H_kv * G, d, device=DEV, dtype=dtype)
            .transpose(1, 2)
            .requires_grad_()
        )
    else:
        q = torch.randn(Bz, H_kv * G, T, d, device=DEV, dtype=dtype, requires_grad=True)
    if G >= 4:  # and K, V too: the kernels read them through TMA descriptors of any aligned layout
        kk, v = (
            torch.randn(Bz, T, H_kv, d, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_()
            for _ in "kv"
        )
    else:
        kk, v = (
            torch.randn(Bz, H_kv, T, d, device=DEV, dtype=dtype, requires_grad=True) for _ in "kv"
        )
    c = torch.randn(Bz, H_kv, T, device=DEV, requires_grad=True)
    q_pos = torch.arange(T, device=DEV).expand(Bz, T)
    mask = random_block_mask(Bz, H_kv, T, B, k, q_pos)
    sel = tiles(mask, BT, k)
    assert torch.equal(sel.mask(mask.shape[-1]), mask)
    do = torch.randn(Bz, H_kv * G, T, d, device=DEV, dtype=dtype)
    outs = []
    for fn in (attention.sparse_attention, None):
        for t in (q, kk, v, c):
            t.grad = None
        if fn is None:
            o = attention_kernels.SparseAttention.apply(q, kk, v, c, sel, q_pos, B)
        else:
            o = fn(q, kk, v, c, mask, q_pos, B=B)
        o.backward(do)
        outs.append([o.detach(), q.grad, kk.grad, v.grad, c.grad])
    for name, got, want in zip(["o", "dq", "dk", "dv", "dc"], outs[1], outs[0]):
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


@pytest.mark.slow
def test_sparse_attention_backward_in_chunks_of_tiles(monkeypatch):
    """dK, dV and dc of a block from several programs (its tiles in ranges of 3 and those in chunks of
    2, added atomically)."""
    monkeypatch.setattr(attention_kernels, "DKV_CHUNK", 2)
    monkeypatch.setattr(attention_kernels, "DKV_RANGE", 3)
    test_sparse_attention_kernel_matches_twin(*CASES[2], torch.float32)


@pytest.mark.slow
def test_parallel_selection_in_chunks_of_queries(monkeypatch):
    """The kernel path of the parallel forward scores and selects nosa_kernels.select_rows(nb)
    queries at a time (nosa.select_tiles): in chunks of 32 of 120 queries, the same tiles as all at
    once, and they hold the twin's block mask."""
    import nosa
    import nosa_kernels

    cfg = Config.from_preset("tiny", n_layer=1, n_win=1, k=6, k_q=2)
    Bz, T = 1, 120
    q = torch.randn(Bz, cfg.H_q, T, cfg.head_dim, device=DEV)
    k = torch.randn(Bz, cfg.H_kv, T, cfg.head_dim, device=DEV)
    c = torch.randn(Bz, cfg.H_kv, T, device=DEV)
    q_pos, nb = torch.arange(T, device=DEV).expand(Bz, T), cfg.n_blocks(T)
    K_sub, c_sub = pooling.compress_keys(k, cfg), pooling.pool_mean(c, cfg)
    with common.kernels(True):
        lists = eviction.e_lists_by_block(c_sub, 0, nb - 1, cfg)[0]
        whole = nosa.select_tiles(q, K_sub, lists, q_pos, nb, cfg, first=0)
        monkeypatch.setattr(nosa_kernels, "SELECT_ROWS", 32)
        monkeypatch.setattr(nosa_kernels, "SELECT_SCORES", 0)
        parts = nosa.select_tiles(q, K_sub, lists, q_pos, nb, cfg, first=0)
    for a, b in zip(whole[:3], parts[:3]):
        assert torch.equal(a, b)
    with common.kernels(False):
        Q = pooling.query_aware_scores(q, K_sub, q_pos, nb, cfg)
        mask = nosa.select_blocks(
            Q, None, q_pos[:, None], cfg, nosa.e_lists_of_queries(lists, q_pos, 0, cfg)
        )
    assert torch.equal(parts.mask(nb), mask) and not mask[:, :, -1].all()


def test_tma_descriptor_reads_aligned_views_in_place_and_copies_the_rest():
    buf = torch.randn(2, 3, 40, 16, device=DEV)
    view = buf[:, :, :33]  # a prefill's keys so far: a view of a longer buffer
    desc = common.tma_descriptor(view, (1, 1, 16, 16))
    assert desc.base.data_ptr() == buf.data_ptr() and list(desc.shape) == [2, 3, 33, 16]
    # rows 40 bytes apart: unaligned
    odd = torch.randn(2, 3, 33, 20, device=DEV, dtype=torch.bfloat16)[..., :16]
    desc = common.tma_descriptor(odd, (1, 1, 16, 16))
    assert desc.base.is_contiguous() and torch.equal(desc.base, odd)


def test_sparse_attention_kernel_ragged_decode_positions():
    """One query per sequence at its own position (decode against a resident cache), no bias: the
    training kernel, and the decode kernel split over the selected blocks (with a bias, too), which
    reads the first S positions of a longer buffer."""
    Bz, H_kv, G, d, B, k, S = 3, 2, 4, 64, 16, 3, 90
    q = torch.randn(Bz, H_kv * G, 1, d, device=DEV)
    kk, v = torch.randn(2, Bz, H_kv, S + 7, d, device=DEV)[..., :S, :]
    c = torch.randn(Bz, H_kv, S, device=DEV)
    q_pos = torch.tensor([[5], [47], [89]], device=DEV)
    mask = random_block_mask(Bz, H_kv, 1, B, k, q_pos)
    want = attention.sparse_attention(q, kk, v, None, mask, q_pos, B=B)
    got = attention_kernels.SparseAttention.apply(q, kk, v, None, tiles(mask, 1, k), q_pos, B)
    assert rel_err(got, want) < FP32_TOL
    for bias in (None, c):
        want = attention.sparse_attention(q, kk, v, bias, mask, q_pos, B=B)
        for n_split in (1, 2, 5):
            got = decode_kernels.sparse_decode(
                q, kk, v, bias, mask, q_pos[:, 0], B=B, k_sel=k, n_split=n_split
            )
            assert rel_err(got, want) < FP32_TOL, (bias is None, n_split)


@pytest.mark.parametrize("G, d", [(1, 64), (4, 128), (16, 64)])
def test_slot_decode_kernel_matches_twin(G, d):
    Bz, H_kv, B, k = 3, 2, 16, 5
    R = Bz * H_kv
    pos = torch.tensor([3, 100, 250], device=DEV)
    q = torch.randn(Bz, H_kv * G, 1, d, device=DEV)
    pool = torch.randn(R, k + 1, 2, B, d, device=DEV)
    slot_block = torch.full((R, k), -1, dtype=torch.long, device=DEV)
    for r in range(R):  # distinct blocks before the tail, some slots free
        q_blk = int(pos[r // H_kv]) // B
        n = min(q_blk, int(torch.randint(0, k + 1, ())))
        slots = torch.randperm(k)[:n]
        slot_block[r, slots] = torch.randperm(q_blk)[:n].to(DEV)
    bias = torch.randn(Bz, H_kv, 256, device=DEV)
    for b in (bias, None):
        with common.kernels(False):
            want = attention.slot_attention(q, pool, slot_block, b, pos, TINY)
        for n_split in (1, 2, 6):
            got = decode_kernels.slot_attention(q, pool, slot_block, b, pos, B, n_split=n_split)
            assert rel_err(got, want) < FP32_TOL, n_split


@pytest.mark.parametrize("G, d", [(1, 64), (16, 32)])
def test_dense_decode_kernel_matches_twin(G, d):
    """Full-attention decode over a static cache: each sequence at its own position, keys past it
    ignored (they hold noise here), any number of splits."""
    Bz, H_kv, S = 3, 2, 300
    q = torch.randn(Bz, H_kv * G, 1, d, device=DEV)
    # the first S of a longer buffer
    k, v = torch.randn(2, Bz, H_kv, S + 50, d, device=DEV)[..., :S, :]
    pos = torch.tensor([0, 130, S - 1], device=DEV)
    with common.kernels(False):
        want = attention.dense_decode(q, k, v, pos, TINY)
    for n_split in (1, 3, 7):
        got = decode_kernels.dense_decode(q, k, v, pos, n_split=n_split)
        assert rel_err(got, want) < FP32_TOL, n_split


def test_mask_to_indices():
    m = torch.tensor([[True, False, True, True], [False, False, False, True]])
    assert decode_kernels.mask_to_indices(m, 3).tolist() == [[0, 2, 3], [3, -1, -1]]


@pytest.mark.parametrize(
    "G, d, T, start, preset, over",
    [
        (1, 64, 50, 0, "tiny", {}),
        (4, 128, 83, 0, "tiny", {}),
        (16, 64, 40, 0, "tiny", {}),
        (2, 64, 300, 0, "paper", {}),
        (4, 32, 700, 0, "tiny", {}),
        (3, 32, 650, 0, "tiny", {}),
        (4, 32, 777, 301, "tiny", {}),
        (2, 32, 600, 0, "tiny", dict(l_c=12)),
        (2, 32, 600, 0, "tiny", dict(l_c=4)),
    ],
)
def test_query_aware_score_kernel_matches_twin(G, d, T, start, preset, over):
    """The prefill's scoring kernel against the twin: the queries of positions start .. T-1 (a chunk)
    over the compressed keys of all T; long enough that most tiles see whole runs of sub-blocks
    (read without masks) and the blocks span several of the kernel's steps (the overlap of a block's
    sub-blocks with the next block carried across them; p = 2 and p = 0 too), G not a power of two
    (padded heads: masks everywhere). A chunk's q and K̃ as a prefill passes them: views, read through
    their strides (q in the projections' layout, K̃ the first M sub-blocks of a longer buffer)."""
    cfg = Config.from_preset(preset, **over)
    Bz, H_kv = 2, 2
    q = torch.randn(Bz, H_kv * G, T - start, d, device=DEV)
    k = torch.randn(Bz, H_kv, T, d, device=DEV)
    K_sub = pooling.compress_keys(k, cfg)
    if start > 0 or G == 3:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        K_sub = torch.cat([K_sub, torch.randn_like(K_sub[:, :, :7])], 2)[:, :, : K_sub.shape[2]]
    q_pos = torch.arange(start, T, device=DEV).expand(Bz, T - start)
    nb = cfg.n_blocks(T)
    with common.kernels(False):
        want = pooling.query_aware_scores(q, K_sub, q_pos, nb, cfg)
    got = pooling_kernels.query_aware_scores(q, K_sub, q_pos, nb, cfg)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert rel_err(got[finite], want[finite]) < FP32_TOL


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's exp2, as intended
def test_query_aware_score_kernel_far_above_the_first_tile():
    """The scoring kernel's first pass takes each row's exponentials against its largest product in
    the first tile: a later compressed key aligned with some queries, whose products exceed that by
    far more than a float's range (2^128 in base 2), makes their sums overflow, and the tile must
    take the online softmax's statistics instead. Against the twin, which never overflows."""
    cfg = Config.from_preset("tiny")
    Bz, H_kv, G, d, T = 1, 2, 4, 32, 1500
    q = torch.randn(Bz, H_kv * G, 64, d, device=DEV)
    # 92 sub-blocks: two tiles
    K_sub = pooling.compress_keys(torch.randn(Bz, H_kv, T, d, device=DEV), cfg)
    # the first query's heads: products of several hundred
    K_sub[:, :, 80] = q[:, :G, 0].mean(1)[:, None] * 80
    q_pos = torch.arange(T - 64, T, device=DEV).expand(Bz, 64)
    nb = cfg.n_blocks(T)
    want = pooling.query_aware_scores(q.double(), K_sub.double(), q_pos, nb, cfg)
    got = pooling_kernels.query_aware_scores(q, K_sub, q_pos, nb, cfg)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert rel_err(got[finite], want[finite]) < FP32_TOL


@pytest.mark.parametrize(
    "G, d, preset, M_len, over",
    [
        (1, 64, "tiny", 700, {}),
        (16, 32, "tiny", 333, {}),
        (4, 64, "paper", 3000, {}),
        (2, 32, "tiny", 500, dict(l_c=12)),
        (2, 32, "tiny", 500, dict(l_c=4)),
    ],
)
def test_decode_score_kernel_matches_twin(G, d, preset, M_len, over):
    """One query per sequence (decode), ragged positions: the key-parallel kernels against the twin,
    over more blocks than the positions reach (static shapes), with chunks of compressed keys that
    do not divide their number, and sub-blocks that reach 0, 1 or 2 strides into the next block."""
    cfg = Config.from_preset(preset, **over)
    Bz, H_kv = 3, 2
    q = torch.randn(Bz, H_kv * G, 1, d, device=DEV)
    K_sub = pooling.compress_keys(torch.randn(Bz, H_kv, M_len, d, device=DEV), cfg)
    # the first sees no sub-block yet
    q_pos = torch.tensor([[5], [M_len // 2], [M_len - 1]], device=DEV)
    nb = cfg.n_blocks(M_len) + 2
    with common.kernels(False):
        want = pooling.query_aware_scores(q, K_sub, q_pos, nb, cfg)
    got = pooling_kernels.query_aware_scores_decode(q, K_sub, q_pos, nb, cfg, CM=32, NBT=16)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert rel_err(got[finite], want[finite]) < FP32_TOL


@pytest.mark.parametrize("attn", ["nosa", "infllmv2", "nosa-hh"])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else []))
def test_append_kernel_matches_twin(attn, dtype):
    """A decode step's cache update (pooling.append_subblocks, eviction.e_list_join_leaver), kernels
    against twins, step after step from the same state: the ring, K̃ and c̃ as sub-blocks complete,
    and the eviction list as blocks leave the window (E from c̃, or from h in nosa-hh), with scores on a
    coarse grid so that a newcomer often ties with members."""
    cfg = Config.from_preset("tiny", attn=attn, max_seq_len=512)
    Bz, H, d = 3, cfg.H_kv, cfg.head_dim
    grid = lambda *shape: torch.randint(-2, 3, shape, device=DEV).float()  # ties in c̃ and E
    import nosa

    caches = [nosa.PooledState(cfg, Bz, DEV, dtype, 512) for _ in range(2)]
    start = dict(
        ring_k=torch.randn(Bz, H, cfg.l_c, d, device=DEV),
        K_sub=torch.randn(Bz, H, 32, d, device=DEV),
        ring_c=grid(Bz, H, cfg.l_c),
        c_sub=grid(Bz, H, 32),
    )
    if cfg.heavy_hitters:  # E from h: one score a block (32 blocks of 16)
        start["h"] = grid(Bz, H, 32)
    for s in caches:
        for name, x in start.items():
            getattr(s, name)[0][:, :, : x.shape[2]] = x
    if cfg.eviction_head:
        ids, E = eviction.e_list(
            grid(Bz, H, 6),
            torch.ones(Bz, H, 6, dtype=torch.bool, device=DEV),
            caches[0].e_list_ids[0].shape[-1],
        )
        for s in caches:
            s.e_list_ids[0].copy_(ids)
            s.e_list_E[0].copy_(E)
    # sub-blocks and blocks complete at different steps per row
    pos = torch.tensor([97, 150, 255], device=DEV)
    n_joins = 0
    for step in range(70):
        k = torch.randn(Bz, H, d, device=DEV, dtype=dtype)
        c = grid(Bz, H) if cfg.eviction_head else None
        before = caches[0].e_list_ids[0].clone() if cfg.eviction_head else None
        for s, twin in zip(caches, (True, False)):
            with common.kernels(not twin):
                append = pooling.append_subblocks if twin else pooling_kernels.append_subblocks
                append(s.ring_k[0], s.ring_c[0], s.K_sub[0], s.c_sub[0], k, c, pos=pos, cfg=cfg)
                if cfg.eviction_head:
                    join = (
                        eviction.e_list_join_leaver if twin else eviction_kernels.e_list_join_leaver
                    )
                    scores = s.h[0] if cfg.heavy_hitters else s.c_sub[0]
                    join(s.e_list_ids[0], s.e_list_E[0], scores, pos, cfg)
        for name in ("ring_k", "K_sub") + (
            ("ring_c", "c_sub", "e_list_ids", "e_list_E") if cfg.eviction_head else ()
        ):
            want, got = getattr(caches[0], name)[0], getattr(caches[1], name)[0]
            assert torch.allclose(
                got.double(),
                want.double(),
                rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                atol=1e-6,
            ), (step, name)
        n_joins += int(cfg.eviction_head and not torch.equal(before, caches[0].e_list_ids[0]))
        pos += 1
    assert not cfg.eviction_head or n_joins >= 3  # the list did change, more than once


@pytest.mark.slow
@pytest.mark.parametrize("H_q, H_kv", [(4, 2), (3, 1)])  # G = 3: SmolLM2's groups (9 / 3)
def test_model_through_the_kernels(H_q, H_kv):
    """The whole system on the kernel path (compiled on a GPU, interpreted on CPU): the parallel
    forward matches the twins, and decoding through the scoring, selection, cache update and decode
    kernels (offloaded: the slot pool; resident) matches the parallel forward through the training kernels."""
    from kvcache import KVCache
    from offload import OffloadCache
    from tests.conftest import decode_logits, make_model, small

    # k·B = 64 tokens
    kw = dict(small, n_layer=1, H_q=H_q, H_kv=H_kv, B=16, l_c=8, s_c=4, n_win=1, k=4, k_q=1)
    model = make_model("nosa", torch.float32, **kw).to(DEV)
    idx = torch.randint(0, 97, (2, 150), device=DEV)
    with torch.no_grad():
        with common.kernels(False):
            ref = model(idx)  # the twins
        with common.kernels(True):
            par = model(idx)
            assert rel_err(par, ref) < FP32_TOL
            prompt_lens = [20, 70]
            offloaded = OffloadCache(model.cfg, 2, DEV, torch.float32, max_len=150)
            for cache in (offloaded, KVCache(model.cfg, 2, DEV, torch.float32)):
                for i, (P, got) in enumerate(
                    zip(prompt_lens, decode_logits(model, idx, prompt_lens, cache))
                ):
                    assert rel_err(got, par[i, P - 1 : P - 1 + got.shape[0]]) < FP32_TOL


# ragged (a mask) and equal (flash, no mask)
@pytest.mark.parametrize("prompt_lens", [[20, 70], [45, 45]])
def test_full_attention_decode_bf16(prompt_lens):
    from tests.conftest import decode_logits, make_model

    # SDPA
    model = make_model(
        "full", torch.bfloat16, n_layer=2, dim=128, H_q=8, H_kv=2, head_dim=64, B=16
    ).to(DEV)
    idx = torch.randint(0, 97, (2, 150), device=DEV)
    with torch.no_grad():
        par = model(idx)
    for i, (P, got) in enumerate(zip(prompt_lens, decode_logits(model, idx, prompt_lens))):
        assert rel_err(got, par[i, P - 1 : P - 1 + got.shape[0]]) < 2e-2


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["nosa", "infllmv2", "dma", "full", "nosa-hh"])
def test_chunked_prefill_through_the_kernels(attn):
    """A prefill in chunks of 48 (not a multiple of B = 16) through the kernels (compiled on a GPU in
    bf16, with the residual stream in pinned host memory and without; interpreted on CPU in fp32):
    the last position's logits are the parallel forward's, also compiled (fast.compile_model), and the
    cache it leaves decodes alike."""
    from kvcache import KVCache
    from prefill import prefill
    from tests.conftest import make_model, small

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    # k·B = 64 tokens
    kw = dict(small, B=16, l_c=8, s_c=4, n_win=1, k=4)
    model = make_model(attn, dtype, **kw).to(DEV)
    idx = torch.randint(0, 97, (1, 200), device=DEV)
    tol = 2e-2 if dtype == torch.bfloat16 else FP32_TOL
    with torch.no_grad(), common.kernels(True):
        ref = model(idx)[0, -1]
        for on_host in (False, True):
            cache = KVCache(model.cfg, 1, DEV, dtype)
            got = prefill(model, idx, cache, 0, 48, stream_on_host=on_host)
            assert rel_err(got, ref) < tol, (on_host, rel_err(got, ref))
            whole = KVCache(model.cfg, 1, DEV, dtype)
            prefill(model, idx, whole, 0)
            assert rel_err(cache.k[1][0, :, :200], whole.k[1][0, :, :200]) < tol
        if DEV == "cuda":  # the prefill's small operations compiled (fast.compile_model)
            fast.compile_model(model, prefill=True)
            got = prefill(model, idx, KVCache(model.cfg, 1, DEV, dtype), 0, 48)
            assert rel_err(got, ref) < tol, rel_err(got, ref)
