"""
The query-agnostic half of NOSA: the ED-DMA eviction head and the eviction policy (docs/METHOD.md §3, §5).

Notation:
  v_j^h   value of token j in KV head h;  H_kv KV heads of dim d
  c_j     eviction score of token j (one per KV head) = A ⊙ softplus(W_δ · concat_h v_j^h)
  E[b]    query-agnostic block score = stage-2 max of the stage-1 sub-block means of c
  F       forced blocks (sinks + window);  C  candidate blocks (causal, not forced)
  core    the top n_core = k_e - n_sink - n_win candidates by E: the part of the selection that
          obeys the policy

c depends on token j alone, so it is computed once, when the token is written, and never again.
It plays two roles: an additive logit bias (ED-DMA: logit = q·k/√d + c_j; DMA: + exp(c_j)), which
is the only path through which A and W_δ receive gradient, and, pooled, the block score E.

The eviction policy (docs/METHOD.md §5 has why it holds). E[b] is final once block b is a candidate,
and candidates only join, so the core changes only at a block boundary, by letting the newcomer
compete with the members: the weakest is *evicted* for good. `core_blocks` is the core from scratch
(the definition); `core_list` the short list of the best candidates from scratch; `join_core_list`
the policy on that list, which the parallel forward runs a query block at a time (block_lists) and
decoding a step at a time (join_leaver). The tests check that they agree and that an evicted block
never comes back. Kernels (eviction_kernels.py): block_lists and join_leaver, one insertion in both.
"""

import torch
import torch.nn.functional as F

import eviction_kernels
import pooling
from common import fp32, use_kernels


# scores, bias and softmax stay in fp32 under bf16 autocast
@torch.amp.autocast("cuda", enabled=False)
def eviction_score(v, A, W_delta):
    """c = A ⊙ softplus(W_δ · concat_h v): v (Bz, H_kv, T, d) -> c (Bz, H_kv, T), in fp32."""
    Bz, H_kv, T, d = v.shape
    x = v.transpose(1, 2).reshape(Bz, T, H_kv * d)  # concat over heads: (Bz, T, H_kv*d)
    c = fp32(A) * F.softplus(fp32(x) @ fp32(W_delta).t())  # (Bz, T, H_kv)
    return c.transpose(1, 2)  # (Bz, H_kv, T)


def attention_bias(c, attn):
    """The per-token logit bias: ED-DMA adds c inside the softmax, DMA adds exp(c)."""
    return torch.exp(c) if attn == "dma" else c


def eviction_block_scores(c_sub, nb, cfg):
    """E: sub-block means of c (..., M) -> block scores (..., nb)."""
    return pooling.max_to_blocks(c_sub, nb, cfg)


def rank_desc(score, valid):
    """Rank (0 = best) of every entry along the last dim among the `valid` ones, ordered by score,
    ties broken towards the larger (more recent) block index; invalid entries get rank n. Valid
    entries of score -inf still rank (by recency), before every invalid one.
    A strict total order makes top-k deterministic, so training and decoding pick the same blocks."""
    score, valid = torch.broadcast_tensors(score, valid)
    n = score.shape[-1]
    s = score.masked_fill(~valid, float("-inf")).flip(-1)  # flip: among equals, later block first
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    valid_first = torch.sort(
        (~valid.flip(-1)).gather(-1, order).to(torch.uint8), dim=-1, stable=True
    ).indices
    order = order.gather(-1, valid_first)  # the invalid entries after every valid one
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(n, device=score.device).expand_as(order)
    )
    return rank.flip(-1).masked_fill(~valid, n)


def top_desc(score, valid, n):
    """rank_desc(score, valid) < n, the n best valid entries, without sorting the row: the n-th best
    score by top-k, then the valid entries tied with it taken from the most recent block down, as
    many as there is room for (valid entries of score -inf fill it by recency, as in rank_desc)."""
    score, valid = torch.broadcast_tensors(score, valid)
    nb = score.shape[-1]
    if n <= 0 or n >= nb:
        return valid & (n > 0)
    s = score.masked_fill(~valid, float("-inf"))
    kth = s.topk(n, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # (..., 1) the n-th best
    above, tie = valid & (s > kth), valid & (s == kth)
    room = n - above.sum(-1, keepdim=True)
    return valid & (above | tie & (tie.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1) <= room))


def core_blocks(E, cand, n_core):
    """The core from scratch: the n_core best candidate blocks by E. E (..., nb), cand bool (..., nb)."""
    return cand & (rank_desc(E, cand) < n_core)


# -----------------------------------------------------------------------------
# The same policy as decoding runs it: on a short list per row instead of a mask over every block.
# A decode step needs the best n_core candidates by E that Q did not pick; those are among the best
# n = n_core + (k_q - 1) candidates, so each row keeps that list, best first, and updates it only
# when a block leaves the window. No step sorts all blocks by E.


def block_score(c_sub, b, cfg):
    """E of one block per row: c̃ (..., M), b (...,) block ids -> (...,), as eviction_block_scores."""
    m = pooling.overlapping_subblocks(b, cfg)  # (..., r+p)
    M = c_sub.shape[-1]
    if M == 0:  # no whole sub-block yet: no block has a score
        return torch.full(b.shape, float("-inf"), dtype=c_sub.dtype, device=c_sub.device)
    valid = (m >= 0) & (m < M)
    return c_sub.gather(-1, m.clamp(0, M - 1)).masked_fill(~valid, float("-inf")).amax(-1)


def best_first(ids, E, n):
    """Order a list of blocks best first, by E and then the more recent block (rank_desc's order),
    empty entries (-1) last, and keep n. ids, E (..., m) -> (ids, E) (..., n)."""
    order = torch.sort(ids, dim=-1, descending=True, stable=True).indices  # recent first; -1 last
    ids, E = (
        ids.gather(-1, order),
        E.gather(-1, order).masked_fill(ids.gather(-1, order) < 0, float("-inf")),
    )
    # stable: ties stay recent first
    order = torch.sort(E, dim=-1, descending=True, stable=True).indices[..., :n]
    return ids.gather(-1, order), E.gather(-1, order)


def core_list(E, cand, n):
    """The list from scratch: the best n candidates. E (..., nb), cand bool (..., nb) -> (ids, E) (..., n)."""
    ids = torch.where(cand, torch.arange(E.shape[-1], device=E.device), -1)
    if E.shape[-1] < n:  # fewer blocks than the list holds: pad with empty entries
        pad = n - E.shape[-1]
        ids, E = F.pad(ids, (0, pad), value=-1), F.pad(E, (0, pad))
    return best_first(ids, E, n)


def join_core_list(ids, E_ids, b_new, E_new):
    """The eviction policy on the list: b_new (...,) a block that has just left the window (-1: none),
    with score E_new, competes with the members; the best n stay, the one left out is evicted for good.
    The list is best first, so this is an insertion: b_new takes the place of its rank (the members
    with a higher E; it wins ties, being more recent than every member, which all left the window
    before it), those after it move down one place and the last falls off.
    ids, E_ids (..., n) -> (ids, E_ids) (..., n), as best_first orders them."""
    b_new, E_new = b_new[..., None], E_new[..., None]
    beats = (ids >= 0) & (E_ids > E_new)
    rank = beats.sum(-1, keepdim=True)  # (..., 1); n: b_new is evicted at once
    j = torch.arange(ids.shape[-1], device=ids.device)
    src = (j - (j > rank).long()).expand_as(ids)  # after the rank, the entry one place up
    here, join = j == rank, b_new >= 0
    ids = torch.where(join, torch.where(here, b_new, ids.gather(-1, src)), ids)
    return ids, torch.where(join, torch.where(here, E_new, E_ids.gather(-1, src)), E_ids)


def block_lists(c_sub, first, last, cfg, carry=None):
    """The list of the best n = n_core + k_q - 1 candidates by E, best first (core_list), of each
    query block first .. last, kept by the eviction policy as decoding keeps it: the candidates of query
    block b are those of b - 1 and the block that has just left the window, b - 1 - n_win, which joins
    the list (join_core_list) with its E from c̃ (block_score). nosa.select_blocks with these lists
    selects what it selects from E itself. c_sub (Bz, H_kv, M): the sub-block means of c.
    carry: (ids, E, b), the list of query block b <= first that a call for the blocks before left (a
    prefill's earlier chunks); None: from the empty list of block 0.
    Returns the lists (Bz, H_kv, last - first + 1, n) and the carry of block `last`.
    Kernel: eviction_kernels.block_lists."""
    n = cfg.n_core + cfg.k_q_free
    if carry is None:
        carry = (
            torch.full((*c_sub.shape[:2], n), -1, dtype=torch.long, device=c_sub.device),
            torch.full(
                (*c_sub.shape[:2], n), float("-inf"), dtype=c_sub.dtype, device=c_sub.device
            ),
            0,
        )
    if use_kernels(c_sub):
        return eviction_kernels.block_lists(c_sub, first, last, cfg, carry)
    ids, E, b0 = carry
    lists = [ids] if b0 == first else []
    for b in range(b0 + 1, last + 1):
        if b - 1 - cfg.n_win >= cfg.n_sink:  # a candidate leaves the window
            b_new = torch.full(ids.shape[:-1], b - 1 - cfg.n_win, device=ids.device)
            ids, E = join_core_list(ids, E, b_new, block_score(c_sub, b_new, cfg))
        if b >= first:
            lists.append(ids)
    return torch.stack(lists, 2), (ids, E, last)


def core_picks(ids, taken, n_core, nb):
    """The E-picks of a step: the first n_core members of the list (best first) that Q has not taken.
    ids (..., n) the list, taken (..., n) bool -> a mask over the nb blocks (..., nb)."""
    pick = (ids >= 0) & ~taken
    pick &= pick.cumsum(-1) <= n_core
    # column nb: a spare
    mask = torch.zeros(*ids.shape[:-1], nb + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(-1, torch.where(pick, ids, nb), True)[..., :nb]


def join_leaver(list_ids, list_E, c_sub, pos, cfg):
    """The eviction policy at a decode step, in place: at a block's first token (pos (Bz,)) the block
    n_win + 1 back leaves the window and competes with each row's list (join_core_list). Its E is
    final: the sub-blocks that overlap it are complete (a check of config.Config).
    list_ids, list_E (Bz, H_kv, n); c̃ (Bz, H_kv, M). Kernel: eviction_kernels.join_leaver."""
    if use_kernels(c_sub):
        return eviction_kernels.join_leaver(list_ids, list_E, c_sub, pos, cfg)
    b_new = pos // cfg.B - cfg.n_win - 1
    b_new = torch.where((pos % cfg.B == 0) & (b_new >= cfg.n_sink), b_new, -1)
    b_new = b_new[:, None].expand(-1, cfg.H_kv)
    E_new = block_score(c_sub, b_new.clamp(min=0), cfg)
    ids, E = join_core_list(list_ids, list_E, b_new, E_new)
    list_ids.copy_(ids)
    list_E.copy_(E)
