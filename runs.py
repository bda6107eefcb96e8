"""
A training run before its first step (train.py): what it trains (configure: a preset's Config,
or the model's it starts from or continues), where it writes (check_out: never over the user's
files, one run per --out), what fits (check_fits), its record (run_record: the corpus and the flags
a resume must match), its data (load_data: the token streams, made once per corpus and tokenizer),
and where it starts from: another model's weights (start_from, --init-from) or the saved run's
weights and optimizer state (resume). Every check, the flags' first (check_options), says what to
do in one line, before any work.
"""

import json
import math
import os
import sysconfig
from dataclasses import replace

import torch
import torch.distributed as dist

import checkpoint
import common
import fsdp
import saving
from config import Config
from data import STDLIB_CORPUS, corpus_id, prepare, streams_dir, tokens

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


def check_options(o):
    """One line for a flag of train.py out of range, or flags that cannot go together, before any
    work; then --out and --data-dir resolved (the lock, saves and messages agree on them)."""
    common.check_flags(
        o,
        finite=("lr", "weight_decay", "grad_clip", "evict_lr_mult", "tasks", "answer_weight"),
        at_least=dict(
            steps=1, batch_size=1, seq_len=1, eval_every=1, log_every=1, warmup=0, stop_at=1
        ),
    )
    if not o.evict_lr_mult >= 0:
        raise ValueError(f"--evict-lr-mult {o.evict_lr_mult}: 0 or more (0: the head stays off)")
    if o.evict_lr_mult == 0 and (o.head_warmup or o.head_distill):
        raise ValueError(
            "--evict-lr-mult 0 keeps the eviction head off, which --head-warmup and "
            "--head-distill would teach: give a positive --evict-lr-mult, or drop them"
        )
    if not o.lr > 0:
        raise ValueError(f"--lr {o.lr}: must be positive")
    if not 0 <= o.head_warmup < o.steps:
        raise ValueError(
            f"--head-warmup {o.head_warmup}: the first steps of the run's --steps "
            f"{o.steps}, from 0 to {o.steps - 1}"
        )
    if not (math.isfinite(o.head_distill) and o.head_distill >= 0):
        raise ValueError(f"--head-distill {o.head_distill}: a weight of at least 0")
    if (o.head_warmup or o.head_distill) and o.attn not in ("nosa", "dma"):
        raise ValueError(
            f"--head-warmup and --head-distill teach the eviction head, which --attn "
            f"{o.attn} lacks: use --attn nosa (or dma)"
        )
    if o.head_target not in ("mass", "output"):
        raise ValueError(f"--head-target {o.head_target!r}: mass or output")
    if o.head_target != "mass" and not (o.head_warmup or o.head_distill):
        raise ValueError(
            f"--head-target {o.head_target}: what --head-warmup or --head-distill "
            f"teaches; give one of them, or drop --head-target"
        )
    if o.head_warmup and o.fsdp:
        raise ValueError(
            "--head-warmup with --fsdp: a warm-up step's forward runs without gradient, "
            "which sharded parameters cannot learn from; warm the head up without --fsdp"
        )
    if not 0 <= o.tasks <= 1:
        raise ValueError(f"--tasks {o.tasks}: a fraction of the training windows, from 0 to 1")
    if not o.answer_weight > 0 or (o.answer_weight != 1.0 and not o.tasks):
        raise ValueError(
            f"--answer-weight {o.answer_weight}: a positive weight of the "
            f"tasks' answers, with --tasks"
        )
    if not 0 <= o.seed < 2**63:
        raise ValueError(f"--seed {o.seed}: give a whole number from 0 to 2^63 - 1")
    if o.data_dir and os.path.isfile(o.data_dir):
        raise ValueError(
            f"--data-dir {o.data_dir} is a file; give a directory (the cache of token streams)"
        )
    if o.fsdp and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        raise ValueError(
            "--fsdp shards the model over processes: run it under torchrun "
            "--nproc_per_node=N (N >= 2)"
        )
    if o.init_from and o.resume:
        raise ValueError("--init-from starts a new run; --resume continues one: give one of them")
    common.pick_device(o.device)  # a device this torch lacks fails here
    o.out = o.out or os.path.join(checkpoint.ROOT, "out", f"{o.preset}-{o.attn}")
    o.out = os.path.realpath(o.out)  # resolved once: the lock, saves and messages agree
    o.data_dir = o.data_dir or os.path.join(checkpoint.ROOT, "data")


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
    saving.check_out(o.out)
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
        head_warmup=o.head_warmup,
        head_distill=o.head_distill,
        head_target=o.head_target,
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


def load_data(o, cfg, run, world, master, *, model_tok=None, init=None):
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
