"""
Train a NOSA model (or one of its baselines) on text that every machine has: the Python standard
library's own source and its pydoc topics, read from the running interpreter. No download.

    python train.py                                   # tiny preset, NOSA -> out/tiny-nosa (CPU: ~10 min)
    python train.py --attn full                       # -> out/tiny-full
    python train.py --data my_texts/ --steps 5000 --out out/mine   # any other text files
    torchrun --nproc_per_node=2 train.py              # DistributedDataParallel (gloo on CPU, NCCL on GPUs)
    python generate.py --checkpoint out/tiny-nosa     # what the first command trained

The sparse pattern is the same in training and in decoding (nosa.py), so the model learns to use
exactly the blocks it will see at inference. Checkpoints: checkpoint.py.
"""

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import checkpoint
import common
import config
from config import Config
from data import STDLIB_CORPUS, corpus_id, get_batch, prepare
from model import Transformer

SHAPE_FIELDS = (
    "vocab_size",
    "n_layer",
    "dim",
    "H_q",
    "H_kv",
    "head_dim",
    "hidden_dim",
    "tie_embeddings",
)


def lm_loss(logits, y, w=None):
    """Cross-entropy of the next tokens, each weighted by w (Bz, T) if given: sum(w · loss) / sum(w)."""
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), y.flatten(), reduction="none" if w is not None else "mean"
    )
    return loss if w is None else (loss * w.flatten()).sum() / w.sum()


# -----------------------------------------------------------------------------
# Training


def lr_at(step, steps, lr, warmup):
    """Linear warm-up, then cosine decay to lr / 10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


@torch.no_grad()
def evaluate(model, val, batch_size, T, device, n_batches=8):
    model.eval()
    losses = []
    for i in range(n_batches):  # the same windows every time
        x, y, _ = get_batch(val, batch_size, T, seed=0, step=i, rank=0, device=device)
        with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x)
        losses.append(lm_loss(logits, y).item())
    model.train()
    return sum(losses) / len(losses)


def main(
    preset="tiny",
    attn="nosa",
    out=None,
    data=None,
    data_dir=None,
    steps=120,
    batch_size=4,
    seq_len=1024,
    lr=3e-3,
    warmup=20,
    weight_decay=0.1,
    grad_clip=1.0,
    eval_every=40,
    seed=1337,
    device=None,
    resume=False,
    force=False,
    stop_at=None,
    save_bf16=False,
    log_every=10,
    evict_lr_mult=1.0,
    init_from=None,
    tasks=0.0,
    corpus=None,
    answer_weight=1.0,
    **overrides,
):
    """Train; returns (model, last validation loss). `overrides` go to the Config (tests use tiny shapes).
    out defaults to out/{preset}-{attn} and data_dir to data/, both in the repository, whatever the
    working directory. An existing checkpoint in out is continued with resume, replaced with force,
    and otherwise left alone. init_from: start from that checkpoint's weights (its shape; any mode),
    e.g. NOSA continued from a dense model, as the paper trains; an eviction head it lacks starts
    from its initialisation (A = 0: the first steps compute what the dense model did). corpus: train on the
    token streams already prepared for that corpus id in data_dir, without its files (another machine's
    standard library, carried as data/ID-VOCAB)."""
    for name, value, least in (
        ("--steps", steps, 1),
        ("--batch-size", batch_size, 1),
        ("--seq-len", seq_len, 1),
        ("--eval-every", eval_every, 1),
        ("--log-every", log_every, 1),
        ("--warmup", warmup, 0),
        ("--stop-at", stop_at or 1, 1),
    ):
        if value < least:
            raise ValueError(f"{name} {value}: must be at least {least}")
    if not lr > 0:
        raise ValueError(f"--lr {lr}: must be positive")
    if not 0 <= tasks <= 1:
        raise ValueError(f"--tasks {tasks}: a fraction of the training windows, from 0 to 1")
    if not answer_weight > 0 or (answer_weight != 1.0 and not tasks):
        raise ValueError(
            f"--answer-weight {answer_weight}: a positive weight of the tasks' answers, with --tasks"
        )
    common.pick_device(device)  # a device this torch lacks fails here, before anything else
    out = out or os.path.join(checkpoint.ROOT, "out", f"{preset}-{attn}")
    data_dir = data_dir or os.path.join(checkpoint.ROOT, "data")
    if init_from and resume:
        raise ValueError("--init-from starts a new run; --resume continues one: give one of them")
    if init_from:
        init_from = checkpoint.resolve(init_from)
        if not checkpoint.is_checkpoint(init_from):
            raise FileNotFoundError(
                f"--init-from {init_from}: no checkpoint there; train the model to start from "
                f"first, e.g. `python train.py --attn full --out {init_from}`"
            )
        init_model, init_tok = checkpoint.load(init_from, dtype=torch.float32)
        shape = [
            k for k in overrides if k in SHAPE_FIELDS and overrides[k] != getattr(init_model.cfg, k)
        ]
        if shape:
            raise ValueError(
                f"--set {shape[0]}={overrides[shape[0]]}: --init-from keeps the shape of {init_from} "
                f"({shape[0]}={getattr(init_model.cfg, shape[0])}); drop it, or start a new run"
            )
        cfg = replace(
            init_model.cfg, attn=attn, **overrides
        )  # invalid configs fail here, before any work
    else:
        cfg = Config.from_preset(preset, attn=attn, **overrides)
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the preset's max_seq_len {cfg.max_seq_len}")
    checkpoint.check_out(
        out
    )  # before anything: never into checkpoints/, over the user's files, or unwritable
    if resume and not checkpoint.is_checkpoint(out):
        raise FileNotFoundError(
            f"--resume: no checkpoint in {out!r} to continue; drop --resume to start a run there"
        )
    if not resume and not force and checkpoint.is_checkpoint(out):
        raise FileExistsError(
            f"{out!r} already holds a checkpoint: --resume continues it, --force replaces it, "
            f"--out DIR writes elsewhere"
        )
    state = json.load(open(os.path.join(out, "train_state.json"))) if resume else None
    if state and state["step"] >= steps:
        print(
            f"the run in {out} is complete (step {state['step']} of {steps}); to train further, --resume with "
            f"a larger --steps (the learning-rate schedule is stretched to it)"
        )
        return checkpoint.load(out, dtype=torch.float32)[0], state.get("val_loss")

    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if ddp:
        backend = "nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"
        dist.init_process_group(backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            device = f"cuda:{os.environ['LOCAL_RANK']}"
    device = common.pick_device(device)
    master = rank == 0
    # a fixed thread count also turns off MKL's dynamic threads, which under load may use fewer threads and
    # so sum in another order: without it, a run resumed on a busy machine is not bit for bit the run it continues
    torch.set_num_threads(torch.get_num_threads())

    if corpus is None:
        corpus = corpus_id(data)  # the cache follows the files: any change of them makes a new one
    elif data or not os.path.exists(
        os.path.join(data_dir, f"{corpus}-{cfg.vocab_size}", "train.bin")
    ):
        raise FileNotFoundError(
            f"--corpus {corpus}: no prepared token streams in {data_dir}/{corpus}-{cfg.vocab_size}"
            f" (prepare them where the files are, with train.py, and copy that directory), and "
            f"no --data beside it"
        )
    if master and not data and corpus != STDLIB_CORPUS:
        print(
            f"note: this interpreter's standard library (Python {sysconfig.get_python_version()}, corpus {corpus}) "
            f"is not the corpus of the embedded model and of BENCHMARKS.md (CPython 3.11.7's, {STDLIB_CORPUS}): "
            f"token counts and losses will differ from the README's",
            flush=True,
        )
    data_dir = os.path.join(data_dir, f"{corpus}-{cfg.vocab_size}")
    run = dict(
        seq_len=seq_len,
        batch_size=batch_size * world,
        lr=lr,
        warmup=warmup,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        seed=seed,
        evict_lr_mult=evict_lr_mult,
        corpus=corpus,
        tasks=tasks,
        answer_weight=answer_weight,
    )  # the run
    if resume:  # continue exactly that run, or say which flag differs (older checkpoints lack some of these)
        flag = dict(
            batch_size="--batch-size (times the processes)",
            corpus="--data (its files changed, or others)",
        )
        for key, value in run.items():
            if key in state and state[key] != value:
                raise ValueError(
                    f"--resume: the run in {out} has {key}={state[key]!r}, this command {value!r}; give "
                    f"{flag.get(key, '--' + key.replace('_', '-'))} as that run did, or --out DIR for a "
                    f"new run"
                )
    if master:
        tok = prepare(data_dir, cfg.vocab_size, data)
    if ddp:
        dist.barrier()
    if not master:
        tok = prepare(data_dir, cfg.vocab_size, data)  # loads what rank 0 wrote
    train_data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(data_dir, "val.bin"), dtype=np.uint16, mode="r")
    if min(len(train_data), len(val_data)) <= seq_len + 1:
        raise ValueError(
            f"corpus too small for --seq-len {seq_len}: {len(train_data)} train / {len(val_data)} val "
            f"tokens; give more text or a shorter --seq-len"
        )

    torch.manual_seed(seed)
    model = Transformer(cfg).to(device)
    if init_from:
        if init_tok.to_str() != tok.to_str():
            raise ValueError(
                f"--init-from {init_from}: its tokenizer is not the one of this corpus; train on the "
                f"data it was trained on (--data)"
            )
        sd = init_model.state_dict()
        head = [
            n for n in model.state_dict() if n not in sd
        ]  # the eviction head, if the source had none
        model.load_state_dict(
            {**model.state_dict(), **{n: t for n, t in sd.items() if n in model.state_dict()}}
        )
        if master:
            print(
                f"initialised from {init_from} ({init_model.cfg.attn}){'; new: ' + ', '.join(head) if head else ''}"
            )
    evict = {
        n
        for n, _ in model.named_parameters()
        if n.endswith((".self_attn.A", ".self_attn.delta.weight"))
    }
    params = [(n, p) for n, p in model.named_parameters() if n not in evict]
    groups = [
        dict(params=[p for _, p in params if p.dim() >= 2], weight_decay=weight_decay),
        dict(params=[p for _, p in params if p.dim() < 2], weight_decay=0.0),
    ]
    if evict:  # the eviction head: A starts at 0 and W_δ gets gradient only through A, so it may learn faster
        groups.append(
            dict(
                params=[p for n, p in model.named_parameters() if n in evict],
                weight_decay=0.0,
                lr_mult=evict_lr_mult,
            )
        )
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    step = 0
    if resume:
        model_r, _ = checkpoint.load(out, device, dtype=torch.float32)
        if model_r.cfg != cfg:
            raise ValueError(
                f"--resume: the checkpoint in {out!r} has another config ({model_r.cfg.attn}, "
                f"{model_r.cfg.n_layer} layers); use its flags, or --out DIR for a new run"
            )
        model.load_state_dict(model_r.state_dict())
        opt.load_state_dict(
            torch.load(os.path.join(out, "optimizer.pt"), map_location=device, weights_only=True)
        )
        step = state["step"]
        if master:
            print(f"resumed from {out} at step {step}")
    raw = model
    if ddp:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    n_params = sum(p.numel() for p in raw.parameters())
    if master:
        print(
            f"{attn} | {n_params / 1e6:.2f}M parameters | {len(train_data) / 1e6:.1f}M train tokens (corpus "
            f"{data or 'stdlib'} {corpus}) | "
            f"{steps} steps x {batch_size * world} x {seq_len} tokens | {device} | checkpoints to {out}"
        )
    t0, t_last, val_loss = time.time(), time.time(), None
    start = step
    stop_at = min(stop_at or steps, steps)
    saved = step if resume else None  # the step of the last checkpoint on disk
    try:
        while step < stop_at:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr, warmup) * g.get("lr_mult", 1.0)
            x, y, w = get_batch(
                train_data, batch_size, seq_len, seed, step, rank, device, tasks, tok, answer_weight
            )
            with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(x)
            loss = lm_loss(logits, y, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            step += 1
            if master and (step % log_every == 0 or step == steps):
                dt = time.time() - t_last
                t_last = time.time()
                tps = log_every * batch_size * world * seq_len / dt
                left = (time.time() - t0) / (step - start) * (steps - step)
                print(
                    f"step {step}/{steps} | loss {loss.item():.3f} | lr {lr_at(step, steps, lr, warmup):.2e} | "
                    f"{tps:.0f} tokens/s | {left / 60:.1f} min left",
                    flush=True,
                )
            if master and (step % eval_every == 0 or step == stop_at):
                val_loss = evaluate(raw, val_data, batch_size, seq_len, device)
                gates = (
                    (
                        " | eviction gates A per layer: "
                        + " | ".join(  # how far they moved from their zero start
                            " ".join(f"{a:+.2f}" for a in layer.self_attn.A.tolist())
                            for layer in raw.layers
                        )
                    )
                    if evict
                    else ""
                )
                print(f"step {step} | val loss {val_loss:.3f}{gates}", flush=True)
                checkpoint.save(
                    raw,
                    tok,
                    out,
                    dtype=torch.bfloat16 if save_bf16 else None,
                    optimizer=opt,
                    train_state=dict(
                        step=step,
                        steps=steps,
                        val_loss=val_loss,
                        attn=attn,
                        **run,
                        data=data or "stdlib",
                        train_tokens=len(train_data),
                        init_from=init_from,
                    ),
                )
                saved = step
    except KeyboardInterrupt:  # Ctrl-C: say where the run can be continued from
        where = (
            f"the last checkpoint, step {saved}, is in {out}: --resume continues it"
            if saved is not None
            else "no checkpoint was saved yet"
        )
        raise KeyboardInterrupt(f"training stopped at step {step}; {where}") from None
    if master and step == steps:
        print(f"done: generate with `python generate.py --checkpoint {out}`")
    if ddp:  # leave without freeing the DDP wrapper: its process group's destructor joins the gloo threads
        dist.barrier()  # while holding the GIL, which a thread still releasing a finished work item may wait
        dist.destroy_process_group()  # for (a deadlock at exit, seen in 1 run of 3); the checkpoints are written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return raw, val_loss


def parse_overrides(items):
    """["k=32", "n_layer=6"] -> {"k": 32, "n_layer": 6}, typed like the Config fields."""
    defaults, out = Config(), {}
    for item in items:
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"--set {item}: write FIELD=VALUE, e.g. --set k=32")
        if key == "attn":
            raise ValueError("--set attn=...: the attention mode has its own flag, --attn")
        if not hasattr(defaults, key) or key.startswith("_"):
            raise ValueError(f"--set {item}: unknown config field {key!r}; see config.Config")
        typ = type(getattr(defaults, key))
        try:
            out[key] = val.lower() in ("1", "true", "yes") if typ is bool else typ(val)
        except ValueError:
            kind = dict(int="an integer", float="a number")[typ.__name__]
            raise ValueError(f"--set {item}: {key} takes {kind}") from None
    return out


def cli(argv=None):
    p = argparse.ArgumentParser(description="Train a NOSA model on an offline corpus.")
    p.add_argument("--preset", default="tiny", help="config preset (config.PRESETS)")
    p.add_argument("--attn", default="nosa", choices=config.MODES, help="attention mode")
    p.add_argument(
        "--out", help="checkpoint directory (default: out/PRESET-ATTN in the repository)"
    )
    p.add_argument("--data", help="a text file or directory (default: the Python standard library)")
    p.add_argument(
        "--data-dir",
        help="where the tokenizer and token streams are cached (default: data/ in the repository)",
    )
    p.add_argument(
        "--steps", type=int, default=120, help="optimizer steps (the length of the schedule)"
    )
    p.add_argument(
        "--stop-at", type=int, help="checkpoint and stop after this step; --resume continues"
    )
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (per process)")
    p.add_argument("--seq-len", type=int, default=1024, help="training length in tokens")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    p.add_argument(
        "--eval-every", type=int, default=40, help="validate and checkpoint every N steps"
    )
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument(
        "--init-from",
        metavar="CKPT",
        help="start from this checkpoint's weights (e.g. NOSA from a "
        "dense model); its shape, --attn's mode",
    )
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in --out")
    p.add_argument("--save-bf16", action="store_true", help="store weights in bf16 (half the size)")
    p.add_argument(
        "--evict-lr-mult",
        type=float,
        default=1.0,
        help="learning rate of the eviction head (A, W_δ) as a multiple of --lr",
    )
    p.add_argument(
        "--tasks",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="replace this fraction of the training windows by long-range recall tasks (tasks.py)",
    )
    p.add_argument(
        "--answer-weight",
        type=float,
        default=1.0,
        metavar="W",
        help="weight of the tasks' answer tokens in the loss, against 1 for every other token",
    )
    p.add_argument(
        "--corpus",
        metavar="ID",
        help="train on the token streams prepared for this corpus id in "
        f"--data-dir (e.g. {STDLIB_CORPUS}, CPython 3.11.7's library, on "
        "a machine with another Python)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field of the preset, e.g. --set k=32 --set n_layer=6",
    )
    a = p.parse_args(argv)
    return common.run_cli(
        lambda: main(
            a.preset,
            a.attn,
            a.out,
            a.data,
            a.data_dir,
            a.steps,
            a.batch_size,
            a.seq_len,
            a.lr,
            a.warmup,
            eval_every=a.eval_every,
            seed=a.seed,
            device=a.device,
            resume=a.resume,
            force=a.force,
            stop_at=a.stop_at,
            save_bf16=a.save_bf16,
            evict_lr_mult=a.evict_lr_mult,
            init_from=a.init_from,
            tasks=a.tasks,
            corpus=a.corpus,
            answer_weight=a.answer_weight,
            **parse_overrides(a.set),
        )
    )


if __name__ == "__main__":
    cli()
