"""Two-stage pooling on small hand-computed cases."""

import math

import torch

import pooling
from config import Config

tiny = Config.from_preset("tiny")  # B=16, l_c=8, s_c=4
paper = Config.from_preset("paper")  # B=64, l_c=32, s_c=16


def test_subblock_counts():
    assert [tiny.n_subblocks(T) for T in (0, 7, 8, 11, 12, 16, 17)] == [
        0,
        0,
        1,
        1,
        2,
        3,
        3,
    ]
    assert [tiny.n_blocks(T) for T in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


def test_pool_mean_by_hand():
    cfg = Config.from_preset("tiny", B=4, l_c=4, s_c=2, n_win=1, k=8, k_q=2)
    x = torch.arange(10.0)  # sub-blocks [0:4], [2:6], [4:8], [6:10]
    assert pooling.pool_mean(x, cfg).tolist() == [1.5, 3.5, 5.5, 7.5]
    k = torch.stack([x, -2 * x], -1)  # (T, d=2)
    assert pooling.compress_keys(k, cfg).tolist() == [
        [1.5, -3.0],
        [3.5, -7.0],
        [5.5, -11.0],
        [7.5, -15.0],
    ]


def test_stage2_overlap_paper():
    # docs/METHOD.md §3: block b is overlapped by sub-blocks 4b-1 ... 4b+3
    M = 30
    x = torch.full((M,), -1.0)
    for b in range(1, 7):
        for m in range(M):
            x.fill_(0.0)
            x[m] = 1.0
            assert pooling.max_to_blocks(x, 8, paper)[b].item() == (
                1.0 if 4 * b - 1 <= m <= 4 * b + 3 else 0.0
            )
    # block 0 has no sub-block -1; the last block only sees the sub-blocks that exist
    x = torch.tensor([5.0, 1.0, 2.0, 3.0, 4.0, 9.0])
    assert pooling.max_to_blocks(x, 3, paper).tolist() == [5.0, 9.0, float("-inf")]


def test_query_aware_scores_by_hand():
    cfg = Config.from_preset(
        "tiny", B=4, l_c=4, s_c=2, n_win=1, k=8, k_q=2, H_q=2, H_kv=1, head_dim=2
    )
    T = 12
    q = torch.randn(1, 2, T, 2)
    k = torch.randn(1, 1, T, 2)
    K_sub = pooling.compress_keys(k, cfg)  # (1, 1, M=5, 2)
    nb = 3
    Q = pooling.query_aware_scores(q, K_sub, torch.arange(T)[None], nb, cfg)
    for t in range(T):
        # all tokens of the sub-block <= t
        vis = [m for m in range(K_sub.shape[2]) if 2 * m + 3 <= t]
        P = [0.0] * K_sub.shape[2]
        for g in range(2):
            if not vis:
                continue
            logits = [float(q[0, g, t] @ K_sub[0, 0, m]) / math.sqrt(2) for m in vis]
            z = sum(math.exp(a) for a in logits)
            for m, a in zip(vis, logits):
                P[m] += math.exp(a) / z
        for b in range(nb):  # r = 2, p = 1: sub-blocks 2b-1 ... 2b+1
            ms = [m for m in range(2 * b - 1, 2 * b + 2) if 0 <= m < K_sub.shape[2]]
            want = max(P[m] for m in ms) if ms else float("-inf")
            assert math.isclose(Q[0, 0, t, b].item(), want, rel_tol=1e-5, abs_tol=1e-6), (t, b)
