"""Does the eviction score E point where attention goes? For held-out text, each layer and KV head,
and every position with more candidate blocks than the core holds: the share of the attention mass
over the candidate blocks (causal, neither sink nor window) that falls in the n_core blocks chosen
by E (the core), against as many blocks chosen by recency (those just before the window) and at
random. Attention is the model's own, computed densely over every causal token (with its bias),
so the measure asks which blocks a sparse selection should have kept."""

import math

import torch

import checkpoint
import eviction
import pooling


def mass_share(mass, chosen, cand):
    """Share of the candidates' attention mass in the chosen blocks. mass (..., nb) >= 0, chosen and
    cand bool (..., nb), chosen within cand. Returns (...,); NaN where the candidates hold no mass."""
    return (mass * chosen).sum(-1) / (mass * cand).sum(-1)


@torch.no_grad()
def block_mass(q, k, c, cfg, t0):
    """The model's own attention of the queries t0..T-1, dense over every causal key (with its bias),
    averaged over each KV head's group and summed per block: (H_kv, T - t0, nb). q (1, H_q, T, d),
    k (1, H_kv, T, d) after RoPE, c (1, H_kv, T) or None."""
    _, H_q, T, d = q.shape
    H_kv, B = k.shape[1], cfg.B
    qf = q[0, :, t0:].float().view(H_kv, H_q // H_kv, T - t0, d)
    logits = torch.einsum("hgtd,hsd->hgts", qf, k[0].float()) / math.sqrt(d)
    if c is not None:
        logits = logits + eviction.attention_bias(c[0].float(), cfg.attn)[:, None, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[t0:]
    # (H_kv, T', S) over the group
    p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).mean(1)
    nb = cfg.n_blocks(T)
    return torch.nn.functional.pad(p, (0, nb * B - T)).view(H_kv, T - t0, nb, B).sum(-1)


@torch.no_grad()
def layer_shares(q, k, c, cfg, t0, generator):
    """One layer of one sequence: q (1, H_q, T, d), k (1, H_kv, T, d) after RoPE, c (1, H_kv, T) or None.
    Returns the mean shares (by E, by recency, at random) over positions t0..T-1 and KV heads."""
    T, H_kv = q.shape[2], k.shape[1]
    mass = block_mass(q, k, c, cfg, t0)  # (H_kv, T', nb)
    nb, dev = mass.shape[-1], mass.device
    pos = torch.arange(t0, T, device=dev)
    b = torch.arange(nb, device=dev)
    q_blk = (pos // cfg.B)[:, None]
    cand = (b >= cfg.n_sink) & (b < q_blk - cfg.n_win)  # (T', nb)
    n = cfg.n_core
    E = (
        eviction.eviction_block_scores(pooling.pool_mean(c[0].float(), cfg), nb, cfg)
        if c is not None
        else torch.zeros(H_kv, nb, device=dev)
    )
    by_e = eviction.core_blocks(E[:, None, :].expand(H_kv, len(pos), nb), cand, n)
    by_recency = cand & (b >= q_blk - cfg.n_win - n)
    # the CPU generator: the same draw anywhere
    noise = torch.rand(H_kv, len(pos), nb, generator=generator).to(dev)
    at_random = eviction.core_blocks(noise, cand.expand_as(noise), n)
    ok = cand.sum(-1) > n  # positions where the core is a real choice
    return [
        mass_share(mass, sel, cand)[:, ok].nanmean().item() for sel in (by_e, by_recency, at_random)
    ]


@torch.no_grad()
def bench_eviction(checkpoint_dir=checkpoint.DEFAULT_CHECKPOINT, windows=8, T=1024, seed=0):
    import data as corpus

    model, tok = checkpoint.load(checkpoint_dir, "cpu", torch.float32)
    cfg = model.cfg
    if T <= cfg.k * cfg.B:  # windows with a sparse part (a released model's k·B is 4096)
        T = min(2 * cfg.k * cfg.B, cfg.max_seq_len)
    if T <= cfg.k * cfg.B:
        raise ValueError(
            f"bench eviction: {checkpoint_dir} selects k·B = {cfg.k * cfg.B} tokens and reads "
            f"at most {cfg.max_seq_len}: no window is sparse"
        )
    val = [
        i for name, text in corpus.documents() if corpus.is_val(name) for i in tok.encode(text).ids
    ]
    starts = torch.linspace(0, len(val) - T - 1, windows).long().tolist()
    g = torch.Generator().manual_seed(seed)
    t0 = cfg.k * cfg.B  # from here on the selection is sparse
    shares = torch.zeros(cfg.n_layer, 3)
    for s in starts:
        idx = torch.tensor([val[s : s + T]])
        x = model.embed_tokens(idx)
        rope = model.rope(torch.arange(T)[None], x.dtype)
        for i, layer in enumerate(model.layers):
            q, k, _, c = layer.self_attn.qkvc(layer.input_layernorm(x), rope)
            shares[i] += torch.tensor(layer_shares(q, k, c, cfg, t0, g)) / windows
            x = layer(x, rope)
    return [
        dict(
            layer=i,
            core_by_E=round(e, 3),
            by_recency=round(r, 3),
            at_random=round(a, 3),
            blocks=cfg.n_core,
        )
        for i, (e, r, a) in enumerate(shares.tolist())
    ]
