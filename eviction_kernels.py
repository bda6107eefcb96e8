"""
The kernels of eviction.py: the eviction policy's insertion (eviction.e_list_join) written once,
_join, and run by both of its kernels:

  e_lists_by_block     the list of every query block of a prefill (or of the parallel forward),
                       the block leaving the window joining at each one: one program (one warp)
                       per (sequence, KV head)
  e_list_join_leaver   a decode step's join: one program per (sequence, KV head)
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _join(ids, E, b_new, E_new, e, on):
    """e_list_join on one row's list, ids and E (NP,) best first: b_new, of score E_new, takes the
    place of its rank (it wins ties: it is the most recent block), the entries after it move down one
    place and the last falls off. e = arange(NP); where `on` is false nothing changes."""
    rank = tl.sum(((ids >= 0) & (E > E_new)).to(tl.int32), 0)
    up = tl.maximum(e - 1, 0)
    ids = tl.where(
        on, tl.where(e == rank, b_new, tl.where(e > rank, tl.gather(ids, up, 0), ids)), ids
    )
    E = tl.where(on, tl.where(e == rank, E_new, tl.where(e > rank, tl.gather(E, up, 0), E)), E)
    return ids, E


@triton.jit
def _block_score(CS, r, M, b, i, R_SUB: tl.constexpr, P_OVER: tl.constexpr):
    """eviction.block_score: the max of c̃ (row r, M sub-blocks) over the sub-blocks that overlap
    block b (or, with R_SUB = 1 and P_OVER = 0, h's entry of block b); i = arange(RPP).
    b (NJ,) -> (NJ,), or a scalar."""
    m = b[:, None] * R_SUB - P_OVER + i[None, :]
    ok = (i < R_SUB + P_OVER)[None, :] & (m >= 0) & (m < M)
    return tl.max(tl.load(CS + r * M + m, mask=ok, other=float("-inf")), 1)


# the lengths are not specialized on: one compile serves prompts of every length (serving)
@triton.jit(do_not_specialize=["M", "b0", "first", "last"])
def _e_lists_by_block_kernel(
    CS,
    IDS,
    ES,
    LISTS,
    IDS_OUT,
    ES_OUT,
    M,
    b0,
    first,
    last,
    N_SINK: tl.constexpr,
    N_WIN: tl.constexpr,
    R_SUB: tl.constexpr,
    P_OVER: tl.constexpr,
    RPP: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    NJ: tl.constexpr,
):
    """From the carried list of query block b0, each query block's list in turn, stored from block
    `first` on. The E of NJ joining blocks are loaded at a time, ahead of their insertions."""
    r = tl.program_id(0)
    e, i, jj = tl.arange(0, NP), tl.arange(0, RPP), tl.arange(0, NJ)
    on = e < N
    ids = tl.load(IDS + r * N + e, mask=on, other=-1)
    E = tl.load(ES + r * N + e, mask=on, other=float("-inf"))
    n_out = last - first + 1
    tl.store(LISTS + (r * n_out) * N + e, ids, mask=on & (e * 0 + b0 == first))
    for b1 in range(b0 + 1, last + 1, NJ):
        E_join = _block_score(CS, r, M, b1 + jj - 1 - N_WIN, i, R_SUB, P_OVER)  # (NJ,)
        for j in range(0, tl.minimum(NJ, last + 1 - b1)):
            b = b1 + j
            b_new = b - 1 - N_WIN
            E_new = tl.max(tl.where(jj == j, E_join, float("-inf")), 0)
            ids, E = _join(ids, E, b_new, E_new, e, on & ((e * 0 + b_new) >= N_SINK))
            tl.store(LISTS + (r * n_out + b - first) * N + e, ids, mask=on & (e * 0 + b >= first))
    tl.store(IDS_OUT + r * N + e, ids, mask=on)
    tl.store(ES_OUT + r * N + e, E, mask=on)


def e_lists_by_block(c_sub, first, last, cfg, e_list_carry):
    """eviction.e_lists_by_block (same arguments and result)."""
    ids, E, b0 = e_list_carry
    Bz, H_kv, n = ids.shape
    r, p = cfg.E_layout
    lists = torch.empty(Bz, H_kv, last - first + 1, n, dtype=ids.dtype, device=ids.device)
    out = torch.empty_like(ids), torch.empty_like(E)
    _e_lists_by_block_kernel[(Bz * H_kv,)](
        c_sub.contiguous(),
        ids.contiguous(),
        E.contiguous(),
        lists,
        *out,
        c_sub.shape[-1],
        b0,
        first,
        last,
        N_SINK=cfg.n_sink,
        N_WIN=cfg.n_win,
        R_SUB=r,
        P_OVER=p,
        RPP=max(2, triton.next_power_of_2(r + p)),  # (nosa-hh: r + p = 1)
        N=n,
        NP=triton.next_power_of_2(n),
        NJ=32,
        num_warps=1,
    )
    return lists, (*out, last)


@triton.jit
def _join_leaver_kernel(
    IDS,
    ES,
    CS,
    POS,
    M,
    H_kv: tl.constexpr,
    B: tl.constexpr,
    N_SINK: tl.constexpr,
    N_WIN: tl.constexpr,
    R_SUB: tl.constexpr,
    P_OVER: tl.constexpr,
    RPP: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
):
    r = tl.program_id(0)
    p = tl.load(POS + r // H_kv)
    e = tl.arange(0, NP)
    on = e < N
    b_new = p // B - N_WIN - 1
    E_new = tl.max(_block_score(CS, r, M, b_new + e * 0, tl.arange(0, RPP), R_SUB, P_OVER), 0)
    ids = tl.load(IDS + r * N + e, mask=on, other=-1)
    E = tl.load(ES + r * N + e, mask=on, other=float("-inf"))
    pe = e * 0 + p  # a vector: the interpreter's masks must be
    join = on & (pe % B == 0) & (pe // B - N_WIN - 1 >= N_SINK)
    ids, E = _join(ids, E, b_new, E_new, e, join)
    tl.store(IDS + r * N + e, ids, mask=join)
    tl.store(ES + r * N + e, E, mask=join)


def e_list_join_leaver(e_list_ids, e_list_E, c_sub, pos, cfg):
    """eviction.e_list_join_leaver (same arguments), one program per row."""
    Bz, H_kv, n = e_list_ids.shape
    r, p = cfg.E_layout
    _join_leaver_kernel[(Bz * H_kv,)](
        e_list_ids,
        e_list_E,
        c_sub,
        pos,
        c_sub.shape[2],
        H_kv=H_kv,
        B=cfg.B,
        N_SINK=cfg.n_sink,
        N_WIN=cfg.n_win,
        R_SUB=r,
        P_OVER=p,
        RPP=max(2, triton.next_power_of_2(r + p)),  # (nosa-hh: r + p = 1)
        N=n,
        NP=triton.next_power_of_2(n),
    )
