"""Long-range recall (tasks.py) of the tiny models train.py makes: exact-match accuracy of the answer
under greedy decoding, binned by the distance from the fact to the question, for every mode and the
training-free baseline (bench.quality.SYSTEMS), the sparse modes decoding through the offload engine
(hit rate beside it); and, for the modes with selection, where the fact's block stands when the
answer's first token is predicted: in the window (forced), picked by Q, in E's core, or not selected;
beside it how much of the model's own dense attention falls on the fact's block there, and for the
modes with an eviction head how c and E rank the fact (eviction_at_the_question). bench_head: whether
the eviction head can learn to keep a fact when it alone learns, from the answers' loss alone."""

import json

import numpy as np
import torch
import torch.nn.functional as F

import bench
import checkpoint
import eviction
import nosa
import pooling
import tasks
from bench.quality import CKPTS, SYSTEMS, trained_path


def cases(tok, filler, distances, n, length, seed=0):
    """n tasks per distance (kinds in turn), each `length` tokens: {distance: [(ids, answer_at, n_answer,
    fact_at)]}, the same for every system."""
    rng = np.random.default_rng(seed)
    return {
        d: [
            tasks.make_task(tasks.KINDS[i % len(tasks.KINDS)], tok, filler, length, d, rng)
            for i in range(n)
        ]
        for d in distances
    }


def value_at(case):
    """Where the fact's value (the tokens the answer copies) starts: the answer's first occurrence
    from the first fact on (the value ends the passkey's, the asked needle's and the chain's first fact)."""
    ids, answer_at, n, fact_at = case
    want = ids[answer_at : answer_at + n].tolist()
    return next(j for j in range(fact_at, answer_at) if ids[j : j + n].tolist() == want)


def held_out_tokens(ckpt, tok):
    """The filler of the tasks: the validation tokens of the corpus the checkpoint was trained on, from
    its prepared cache (data/CORPUS-VOCAB: the same on any machine it is copied to), else the held-out
    files of this machine's standard library."""
    import json
    import os

    import data as corpus

    state = json.load(open(os.path.join(ckpt, "train_state.json")))
    path = os.path.join(
        checkpoint.ROOT, "data", f"{state.get('corpus')}-{tok.get_vocab_size()}", "val.bin"
    )
    if os.path.exists(path):
        return np.asarray(corpus.tokens(path, tok.get_vocab_size())).astype(np.int64)
    return np.array(
        [
            i
            for name, text in corpus.documents()
            if corpus.is_val(name)
            for i in tok.encode(text).ids
        ]
    )


@torch.no_grad()
def where_the_fact_is(model, ids, t, b_fact):
    """For each layer and KV head, how the fact's block b_fact stands in Γ(t), the selection of the query
    at position t over the prefix ids[:t+1]: 'forced' (sink, window, own block), 'Q', 'E' (the core) or
    'none'. Computed from the layer's own q, k, c, as nosa_attention selects."""
    cfg, dev = model.cfg, model.embed_tokens.weight.device
    idx = torch.tensor(ids[: t + 1], device=dev)[None]
    x = model.embed_tokens(idx)
    rope = model.rope(torch.arange(t + 1, device=dev)[None], x.dtype)
    out = []
    for layer in model.layers:
        q, k, _, c = layer.self_attn.qkvc(layer.input_layernorm(x), rope)
        nb, pos = cfg.n_blocks(t + 1), torch.tensor([[t]], device=dev)
        Q = pooling.query_aware_scores(q[:, :, -1:], pooling.compress_keys(k, cfg), pos, nb, cfg)[
            :, :, 0
        ]
        b, q_blk = torch.arange(nb, device=dev), t // cfg.B
        forced = (b <= q_blk) & ((b < cfg.n_sink) | (b >= q_blk - cfg.n_win))
        cand = (b <= q_blk) & ~forced
        pick_q = eviction.top_desc(Q, cand, cfg.k_q_free)  # (1, H_kv, nb)
        pick_e = torch.zeros_like(pick_q)
        if c is not None and cfg.n_core > 0:
            scores = pooling.pool_mean(c, cfg)  # c̃, or nosa-hh's h
            if cfg.heavy_hitters:
                scores = eviction.hh_scores(eviction.heavy_hitters(q, k, c, cfg), cfg)
            ids_e = nosa.e_lists(scores, pos, cfg)[:, :, 0]  # (1, H_kv, n)
            pick_e = eviction.core_picks(
                ids_e, pick_q.gather(-1, ids_e.clamp(min=0)), cfg.n_core, nb
            )
        few = q_blk + 1 <= cfg.k
        for h in range(cfg.H_kv):
            out.append(
                "forced"
                if few or forced[b_fact]
                else "Q"
                if pick_q[0, h, b_fact]
                else "E"
                if pick_e[0, h, b_fact]
                else "none"
            )
        x = layer(x, rope)
    return out


@torch.no_grad()
def eviction_at_the_question(model, ids, t, v, n):
    """The eviction head where a far block is needed: the query at position t (the question's last
    token) over the prefix ids[:t+1], per layer and KV head, from the layer's own q, k, c; the fact's
    value (what the answer copies) is ids[v:v+n], its block the one of its first token.
    Returns {layer: dict} of: c_fact_z, how far c on the value's tokens stands above c on the rest of
    the prefix (in standard deviations of c); E_rank_fact, the value's block's place among the
    candidate blocks by E (1 = no candidate above it, 0 = all); dense_fact, the share of the query's
    dense attention mass over the candidates that falls on the blocks the value spans (what a core
    would have to keep); and bench eviction's shares at this one position (the core by E, by recency, at random)."""
    from bench.eviction import block_mass, layer_shares

    cfg, dev = model.cfg, model.embed_tokens.weight.device
    idx = torch.tensor(ids[: t + 1], device=dev)[None]
    x = model.embed_tokens(idx)
    rope = model.rope(torch.arange(t + 1, device=dev)[None], x.dtype)
    nb, q_blk, b_fact = cfg.n_blocks(t + 1), t // cfg.B, v // cfg.B
    b = torch.arange(nb, device=dev)
    cand = (b >= cfg.n_sink) & (b < q_blk - cfg.n_win)
    value = torch.zeros(t + 1, dtype=torch.bool, device=dev)
    value[v : v + n] = True
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, layer in enumerate(model.layers):
        q, k, _, c = layer.self_attn.qkvc(layer.input_layernorm(x), rope)
        row = dict(
            zip(("share_E", "share_recency", "share_random"), layer_shares(q, k, c, cfg, t, g))
        )
        if c is not None and cand[b_fact]:
            cf = c[0].float()  # (H_kv, t+1)
            rest = cf[:, ~value]
            row["c_fact_z"] = ((cf[:, value].mean(-1) - rest.mean(-1)) / rest.std(-1)).mean().item()
            E = eviction.eviction_block_scores(pooling.pool_mean(c, cfg), nb, cfg)[0]  # (H_kv, nb)
            # the others at or below it
            below = ((E <= E[:, b_fact : b_fact + 1]) & cand).sum(-1).float() - 1
            row["E_rank_fact"] = (below / max(int(cand.sum()) - 1, 1)).mean().item()
        if cand[b_fact]:
            mass = block_mass(q, k, c, cfg, t)[:, -1]  # (H_kv, nb): the question's dense attention
            held = cand & (b >= b_fact) & (b <= (v + n - 1) // cfg.B)  # the blocks the value spans
            row["dense_fact"] = ((mass * held).sum(-1) / (mass * cand).sum(-1)).mean().item()
        out[i] = row
        x = layer(x, rope)
    return out


def fact_standing(model, cs, where=True):
    """For the cases cs at the question's last token: where the value's block stands in Γ(t), per layer
    and KV head (where_the_fact_is; [] unless `where`), and eviction_at_the_question's rows per layer."""
    at_q = [(c[0].tolist(), c[1] - 1, value_at(c), c[2]) for c in cs]
    return (
        [w for ids, t, v, _ in at_q for w in where_the_fact_is(model, ids, t, v // model.cfg.B)]
        if where
        else [],
        [
            r
            for ids, t, v, n in at_q
            for r in eviction_at_the_question(model, ids, t, v, n).values()
        ],
    )


def answer_loss(model, ids, at, n):
    """Cross-entropy of the answer's n tokens at `at` given what precedes it: ids (L,) -> a scalar tensor."""
    x = torch.as_tensor(ids, device=model.embed_tokens.weight.device)
    logits = model(x[None, : at + n - 1])[0, at - 1 :]
    return F.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)), x[at : at + n]
    )


def gradient_on_the_value(model, case, offset=None):
    """What the eviction head hears of a fact in training: the answer's loss (teacher-forced, through
    the parallel forward) differentiated by every layer's eviction scores c. Returns (on_value,
    elsewhere): the mean of -dL/dc over the value's tokens (> 0: a larger c there would lower the
    loss), and the mean of |dL/dc| over the other tokens before the question; over layers and KV
    heads. offset: add this to c on the value's tokens first, and return the loss instead (tests)."""
    ids, at, n, _ = case
    v = value_at(case)
    cs, score = [], eviction.eviction_score

    def keep(*args):  # each layer's c, kept with its gradient
        c = score(*args)
        if offset is not None:
            c = c + F.pad(
                torch.full((n,), offset, dtype=c.dtype, device=c.device), (v, c.shape[-1] - v - n)
            )
        c.retain_grad()
        cs.append(c)
        return c

    eviction.eviction_score = keep
    try:
        with torch.enable_grad():
            loss = answer_loss(model, ids, at, n)
            if offset is not None:
                return loss.item()
            loss.backward()
    finally:
        eviction.eviction_score = score
        model.zero_grad(set_to_none=True)
    g = -torch.stack([c.grad[0] for c in cs])  # (layers, H_kv, T)
    return g[..., v : v + n].mean().item(), torch.cat(
        [g[..., :v], g[..., v + n : at]], -1
    ).abs().mean().item()


# bench_recall's bins, in tokens from the fact to the question
DISTANCES = (128, 256, 512, 1024, 2048, 4000)


def bench_recall(
    ckpts=CKPTS, systems=tuple(SYSTEMS), distances=DISTANCES, *, n=200, seed=0, where_cases=20,
    json_path=None,
):  # fmt: skip
    """Accuracy per distance bin and system; the fact's standing for `where_cases` cases per bin. The
    bins reach twice and about four times the tiny models' 1024-token training windows (4000: about
    the farthest a 4096-token context holds with the question and the longest answer); a bin the
    model's context cannot hold is skipped. json_path: the rows so far are written there after each
    bin, so a run stopped early keeps what it measured."""
    from generate import generate
    from kvcache import KVCache
    from offload import OffloadCache

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    # all there before any work
    paths = {SYSTEMS[s][0]: trained_path(ckpts, SYSTEMS[s][0]) for s in systems}
    first = next(iter(paths.values()))
    _, tok = checkpoint.load(first)
    val = held_out_tokens(first, tok)
    rows = []
    for name in systems:
        ck, attn = SYSTEMS[name]
        model, _ = checkpoint.load(paths[ck], dev, dtype, **({"attn": attn} if attn else {}))
        cfg = model.cfg
        for d in distances:
            length = d + 64  # room before the fact for the sinks, and for the question and answer
            cs = cases(tok, val, [d], n, length, seed)[d]
            prompts = [c[0][: c[1]].tolist() for c in cs]
            G = max(c[2] for c in cs)  # every prompt is followed by the longest answer's tokens
            if max(map(len, prompts)) + G > cfg.max_seq_len:
                print(
                    f"recall: {name} skips distance {d}: prompts and answers exceed max_seq_len={cfg.max_seq_len}"
                )
                continue
            cache = (
                OffloadCache(cfg, len(prompts), dev, dtype, max_len=length + G)
                if cfg.sparse
                else KVCache(cfg, len(prompts), dev, dtype, length + G)
            )
            out = generate(model, prompts, G, cache=cache)
            correct = [o[: c[2]] == c[0][c[1] :].tolist() for o, c in zip(out, cs)]
            row = dict(
                system=name, distance=d, cases=len(cs), accuracy=round(float(np.mean(correct)), 3)
            )
            where, ev = fact_standing(model, cs[:where_cases], cfg.sparse)
            if cfg.sparse:
                s = cache.stats
                row["hit_rate"] = round(1 - s.moved.sum().item() / max(s.needed.sum().item(), 1), 3)
                for kind in ("forced", "Q", "E", "none"):
                    row[f"fact_{kind}"] = round(where.count(kind) / len(where), 3)
            # means over cases, layers and KV heads
            for key in ("dense_fact", "c_fact_z", "E_rank_fact"):
                if any(key in r for r in ev):
                    row[key] = round(float(np.mean([r[key] for r in ev if key in r])), 3)
            if cfg.eviction_head:
                on, off = np.mean([gradient_on_the_value(model, c) for c in cs[:where_cases]], 0)
                row.update(dLdc_value=float(f"{on:.3g}"), dLdc_elsewhere=float(f"{off:.3g}"))
            rows.append(row)
            print(row, flush=True)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(rows, f, indent=1)
    return rows


def train_head(model, tok, filler, steps, rng, *, batch=4, length=1025, lr=1e-2):
    """Train only the eviction heads (A, W_δ) of every layer, the rest frozen, on recall tasks alone (a
    random kind at a random distance past k·B), by the answer's loss alone: the signal the head gets
    when nothing dilutes it. Returns the losses of the steps."""
    cfg = model.cfg
    head = [p for blk in model.layers for p in (blk.self_attn.A, blk.self_attn.delta.weight)]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in head:
        p.requires_grad_(True)
    opt = torch.optim.Adam(head, lr=lr)
    losses = []
    for _ in range(steps):
        loss = 0
        for _ in range(batch):
            kind = tasks.KINDS[int(rng.integers(0, len(tasks.KINDS)))]
            ids, at, n, _ = tasks.make_task(
                kind, tok, filler, length, int(rng.integers(cfg.k * cfg.B, length - 24)), rng
            )
            loss = loss + answer_loss(model, ids, at, n) / batch
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for p in head:
        p.requires_grad_(False)
    return losses


def bench_head(
    checkpoint_dir=checkpoint.DEFAULT_CHECKPOINT, steps=150, distances=(256, 768), *, n=24,
    where_cases=8, seed=0,
):  # fmt: skip
    """Can the eviction head learn to keep a fact? A trained model with an eviction head, frozen but for
    the heads, trained on recall tasks by the answer's loss (train_head), from its own head ('as trained')
    and from A = 1, W_δ = 0 ('A = 1, W_δ = 0': c constant, the same function as A = 0, but W_δ's
    gradient is not scaled by A); before and after: the answer's loss on held-out tasks, where the
    value's block stands (where_the_fact_is) and how c ranks it (eviction_at_the_question), and the
    loss on held-out Python text (what the tuned heads cost the text)."""
    import train

    _, tok = checkpoint.load(checkpoint_dir)
    val = held_out_tokens(checkpoint_dir, tok)
    # tasks to learn from and to test on
    train_fill, test_fill = (val[: len(val) // 2], val[len(val) // 2 :])
    rows = []
    for init in ("as trained", "A = 1, W_δ = 0"):
        model, _ = checkpoint.load(checkpoint_dir, dtype=torch.float32)
        if not model.cfg.eviction_head:
            raise ValueError(
                f"{checkpoint_dir}: bench head needs a model with an eviction head (nosa or dma)"
            )
        if init != "as trained":
            for blk in model.layers:
                torch.nn.init.ones_(blk.self_attn.A)
                torch.nn.init.zeros_(blk.self_attn.delta.weight)
        for phase in ("before", "after"):
            if phase == "after":
                losses = train_head(model, tok, train_fill, steps, np.random.default_rng(seed))
            # what the heads cost the text: the held-out half's loss, 6 x 8 windows
            with torch.no_grad():
                text_loss = train.evaluate(
                    model, test_fill, 8, 1024, torch.device("cpu"), n_batches=6
                )
            for d in distances:
                cs = cases(tok, test_fill, [d], n, d + 64, seed + d)[d]
                with torch.no_grad():
                    loss = np.mean([answer_loss(model, c[0], c[1], c[2]).item() for c in cs])
                where, ev = fact_standing(model, cs[:where_cases])
                # none while c is constant
                z = [r["c_fact_z"] for r in ev if np.isfinite(r.get("c_fact_z", np.nan))]
                row = dict(
                    init=init,
                    phase=phase,
                    steps=steps if phase == "after" else 0,
                    distance=d,
                    cases=n,
                    answer_loss=round(float(loss), 3),
                    text_loss=round(text_loss, 3),
                    **{
                        f"fact_{k}": round(where.count(k) / len(where), 3)
                        for k in ("Q", "E", "none")
                    },
                    c_fact_z=round(float(np.mean(z)), 2) if z else None,
                    mean_abs_A=round(
                        float(
                            np.mean([blk.self_attn.A.abs().mean().item() for blk in model.layers])
                        ),
                        3,
                    ),
                )
                if phase == "after":
                    row["train_loss_first_last_10"] = (
                        round(float(np.mean(losses[:10])), 3),
                        round(float(np.mean(losses[-10:])), 3),
                    )
                rows.append(row)
                print(row, flush=True)
    return rows


def recall_flags(p):
    bench.add_ckpts(p, "where train.py wrote tiny-nosa/, tiny-full/, ... (default: %(default)s)")
    bench.add_systems(p, SYSTEMS)
    p.add_argument(
        "--distances",
        type=bench.positive_ints,
        help="the distance bins in tokens, e.g. 128,256,512 (default: %(default)s)",
    )
    p.add_argument(
        "--cases",
        dest="n",
        type=bench.at_least_one,
        help="tasks per distance (default: %(default)s)",
    )


def head_flags(p):
    bench.add_checkpoint(p, "a model with an eviction head (default: the embedded one)")
    p.add_argument("--steps", type=bench.at_least_one, help="training steps (default: %(default)s)")
    p.add_argument(
        "--distances", type=bench.positive_ints, help="distances in tokens (default: %(default)s)"
    )


COMMANDS = {"recall": (bench_recall, recall_flags), "head": (bench_head, head_flags)}
