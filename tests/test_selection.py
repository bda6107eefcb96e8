"""Dual selection and the locality theorem (docs/METHOD.md §3, §5), under adversarial scores."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import eviction
import eviction_kernels
import nosa
import nosa_kernels
from config import Config
from kvcache import write_now

paper = Config.from_preset("paper")


def core_mask(E, q_pos, cfg):
    """The query-agnostic core at each position (..., T, nb): the top n_core candidates by E.
    Γ(t) contains it (plus F(t)) whenever more than k blocks are causal."""
    nb = E.shape[-1]
    b = torch.arange(nb, device=E.device)
    q_blk = (q_pos // cfg.B)[..., None]
    cand = (b >= cfg.n_sink) & (b < q_blk - cfg.n_win)
    return eviction.core_blocks(E.unsqueeze(-2).expand(*cand.shape), cand, cfg.n_core)


def evict(core, E, b_new, n_core):
    """The eviction policy at one block boundary: block b_new has just left the window and competes
    with the current core (bool mask over blocks, (nb,)). The best n_core of them stay; the block
    that drops out (if any) is evicted for good."""
    members = core.clone()
    members[b_new] = True
    return members & (eviction.rank_desc(E, members) < n_core)


@st.composite
def configs(draw):
    """Random NOSA configs, only valid ones (invalid draws are rejected, not replaced)."""
    s_c = draw(st.sampled_from([1, 2, 4]))
    B = s_c * draw(st.integers(1, 4))
    l_c = s_c * draw(st.integers(1, 3))
    n_sink = draw(st.integers(0, 2))
    n_win = draw(st.integers(1, 3))
    k_q = draw(st.integers(1, 5))
    k = n_sink + n_win + k_q + draw(st.integers(0, 5))
    try:
        return Config.from_preset(
            "tiny", B=B, l_c=l_c, s_c=s_c, n_sink=n_sink, n_win=n_win, k=k, k_q=k_q
        )
    except ValueError:
        assume(False)


def decode_selections(cfg, E, n_steps, strategy, seed):
    """Run the selection one decode step at a time for R rows with query-aware scores chosen by
    `strategy`: 'adversarial' favours blocks *not* selected the step before, 'evicted' favours blocks
    that left the core, 'random' is noise. E (R, nb) is fixed per block, as the eviction head makes
    it. Returns (t, Γ(t) (R, nb), core (R, nb)) per step, from just before sparsity sets in."""
    g = torch.Generator().manual_seed(seed)
    R, nb = E.shape
    t0 = max(0, (cfg.k - 2) * cfg.B)
    prev, evicted, out = (
        torch.zeros(R, nb, dtype=torch.bool),
        torch.zeros(R, nb, dtype=torch.bool),
        [],
    )
    prev_core = None
    for t in range(t0, min(t0 + n_steps, nb * cfg.B)):
        noise = torch.rand(R, nb, generator=g, dtype=torch.float64)
        Q = {"adversarial": (~prev).double(), "evicted": evicted.double(), "random": 0.0}[
            strategy
        ] + 0.1 * noise
        pos = torch.full((R, 1), t)
        sel = nosa.select_blocks(Q[:, None], E, pos, cfg)[:, 0]
        core = core_mask(E, pos, cfg)[:, 0]
        if prev_core is not None:
            evicted |= prev_core & ~core
        out.append((t, sel, core))
        prev, prev_core = sel, core
    return out


def check_locality(cfg, E, steps):
    """Per step and per row: the structure of Γ(t), the theorem γ(t) >= k_e / k exactly as stated
    (at every step whose predecessor selected k blocks), at most k_q - 1 blocks to fetch besides
    the query's own, and the eviction policy."""
    b = torch.arange(E.shape[1])
    boundaries = 0
    for (pt, psel, pcore), (t, sel, core) in zip(steps, steps[1:]):
        q_blk = t // cfg.B
        n_causal = q_blk + 1
        boundaries += pt // cfg.B != q_blk
        forced = (b <= q_blk) & ((b < cfg.n_sink) | (b >= q_blk - cfg.n_win))
        for r in range(E.shape[0]):
            assert not sel[r, b > q_blk].any(), "a block from the future was selected"
            assert int(sel[r].sum()) == min(cfg.k, n_causal), "not min(k, causal) blocks"
            assert sel[r, forced].all(), "a sink or window block is missing"
            if n_causal > cfg.k:
                assert sel[r, core[r]].all(), "the query-agnostic core is not selected"
                assert int(core[r].sum()) == cfg.n_core
            if int(psel[r].sum()) == cfg.k:  # the theorem, literally: γ(t) >= k_e / k
                gamma = int((sel[r] & psel[r]).sum()) / int(sel[r].sum())
                assert gamma >= cfg.k_e / cfg.k, (t, r, gamma)
            misses = sel[r] & ~psel[r] & (b != q_blk)  # what crosses PCIe at this step
            assert int(misses.sum()) <= cfg.k_q - 1, (t, r)
            if n_causal > cfg.k + 1:
                # the eviction policy, applied incrementally, gives the same core
                if pt // cfg.B != q_blk:
                    assert torch.equal(
                        evict(pcore[r], E[r], q_blk - cfg.n_win - 1, cfg.n_core), core[r]
                    )
                else:
                    assert torch.equal(pcore[r], core[r])
    ever = torch.zeros_like(E, dtype=torch.bool)
    for (_, _, pcore), (_, _, core) in zip(steps, steps[1:]):  # an evicted block never comes back
        assert not (core & ever).any(), "an evicted block came back into the core"
        ever |= pcore & ~core
    return boundaries


@settings(max_examples=60, deadline=None)
@given(
    cfg=configs(), data=st.data(), strategy=st.sampled_from(["adversarial", "evicted", "random"])
)
def test_locality_random_configs(cfg, data, strategy):
    R, nb = 3, cfg.k + 8
    # few distinct values: many ties, which the order (score, then later block) must break consistently
    E = torch.tensor(
        data.draw(st.lists(st.integers(0, 3), min_size=R * nb, max_size=R * nb)),
        dtype=torch.float64,
    ).view(R, nb)
    check_locality(
        cfg, E, decode_selections(cfg, E, 9 * cfg.B, strategy, data.draw(st.integers(0, 2**16)))
    )


@settings(max_examples=6, deadline=None)
@given(data=st.data(), strategy=st.sampled_from(["adversarial", "evicted", "random"]))
def test_locality_paper_preset(data, strategy):
    """The paper's defaults, 4 rows over 12 block boundaries (768 steps) each, E drawn per row."""
    R, nb = 4, paper.k + 12
    E = torch.tensor(
        data.draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=R * nb, max_size=R * nb)),
        dtype=torch.float64,
    ).view(R, nb)
    steps = decode_selections(
        paper, E, 12 * paper.B + 2, strategy, data.draw(st.integers(0, 2**16))
    )
    assert check_locality(paper, E, steps) == 12


def test_few_blocks_selects_all_and_modes():
    cfg = Config.from_preset("tiny")
    Q, E = torch.rand(1, 40), torch.rand(40)
    for t in (0, 17, cfg.k * cfg.B - 1):
        assert torch.equal(
            nosa.select_blocks(Q, E, torch.tensor([t]), cfg)[0], torch.arange(40) <= t // cfg.B
        )
    t = torch.tensor([39 * cfg.B])
    cand = (torch.arange(40) >= cfg.n_sink) & (torch.arange(40) < 39 - cfg.n_win)
    # infllmv2 fills the budget by Q alone, dma by E alone
    for attn, score in (("infllmv2", Q[0]), ("dma", E)):
        sel = nosa.select_blocks(Q, E, t, Config.from_preset("tiny", attn=attn))[0]
        want = eviction.core_blocks(score, cand, cfg.k - cfg.n_forced)
        assert torch.equal(sel & cand, want)
    # nosa: k_q best by Q, then the best of the rest by E
    sel = nosa.select_blocks(Q, E, t, cfg)[0]
    # the own block is the k_q-th query-aware block
    pick_q = eviction.core_blocks(Q[0], cand, cfg.k_q - 1)
    assert torch.equal(
        sel & cand,
        pick_q | eviction.core_blocks(E, cand & ~pick_q, cfg.k_e - cfg.n_sink - cfg.n_win),
    )


def test_rank_ties_prefer_recent():
    r = eviction.rank_desc(
        torch.tensor([1.0, 2.0, 1.0, 2.0]), torch.tensor([True, True, True, False])
    )
    assert r.tolist() == [2, 0, 1, 4]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), nb=st.integers(1, 40), n=st.integers(0, 44))
def test_top_k_without_sort_equals_rank(data, nb, n):
    """eviction.top_desc (top-k and a tie count: decode's query-aware picks) == rank_desc < n, with
    many ties and -inf scores."""
    score = torch.tensor(
        data.draw(
            st.lists(
                st.sampled_from([-2.0, 0.0, 1.0, 3.0, float("-inf")]), min_size=nb, max_size=nb
            )
        )
    )
    valid = torch.tensor(data.draw(st.lists(st.booleans(), min_size=nb, max_size=nb)))
    assert torch.equal(
        eviction.top_desc(score, valid, n), valid & (eviction.rank_desc(score, valid) < n)
    )


@pytest.mark.parametrize("tied", [False, True])
def test_parallel_selection_equals_decode_selection(tied):
    """The selection of token t in the parallel forward equals that at step t of decoding, which
    scores from the incrementally pooled caches, both from c̃ and from each row's list of its best
    candidates by E that the eviction policy keeps (ragged batch, fp64 so no rounding ties in Q;
    tied: eviction scores of three values, so E ties everywhere and the order among equals counts)."""
    cfg = Config.from_preset("tiny", n_layer=1, B=8, l_c=8, s_c=2, n_win=1, k=6, k_q=2)
    Bz, T = 2, 300
    q = torch.randn(Bz, cfg.H_q, T, cfg.head_dim, dtype=torch.float64)
    k = torch.randn(Bz, cfg.H_kv, T, cfg.head_dim, dtype=torch.float64)
    v = torch.randn_like(k)
    c = (
        torch.randint(0, 3, (Bz, cfg.H_kv, T)).double()
        if tied
        else torch.randn(Bz, cfg.H_kv, T, dtype=torch.float64)
    )
    par = nosa.nosa_attention(q, k, v, c, cfg)[1]  # (Bz, H_kv, T, nb)
    assert not par[:, :, -1].all(), "test too short: sparsity never kicks in"
    sub = nosa.PooledState(cfg, Bz, "cpu", torch.float64)
    starts = [5, 40]
    for i, s in enumerate(starts):
        pooled = nosa.pooled_prompt(k[i, :, :s], c[i, :, :s], cfg)
        sub.prefill(0, i, k[i, :, :s], c[i, :, :s], pooled, write_now)
    for step in range(T - max(starts)):
        pos = torch.tensor([s + step for s in starts])
        rows = torch.arange(Bz)
        sub.update(0, k[rows, :, pos], c[rows, :, pos], pos, T=int(pos.max()) + 1)
        nb = cfg.n_blocks(int(pos.max()) + 1)
        q_t = q[rows, :, pos][:, :, None]
        # from c̃, the lists from block 0 on
        lists = nosa.e_lists(sub.c_sub[0], pos[:, None], cfg)
        dec = nosa.select(q_t, sub.K_sub[0], lists, pos[:, None], nb, cfg)[:, :, 0]
        dec_list = nosa.select(q_t, sub.K_sub[0], sub.e_list_ids[0], pos[:, None], nb, cfg)[:, :, 0]
        for i in range(Bz):
            p = int(pos[i])
            nbi = cfg.n_blocks(p + 1)
            assert torch.equal(dec[i, :, :nbi], par[i, :, p, :nbi]), (i, p)
            assert torch.equal(dec_list[i, :, :nbi], par[i, :, p, :nbi]), (i, p)
            assert not dec[i, :, nbi:].any() and not dec_list[i, :, nbi:].any()


@pytest.mark.parametrize(
    "bad, msg",
    [
        (dict(H_q=6, H_kv=4), "multiple of H_kv"),
        (dict(B=10), "multiple of s_c"),
        (dict(s_c=16), "s_c <= l_c"),
        (dict(k_q=17), "k_q <= k"),
        (dict(k=8), "sink and window blocks"),
        (dict(k_q=0), "own block"),
        (dict(n_win=0), "window"),
        (dict(attn="dense"), "choose one of"),
    ],
)
def test_bad_configs_raise(bad, msg):
    with pytest.raises(ValueError, match=msg):
        Config.from_preset("tiny", **bad)


def test_e_list_kept_by_the_policy_equals_the_list_from_scratch():
    """Decoding keeps each row's best n candidates by E by letting every block that leaves the window
    compete with the list (eviction.e_list_join); that is the list made from scratch, in the same
    order (best first, ties to the more recent block), whatever the scores: here with many ties."""
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        nb, n, start = 40, 1 + trial % 8, trial % 5
        E = torch.randint(0, 4, (3, nb), generator=g).double()  # 3 rows
        b = torch.arange(nb)
        ids, E_ids = eviction.e_list(E, (b < start).expand(3, nb), n)
        for j in range(start, nb):
            b_new = torch.full((3,), j)
            ids, E_ids = eviction.e_list_join(ids, E_ids, b_new, E[:, j])
            want_ids, want_E = eviction.e_list(E, (b <= j).expand(3, nb), n)
            assert torch.equal(ids, want_ids) and torch.equal(E_ids, want_E), (trial, j)
        # no block leaves
        ids2, _ = eviction.e_list_join(ids, E_ids, torch.full((3,), -1), torch.zeros(3))
        assert torch.equal(ids2, ids)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(cfg=configs(), data=st.data(), attn=st.sampled_from(["nosa", "dma", "nosa-hh"]))
def test_e_lists_by_block_kept_chunk_by_chunk_equal_the_lists_from_scratch(cfg, data, attn):
    """Each query block's list of its best candidates by E, kept by the eviction policy as a chunked
    prefill keeps it (eviction.e_lists_by_block, carried from chunk to chunk; its Triton kernel,
    interpreted on CPU, and its torch loop) == the list from scratch (eviction.e_list) for every
    query block: random configs and chunk boundaries (mid-block too), E with ties and -inf."""
    from dataclasses import replace

    cfg = replace(cfg, attn=attn)
    assume(cfg.n_core > 0)  # (without a core there are no lists)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    S = data.draw(st.integers(1, 40 * cfg.B))
    nb, n = cfg.n_blocks(S), cfg.n_core + cfg.k_q_free
    c_sub = torch.randint(0, 4, (2, 2, cfg.n_subblocks(S)), generator=g).float()
    c_sub[c_sub == 3] = float("-inf")
    E = eviction.eviction_block_scores(c_sub, nb, cfg)
    if cfg.heavy_hitters:  # E is h itself, one score a block
        c_sub = E = torch.randint(0, 4, (2, 2, nb), generator=g).float()
    ends = sorted(set(data.draw(st.lists(st.integers(1, S), max_size=4)) + [S]))  # the chunks' ends
    e_list_carry = e_list_carry_gpu = None
    start = 0
    for e in ends:
        first, last = start // cfg.B, (e - 1) // cfg.B
        lists, e_list_carry = eviction.e_lists_by_block(c_sub, first, last, cfg, e_list_carry)
        got, e_list_carry_gpu = eviction_kernels.e_lists_by_block(
            c_sub.to(dev),
            first,
            last,
            cfg,
            e_list_carry_gpu
            or tuple(x.to(dev) for x in eviction.e_lists_by_block(c_sub, 0, 0, cfg)[1][:2]) + (0,),
        )
        assert (
            torch.equal(got.cpu(), lists)
            and torch.equal(e_list_carry_gpu[0].cpu(), e_list_carry[0])
            and e_list_carry_gpu[2] == last
        )
        b = torch.arange(nb)
        for qb in range(first, last + 1):
            want = eviction.e_list(E, ((b >= cfg.n_sink) & (b < qb - cfg.n_win)).expand_as(E), n)[0]
            assert torch.equal(lists[:, :, qb - first], want), (qb, first, last)
        start = e


@settings(max_examples=60, deadline=None)
@given(cfg=configs(), data=st.data(), attn=st.sampled_from(["nosa", "dma", "nosa-hh"]))
def test_selection_from_e_lists_by_block_equals_the_definition(cfg, data, attn):
    """The parallel forward selects from each query block's list of its best candidates by E
    (nosa.e_lists, the list decoding keeps), not by ranking every block for every query: the same
    blocks as select_blocks from E itself, for random configs, ragged positions and many ties."""
    from dataclasses import replace

    cfg = replace(cfg, attn=attn)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    Bz, H, nb = 2, 2, data.draw(st.integers(1, 40))
    T = data.draw(st.integers(1, 3 * cfg.B))
    start = (
        torch.randint(0, nb * cfg.B - T + 1, (Bz, 1), generator=g)
        if nb * cfg.B > T
        else torch.zeros(Bz, 1)
    )
    q_pos = (start + torch.arange(T)).long()  # (Bz, T)
    c_sub = torch.randint(0, 4, (Bz, H, cfg.n_subblocks(nb * cfg.B)), generator=g).double()
    E = eviction.eviction_block_scores(c_sub, nb, cfg)  # ties everywhere
    if cfg.heavy_hitters:
        c_sub = E = torch.randint(0, 4, (Bz, H, nb), generator=g).double()
    Q = torch.randint(0, 4, (Bz, H, T, nb), generator=g).double()
    want = nosa.select_blocks(Q, E, q_pos[:, None], cfg)
    got = nosa.select_blocks(Q, None, q_pos[:, None], cfg, nosa.e_lists(c_sub, q_pos, cfg))
    assert torch.equal(got, want)


def test_e_lists_by_block_before_the_first_whole_subblock():
    """Queries before the first whole sub-block (l_c > B here): no block has an E yet, and the lists
    give the definition's blocks (a case hypothesis found: E of a block over no sub-blocks)."""
    cfg = Config.from_preset("tiny", B=2, l_c=4, s_c=2, n_sink=0, n_win=1, k=2, k_q=1)
    c_sub = torch.zeros(2, 2, 0, dtype=torch.float64)
    assert torch.equal(
        eviction.block_score(c_sub, torch.zeros(2, 2, dtype=torch.long), cfg),
        torch.full((2, 2), float("-inf"), dtype=torch.float64),
    )
    q_pos = torch.arange(5).expand(2, 5)
    Q = torch.randn(2, 2, 5, 1, dtype=torch.float64)
    want = nosa.select_blocks(Q, eviction.eviction_block_scores(c_sub, 1, cfg), q_pos[:, None], cfg)
    assert torch.equal(
        nosa.select_blocks(Q, None, q_pos[:, None], cfg, nosa.e_lists(c_sub, q_pos, cfg)), want
    )


@pytest.mark.parametrize("inf_in", ["Q", "E", "both"])
def test_minus_inf_scores_still_fill_the_budget(inf_in):
    """The rule for scores of -inf: a candidate of score -inf is still a candidate, and fills the
    budget by recency; blocks that are no candidates never do. So Γ(t) has min(k, causal) blocks, and
    the definition, the per-query-block lists, the decode step's torch code and its kernel agree
    (tiny preset, position 403: 26 causal blocks, 20 candidates)."""
    cfg = Config.from_preset("tiny")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    nb, t = 30, 403
    g = torch.Generator().manual_seed(0)
    Q, c_sub = (
        torch.rand(1, 2, 1, nb, generator=g),
        torch.rand(1, 2, nb * cfg.B // cfg.s_c, generator=g),
    )
    if inf_in in ("Q", "both"):
        Q[..., 1:21] = float("-inf")
    if inf_in in ("E", "both"):  # the sub-blocks that overlap blocks 1 .. 20, and no others wholly
        c_sub[..., 3:84] = float("-inf")
    E = eviction.eviction_block_scores(c_sub, nb, cfg)
    assert (
        E[..., 1:21].isinf().all() == (inf_in != "Q")
        and E[..., 21:].isfinite().all()
        and E[..., 0].isfinite().all()
    )
    pos = torch.tensor([[t]])
    want = nosa.select_blocks(Q, E, pos[:, None], cfg)
    assert (want.sum(-1) == cfg.k).all() and not want[..., t // cfg.B + 1 :].any()
    lists = nosa.e_lists(c_sub, pos, cfg)
    assert torch.equal(nosa.select_blocks(Q, None, pos[:, None], cfg, lists), want)
    row_list = lists[:, :, 0]  # what decoding keeps, one list per row
    assert torch.equal(nosa.select_step(Q, row_list, pos, cfg), want)  # the twin, on the CPU
    got = nosa_kernels.select_step(Q.to(dev), row_list.to(dev), pos.to(dev), cfg)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("offloaded, hh_recency", [(False, 0.0), (True, 0.0), (True, 0.7)])
def test_heavy_hitters_are_final_when_a_block_leaves_the_window(offloaded, hh_recency):
    """nosa-hh scores a block by the attention its window's queries paid it (eviction.heavy_hitters).
    Decoded step by step, a block's h never changes once it has left the window, it equals what
    the parallel forward computes from every query at once, and with those scores as E (h, or
    log h + recency: eviction.hh_scores) the theorem and the eviction policy hold under
    adversarial, evicted-seeking and random Q."""
    from kvcache import KVCache
    from offload import OffloadCache
    from prefill import prefill
    from tests.conftest import make_model

    model = make_model("nosa-hh", torch.float64, n_layer=1, hh_recency=hh_recency)
    cfg = model.cfg
    T, P = 260, 30
    idx = torch.randint(0, cfg.vocab_size, (2, T))
    cache = (OffloadCache if offloaded else KVCache)(cfg, 2, "cpu", torch.float64)
    layer = model.layers[0]
    with torch.no_grad():
        for i in range(2):
            prefill(model, idx[i : i + 1, :P], cache, i)
        final = {}
        for t in range(P, T):
            model.decode(idx[:, t], cache)
            h = cache.sub.h[0]
            for b in range(max(0, (t + 1) // cfg.B - cfg.n_win)):  # blocks out of the window
                if b in final:
                    assert torch.equal(h[:, :, b], final[b]), (t, b)
                else:
                    final[b] = h[:, :, b].clone()
        x = model.embed_tokens(idx)
        rope = model.rope(torch.arange(T)[None].expand(2, T), x.dtype)
        q, k, _, c = layer.self_attn.qkvc(layer.input_layernorm(x), rope)
        whole = eviction.heavy_hitters(q, k, c, cfg)
    nb_done = max(final) + 1
    torch.testing.assert_close(
        cache.sub.h[0][:, :, :nb_done], whole[:, :, :nb_done], rtol=0, atol=1e-12
    )
    E = eviction.hh_scores(whole, cfg).flatten(0, 1)  # (rows, nb): the decoded rows' final E
    for strategy in ("adversarial", "evicted", "random"):
        check_locality(cfg, E, decode_selections(cfg, E, 9 * cfg.B, strategy, 0))


def test_hh_recency_blends_recency_into_the_heavy_hitter_scale_free():
    """eviction.hh_scores: at hh_recency = 0, E is h itself; above it E = log h + r·b, whose ranking
    of a row does not change when the row's h is scaled (one r serves every layer and head), which
    ranks by h as r -> 0 and by recency as r grows, and in between differs from both."""
    g = torch.Generator().manual_seed(5)
    h = torch.rand(3, 2, 40, generator=g, dtype=torch.float64) ** 4  # heavy-tailed, as attention
    cfg0 = Config.from_preset("tiny", attn="nosa-hh")
    assert eviction.hh_scores(h, cfg0) is h
    rank = lambda E: torch.sort(E, dim=-1, descending=True, stable=True).indices
    b = torch.arange(40, dtype=torch.float64)
    for r in (1e-9, 0.3, 1e3):
        cfg = Config.from_preset("tiny", attn="nosa-hh", hh_recency=r)
        E = eviction.hh_scores(h, cfg)
        torch.testing.assert_close(E, h.log() + r * b, rtol=0, atol=1e-12)
        scaled = h * torch.rand(3, 2, 1, generator=g, dtype=torch.float64) * 100
        assert torch.equal(rank(eviction.hh_scores(scaled, cfg)), rank(E))
    low, mid, high = (
        rank(eviction.hh_scores(h, Config.from_preset("tiny", attn="nosa-hh", hh_recency=r)))
        for r in (1e-9, 0.3, 1e3)
    )
    assert torch.equal(low, rank(h)) and torch.equal(high, rank(b.expand_as(h)))
    top = lambda order: set(order[0, 0, :7].tolist())  # a core of 7
    assert top(mid) != top(low) and top(mid) != top(high)
    assert torch.isfinite(eviction.hh_scores(torch.zeros(2, 3), cfg)).all()  # h = 0: no -inf
