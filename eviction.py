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
(the definition); `e_list` the short list of the best candidates from scratch; `e_list_join` the
policy on that list, which the parallel forward runs a query block at a time (e_lists_by_block) and
decoding a step at a time (e_list_join_leaver). The tests check that they agree and that an evicted
block never comes back. Kernels (eviction_kernels.py): e_lists_by_block and e_list_join_leaver, one
insertion in both.
"""

import math

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


def block_score(scores, b, cfg):
    """E of one block per row: b (...,) block ids -> (...,), from `scores`: c̃ (..., M) (the max over
    the sub-blocks that overlap b, as eviction_block_scores), or h (..., nb) in nosa-hh."""
    r, p = cfg.E_layout
    m = b[..., None] * r - p + torch.arange(r + p, device=b.device)  # (..., r+p)
    M = scores.shape[-1]
    if M == 0:  # no whole sub-block yet: no block has a score
        return torch.full(b.shape, float("-inf"), dtype=scores.dtype, device=scores.device)
    valid = (m >= 0) & (m < M)
    return scores.gather(-1, m.clamp(0, M - 1)).masked_fill(~valid, float("-inf")).amax(-1)


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


def e_list(E, cand, n):
    """The list from scratch: the best n candidates. E (..., nb), cand bool (..., nb) -> (ids, E) (..., n)."""
    ids = torch.where(cand, torch.arange(E.shape[-1], device=E.device), -1)
    if E.shape[-1] < n:  # fewer blocks than the list holds: pad with empty entries
        pad = n - E.shape[-1]
        ids, E = F.pad(ids, (0, pad), value=-1), F.pad(E, (0, pad))
    return best_first(ids, E, n)


def e_list_join(ids, E_ids, b_new, E_new):
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


def e_lists_by_block(scores, first, last, cfg, e_list_carry=None):
    """The E-list (nosa.py's legend) of each query block first .. last, kept by the eviction policy
    as decoding keeps it: the candidates of query block b are those of b - 1 and the block that has
    just left the window, b - 1 - n_win, which joins the list (e_list_join) with its E
    (block_score). nosa.select_blocks with these lists selects what it selects from E itself.
    scores: c̃ (Bz, H_kv, M), the sub-block means of c, or in nosa-hh h (Bz, H_kv, nb), final for
    every block that has left the window of query block `last`. e_list_carry: (ids, E, b), the list
    of query block b <= first that a call for the blocks before left (a prefill's earlier chunks);
    None: from the empty list of block 0.
    Returns the lists (Bz, H_kv, last - first + 1, n) and the e_list_carry of block `last`.
    Kernel: eviction_kernels.e_lists_by_block."""
    n = cfg.n_core + cfg.k_q_free
    if e_list_carry is None:
        shape, dev = (*scores.shape[:2], n), scores.device
        e_list_carry = (
            torch.full(shape, -1, dtype=torch.long, device=dev),
            torch.full(shape, float("-inf"), dtype=scores.dtype, device=dev),
            0,
        )
    if use_kernels(scores):
        return eviction_kernels.e_lists_by_block(scores, first, last, cfg, e_list_carry)
    ids, E, b0 = e_list_carry
    lists = [ids] if b0 == first else []
    for b in range(b0 + 1, last + 1):
        if b - 1 - cfg.n_win >= cfg.n_sink:  # a candidate leaves the window
            b_new = torch.full(ids.shape[:-1], b - 1 - cfg.n_win, device=ids.device)
            ids, E = e_list_join(ids, E, b_new, block_score(scores, b_new, cfg))
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


def e_list_join_leaver(e_list_ids, e_list_E, scores, pos, cfg):
    """The eviction policy at a decode step, in place: at a block's first token (pos (Bz,)) the block
    n_win + 1 back leaves the window and competes with each row's list (e_list_join). Its E is
    final: the sub-blocks that overlap it are complete (a check of config.Config), or, in nosa-hh,
    the queries of its window have all attended. e_list_ids, e_list_E (Bz, H_kv, n); scores: c̃
    (Bz, H_kv, M) or h (Bz, H_kv, nb) (block_score). Kernel: eviction_kernels.e_list_join_leaver."""
    if use_kernels(scores):
        return eviction_kernels.e_list_join_leaver(e_list_ids, e_list_E, scores, pos, cfg)
    b_new = pos // cfg.B - cfg.n_win - 1
    b_new = torch.where((pos % cfg.B == 0) & (b_new >= cfg.n_sink), b_new, -1)
    b_new = b_new[:, None].expand(-1, cfg.H_kv)
    E_new = block_score(scores, b_new.clamp(min=0), cfg)
    ids, E = e_list_join(e_list_ids, e_list_E, b_new, E_new)
    e_list_ids.copy_(ids)
    e_list_E.copy_(E)


# -----------------------------------------------------------------------------
# nosa-hh: E from the attention a block got while it was in the window (docs/METHOD.md §5). The
# window's blocks are forced, so what its queries pay them depends on no selection; it is final
# when the block leaves the window, the moment it becomes a candidate, so the theorem holds as for
# c. h[b] = the mean over the n_win·B queries of blocks b+1 .. b+n_win of the share of their
# attention over F(t) (sinks, window, own block; with the bias) that falls on block b.


HH_PASS = (
    2**24
)  # logits a pass of heavy_hitters computes at most (memory.prefill_bytes counts them)


@torch.amp.autocast("cuda", enabled=False)  # in fp32 (or fp64) under bf16 autocast, as decoding
def window_attention(q, keys, key_pos, bias, q_pos, cfg):
    """What each query attends to within its forced blocks F(t): the softmax of q·k/√d + bias over
    the keys in F(t) and not after t, averaged over the G query heads of each KV head.
    q (..., G, n, d) at positions q_pos (..., n); keys (..., m, d) at key_pos (..., m) (-1: none);
    bias (..., m) or None -> (..., n, m)."""
    d = q.shape[-1]
    s = fp32(q) @ fp32(keys).unsqueeze(-3).transpose(-1, -2) / math.sqrt(d)  # (..., G, n, m)
    if bias is not None:
        s = s + fp32(bias)[..., None, None, :]
    kb, qb = (key_pos // cfg.B)[..., None, :], (q_pos // cfg.B)[..., :, None]
    ok = (key_pos[..., None, :] >= 0) & (key_pos[..., None, :] <= q_pos[..., :, None])
    ok &= (kb < cfg.n_sink) | (kb >= qb - cfg.n_win)  # (..., n, m)
    p = torch.softmax(s.masked_fill(~ok[..., None, :, :], float("-inf")), -1)
    return torch.where(ok[..., None, :, :], p, 0.0).mean(-3)  # (a query with no key: 0, not NaN)


def add_heavy_hitters(h, p, key_pos, q_pos, cfg):
    """h (..., nb) += what the queries pay the blocks of their window before their own (blocks
    q_t - n_win .. q_t - 1), over n_win·B: p (..., n, m) by window_attention, keys at key_pos (..., m),
    queries at q_pos (..., n) (-1: none)."""
    kb, qb = key_pos // cfg.B, (q_pos // cfg.B)[..., None]
    win = (key_pos[..., None, :] >= 0) & (q_pos[..., None] >= 0)
    win &= (kb[..., None, :] < qb) & (kb[..., None, :] >= qb - cfg.n_win)  # (..., n, m)
    w = torch.where(win, p, 0.0).sum(-2) / (cfg.n_win * cfg.B)  # (..., m)
    idx = kb.clamp(0, h.shape[-1] - 1).expand_as(w)
    h.scatter_add_(-1, idx, w.to(h.dtype))


def hh_scores(h, cfg):
    """nosa-hh's E from h (..., nb): h itself, or with hh_recency = r > 0 its log plus r a block of
    recency, E_b = log h_b + r·b (docs/METHOD.md §5). Both terms are final when block b leaves the
    window, so the theorem holds as for h; the log makes a row's scale of h drop out of the ranking,
    so one r serves every layer and head: a block must hold e^(r·j) times the attention of one j
    blocks more recent to outrank it."""
    if cfg.hh_recency == 0:
        return h
    b = torch.arange(h.shape[-1], device=h.device, dtype=h.dtype)
    return h.clamp_min(torch.finfo(h.dtype).tiny).log() + cfg.hh_recency * b


@torch.no_grad()
def heavy_hitters(q, k, c, cfg, start=0, h=None):
    """The parallel forward's h: what the queries at start .. S-1 add to it (all of it when start =
    0), a few query blocks at a time. q (Bz, H_q, T, d) at positions start.., k (Bz, H_kv, S, d),
    c (Bz, H_kv, S) the bias; h (Bz, H_kv, nb) to add to (the earlier chunks' of a prefill), or None.
    Returns h, final for every block that has left the window of the last query's block."""
    Bz, H_q, T, d = q.shape
    H_kv, S, B, dev = k.shape[1], k.shape[2], cfg.B, q.device
    nb = cfg.n_blocks(S)
    h = torch.zeros(Bz, H_kv, nb, dtype=fp32(q).dtype, device=dev) if h is None else h
    qg = q.view(Bz, H_kv, H_q // H_kv, T, d)
    n_kb = cfg.n_sink + cfg.n_win + 1  # key blocks of a query block: F(t)
    step = max(1, HH_PASS // (Bz * H_q * B * n_kb * B))  # query blocks a pass
    col = torch.arange(n_kb, device=dev)
    for b0 in range(start // B, (S - 1) // B + 1, step):
        qb = torch.arange(b0, min(b0 + step, (S - 1) // B + 1), device=dev)  # (nq,)
        kb = torch.where(col < cfg.n_sink, col, qb[:, None] - cfg.n_win - cfg.n_sink + col)
        kb = torch.where((kb >= 0) & ((col < cfg.n_sink) | (kb >= cfg.n_sink)), kb, -1)
        key_pos = (kb[..., None] * B + torch.arange(B, device=dev)).flatten(1)  # (nq, m)
        key_pos = torch.where((kb.repeat_interleave(B, 1) >= 0) & (key_pos < S), key_pos, -1)
        q_pos = qb[:, None] * B + torch.arange(B, device=dev)  # (nq, B)
        q_pos = torch.where((q_pos >= start) & (q_pos < S), q_pos, -1)
        qi = (q_pos - start).clamp(0, T - 1).flatten()
        qs = qg[:, :, :, qi].unflatten(3, q_pos.shape).transpose(2, 3)  # (Bz, H_kv, nq, G, B, d)
        keys = k[:, :, key_pos.clamp(min=0)]  # (Bz, H_kv, nq, m, d)
        bias = None if c is None else attention_bias(c, cfg.attn)[:, :, key_pos.clamp(min=0)]
        p = window_attention(qs, keys, key_pos, bias, q_pos, cfg)  # (Bz, H_kv, nq, B, m)
        part = torch.zeros(Bz, H_kv, qb.numel(), nb, dtype=h.dtype, device=dev)
        add_heavy_hitters(part, p, key_pos, q_pos, cfg)
        h += part.sum(2)
    return h


# -----------------------------------------------------------------------------
# Teaching the head: this project's addition to the paper's recipe (docs/METHOD.md §8). The bias is
# the only path by which the language-model loss reaches A and W_δ, and nothing in it asks E to rank
# blocks by the attention they will get; a distillation loss asks that directly.


OUTPUT_PASS = 2**24  # floats of the per-block outputs attention_by_block(v=...) holds at once


@torch.no_grad()
@torch.amp.autocast("cuda", enabled=False)
def attention_by_block(q, k, t, cfg, bias=None, v=None):
    """The teacher: what the queries at positions t attend to, block by block. The dense softmax of
    q·k/√d (+ bias) over every causal key, averaged over each KV head's G query heads and summed
    over each block's tokens. q (Bz, H_q, n, d), t (n,) their positions, k (Bz, H_kv, S, d),
    bias (Bz, H_kv, S) or None -> (Bz, H_kv, n, nb); each row sums to 1.
    With the values v (Bz, H_kv, S, d): what each block adds to the query's output beyond its share
    of it, |Σ_{j in b} p_j (v_j - o)| with o = Σ_j p_j v_j (how far o moves, to first order, if the
    block is dropped), averaged over the group; a block of much mass whose values are o's changes
    little."""
    Bz, H_q, n, d = q.shape
    H_kv, S, B = k.shape[1], k.shape[2], cfg.B
    qg = fp32(q).view(Bz, H_kv, H_q // H_kv, n, d)
    s = torch.einsum("bhgnd,bhsd->bhgns", qg, fp32(k)) / math.sqrt(d)  # (Bz, H_kv, G, n, S)
    if bias is not None:
        s = s + fp32(bias)[:, :, None, None, :]
    s = s.masked_fill(torch.arange(S, device=q.device) > t[:, None], float("-inf"))
    nb = cfg.n_blocks(S)
    if v is None:
        p = torch.softmax(s, -1).mean(2)  # (Bz, H_kv, n, S)
        return F.pad(p, (0, nb * B - S)).view(Bz, H_kv, n, nb, B).sum(-1)
    p = F.pad(torch.softmax(s, -1), (0, nb * B - S)).unflatten(-1, (nb, B))  # (.., G, n, nb, B)
    vb = F.pad(fp32(v), (0, 0, 0, nb * B - S)).view(Bz, H_kv, nb, B, d)
    o = torch.einsum("bhgnkj,bhkjd->bhgnd", p, vb)
    out = torch.empty(Bz, H_kv, n, nb, dtype=o.dtype, device=o.device)
    step = max(1, OUTPUT_PASS // (Bz * H_q * nb * d))  # queries a pass
    for i in range(0, n, step):
        pi = p[:, :, :, i : i + step]
        a = torch.einsum("bhgnkj,bhkjd->bhgnkd", pi, vb)  # each block's part of the output
        a = a - pi.sum(-1, keepdim=True) * o[:, :, :, i : i + step, None]
        out[:, :, i : i + step] = a.norm(dim=-1).mean(2)
    return out


def distillation_loss(c, mass, t, cfg, tau):
    """KL(teacher ‖ student) over each query's candidate blocks C(t) (causal, neither sink nor
    window: those the core chooses among), averaged over the queries, KV heads and sequences.
    teacher: the attention mass the query puts on each candidate (attention_by_block), renormalised
    over C(t); student: the softmax over C(t) of E / tau, E the block scores of c. E is fixed per
    block, so the best it can do is to rank blocks by the attention later queries pay them.
    c (Bz, H_kv, S) with its gradient; mass (Bz, H_kv, n, nb); t (n,) positions past k·B."""
    nb = mass.shape[-1]
    E = eviction_block_scores(pooling.pool_mean(c, cfg), nb, cfg)  # (Bz, H_kv, nb)
    b = torch.arange(nb, device=c.device)
    cand = (b >= cfg.n_sink) & (b < (t // cfg.B)[:, None] - cfg.n_win)  # (n, nb)
    target = torch.where(cand, mass, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp(min=1e-30)
    log_student = torch.log_softmax((E[:, :, None] / tau).masked_fill(~cand, float("-inf")), -1)
    kl = target * (torch.log(target.clamp(min=1e-30)) - log_student)
    return torch.where(target > 0, kl, 0.0).sum(-1).mean()
