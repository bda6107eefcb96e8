"""Long-sequence quality of the tiny models train.py makes, against a training-free sparse decode."""

import os

import torch
import torch.nn.functional as F

import bench
import checkpoint

# name -> (the model in ckpts/tiny-NAME, the attention it decodes with; None: the one it was trained with)
# the training-free baseline
SYSTEMS = {
    "nosa": ("nosa", None),
    "full": ("full", None),
    "infllmv2": ("infllmv2", None),
    "dma": ("dma", None),
    "full-as-infllmv2": ("full", "infllmv2"),
}


CKPTS = os.path.join(checkpoint.ROOT, "out")  # where train.py's tiny models are by default


def trained_path(ckpts, attn):
    """Where train.py --attn ATTN puts its tiny model: ckpts/tiny-ATTN (ckpts = out/ by default)."""
    path = os.path.join(ckpts, f"tiny-{attn}")
    if not checkpoint.is_checkpoint(path):
        raise FileNotFoundError(
            f"{path}: no trained {attn} model; train it with `python train.py --attn {attn} "
            f"--out {path}` (BENCHMARKS.md gives the settings), or point --ckpts elsewhere"
        )
    return path


def distinct_4grams(seqs):
    """Mean share of distinct 4-grams per sequence: 1 for no repetition, near 0 for a loop."""
    return sum(
        len({tuple(t[i : i + 4]) for i in range(len(t) - 3)}) / (len(t) - 3) for t in seqs
    ) / len(seqs)


def held_out(tok):
    """The held-out files of the default corpus, as train.py splits them, as one tensor of ids."""
    import data as corpus

    eot = tok.token_to_id(corpus.EOT)
    docs = [text for name, text in corpus.documents() if corpus.is_val(name)]
    return torch.tensor([i for text in docs for i in tok.encode(text).ids + [eot]])


def token_losses(model, seqs):
    """Each next token's loss under model, a row per sequence of seqs (n, T + 1) -> (n, T)."""
    return torch.stack(
        [F.cross_entropy(model(s[None, :-1])[0], s[1:], reduction="none") for s in seqs]
    )


def bench_quality(
    ckpts=CKPTS, systems=tuple(SYSTEMS), judge=None, *, max_new_tokens=1024, windows=16,
    n_prompts=8, prompt_len=128,
):  # fmt: skip
    """Long-sequence quality of the tiny models trained by train.py (ckpts/tiny-{nosa,full,...}):
    teacher-forced loss on held-out windows of max_new_tokens tokens (by position: the first k·B are
    dense for every model), and free generations of max_new_tokens tokens from n_prompts held-out
    prompts, decoded together (sparse modes through the offload engine, which reports its hit rate)
    and scored by the judge (default: ckpts/tiny-full; best a full-attention model that is none of
    the contestants). 'full-as-infllmv2' is the training-free baseline: the full-attention model
    decoded with InfLLMv2-style selection at the same budget k."""
    from generate import Sampling, generate
    from kvcache import KVCache
    from offload import OffloadCache

    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown system(s) {sorted(unknown)}; choose from {list(SYSTEMS)}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # all there before any work
    paths = {SYSTEMS[s][0]: trained_path(ckpts, SYSTEMS[s][0]) for s in systems}
    judge_path = judge or trained_path(ckpts, "full")
    judge, tok = checkpoint.load(judge_path, dev, torch.float32)
    judge.check_length(prompt_len, max_new_tokens)
    val = held_out(tok)
    kB = judge.cfg.k * judge.cfg.B
    starts = torch.linspace(0, len(val) - max_new_tokens - 1, windows).long()
    x = torch.stack([val[s : s + max_new_tokens + 1] for s in starts]).to(dev)
    prompts = [val[s : s + prompt_len].tolist() for s in starts[:n_prompts]]
    rows = []
    for name in systems:
        ck, attn = SYSTEMS[name]
        model, _ = checkpoint.load(
            paths[ck], dev, torch.float32, **({"attn": attn} if attn else {})
        )
        model.check_length(prompt_len, max_new_tokens)
        cfg = model.cfg
        with torch.no_grad():
            nll = token_losses(model, x)
            cache = (
                OffloadCache(
                    cfg, n_prompts, dev, torch.float32, max_len=prompt_len + max_new_tokens
                )
                if cfg.sparse
                else KVCache(cfg, n_prompts, dev, torch.float32, prompt_len + max_new_tokens)
            )
            torch.manual_seed(0)
            gen = generate(model, prompts, max_new_tokens, sampling=Sampling(0.8, 50), cache=cache)
            full = torch.tensor([p + g for p, g in zip(prompts, gen)], device=dev)
            judged = token_losses(judge, full)[:, prompt_len - 1 :]
        row = dict(
            system=name,
            val_loss_dense_part=round(nll[:, :kB].mean().item(), 3),
            val_loss_sparse_part=round(nll[:, kB:].mean().item(), 3),
            gen_judge_loss_first_kB=round(judged[:, :kB].mean().item(), 3),
            gen_judge_loss_last_kB=round(judged[:, -kB:].mean().item(), 3),
            gen_distinct_4grams_last_kB=round(distinct_4grams([g[-kB:] for g in gen]), 3),
        )
        if cfg.sparse:
            s = cache.stats
            row["hit_rate"] = round(1 - s.moved.sum().item() / max(s.needed.sum().item(), 1), 3)
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


def flags(p):
    bench.add_ckpts(p, "where train.py wrote tiny-nosa/, tiny-full/, ... (default: %(default)s)")
    bench.add_systems(p, SYSTEMS)
    p.add_argument(
        "--judge",
        metavar="DIR",
        help="the model that scores the generations (default: CKPTS/tiny-full)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=bench.at_least_one,
        help="tokens generated, and the teacher-forced window (default: %(default)s)",
    )


COMMANDS = {"quality": (bench_quality, flags)}
