"""The selection kernels (nosa_kernels.py, interpreted on the CPU) against their torch twins: a
decode step's picks and the parallel forward's tiles, for random configs and adversarial scores."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import eviction
import nosa
import nosa_kernels
from attention_kernels import Tiles
from config import Config
from tests.test_selection import configs


@settings(max_examples=40, deadline=None)
@given(cfg=configs(), data=st.data(), attn=st.sampled_from(["nosa", "infllmv2", "dma"]))
def test_select_step_kernel_equals_twin(cfg, data, attn):
    """A decode step's selection as one Triton kernel (interpreted on CPU) == the torch code, for random
    configs, every sparse mode, ragged positions (few blocks, and past them), Q with many ties, zeros,
    -inf and values apart only in their lowest bits, and each row's list of its best candidates by E
    (at times Q's own order, so that Q takes list members tied with its last pick)."""
    from dataclasses import replace

    cfg = replace(cfg, attn=attn)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    Bz, H, nb = 3, 2, data.draw(st.integers(1, 48))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    values = torch.tensor(
        [
            -1.0,
            0.0,
            0.25,
            0.5,
            1.0,
            float("-inf"),  # and neighbours that differ in low bits:
            1 + 2**-23,
            1 + 2**-15,
            1 - 2**-24,
            -1 - 2**-23,
            0.5 + 2**-22,
            2**-140,
            -(2**-140),
        ]
    )
    Q = values[
        torch.randint(
            0, len(values) if data.draw(st.booleans()) else 6, (Bz, H, 1, nb), generator=g
        )
    ]
    pos = torch.randint(0, nb * cfg.B, (Bz, 1), generator=g)
    n = cfg.n_core + cfg.k_q_free if cfg.eviction_head and cfg.n_core > 0 else 0
    ids = None
    if n:
        b = torch.arange(nb)
        cand = (b >= cfg.n_sink) & (b < pos[:, :, None] // cfg.B - cfg.n_win)  # (Bz, 1, nb)
        E = (
            Q[:, :, 0]
            if data.draw(st.booleans())
            else values[torch.randint(0, 5, (Bz, H, nb), generator=g)]
        )
        # E = Q: the list and Q's picks overlap
        ids = eviction.e_list(E, cand.expand(Bz, H, nb), n)[0]
        ids = ids.to(dev)
    want = nosa.select_step(Q, None if ids is None else ids.cpu(), pos, cfg)  # the twin, on the CPU
    got = nosa_kernels.select_step(Q.to(dev), ids, pos.to(dev), cfg)
    assert torch.equal(got.cpu(), want)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(cfg=configs(), data=st.data(), attn=st.sampled_from(["nosa", "infllmv2", "dma"]))
def test_select_tiles_kernel_equals_twin(cfg, data, attn):
    """The parallel forward's selection as one Triton kernel (interpreted on CPU), written as tiles of
    BT queries (union, bits, count) == the torch code, and those tiles hold select_blocks' mask: random
    configs and modes, a chunk of queries starting anywhere (tiles across block boundaries), ties or not."""
    from dataclasses import replace

    cfg = replace(cfg, attn=attn)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    Bz, H, nb = 2, 2, data.draw(st.integers(1, 40))
    T = data.draw(st.integers(1, min(nb * cfg.B, 3 * cfg.B)))
    start = data.draw(st.integers(0, nb * cfg.B - T))
    q_pos = (start + torch.arange(T)).expand(Bz, T)
    nb = (start + T - 1) // cfg.B + 1  # the blocks the chunk's keys span
    first, BT = start // cfg.B, data.draw(st.sampled_from([1, 2, 8]))
    if data.draw(st.booleans()):  # ties everywhere (the kernel's rounds over (score, block) keys)
        Q = torch.randint(0, 4, (Bz, H, T, nb), generator=g).float()
    else:  # distinct scores (its rounds over the scores alone)
        Q = torch.rand(Bz, H, T, nb, generator=g)
    lists = None
    if cfg.eviction_head and cfg.n_core > 0:  # E from sub-block means of c of a few values: ties
        c_sub = torch.randint(0, 3, (Bz, H, cfg.n_subblocks(start + T)), generator=g).float()
        lists = eviction.e_lists_by_block(c_sub, first, nb - 1, cfg)[0]
    U = min(nb, BT * cfg.k)
    want = tiles_twin(Q, lists, first, q_pos, cfg, BT, U)
    # few groups: many keys to keep, and rows with too many
    groups = data.draw(st.sampled_from([1, 2, 4, 128]))
    got = tiles_with_groups(
        groups,
        data.draw(st.sampled_from([1, 4])),
        Q.to(dev),
        None if lists is None else lists.to(dev),
        first,
        q_pos.to(dev),
        cfg,
        BT=BT,
        U=U,
    )
    for w, x in zip(want, got):
        assert torch.equal(x.cpu(), w)
    ids = None if lists is None else nosa.e_lists_of_queries(lists, q_pos, first, cfg)
    mask = nosa.select_blocks(Q, None, q_pos[:, None], cfg, ids)
    assert torch.equal(Tiles(*want, BT, T).mask(nb), mask)


def tiles_twin(Q, lists, first, q_pos, cfg, BT, U):
    """What nosa_kernels.select_tiles writes, from the definition: select_blocks' mask as Tiles."""
    ids = None if lists is None else nosa.e_lists_of_queries(lists, q_pos, first, cfg)
    tiles = Tiles.from_mask(nosa.select_blocks(Q, None, q_pos[:, None], cfg, ids), BT, U)
    return tiles.idx, tiles.bits, tiles.n


def tiles_with_groups(groups, per_pick, *args, BT, U):
    """nosa_kernels.select_tiles(*args, BT=BT, U=U) with the kernel's groups of blocks and room for keys set
    (nosa_kernels._kth_best)."""
    saved = nosa_kernels.GROUPS, nosa_kernels.CAP_PER_PICK
    nosa_kernels.GROUPS, nosa_kernels.CAP_PER_PICK = groups, per_pick
    try:
        return nosa_kernels.select_tiles(*args, BT=BT, U=U)
    finally:
        nosa_kernels.GROUPS, nosa_kernels.CAP_PER_PICK = saved


@pytest.mark.parametrize("tied", [False, True])
def test_select_tiles_kernel_keeps_the_best_through_its_groups(tied):
    """The selection kernel's k_q - 1 best candidates come through a few passes (_kth_best): the best
    key of each group of blocks, the keys at or above the (k_q - 1)-th best of those, then rounds over
    them; a row with more such keys than the kernel has room for takes rounds over every block. Rows of
    both kinds (counted here as the kernel counts), against the torch code, at the paper's k_q, 700 blocks."""
    cfg = Config.from_preset("paper")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    T, nb, groups, KQ = 16, 700, 32, cfg.k_q_free
    start = nb * cfg.B - T
    q_pos = (start + torch.arange(T)).expand(1, T)
    Q = (
        torch.randint(0, 40, (T, nb), generator=g).float()
        if tied
        else torch.rand(T, nb, generator=g)
    )
    b = torch.arange(nb)
    # every other row's best all in 3 of the 32 groups: too many keys to keep
    Q[::2] += 100 * (b % groups < 3)
    cand = (b >= cfg.n_sink) & (b < start // cfg.B - cfg.n_win)
    # (score, block), ties to the recent one
    key = torch.where(cand, Q.double() + b * 2.0**-40, float("-inf"))
    L = (
        torch.stack([key[:, b % groups == i].amax(1) for i in range(groups)], 1)
        .topk(KQ, 1)
        .values[:, -1:]
    )
    n = (key >= L).sum(1)
    cap = 4 * (1 << (KQ - 1).bit_length())
    assert (n[::2] > cap).all() and (n[1::2] <= cap).all(), n.tolist()
    Q, U = Q[None, None], min(nb, T * cfg.k)
    want = tiles_twin(Q, None, start // cfg.B, q_pos, cfg, T, U)
    got = tiles_with_groups(
        groups, 4, Q.to(dev), None, start // cfg.B, q_pos.to(dev), cfg, BT=T, U=U
    )
    for w, x in zip(want, got):
        assert torch.equal(x.cpu(), w)
