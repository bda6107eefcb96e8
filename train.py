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
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

import checkpoint
import common
import config
import fsdp
from config import Config
from data import STDLIB_CORPUS, corpus_id, get_batch, prepare, streams_dir, tokens
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


@dataclass
class Options:
    """The flags of `python train.py` (cli says what each does); Config fields go apart (--set)."""

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

    def check(self):
        """One line for a flag out of range, before any work."""
        for name in ("lr", "weight_decay", "grad_clip", "evict_lr_mult", "tasks", "answer_weight"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: give a finite number"
                )
        if not self.evict_lr_mult > 0:
            raise ValueError(f"--evict-lr-mult {self.evict_lr_mult}: must be positive")
        for name, least in (
            ("steps", 1),
            ("batch_size", 1),
            ("seq_len", 1),
            ("eval_every", 1),
            ("log_every", 1),
            ("warmup", 0),
            ("stop_at", 1),
        ):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"--{name.replace('_', '-')} {value}: must be at least {least}")
        if not self.lr > 0:
            raise ValueError(f"--lr {self.lr}: must be positive")
        if not 0 <= self.tasks <= 1:
            raise ValueError(
                f"--tasks {self.tasks}: a fraction of the training windows, from 0 to 1"
            )
        if not self.answer_weight > 0 or (self.answer_weight != 1.0 and not self.tasks):
            raise ValueError(
                f"--answer-weight {self.answer_weight}: a positive weight of the "
                f"tasks' answers, with --tasks"
            )
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed {self.seed}: give a whole number from 0 to 2^63 - 1")
        if self.data_dir and os.path.isfile(self.data_dir):
            raise ValueError(
                f"--data-dir {self.data_dir} is a file; give a directory (the cache of token streams)"
            )
        if self.fsdp and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            raise ValueError(
                "--fsdp shards the model over processes: run it under torchrun "
                "--nproc_per_node=N (N >= 2)"
            )
        if self.init_from and self.resume:
            raise ValueError(
                "--init-from starts a new run; --resume continues one: give one of them"
            )
        common.pick_device(self.device)  # a device this torch lacks fails here
        self.out = self.out or os.path.join(checkpoint.ROOT, "out", f"{self.preset}-{self.attn}")
        self.out = os.path.realpath(self.out)  # resolved once: the lock, saves and messages agree
        self.data_dir = self.data_dir or os.path.join(checkpoint.ROOT, "data")


def main(**flags):
    """Train; returns (model, last validation loss). Flags: Options, and Config fields (tests use
    tiny shapes). An existing checkpoint in out is continued with resume, replaced with force, and
    otherwise left alone. init_from: start from that checkpoint's weights (its shape, any mode), e.g.
    NOSA continued from a dense model, as the paper trains; an eviction head it lacks starts at A = 0.
    corpus: train on the token streams already prepared for that corpus id in data_dir."""
    names = {f.name for f in fields(Options)}
    o = Options(**{k: v for k, v in flags.items() if k in names})
    o.check()
    cfg, init = configure(o, {k: v for k, v in flags.items() if k not in names})
    state = check_out(o)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0:
        o.lock = checkpoint.hold(o.out)  # held for the run's life: one run per --out
    # the corpus is encoded with the tokenizer of the model trained on (a new BPE for a new model)
    model_tok = init[1] if init else saved_tokenizer(o.out) if o.resume else None
    run = run_record(o, cfg, state, world, int(os.environ.get("RANK", "0")) == 0, model_tok)
    if state and state["step"] >= o.steps:
        print(
            f"the run in {o.out} is complete (step {state['step']} of {o.steps}); to train "
            f"further, --resume with a larger --steps (its schedule is stretched to it)"
        )
        return checkpoint.load(o.out, dtype=torch.float32)[0], state.get("val_loss")
    rank, world, device = common.start_processes(o.device)
    check_fits(o, cfg, device)
    master = rank == 0
    # a fixed thread count also turns off MKL's dynamic threads, which under load sum in another
    # order: without it a run resumed on a busy machine is not bit for bit the run it continues
    torch.set_num_threads(torch.get_num_threads())
    tok, train_data, val_data = load_data(o, cfg, run, world, master, model_tok, init)
    torch.manual_seed(o.seed)
    model = Transformer(cfg).to(device)
    if init:
        start_from(model, init[0], o.init_from, master)
    if o.fsdp:  # the optimizer is made over the shards
        fsdp.fully_shard_blocks(model, device)
    opt, evict = optimizer(model, o, device)
    step = 0
    if o.resume:
        step = resume(model, opt, state, o, device, master)
    raw = model
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
    job = Job(device, rank, world, model, raw, opt, evict, tok, train_data, val_data, run)
    step, val_loss = train_steps(o, job, step)
    if master and step == o.steps:
        print(f"done: generate with `python generate.py --checkpoint {o.out}`")
    elif master:
        print(
            f"stopped at step {step} of {o.steps} (--stop-at); `python train.py --resume --out "
            f"{o.out}` continues it"
        )
    if world > 1:  # leave without freeing the DDP wrapper: its process group's destructor joins the
        dist.barrier()  # gloo threads holding the GIL, which a thread releasing a finished work
        dist.destroy_process_group()  # item may wait for (a deadlock at exit, 1 run in 3)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return raw, val_loss


def configure(o, overrides):
    """The run's Config: the preset's with --set's fields, or --init-from's (its shape, this mode).
    Returns it and (the model, tokenizer) to start from, or None."""
    if started_from_a_model(o) and checkpoint.is_checkpoint(o.out):  # its shape, not a preset's
        cfg = replace(checkpoint.read_config(o.out)[1], attn=o.attn, **overrides)
        init = None
    elif not o.init_from:
        cfg = Config.from_preset(o.preset, attn=o.attn, **overrides)
        init = None
    else:
        o.init_from = checkpoint.resolve(o.init_from)
        if not checkpoint.is_checkpoint(o.init_from):
            raise FileNotFoundError(
                f"--init-from {o.init_from}: no checkpoint there; train the model "
                f"to start from first, e.g. `python train.py --attn full --out "
                f"{o.init_from}`"
            )
        init = checkpoint.load(o.init_from, dtype=torch.float32)
        have = init[0].cfg
        shape = [k for k in overrides if k in SHAPE_FIELDS and overrides[k] != getattr(have, k)]
        if shape:
            k = shape[0]
            raise ValueError(
                f"--set {k}={overrides[k]}: --init-from keeps the shape of "
                f"{o.init_from} ({k}={getattr(have, k)}); drop it, or start a new run"
            )
        cfg = replace(have, attn=o.attn, **overrides)  # an invalid config fails here
    if o.seq_len > cfg.max_seq_len:
        raise ValueError(
            f"--seq-len {o.seq_len} exceeds the preset's max_seq_len {cfg.max_seq_len}"
        )
    return cfg, init


def started_from_a_model(o):
    """Whether --resume continues a run that was started --init-from a model (check_out says
    what is wrong with a damaged state)."""
    try:
        return o.resume and bool(checkpoint.read_json(o.out, "train_state.json").get("init_from"))
    except ValueError:
        return False


def check_out(o):
    """--out before anything (never into checkpoints/, over the user's files, or unwritable), and
    what it holds: the state of the run to resume, or None."""
    if o.resume and not checkpoint.is_checkpoint(o.out):  # (before check_out makes its parents)
        raise FileNotFoundError(
            f"--resume: no checkpoint in {o.out!r} to continue; drop --resume to start a run there"
        )
    checkpoint.check_out(o.out)
    if not o.resume and not o.force and checkpoint.is_checkpoint(o.out):
        raise FileExistsError(
            f"{o.out!r} already holds a checkpoint: --resume continues it, --force "
            f"replaces it, --out DIR writes elsewhere"
        )
    if not o.resume:
        return None
    path = os.path.join(o.out, "train_state.json")
    try:
        with open(path) as f:
            state = json.load(f)
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"its step is {step!r}, not a count of steps")
        if o.steps < state.get("steps", 0):
            raise ValueError(
                f"--steps {o.steps}: the run in {o.out} has a schedule of {state['steps']} steps; "
                f"give --steps {state['steps']} (or more, to extend it), or --stop-at to stop early"
            )
    except (OSError, ValueError) as e:
        if str(e).startswith("--steps"):
            raise
        raise ValueError(
            f"--resume: {path} is missing or damaged ({e}); the weights in {o.out} "
            f"still generate, and --init-from {o.out} starts a new run from them"
        ) from None
    return state


def check_fits(o, cfg, device):
    """A step's largest tensors, the logits and their gradient in fp32, within the memory there
    is: a batch far too large is one line here, not an allocator's failure after the corpus."""
    import memory

    need = 2 * o.batch_size * o.seq_len * cfg.vocab_size * 4
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = memory.host_bytes_available() or float("inf")
    if need > free:
        raise MemoryError(
            f"--batch-size {o.batch_size} x --seq-len {o.seq_len}: the logits alone take "
            f"{need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free; give a smaller batch"
        )


def saved_tokenizer(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))


def run_record(o, cfg, state, world, master, model_tok=None):
    """The run's record: its corpus (by the hash of its files) and the flags that make it. A resumed
    run must be the saved one, config and flag for flag, also when it is complete; a larger --steps
    extends it, and says so."""
    corpus = o.corpus
    if corpus is None:
        corpus = corpus_id(o.data)  # the cache follows the files: a change of them makes a new one
    else:
        where = streams_dir(o.data_dir, corpus, cfg.vocab_size, model_tok)
        if o.data or not os.path.exists(os.path.join(where, "train.bin")):
            raise FileNotFoundError(
                f"--corpus {corpus}: no prepared token streams in {where} (prepare them where "
                f"the files are, with train.py, and copy that directory), and no --data beside it"
            )
    if master and not o.data and corpus != STDLIB_CORPUS:
        print(
            f"note: this interpreter's standard library (Python {sysconfig.get_python_version()}, "
            f"corpus {corpus}) is not the corpus of the embedded model and of BENCHMARKS.md "
            f"(CPython 3.11.7's, {STDLIB_CORPUS}): token counts and losses will differ from the "
            f"README's",
            flush=True,
        )
    run = dict(
        seq_len=o.seq_len,
        batch_size=o.batch_size * world,
        lr=o.lr,
        warmup=o.warmup,
        weight_decay=o.weight_decay,
        grad_clip=o.grad_clip,
        seed=o.seed,
        evict_lr_mult=o.evict_lr_mult,
        corpus=corpus,
        tasks=o.tasks,
        answer_weight=o.answer_weight,
        fsdp=o.fsdp,
    )
    if state:  # continue exactly that run (older checkpoints lack some of these)
        flag = dict(
            batch_size="--batch-size (times the processes)",
            corpus="--data (its files changed, or others)",
        )
        for key, value in run.items():
            if key in state and state[key] != value:
                raise ValueError(
                    f"--resume: the run in {o.out} has {key}={state[key]!r}, this "
                    f"command {value!r}; give {flag.get(key, '--' + key.replace('_', '-'))}"
                    f" as that run did, or --out DIR for a new run"
                )
        saved = checkpoint.load(o.out, dtype=torch.float32)[0].cfg
        if saved != cfg:
            raise ValueError(
                f"--resume: the checkpoint in {o.out!r} has another config ({saved.attn}, "
                f"{saved.n_layer} layers); use its flags, or --out DIR for a new run"
            )
        if master and o.steps > state.get("steps", o.steps):
            print(
                f"--steps {o.steps}: the run of {state['steps']} steps is extended, its "
                f"learning-rate schedule stretched to {o.steps} steps"
            )
    return run


def load_data(o, cfg, run, world, master, model_tok=None, init=None):
    """The tokenizer and the token streams (made once, cached by the corpus's hash and the
    tokenizer): a new BPE for a new model, the model's own tokenizer for one trained further."""
    data_dir = streams_dir(o.data_dir, run["corpus"], cfg.vocab_size, model_tok)
    end = checkpoint.EOT
    if model_tok is not None and model_tok.token_to_id(end) is None and init:
        end = init[0].special_tokens.get("eos_token")  # a document ends as a sequence does
    if master:
        tok = prepare(data_dir, cfg.vocab_size, o.data, model_tok, end)
    if world > 1:
        dist.barrier()
    if not master:
        tok = prepare(data_dir, cfg.vocab_size, o.data, model_tok, end)  # what rank 0 wrote
    train_data = tokens(os.path.join(data_dir, "train.bin"), cfg.vocab_size)
    val_data = tokens(os.path.join(data_dir, "val.bin"), cfg.vocab_size)
    if min(len(train_data), len(val_data)) <= o.seq_len + 1:
        raise ValueError(
            f"corpus too small for --seq-len {o.seq_len}: {len(train_data)} train / "
            f"{len(val_data)} val tokens; give more text or a shorter --seq-len"
        )
    return tok, train_data, val_data


def start_from(model, init_model, path, master):
    """--init-from: the model's weights from init_model's (an eviction head it lacks stays as made,
    A = 0), and how it generates (end-of-sequence ids, chat template), which its checkpoints keep."""
    model.eos_ids, model.chat_template = init_model.eos_ids, init_model.chat_template
    model.special_tokens = init_model.special_tokens
    sd = init_model.state_dict()
    own = model.state_dict()
    head = [n for n in own if n not in sd]  # the eviction head, if the source had none
    model.load_state_dict({**own, **{n: t for n, t in sd.items() if n in own}})
    if master:
        layers = len({n.split(".")[1] for n in head if n.startswith("layers.")})
        new = f"; new: the eviction head (A = 0, W_δ) of {layers} layers" if layers else ""
        print(f"initialised from {path} ({init_model.cfg.attn}){new}")


def optimizer(model, o, device):
    """AdamW with weight decay on matrices only; the eviction head (A starts at 0, and W_δ gets a
    gradient only through A) in a group of its own, at evict_lr_mult times the learning rate.
    Returns it and whether the model has the head."""
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
    if evict:
        groups.append(
            dict(
                params=[p for n, p in model.named_parameters() if n in evict],
                weight_decay=0.0,
                lr_mult=o.evict_lr_mult,
            )
        )
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    return opt, bool(evict)


def resume(model, opt, state, o, device, master):
    """The saved run's weights and optimizer state (its config and flags: run_record); returns its
    step. Under --fsdp each process takes its shards of them (the checkpoint holds them whole)."""
    out = o.out
    saved, _ = checkpoint.load(out, device, dtype=torch.float32)
    model.eos_ids, model.chat_template = saved.eos_ids, saved.chat_template
    model.special_tokens = saved.special_tokens
    if not o.fsdp:
        model.load_state_dict(saved.state_dict())
    path = os.path.join(out, "optimizer.pt")
    try:
        opt_state = torch.load(path, map_location=device, weights_only=True)
        if o.fsdp:  # shard by shard from the saved weights and their optimizer's state
            fsdp.to_shards(model, opt, saved, opt_state)
        else:
            opt.load_state_dict(opt_state)
    except Exception as e:  # missing, truncated, or another run's
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise ValueError(
            f"--resume: {path} is missing or damaged ({reason}); the weights in {out} "
            f"still generate, and --init-from {out} starts a new run from them"
        ) from None
    if master:
        print(f"resumed from {out} at step {state['step']}")
    return state["step"]


@dataclass
class Job:
    """One process's part of a run, made by main and passed whole: where it runs (device, rank of
    world), the model (model: the DDP wrapper where several processes train, raw: the module), its
    optimizer and whether it trains an eviction head (evict), the tokenizer and the token streams,
    and the run's record (run_record)."""

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


def train_steps(o, job, step):
    """The loop from `step`: a step, a log line every log_every steps, validation and a checkpoint
    every eval_every; Ctrl-C says where the last checkpoint is. Returns (step, last validation
    loss)."""
    model, raw, opt, device, world = job.model, job.raw, job.opt, job.device, job.world
    master = job.rank == 0
    t0 = t_last = time.time()
    logged = step  # the step of the last log line
    start, val_loss = step, None
    stop_at = min(o.stop_at or o.steps, o.steps)
    saved = step if o.resume else None  # the step of the last checkpoint on disk
    try:
        while step < stop_at:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, o.steps, o.lr, o.warmup) * g.get("lr_mult", 1.0)
            x, y, w = get_batch(
                job.train_data,
                o.batch_size,
                o.seq_len,
                o.seed,
                step,
                job.rank,
                device,
                o.tasks,
                job.tok,
                o.answer_weight,
            )
            with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(x)
            loss = lm_loss(logits, y, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()
            step += 1
            if master and (step % o.log_every == 0 or step == o.steps):
                tps = (step - logged) * o.batch_size * world * o.seq_len / (time.time() - t_last)
                t_last, logged = time.time(), step
                left = (time.time() - t0) / (step - start) * (o.steps - step)
                print(
                    f"step {step}/{o.steps} | loss {loss.item():.3f} | lr "
                    f"{lr_at(step, o.steps, o.lr, o.warmup):.2e} | {tps:.0f} tokens/s | "
                    f"{left / 60:.1f} min left",
                    flush=True,
                )
            if (master or o.fsdp) and (step % o.eval_every == 0 or step == stop_at):
                # under FSDP every process takes part: the forward and the gathering are collective
                val_loss = evaluate(raw, job.val_data, o.batch_size, o.seq_len, device)
                whole, whole_opt = fsdp.gathered(raw, opt) if o.fsdp else (raw, opt)
                if not master:
                    continue  # (the rest of the loop is the first process's)
                # how far they moved from their start at 0
                gates = (
                    ""
                    if not job.evict
                    else " | eviction gates A per layer: "
                    + " | ".join(
                        " ".join(f"{a:+.2f}" for a in layer.self_attn.A.tolist())
                        for layer in whole.layers
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
                checkpoint.save(
                    whole,
                    job.tok,
                    o.out,
                    dtype=torch.bfloat16 if o.save_bf16 else None,
                    optimizer=whole_opt,
                    train_state=state,
                )
                saved = step
    except KeyboardInterrupt:  # Ctrl-C: say where the run can be continued from
        where = (
            f"the last checkpoint, step {saved}, is in {o.out}: --resume continues it"
            if saved is not None
            else "no checkpoint was saved yet"
        )
        raise KeyboardInterrupt(f"training stopped at step {step}; {where}") from None
    return step, val_loss


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
        truth = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
        try:
            out[key] = truth[val.lower()] if typ is bool else typ(val)
        except (KeyError, ValueError):
            kind = dict(int="an integer", float="a number", bool="true or false")[typ.__name__]
            raise ValueError(f"--set {item}: {key} takes {kind}") from None
    return out


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
    p.add_argument(
        "--seed",
        type=int,
    )
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
        help="learning rate of the eviction head (A, W_δ) as a multiple of --lr",
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
    return common.run_cli(lambda: main(**a, **parse_overrides(sets)))


if __name__ == "__main__":
    cli()
