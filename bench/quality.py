"""Long-sequence quality of the tiny models train.py makes, against a training-free sparse decode."""
import os

import torch
import torch.nn.functional as F

import checkpoint


def trained_path(ckpts, attn):
    """Where train.py --attn ATTN puts its tiny model: ckpts/tiny-ATTN (ckpts = out/ by default)."""
    path = os.path.join(ckpts, f"tiny-{attn}")
    if not checkpoint.is_checkpoint(path):
        raise FileNotFoundError(f"{path}: no trained {attn} model; train it with `python train.py --attn {attn} "
                                f"--out {path}` (BENCHMARKS.md gives the settings), or point --ckpts elsewhere")
    return path


def bench_quality(ckpts, windows=16, T=1024, n_prompts=8, prompt_len=128, gen_len=1024):
    """Long-sequence quality of the tiny models trained by train.py (ckpts/tiny-{nosa,full,infllmv2,dma}):
    teacher-forced loss on held-out windows (by position: the first k·B tokens are dense for every
    model), and free generations of gen_len tokens scored by the full-attention model. 'full as
    infllmv2' is the training-free baseline: the full-attention model decoded with InfLLMv2-style
    selection at the same budget k."""
    import train
    from generate import generate
    from kvcache import KVCache
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    systems = [("nosa", "nosa", None), ("full", "full", None), ("infllmv2", "infllmv2", None),
               ("dma", "dma", None), ("full as infllmv2 (training-free)", "full", "infllmv2")]
    paths = {ck: trained_path(ckpts, ck) for _, ck, _ in systems}  # all there before any work
    judge, tok = checkpoint.load(paths["full"], dev, torch.float32)
    eot = tok.token_to_id(train.EOT)  # the held-out files of the default corpus, as train.py splits them
    val = torch.tensor([i for name, text in train.documents() if train.is_val(name)
                        for i in tok.encode(text).ids + [eot]])
    kB = judge.cfg.k * judge.cfg.B
    starts = torch.linspace(0, len(val) - T - 1, windows).long()
    x = torch.stack([val[s:s + T] for s in starts]).to(dev)
    prompts = [val[s:s + prompt_len].tolist() for s in starts[:n_prompts]]
    rows = []
    for name, ck, attn in systems:
        model, _ = checkpoint.load(paths[ck], dev, torch.float32, **({"attn": attn} if attn else {}))
        with torch.no_grad():
            nll = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(windows, -1)
            torch.manual_seed(0)
            gen = generate(model, prompts, gen_len, temperature=0.8, top_k=50,
                           cache=KVCache(model.cfg, n_prompts, dev, torch.float32))
            full = torch.tensor([p + g for p, g in zip(prompts, gen)], device=dev)
            judged = F.cross_entropy(judge(full[:, :-1]).flatten(0, 1), full[:, 1:].flatten(), reduction="none")
            judged = judged.view(n_prompts, -1)[:, prompt_len - 1:]
        tail = [g[-kB:] for g in gen]  # repetition: share of distinct 4-grams in the last k·B tokens
        distinct = sum(len({tuple(t[i:i + 4]) for i in range(len(t) - 3)}) / (len(t) - 3) for t in tail) / len(tail)
        rows.append(dict(system=name, val_loss_dense_part=round(nll[:, :kB].mean().item(), 3),
                         val_loss_sparse_part=round(nll[:, kB:].mean().item(), 3),
                         gen_judge_loss_first_kB=round(judged[:, :kB].mean().item(), 3),
                         gen_judge_loss_last_kB=round(judged[:, -kB:].mean().item(), 3),
                         gen_distinct_4grams_last_kB=round(distinct, 3)))
        print(rows[-1], flush=True)
    return rows
