"""
Train a NOSA model (or one of its baselines) on text that every machine has: the Python standard
library's own source and its pydoc topics, read from the running interpreter. No download.

    python train.py                                   # tiny preset, NOSA -> out/tiny-nosa (CPU: ~10 min)
    python train.py --attn full                       # -> out/tiny-full
    python train.py --data my_texts/ --steps 5000 --out out/mine   # any other text files
    torchrun --nproc_per_node=2 train.py              # DistributedDataParallel (gloo on CPU, NCCL on GPUs)
    python generate.py --checkpoint out/tiny-nosa     # what the first command trained

The sparse pattern is the same in training and in decoding (nosa.py), so the model learns to use
exactly the blocks it will see at inference. This file holds the loop; what a run settles before
its first step (its flags, config, --out, data, --init-from, --resume) is in runs.py, FSDP2 in fsdp.py,
checkpoints in checkpoint.py.
"""

import argparse
import math
import os
import time
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

import checkpoint
import common
import config
import distill
import fsdp
import runs
import saving
from data import STDLIB_CORPUS, get_batch
from model import Transformer


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


def stage_lr(step, o):
    """The learning rate at a step: the warm-up of the head (--head-warmup) on a schedule of its own
    (a tenth of it rising, then the cosine), then the language-model steps on theirs."""
    n = o.head_warmup
    if step < n:
        return lr_at(step, n, o.lr, max(1, n // 10))
    return lr_at(step - n, o.steps - n, o.lr, o.warmup)


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


@dataclass
class Options:
    """The flags of `python train.py` (cli says what each does, runs.check_options checks them);
    Config fields go apart (--set)."""

    preset: str = "tiny"
    attn: str = "nosa"
    out: str = None  # default: out/{preset}-{attn} in the repository
    data: str = None  # default: the standard library
    data_dir: str = None  # default: data/ in the repository
    steps: int = 120
    batch_size: int = 4
    seq_len: int = 1024
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 40
    seed: int = 1337
    device: str = None
    resume: bool = False
    force: bool = False
    stop_at: int = None
    save_bf16: bool = False
    log_every: int = 10
    evict_lr_mult: float = 1.0
    init_from: str = None
    tasks: float = 0.0
    corpus: str = None
    answer_weight: float = 1.0
    fsdp: bool = False  # under torchrun: weights, gradients and optimizer state sharded (FSDP2)
    head_warmup: int = 0  # the first N steps teach the eviction head alone (distill.py)
    head_distill: float = 0.0  # after them, this times the head's distillation loss beside the LM's
    head_target: str = "mass"  # what the head is taught: a block's attention mass, or output change


def main(**flags):
    """Train; returns (model, last validation loss). Flags: Options, and Config fields (tests use
    tiny shapes). An existing checkpoint in out is continued with resume, replaced with force, and
    otherwise left alone. init_from: start from that checkpoint's weights (its shape, any mode), e.g.
    NOSA continued from a dense model, as the paper trains; an eviction head it lacks starts at A = 0.
    corpus: train on the token streams already prepared for that corpus id in data_dir."""
    names = {f.name for f in fields(Options)}
    o = Options(**{k: v for k, v in flags.items() if k in names})
    runs.check_options(o)
    cfg, init = runs.configure(o, {k: v for k, v in flags.items() if k not in names})
    state = runs.check_out(o)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0:
        o.lock = saving.hold(o.out)  # held for the run's life: one run per --out
    # the corpus is encoded with the tokenizer of the model trained on (a new BPE for a new model)
    model_tok = init[1] if init else runs.saved_tokenizer(o.out) if o.resume else None
    run = runs.run_record(o, cfg, state, world, int(os.environ.get("RANK", "0")) == 0, model_tok)
    if state and state["step"] >= o.steps:
        print(
            f"the run in {o.out} is complete (step {state['step']} of {o.steps}); to train "
            f"further, --resume with a larger --steps (its schedule is stretched to it)"
        )
        return checkpoint.load(o.out, dtype=torch.float32)[0], state.get("val_loss")
    rank, world, device = common.start_processes(o.device)
    runs.check_fits(o, cfg, device)
    master = rank == 0
    # a fixed thread count also turns off MKL's dynamic threads, which under load sum in another
    # order: without it a run resumed on a busy machine is not bit for bit the run it continues
    torch.set_num_threads(torch.get_num_threads())
    tok, train_data, val_data = runs.load_data(
        o, cfg, run, world, master, model_tok=model_tok, init=init
    )
    torch.manual_seed(o.seed)
    model = Transformer(cfg).to(device)
    if init:
        runs.start_from(model, init[0], o.init_from, master)
    if o.fsdp:  # the optimizer is made over the shards
        fsdp.fully_shard_blocks(model, device)
    opt, evict = optimizer(model, o, device)
    step = 0
    if o.resume:
        step = runs.resume(model, opt, state, o, device, master)
    raw = model
    teacher = None
    if o.head_warmup or o.head_distill:
        teacher = distill.Teacher(raw, target=o.head_target)
    if o.head_warmup and step == 0:
        distill.start_head(raw)
    if world > 1 and not o.fsdp:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if master:
        print(
            f"{o.attn} | {sum(p.numel() for p in raw.parameters()) / 1e6:.2f}M parameters | "
            f"{len(train_data) / 1e6:.1f}M train tokens (corpus {o.data or 'stdlib'} "
            f"{run['corpus']}) | {o.steps} steps x {o.batch_size * world} x {o.seq_len} tokens "
            f"| {device} | checkpoints to {o.out}"
        )
    job = Job(device, rank, world, model, raw, opt, evict, tok, train_data, val_data, run, teacher)
    step, val_loss = train_steps(o, job, step)
    if master and step == o.steps:
        print(f"done: generate with `python generate.py --checkpoint {o.out}`")
    elif master:
        print(
            f"stopped at step {step} of {o.steps} (--stop-at); `python train.py --resume --out "
            f"{o.out}` continues it"
        )
    return raw, val_loss


def optimizer(model, o, device):
    """AdamW with weight decay on matrices only; the eviction head (A starts at 0, and W_δ gets a
    gradient only through A) in a group of its own, at evict_lr_mult times the learning rate (0:
    left out, so it stays as it starts). Returns it and whether the model has the head."""
    evict = {
        n
        for n, _ in model.named_parameters()
        if n.endswith((".self_attn.A", ".self_attn.delta.weight"))
    }
    params = [(n, p) for n, p in model.named_parameters() if n not in evict]
    groups = [
        dict(params=[p for _, p in params if p.dim() >= 2], weight_decay=o.weight_decay),
        dict(params=[p for _, p in params if p.dim() < 2], weight_decay=0.0),
    ]
    if evict and o.evict_lr_mult == 0:  # off: no gradient, and none in the clipped norm
        for n, p in model.named_parameters():
            p.requires_grad_(n not in evict)
    elif evict:
        groups.append(
            dict(
                params=[p for n, p in model.named_parameters() if n in evict],
                weight_decay=0.0,
                lr_mult=o.evict_lr_mult,
            )
        )
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    return opt, bool(evict)


@dataclass
class Job:
    """One process's part of a run, made by main and passed whole: where it runs (device, rank of
    world), the model (model: the DDP wrapper where several processes train, raw: the module), its
    optimizer and whether it trains an eviction head (evict), the tokenizer and the token streams,
    the run's record (runs.run_record), and what teaches the head (distill.Teacher) if anything."""

    device: torch.device
    rank: int
    world: int
    model: torch.nn.Module
    raw: torch.nn.Module
    opt: torch.optim.Optimizer
    evict: bool
    tok: object
    train_data: object
    val_data: object
    run: dict
    teacher: distill.Teacher = None


def train_steps(o, job, step):
    """The loop from `step`: a step, a log line every log_every steps, validation and a checkpoint
    every eval_every; Ctrl-C says where the last checkpoint is. Returns (step, last validation
    loss)."""
    master = job.rank == 0
    t0 = t_last = time.time()
    logged = step  # the step of the last log line
    start, val_loss = step, None
    stop_at = min(o.stop_at or o.steps, o.steps)
    saved = step if o.resume else None  # the step of the last checkpoint on disk
    try:
        while step < stop_at:
            warm = step < o.head_warmup  # the head alone, by distillation
            loss, head_loss = one_step(o, job, step, warm)
            step += 1
            if master and (step % o.log_every == 0 or step == o.steps):
                tps = (
                    (step - logged) * o.batch_size * job.world * o.seq_len / (time.time() - t_last)
                )
                t_last, logged = time.time(), step
                left = (time.time() - t0) / (step - start) * (o.steps - step)
                what = "head distillation loss" if warm else "loss"
                head = (
                    f" | head {head_loss.item():.4f}" if head_loss is not None and not warm else ""
                )
                print(
                    f"step {step}/{o.steps} | {what} {loss.item():.3f}{head} | lr "
                    f"{stage_lr(step, o):.2e} | {tps:.0f} tokens/s | {left / 60:.1f} min left",
                    flush=True,
                )
            if (master or o.fsdp) and (step % o.eval_every == 0 or step == stop_at):
                val_loss = validate_and_save(o, job, step)
                saved = step
    except KeyboardInterrupt:  # Ctrl-C: say where the run can be continued from
        where = (
            f"the last checkpoint, step {saved}, is in {o.out}: --resume continues it"
            if saved is not None
            else "no checkpoint was saved yet"
        )
        raise KeyboardInterrupt(f"training stopped at step {step}; {where}") from None
    return step, val_loss


def one_step(o, job, step, warm):
    """One optimizer step at `step`: the language-model loss (with the head's distillation beside
    it where asked), or while warm the head's distillation alone. Returns (loss, head loss)."""
    model, raw, opt, device = job.model, job.raw, job.opt, job.device
    for g in opt.param_groups:
        g["lr"] = stage_lr(step, o) * g.get("lr_mult", 1.0)
    x, y, w = get_batch(
        job.train_data,
        o.batch_size,
        o.seq_len,
        seed=o.seed,
        step=step,
        rank=job.rank,
        device=device,
        tasks=o.tasks,
        tok=job.tok,
        answer_weight=o.answer_weight,
    )
    if job.teacher:
        job.teacher.queries(o.seq_len, o.seed, step, job.rank, device)
    with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
        if warm:  # the forward only feeds the teacher's hooks
            with torch.no_grad():
                raw(x)
        else:
            logits = model(x)
    head_loss = job.teacher.loss() if job.teacher else None
    if warm:
        loss = head_loss
    else:
        loss = lm_loss(logits, y, w)
        if o.head_distill:
            loss = loss + o.head_distill * head_loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if warm:
        distill.average_gradients(raw, job.world)
    torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
    opt.step()
    return loss, head_loss


def validate_and_save(o, job, step):
    """The validation loss at `step`, and the checkpoint (the first process writes it; under FSDP
    every process takes part in the forward and the gathering, which are collective). Returns the
    validation loss."""
    val_loss = evaluate(job.raw, job.val_data, o.batch_size, o.seq_len, job.device)
    whole, whole_opt = fsdp.gathered(job.raw, job.opt) if o.fsdp else (job.raw, job.opt)
    if job.rank != 0:
        return val_loss
    # how far the gates moved from their start at 0
    gates = (
        ""
        if not job.evict
        else " | eviction gates A per layer: "
        + " | ".join(
            " ".join(f"{a:+.2f}" for a in layer.self_attn.A.tolist()) for layer in whole.layers
        )
    )
    print(f"step {step} | val loss {val_loss:.3f}{gates}", flush=True)
    state = dict(
        step=step,
        steps=o.steps,
        val_loss=val_loss,
        attn=o.attn,
        **job.run,
        data=o.data or "stdlib",
        train_tokens=len(job.train_data),
        init_from=o.init_from,
    )
    saving.save(
        whole,
        job.tok,
        o.out,
        dtype=torch.bfloat16 if o.save_bf16 else None,
        optimizer=whole_opt,
        train_state=state,
    )
    return val_loss


def cli(argv=None):
    p = argparse.ArgumentParser(description="Train a NOSA model on an offline corpus.")
    p.add_argument("--preset", help="config preset (config.PRESETS)")
    p.add_argument("--attn", choices=config.MODES, help="attention mode")
    p.add_argument(
        "--out", help="checkpoint directory (default: out/PRESET-ATTN in the repository)"
    )
    p.add_argument("--data", help="a text file or directory (default: the Python standard library)")
    p.add_argument(
        "--data-dir",
        help="where the tokenizer and token streams are cached (default: data/ in the repository)",
    )
    p.add_argument("--steps", type=int, help="optimizer steps (the length of the schedule)")
    p.add_argument(
        "--stop-at", type=int, help="checkpoint and stop after this step; --resume continues"
    )
    p.add_argument("--batch-size", type=int, help="sequences per step (per process)")
    p.add_argument("--seq-len", type=int, help="training length in tokens")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup", type=int, help="warm-up steps")
    p.add_argument("--eval-every", type=int, help="validate and checkpoint every N steps")
    p.add_argument("--seed", type=int, help="seed of the weights, the batches and the tasks")
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
        help="learning rate of the eviction head (A, W_δ) as a multiple of --lr; 0: the head stays "
        "as it starts, off (A = 0: the core is the most recent blocks)",
    )
    p.add_argument(
        "--tasks",
        type=float,
        metavar="FRACTION",
        help="replace this fraction of the training windows by long-range recall tasks (tasks.py)",
    )
    p.add_argument(
        "--answer-weight",
        type=float,
        metavar="W",
        help="weight of the tasks' answer tokens in the loss, against 1 for every other token",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard the weights, gradients and optimizer state over the processes "
        "(FSDP2, a block a unit; bf16 compute and fp32 reductions on GPUs); the checkpoint is "
        "saved gathered",
    )
    p.add_argument(
        "--head-warmup",
        type=int,
        metavar="N",
        help="the first N of --steps teach the eviction head alone, by distillation from the "
        "model's own dense attention (docs/METHOD.md §8), the rest of the model frozen",
    )
    p.add_argument(
        "--head-distill",
        type=float,
        metavar="W",
        help="after the warm-up, W times the head's distillation loss beside the language-model "
        "loss (default 0: the paper's recipe)",
    )
    p.add_argument(
        "--head-target",
        choices=("mass", "output"),
        help="what the distillation teaches E: each candidate block's share of the dense attention "
        "(mass, the default), or how far the query's output moves without it (output: "
        "eviction.attention_by_block)",
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
    p.set_defaults(**{f.name: f.default for f in fields(Options)})  # the one source of defaults
    a = vars(p.parse_args(argv))
    sets = a.pop("set")
    return common.run_cli(lambda: main(**a, **config.parse_overrides(sets)))


if __name__ == "__main__":
    cli()
