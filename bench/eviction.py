"""How much of the attention does a selection hold? The eviction head's figure of merit, without
training noise: for held-out text, every layer and KV head, and every query whose selection is
sparse (t >= k·B), the share of the query's dense attention mass (softmax over every causal key,
averaged over the KV head's G query heads) that falls in its k selected blocks Γ(t). Γ(t) is the
checkpoint's own: the forced blocks, k_q - 1 picks by its Q, and the core chosen by E; the rules
for E differ row by row, so the rows separate "E cannot" from "E did not learn":

  learned       the checkpoint's own E (its eviction head), as it decodes
  recency       E flat: the core is the blocks that left the window last (what A = 0 gives)
  random        a fixed random score per block (an untrained head, roughly)
  heavy hitter  the attention a block received from the queries of its window (its own block and
                the n_win after it), known when it leaves the window: query-agnostic from then on
  oracle        a static in-sample score: the mean attention a block gets from all the later queries
                that see it as a candidate (no query-agnostic score can do better in-sample)
  nosa-hh       the nosa-hh mode's E (eviction.hh_scores): the heavy hitter as a model can know
                it, each window query's attention over its forced blocks alone (with recency
                blended in where hh_recency > 0)
and InfLLMv2's selection at the same k (no core: every free pick by Q). `core` is the share of the
mass outside F(t) and the Q-picks that the core holds. The attention is the checkpoint's own (with
its bias), or that of a reference model on the same tokens (--reference: e.g. the dense control).
"""

import argparse
import math
from dataclasses import replace

import torch

import bench
import checkpoint
import eviction
import nosa
import pooling

RULES = ("learned", "recency", "random", "heavy hitter", "oracle", "nosa-hh")


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
    """The core alone, one layer of one sequence: the share of the candidates' attention mass that
    the n_core blocks chosen by E, by recency and at random hold, averaged over positions t0..T-1
    and KV heads. q (1, H_q, T, d), k (1, H_kv, T, d) after RoPE, c (1, H_kv, T) or None."""
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


def rule_scores(mass, c, cfg, t0, generator, h=None):
    """E (H_kv, nb) by each rule of RULES (None where the checkpoint has no eviction head).
    mass (H_kv, T, nb): the attention of every query 0..T-1; c (1, H_kv, T) or None; h (H_kv, nb)
    the nosa-hh scores, or None."""
    H_kv, T, nb = mass.shape
    dev = mass.device
    b = torch.arange(nb, device=dev)
    q_blk = (torch.arange(T, device=dev) // cfg.B)[:, None]  # (T, 1)
    # heavy hitter: the attention b got while forced, from query blocks b .. b + n_win
    in_window = (b <= q_blk) & (b >= q_blk - cfg.n_win)  # (T, nb)
    heavy = (mass * in_window).sum(1)
    # oracle: the mean attention b gets from the queries t >= t0 that see it as a candidate
    cand = ((b >= cfg.n_sink) & (b < q_blk - cfg.n_win))[t0:]  # (T', nb)
    seen = cand.sum(0).clamp(min=1)
    oracle = (mass[:, t0:] * cand).sum(1) / seen
    learned = None
    if c is not None:
        learned = eviction.eviction_block_scores(pooling.pool_mean(c[0].float(), cfg), nb, cfg)
    flat = torch.zeros(H_kv, nb, device=dev)
    noise = torch.rand(H_kv, nb, generator=generator).to(dev)
    return dict(zip(RULES, (learned, flat, noise, heavy, oracle, h)))


@torch.no_grad()
def layer_captured(q, k, c, mass, cfg, t0, *, generator):
    """One layer of one sequence: {row: (share of the attention Γ(t) holds, share of the rest the
    core holds)}, averaged over the queries t0..T-1 and the KV heads. q (1, H_q, T, d), k (1, H_kv,
    T, d) after RoPE and c (1, H_kv, T) or None: the checkpoint's (its selection); mass (H_kv, T, nb):
    the attention, of every query from 0 (block_mass)."""
    T = q.shape[2]
    nb, dev = mass.shape[-1], mass.device
    pos = torch.arange(t0, T, device=dev)
    m = mass[:, t0:]  # (H_kv, T', nb)
    K_sub = pooling.compress_keys(k, cfg)
    Q = pooling.query_aware_scores(q[:, :, t0:], K_sub, pos[None], nb, cfg)[0]  # (H_kv, T', nb)
    b = torch.arange(nb, device=dev)
    q_blk = (pos // cfg.B)[:, None]
    forced = (b <= q_blk) & ((b < cfg.n_sink) | (b >= q_blk - cfg.n_win))  # (T', nb)
    cand = (b <= q_blk) & ~forced
    rest = cand & ~eviction.top_desc(Q, cand, cfg.k_q_free)  # (H_kv, T', nb): not picked by Q
    hh = replace(cfg, attn="nosa-hh")  # (with the checkpoint's hh_recency, if it is nosa-hh)
    h = eviction.hh_scores(eviction.heavy_hitters(q, k, c, hh)[0], hh)
    out = {}
    for rule, E in rule_scores(mass, c, cfg, t0, generator, h).items():
        if E is None:
            continue
        sel = nosa.select_blocks(Q, E, pos, cfg)
        core = sel & rest
        out[rule] = ((m * sel).sum(-1).mean().item(), mass_share(m, core, rest).nanmean().item())
    sel = nosa.select_blocks(Q, None, pos, replace(cfg, attn="infllmv2"))
    out["infllmv2"] = ((m * sel).sum(-1).mean().item(), float("nan"))
    return out


def held_out_windows(tok, windows, T):
    """`windows` windows of T token ids, evenly spread over the held-out documents of the standard
    library (the corpus train.py reads by default), in the checkpoint's tokenizer."""
    import data as corpus

    val = [
        i for name, text in corpus.documents() if corpus.is_val(name) for i in tok.encode(text).ids
    ]
    if len(val) < T + 1:
        raise ValueError(f"bench eviction: the held-out text has {len(val)} tokens, fewer than T")
    starts = torch.linspace(0, len(val) - T - 1, windows).long().tolist()
    return [torch.tensor([val[s : s + T]]) for s in starts]


def bands(n_layer, n=4):
    """The layers in n bands of (nearly) equal size: [(first, last)]."""
    cuts = [round(i * n_layer / n) for i in range(n + 1)]
    return [(a, b - 1) for a, b in zip(cuts, cuts[1:]) if b > a]


@torch.no_grad()
def bench_eviction(
    checkpoint_dir=checkpoint.DEFAULT_CHECKPOINT, reference=None, windows=4, T=None, seed=0, *,
    sets=None,
):  # fmt: skip
    """The captured-attention table of a checkpoint: a row per rule for E (and InfLLMv2's selection),
    the share Γ(t) holds over all layers and per band of layers; per-layer values under "layers".
    sets: selection fields (k, n_win, k_q, ...) to evaluate a checkpoint at. A dense checkpoint is
    read as InfLLMv2 (its q and k select; it has no eviction head, so no row "learned")."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sets = sets or {}
    own = checkpoint.read_config(checkpoint.located(checkpoint_dir))[1]
    over = dict(sets, attn="infllmv2") if not own.sparse else sets  # a dense model: no head
    model, tok = checkpoint.load(checkpoint_dir, dev, torch.float32, **over)
    ref = checkpoint.load(reference, dev, torch.float32)[0] if reference else model
    cfg = replace(model.cfg, attn="nosa")  # the selection every rule completes with its core
    T = T or min(2 * cfg.k * cfg.B, cfg.max_seq_len)  # a released model's k·B is 4096
    if T <= cfg.k * cfg.B:
        raise ValueError(
            f"bench eviction: {checkpoint_dir} selects k·B = {cfg.k * cfg.B} tokens and reads "
            f"at most {cfg.max_seq_len}: no window is sparse"
        )
    g = torch.Generator().manual_seed(seed)
    t0 = cfg.k * cfg.B  # from here on the selection is sparse
    per_layer = [dict() for _ in range(cfg.n_layer)]
    for x in held_out_windows(tok, windows, T):
        x = x.to(dev)
        rope = model.rope(torch.arange(T, device=dev)[None], torch.float32)
        h, hr = model.embed_tokens(x), ref.embed_tokens(x)
        for i, (layer, lr) in enumerate(zip(model.layers, ref.layers)):
            q, k, _, c = layer.self_attn.qkvc(layer.input_layernorm(h), rope)
            qr, kr, _, cr = (
                (q, k, None, c) if ref is model else lr.self_attn.qkvc(lr.input_layernorm(hr), rope)
            )
            mass = block_mass(qr, kr, cr, replace(cfg, attn=ref.cfg.attn), 0)  # in cfg's blocks
            for row, v in layer_captured(q, k, c, mass, cfg, t0, generator=g).items():
                per_layer[i][row] = [
                    a + x / windows for a, x in zip(per_layer[i].get(row, (0, 0)), v)
                ]
            h = layer(h, rope)
            hr = h if ref is model else lr(hr, rope)
    rows = []
    for row in per_layer[0]:
        r = {"E by": row if row != "infllmv2" else "InfLLMv2 (no core)"}
        r["held"] = round(sum(p[row][0] for p in per_layer) / cfg.n_layer, 4)
        for a, b in bands(cfg.n_layer):
            r[f"layers {a}-{b}"] = round(
                sum(p[row][0] for p in per_layer[a : b + 1]) / (b - a + 1), 4
            )
        if row != "infllmv2":
            r["core"] = round(sum(p[row][1] for p in per_layer) / cfg.n_layer, 4)
        r["layers"] = [round(p[row][0], 4) for p in per_layer]
        rows.append(r)
    return rows


def fields(text):
    """An argparse type: 'k=16' -> {"k": 16}, typed as the Config field."""
    from config import parse_overrides

    try:
        return parse_overrides([text])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--set {text}: ")) from None


class Merge(argparse.Action):
    """--set k=16 --set n_win=4 -> {"k": 16, "n_win": 4}"""

    def __call__(self, p, namespace, value, option=None):
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest) or {}), **value})


def flags(p):
    bench.add_checkpoint(p, "the model to diagnose (default: the embedded one)")
    p.add_argument(
        "--reference",
        metavar="DIR",
        help="the model whose dense attention measures the selections (default: the "
        "checkpoint's own), e.g. the dense model a NOSA model was continued from",
    )
    p.add_argument(
        "--windows", type=bench.at_least_one, help="held-out windows (default: %(default)s)"
    )
    p.add_argument(
        "--set",
        dest="sets",
        type=fields,
        action=Merge,
        metavar="FIELD=VALUE",
        help="a selection field to read the checkpoint at, e.g. --set k=16",
    )


COMMANDS = {"eviction": (bench_eviction, flags)}
