"""A pretrained model through NOSA by the paper's recipe (README: A real model): a dense model
imported with import_gguf.py, continued by train.py --init-from in full attention (the control),
InfLLMv2 and NOSA, and measured on the held-out files of the corpus the training read:

- loss on held-out windows of T tokens, at positions T/2 .. T-1, every model with its own attention,
  and the dense ones also decoded training-free as InfLLMv2 at the trained models' k; each row's
  difference to the control and to InfLLMv2 trained taken window by window, ± its standard error;
- what NOSA's eviction head keeps: how often its core holds the block the full-attention model
  attends to most, and how much of that attention it holds, against random and recent blocks;
- offloaded decode of held-out prompts: hit rate, blocks and bytes moved per step;
- long-range recall in the model's chat format: a number planted at a random depth of held-out
  code, asked for at the end ("The secret number is" begun for the assistant), greedy."""

import argparse
import os
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

import bench
import checkpoint
import data
import eviction
import pooling
from bench.eviction import block_mass, mass_share
from model import Attention

SPARSITY = ("B", "l_c", "s_c", "n_sink", "n_win", "k", "k_q")


def systems(dense, full, infllmv2, nosa):
    """(name, checkpoint, config overrides, whether the eviction head is turned off): each model
    with its own attention, the dense ones also training-free as InfLLMv2 at the NOSA model's
    sparsity, and NOSA with A = 0 (its bias gone and E flat: the core is the most recent blocks);
    then, where they were trained, NOSA with its head off throughout (DIR-nosa-off, train.py
    --evict-lr-mult 0), with the head's warm-up (DIR-nosa-warm, --head-warmup) and nosa-hh
    (DIR-nosa-hh)."""
    sparse = checkpoint.read_config(nosa)[1]
    as_infllmv2 = dict(attn="infllmv2", **{f: getattr(sparse, f) for f in SPARSITY})
    out = [
        ("full, imported", dense, {}, False),
        ("infllmv2 training-free, imported", dense, as_infllmv2, False),
        ("full, continued", full, {}, False),
        ("infllmv2 training-free, continued", full, as_infllmv2, False),
        ("nosa training-free, continued, A = 0", full, as_infllmv2 | dict(attn="nosa"), True),
        ("infllmv2, trained", infllmv2, {}, False),
        ("nosa, trained", nosa, {}, False),
        ("nosa, trained, A = 0", nosa, {}, True),
    ]
    warm, hh, off = f"{nosa}-warm", f"{dense}-nosa-hh", f"{nosa}-off"
    if checkpoint.is_checkpoint(off):  # train.py --evict-lr-mult 0
        out.append(("nosa, trained with its head off throughout", off, {}, False))
    if checkpoint.is_checkpoint(warm):
        out += [
            ("nosa + warm-up, trained", warm, {}, False),
            ("nosa + warm-up, A = 0", warm, {}, True),
        ]
    if checkpoint.is_checkpoint(hh):  # and its rule for E on the control, training-free
        r = checkpoint.read_config(hh)[1].hh_recency
        as_hh = as_infllmv2 | dict(attn="nosa-hh", hh_recency=r)
        out += [
            (f"nosa-hh training-free, continued, A = 0, hh_recency = {r:g}", full, as_hh, True),
            ("nosa-hh, trained", hh, {}, False),
            ("nosa-hh, trained, A = 0", hh, {}, True),
        ]
    return out


def load(path, over, head_off, dev):
    """A system's model, fp32: the checkpoint at its overrides, its eviction head turned off (A = 0:
    no bias; in nosa also E flat, so the core is the most recent blocks) where asked. A dense
    checkpoint read as NOSA (or nosa-hh, at the hh_recency asked) gets a head that is off:
    training-free."""
    if (
        over.get("attn") in ("nosa", "nosa-hh")
        and not checkpoint.read_config(path)[1].eviction_head
    ):
        as_infllmv2 = over | dict(attn="infllmv2", hh_recency=0)
        model = checkpoint.load(path, dev, torch.float32, **as_infllmv2)[0]
        cfg = replace(model.cfg, attn=over["attn"], hh_recency=over.get("hh_recency", 0))
        for m in model.modules():
            if isinstance(m, Attention):
                m.delta = torch.nn.Linear(cfg.H_kv * cfg.head_dim, cfg.H_kv, bias=False, device=dev)
                m.A = torch.nn.Parameter(torch.zeros(cfg.H_kv, device=dev))
            if hasattr(m, "cfg"):
                m.cfg = cfg
        return model
    model = checkpoint.load(path, dev, torch.float32, **over)[0]
    for layer in model.layers if head_off else ():
        layer.self_attn.A.data.zero_()
    return model


def captured(dense, full, systems_, windows=4, T=8192):
    """The share of the control's attention each trained selection holds (bench eviction, the
    control's dense attention as the measure, 8K windows), and the control read at the NOSA models'
    sparsity for the rules' bounds (recency, heavy hitter, oracle)."""
    from bench.eviction import bench_eviction

    sparse = checkpoint.read_config(f"{dense}-nosa")[1]
    sets = {f: getattr(sparse, f) for f in SPARSITY}
    rows = []
    for r in bench_eviction(full, None, windows, T, sets=sets):
        if r["E by"] in ("recency", "random", "heavy hitter", "oracle", "nosa-hh"):
            rows.append(dict(system=f"control, core by {r['E by']}", **strip(r)))
    row_of = {"infllmv2": "InfLLMv2 (no core)", "nosa": "learned", "nosa-hh": "nosa-hh"}
    for name, path, _, head_off in systems_:
        attn = checkpoint.read_config(path)[1].attn
        if "trained" not in name or head_off or attn not in row_of:
            continue
        for r in bench_eviction(path, full, windows, T):
            if r["E by"] == row_of[attn]:
                rows.append(dict(system=name, **strip(r)))
        print(rows[-1], flush=True)
    return rows


def strip(r):
    return {k: v for k, v in r.items() if k not in ("E by", "layers")}


@torch.no_grad()
def long_generation(control, systems_, val, dev, *, n=8, prompt=2048, new=2048):
    """The paper's long-generation claim: n held-out prompts continued for `new` tokens by each
    system (sampled, temperature 0.8, top-k 50, the same seed), scored by the control model: its
    loss on the continuation, per half."""
    from generate import Sampling, generate
    from kvcache import KVCache

    starts = np.linspace(0, len(val) - prompt - 1, n).astype(int) + prompt // 7
    prompts = [val[s : s + prompt].tolist() for s in starts % (len(val) - prompt - 1)]
    judge = checkpoint.load(control, dev, torch.float32)[0].to(
        torch.bfloat16 if dev == "cuda" else torch.float32
    )
    rows = []
    for name, path, over, head_off in systems_:
        if "imported" in name or head_off:
            continue
        model = checkpoint.load(path, dev, torch.float32, **over)[0].to(
            judge.embed_tokens.weight.dtype
        )
        torch.manual_seed(0)
        cache = KVCache(model.cfg, n, dev, judge.embed_tokens.weight.dtype, prompt + new)
        outs = generate(model, prompts, new, sampling=Sampling(0.8, 50), cache=cache)
        x = torch.tensor([p + o[:new] for p, o in zip(prompts, outs)], device=dev)
        logits = judge(x[:, :-1])[:, prompt - 1 :].float()
        nll = F.cross_entropy(logits.flatten(0, 1), x[:, prompt:].flatten(), reduction="none")
        nll = nll.view(n, -1)
        half = nll.shape[1] // 2
        rows.append(
            dict(
                system=name,
                control_loss_first_half=round(nll[:, :half].mean().item(), 4),
                control_loss_second_half=round(nll[:, half:].mean().item(), 4),
            )
        )
        print(rows[-1], flush=True)
        del model, cache
    return rows


def held_out(path, data_dir, corpus):
    """The validation stream of the corpus as train.py encoded it for the model at path."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    vocab = checkpoint.read_config(path)[1].vocab_size
    where = data.streams_dir(data_dir, corpus, vocab, tok)
    if not os.path.exists(os.path.join(where, "val.bin")):
        raise FileNotFoundError(
            f"{where}: no token streams; train.py --init-from {path} prepares them"
        )
    return np.asarray(data.tokens(os.path.join(where, "val.bin"), vocab)).astype(np.int64), tok


@torch.no_grad()
def window_losses(model, x, lo):
    """Mean loss per window at positions lo..T-1: x (n, T + 1)."""
    out = []
    for w in x:
        logits = model(w[None, :-1])[0, lo:].float()
        out.append(F.cross_entropy(logits, w[lo + 1 :]).item())
    return out


@torch.no_grad()
def core_against_dense(nosa, dense, x, generator):
    """NOSA's core (the n_core best candidate blocks by its E) against the full-attention model's
    attention on the same tokens x (1, T), from position k·B on, per layer: how often the block it
    attends to most is in the core (and by chance), and the share of its attention mass over the
    candidates that the core holds (and random picks, and the most recent blocks)."""
    cfg, T, dev = nosa.cfg, x.shape[1], x.device
    t0 = cfg.k * cfg.B
    rope = nosa.rope(torch.arange(T, device=dev)[None], torch.float32)
    hn, hd = nosa.embed_tokens(x), dense.embed_tokens(x)
    nb = cfg.n_blocks(T)
    b, q_blk = torch.arange(nb, device=dev), (torch.arange(t0, T, device=dev) // cfg.B)[:, None]
    cand = (b >= cfg.n_sink) & (b < q_blk - cfg.n_win)  # (T', nb)
    ok = cand.sum(-1) > cfg.n_core  # positions where the core is a choice
    rows = []
    for ln, ld in zip(nosa.layers, dense.layers):
        _, _, _, c = ln.self_attn.qkvc(ln.input_layernorm(hn), rope)
        q, k, _, _ = ld.self_attn.qkvc(ld.input_layernorm(hd), rope)
        mass = block_mass(q, k, None, cfg, t0)  # (H_kv, T', nb): the dense model's attention
        E = eviction.eviction_block_scores(pooling.pool_mean(c[0].float(), cfg), nb, cfg)
        core = eviction.core_blocks(E[:, None, :].expand_as(mass), cand, cfg.n_core)
        noise = torch.rand(mass.shape, generator=generator).to(dev)
        rand = eviction.core_blocks(noise, cand.expand_as(mass), cfg.n_core)
        recent = cand & (b >= q_blk - cfg.n_win - cfg.n_core)
        top = mass.masked_fill(~cand, -1).argmax(-1, keepdim=True)  # (H_kv, T', 1)
        rows.append(
            [
                core.gather(-1, top)[..., 0][:, ok].float().mean().item(),
                (cfg.n_core / cand.sum(-1).float())[ok].mean().item(),
                mass_share(mass, core, cand)[:, ok].nanmean().item(),
                mass_share(mass, rand, cand)[:, ok].nanmean().item(),
                mass_share(mass, recent, cand)[:, ok].nanmean().item(),
            ]
        )
        hn, hd = ln(hn, rope), ld(hd, rope)
    return rows


def recall_cases(tok, model, val, lengths, n, seed=0):
    """n chat prompts per length (tokens of held-out code around the planted fact): [(length,
    ids, key, position of the fact's number)]."""
    import console

    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        for _ in range(n):
            key = str(rng.integers(10000, 100000))
            s = int(rng.integers(0, len(val) - length))
            code = [t for t in val[s : s + length].tolist() if t not in model.eos_ids]
            depth = int(len(code) * rng.uniform(0.1, 0.9))
            head = tok.decode(code[:depth], skip_special_tokens=False)
            tail = tok.decode(code[depth:], skip_special_tokens=False)
            fact = f"\nThe secret number is {key}. Remember it.\n"
            user = f"{head}{fact}{tail}\nWhat is the secret number?"
            text = console.chat_prompt(model.chat_template, user, model.special_tokens)
            ids = tok.encode(text + "The secret number is", add_special_tokens=False).ids
            before = text[: text.index(fact) + len("\nThe secret number is")]
            at = len(tok.encode(before, add_special_tokens=False).ids)  # the number's first token
            out.append((length, ids, key, at))
    return out


@torch.no_grad()
def bench_pretrained(
    dense,
    corpus=None,
    data_dir=None,
    *,
    windows=16,
    T=8192,
    prompts=8,
    prompt_len=7000,
    new_tokens=256,
    recall_lengths=(2048, 4096, 7800),
    recall_n=8,
    captured_windows=2,
    long=(8, 2048, 1024),
):  # fmt: skip   (the defaults, with 8 windows: 3.5 minutes for 10 systems on an H100)
    """An imported dense model and the recipe's runs of it (DENSE-full, -infllmv2, -nosa), measured
    on the held-out files of their corpus: loss, captured attention, offloaded decode, recall and
    long generation (the module's docstring); a table each."""

    full, infllmv2, nosa = (f"{dense}-{attn}" for attn in ("full", "infllmv2", "nosa"))
    for path in (dense, full, infllmv2, nosa):  # all there before any work
        if not checkpoint.is_checkpoint(path):
            raise FileNotFoundError(
                f"{path}: no checkpoint; README (A real model) gives the commands that make it"
            )
    corpus = corpus or data.corpus_id()
    data_dir = data_dir or os.path.join(checkpoint.ROOT, "data")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    val, tok = held_out(dense, data_dir, corpus)
    starts = np.linspace(0, len(val) - T - 2, windows).astype(int)
    x = torch.tensor(np.stack([val[s : s + T + 1] for s in starts]), device=dev)
    starts = np.linspace(0, len(val) - prompt_len - 2, prompts).astype(int) + T // 3
    starts = starts % (len(val) - prompt_len - 1)  # (not where the loss windows start)
    prompt_ids = [val[s : s + prompt_len].tolist() for s in starts]
    cases = None
    loss, offload, recall, where, per_window = [], [], [], [], {}
    for name, path, over, head_off in systems(dense, full, infllmv2, nosa):
        model = load(path, over, head_off, dev)
        cfg = model.cfg
        per_window[name] = losses = window_losses(model, x, T // 2)
        loss.append(dict(system=name, loss=round(float(np.mean(losses)), 4), windows=windows))
        print(loss[-1], flush=True)
        model = model.to(dtype)
        if cases is None:
            cases = recall_cases(tok, model, val, recall_lengths, recall_n)
        if cfg.sparse:
            offload.append(dict(system=name) | offloaded_decode(model, prompt_ids, new_tokens))
            print(offload[-1], flush=True)
        row, fact = recall_row(model, tok, cases, recall_lengths)
        row, where = dict(system=name) | row, where + [dict(system=name) | f for f in fact]
        recall.append(row)
        print(row, flush=True)
        del model
    for r in loss:
        for key, ref in (
            ("full_continued", "full, continued"),
            ("infllmv2_trained", "infllmv2, trained"),
        ):
            r[f"vs_{key}"] = "{:+.2f} ± {:.2f}%".format(
                *paired(per_window[r["system"]], per_window[ref])
            )
        r["window_losses"] = np.round(per_window[r["system"]], 4).tolist()
    core = core_table(nosa, full, x[:4])
    sys_ = systems(dense, full, infllmv2, nosa)
    tables = dict(loss=loss, offload=offload, recall=recall, fact_in_selection=where, core=core)
    tables["captured"] = captured(dense, full, sys_, captured_windows, T)
    tables["long_generation"] = long_generation(
        full, sys_, val, dev, **dict(zip(("n", "prompt", "new"), long))
    )
    return tables


def paired(losses, ref):
    """How far behind ref a system's per-window losses are, in percent, the difference taken window
    by window: (mean, its standard error over the windows). Windows differ far more among
    themselves (1-7% for one system against another) than two systems differ on one window."""
    d = 100 * (np.asarray(losses) / np.asarray(ref) - 1)
    return d.mean(), d.std(ddof=1) / len(d) ** 0.5


def offloaded_decode(model, prompt_ids, new_tokens):
    """The held-out prompts decoded together through the offload engine (after a short warm-up
    whose moves are not counted): hit rate, blocks and MB moved a step."""
    from generate import Sampling, generate
    from offload import OffloadCache

    cfg, w = model.cfg, model.embed_tokens.weight
    n, P = len(prompt_ids), len(prompt_ids[0])
    cache = OffloadCache(cfg, n, w.device, w.dtype, max_len=P + new_tokens)
    generate(model, [p[: 64 + i % 2] for i, p in enumerate(prompt_ids)], 2, cache=cache)
    cache.reset_stats()
    torch.manual_seed(0)
    generate(model, prompt_ids, new_tokens, sampling=Sampling(0.8, 50), cache=cache)
    s = cache.stats
    steps, moved = max(s.steps, 1), s.moved.sum().item()
    return dict(
        hit_rate=round(1 - moved / max(s.needed.sum().item(), 1), 4),
        blocks_per_step=round(moved / steps, 1),
        MB_per_step=round(moved * s.unit_bytes / steps / 1e6, 3),
        batch=n,
        prompt=P,
    )


def recall_row(model, tok, cases, lengths):
    """Recall at each length (greedy, 8 tokens; a hit where the number is in them), and for a
    sparse model at the longest, where the fact's block stands in the selection. Returns the row
    and those shares (a dict a length)."""
    from bench.recall import where_the_fact_is
    from generate import generate
    from kvcache import KVCache

    cfg, w = model.cfg, model.embed_tokens.weight
    row, where = {}, []
    for length in lengths:
        mine = [c for c in cases if c[0] == length]
        cache = KVCache(cfg, len(mine), w.device, w.dtype, max(len(c[1]) for c in mine) + 8)
        outs = generate(model, [c[1] for c in mine], 8, cache=cache)
        hits = [key in tok.decode(o).replace(" ", "") for (_, _, key, _), o in zip(mine, outs)]
        row[f"recall_{length}"] = f"{sum(hits)}/{len(hits)}"
        if cfg.sparse and length == lengths[-1]:  # where the fact's block stands
            parts = [
                p
                for _, ids, _, at in mine
                for p in where_the_fact_is(model, ids, len(ids) - 1, at // cfg.B)
            ]
            shares = {
                p: round(parts.count(p) / len(parts), 3) for p in ("forced", "Q", "E", "none")
            }
            where.append(dict(length=length) | shares)
    return row, where


def core_table(nosa, full, windows):
    """How the NOSA model's core stands against the control's dense attention (core_against_dense),
    over the windows: the mean over layers, then a row a layer."""
    dev = windows.device
    nosa_m = checkpoint.load(nosa, dev, torch.float32)[0]
    dense_m = checkpoint.load(full, dev, torch.float32)[0]
    g = torch.Generator().manual_seed(0)
    per_layer = np.mean([core_against_dense(nosa_m, dense_m, w[None, :-1], g) for w in windows], 0)
    keys = ("top_block_in_core", "by_chance", "mass_in_core", "mass_random", "mass_recent")
    core = [dict(layer="mean") | dict(zip(keys, np.round(per_layer.mean(0), 3).tolist()))]
    return core + [
        dict(layer=i) | dict(zip(keys, np.round(r, 3).tolist())) for i, r in enumerate(per_layer)
    ]


def flags(p):
    p.add_argument(
        "--checkpoint",
        dest="dense",
        metavar="DIR",
        required=True,
        help="the imported dense model DIR, continued by train.py into DIR-full, DIR-infllmv2, "
        "DIR-nosa",
    )
    p.add_argument(
        "--corpus",
        help="the id of the corpus the models were trained on (train_state.json's; default: the "
        "standard library here), whose held-out files are read from data/",
    )
    p.add_argument(
        "--windows",
        type=at_least_two,
        help="held-out windows of 8192 for the loss (default: %(default)s)",
    )
    p.add_argument(
        "--cases",
        dest="recall_n",
        type=bench.at_least_one,
        help="recall tasks per length (default: %(default)s)",
    )


def at_least_two(text):
    """An argparse type: a whole number >= 2 (a standard error needs two windows)."""
    if bench.at_least_one(text) < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r}: at least 2, so that each difference has an error"
        )
    return int(text)


COMMANDS = {"pretrained": (bench_pretrained, flags)}
