"""
Generate text with a NOSA model.

    python generate.py                       # the embedded tiny model, GPU-resident cache
    python generate.py --offload             # the same, KV cache in host memory (NOSI)
    python generate.py --checkpoint DIR --prompt "import os" --batch 4 --max-new-tokens 200
    python generate.py --requests prompts.jsonl --batch 8 --offload   # served: continuous batching

Prints the text (a single prompt's as it is generated), then greppable lines: tokens/sec, and with
--offload the cache hit rate and the bytes moved per step. Sequences end at the checkpoint's
end-of-sequence token, or after --max-new-tokens. Given more prompts than sequences (--batch), or a file
of requests, it serves them by continuous batching (serve.py): each request's text as it ends, or a
JSON line in --completions, with its time to first token and tokens/s.
"""

import argparse
import os
import sys
import time
from dataclasses import dataclass, fields, replace

import torch

import checkpoint
import common
import config
import console
import fast
import memory
import offload
import serve
import tp
from config import Config
from kvcache import KVCache
from model import random_model
from prefill import prefill

PROMPT_FILE = os.path.join(checkpoint.ROOT, "prompt.txt")  # about 400 tokens: sparsity at work


# -----------------------------------------------------------------------------
# Sampling, prefill and the decode loop


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked, passed whole: greedy at temperature 0, else from
    softmax(logits / temperature) over the top_k most likely (None: all)."""

    temperature: float = 0.0
    top_k: int = None

    def __call__(self, logits):  # (Bz, vocab) -> (Bz,)
        if self.temperature <= 0:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]


@torch.no_grad()
def generate(
    model,
    prompts,
    max_new_tokens,
    *,
    sampling=Sampling(),
    cache=None,
    eos_ids=(),
    on_token=None,
    chunk=None,
    on_prefill=None,
    stream_on_host=False,
    micro_batches=1,
):
    """Prompts: list of token lists (lengths may differ). Returns the new tokens of each. Each prompt
    is prefilled in turn, `chunk` tokens at a time (prefill.prefill; on_prefill(i, fraction) after
    each of its layers), then all sequences decode together, as one CUDA graph a step on a GPU, in
    micro-batches if asked (fast.GraphedDecode). A sequence ends at its first token in eos_ids
    (kept in its output); from then on it costs no transfers (cache.finish), and the loop stops
    once every sequence has ended. on_token(tok) receives the new tokens (Bz,) of every step."""
    if not prompts or max_new_tokens < 1:
        raise ValueError("give at least one prompt and max_new_tokens >= 1")
    model.check_length(max(len(p) for p in prompts), max_new_tokens)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt: give at least one token per sequence")
    dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    max_len = max(len(p) for p in prompts) + max_new_tokens
    cache = cache or KVCache(model.cfg, len(prompts), dev, dtype, max_len)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=dev)
    tok = torch.empty(len(prompts), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        progress = (lambda f, i=i: on_prefill(i, f)) if on_prefill else None
        idx = torch.tensor([p], device=dev)
        logits = prefill(
            model, idx, cache, i, chunk, progress=progress, stream_on_host=stream_on_host
        )
        tok[i] = sampling(logits[None])[0]
    out, done = [tok.clone()], torch.isin(tok, eos)  # (Bz,) ended
    on_token = on_token or (lambda tok: None)
    on_token(tok)
    decode = fast.GraphedDecode(model, cache, micro_batches)
    for step in range(max_new_tokens - 1):
        if eos.numel() and step % 8 == 0 and bool(done.all()):  # a host sync: every few steps
            break
        cache.finish(done)
        tok = sampling(decode(tok))
        out.append(tok)
        on_token(tok)
        done |= torch.isin(tok, eos)
    seqs = torch.stack(out, 1).tolist()
    eos = set(eos_ids)
    return [s[: next((i + 1 for i, t in enumerate(s) if t in eos), len(s))] for s in seqs]


# -----------------------------------------------------------------------------
# The script


@dataclass
class Options:
    """The flags of `python generate.py` (cli says what each does)."""

    checkpoint: str = checkpoint.DEFAULT_CHECKPOINT
    prompt: object = None  # a text, or a list of texts (a ragged batch); None: prompt.txt
    requests: str = None  # a file of requests: a prompt a line, or JSON lines (.jsonl)
    completions: str = None  # a JSONL file for the served requests' completions
    force: bool = False  # replace an existing completions file
    prefill_budget: int = None  # served: prompt tokens a decode step waits for (None: by stall)
    max_stall: float = 2.0  # served: a step beside a prefill at most this many times a step alone
    max_new_tokens: int = 300
    batch: int = None  # sequences decoded together; None: one per prompt
    temperature: float = 0.8
    top_k: int = 50
    offload: bool = False
    device: str = None
    seed: int = 1337
    quiet: bool = False
    attn: str = None
    chat: bool = False
    profile: str = None
    gpu_budget: float = None  # GiB
    host_budget: float = None  # GiB
    random: str = None
    prompt_len: int = None
    chunk: int = None
    compile: str = "auto"
    micro_batches: int = None  # None: 2 for an offloaded batch of 16 or more, else 1

    @property
    def sampling(self):
        return Sampling(self.temperature, self.top_k)

    def check(self):
        """One line for a flag out of range, before any work."""
        common.check_flags(
            self,
            finite=("temperature", "gpu_budget", "host_budget", "max_stall"),
            at_least=dict(batch=1, max_new_tokens=1, top_k=0, temperature=0, prompt_len=1, chunk=1,
                micro_batches=1, prefill_budget=1, max_stall=1, gpu_budget=1e-9, host_budget=1e-9),
        )  # fmt: skip
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed {self.seed}: give a whole number from 0 to 2^63 - 1")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"--compile {self.compile}: give auto, on or off")
        if self.requests:
            self.requests = checkpoint.resolve(self.requests)
        inputs = {os.path.realpath(p) for p in (self.requests, self.checkpoint) if p}
        for flag, path in (("--profile", self.profile), ("--completions", self.completions)):
            if path:  # found now, not after the generation; nothing is made before serving
                console.check_output(flag, path, inputs, replace=flag == "--profile" or self.force)


def main(**flags):
    """Generate from one prompt or several (a ragged batch); returns the new tokens of each
    sequence. A single prompt's text is streamed as it is generated (unless quiet). Flags: Options.
    The memory budgets (memory.plan_memory) are checked before anything is allocated."""
    o = Options(**flags)
    o.check()
    # under torchrun: tensor parallelism over the KV heads (tp.py)
    rank, world, device = common.start_processes(o.device)
    if rank:  # one process prints
        sys.stdout = open(os.devnull, "w")
    requests = []  # the file read and checked before the model is loaded
    if o.requests:
        requests = console.parse_requests(console.read_prompt(o.requests, "--requests"), o.requests)
    n_prompts = 1 if isinstance(o.prompt, str) else max(len(o.prompt or []), 1)  # or prompt.txt
    if o.completions and not (o.requests or o.batch and o.batch < n_prompts):
        raise ValueError(
            "--completions holds served requests' completions: give --requests FILE, or more "
            "prompts than --batch"
        )
    torch.manual_seed(o.seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = load(o, device, dtype)
    if world > 1:
        tp.shard(model, rank, world)
    prompts, ids, news, names = encode(o, model, tokenizer, requests)
    P, max_len = max(map(len, ids)), max(len(p) + n for p, n in zip(ids, news))
    if o.random:  # any length: a random model has no trained context
        model.cfg = replace(model.cfg, max_seq_len=max(model.cfg.max_seq_len, max_len))
    for p, n, name in zip(ids, news, names):  # before any cache is allocated
        try:
            model.check_length(len(p), n)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    batch = o.batch or len(ids)
    if world > 1 and (o.requests is not None or batch < len(ids)):
        raise ValueError(
            "serving requests under torchrun is not supported: its schedule follows each "
            "process's clock, and the processes must step together; serve in one process"
        )
    if o.offload:
        offload.check_mode(model.cfg)
    served = o.requests is not None or batch < len(ids)
    pl = plan(o, model, device, dtype, batch=batch, P=P, max_len=max_len, served=served)
    cycled = [ids[i % len(ids)] for i in range(batch)]  # prompts are cycled over the batch
    pl = replace(pl, micro=speed_up(o, model, pl, cycled))
    cache = offload.make_cache(
        model.cfg, pl.batch, pl.device, pl.dtype, pl.max_len, offload=o.offload, host_budget=pl.host
    )
    warm_up(o, model, cache, pl, cycled)
    if pl.served:
        return serve_requests(o, model, tokenizer, cache, pl, list(zip(ids, news, names)))
    ids = cycled
    printer = (
        None if batch > 1 or o.quiet or o.prompt_len else console.Printer(tokenizer, model.eos_ids)
    )
    if printer:
        print(prompts[0], end="", flush=True)
    progress = console.PrefillProgress([len(p) for p in ids], device, o.quiet)
    with console.profiler(o.profile, device) as prof:
        out = generate(
            model,
            ids,
            o.max_new_tokens,
            sampling=o.sampling,
            cache=cache,
            eos_ids=model.eos_ids,
            on_token=printer,
            chunk=pl.chunk,
            on_prefill=progress,
            stream_on_host=pl.on_host,
            micro_batches=pl.micro,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        progress.t_end = time.perf_counter()
    if printer:
        print("\n---")
    elif not o.quiet:
        for i, seq in enumerate(out):  # the prompt as the model read it (--prompt-len cuts it)
            print(f"--- sample {i} ---\n{tokenizer.decode(ids[i])}{tokenizer.decode(seq)}")
        print("---")
    console.report(cache, pl, ids, out, progress, offload=o.offload, gpu_budget=o.gpu_budget)
    console.export_trace(prof, o.profile)
    return out


def plan(o, model, device, dtype, *, batch, P, max_len, served):
    """The budgets (GiB flags, else the GPU's free memory and what the host has) and the memory
    plan (memory.plan_memory) of `batch` sequences, the longest prompt P and sequence max_len; on the
    device. Returns the memory.Plan."""
    tensors = [*model.parameters(), *model.buffers()]  # (of this process's shard, under tp.py)
    weights = sum(t.numel() * t.element_size() for t in tensors)
    gpu = o.gpu_budget and o.gpu_budget * 2**30
    if gpu is None and device.type == "cuda":
        gpu = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(device)
    host = o.host_budget and o.host_budget * 2**30
    if host is None and o.offload:
        host = memory.host_bytes_available()
    pl = memory.plan_memory(
        model.cfg, weights, batch, P, max_len, dtype, gpu_budget=gpu, host_budget=host,
        offload=o.offload, chunk=o.chunk, served=served,
    )  # fmt: skip
    tight = o.offload and memory.host_warning(
        memory.cache_bytes(model.cfg, batch, max_len, dtype)[1]
    )
    if tight:
        print(tight, file=sys.stderr)
    return replace(pl, device=device)


def warm_up(o, model, cache, pl, ids):
    """On a GPU, before the timed run: uva_copy.cu built and the kernels compiled by generating 2
    tokens from short prompts of two lengths (so that torch.compile makes a prefill's graph for any
    chunk length here); the offload statistics then start from zero."""
    if pl.device.type != "cuda":
        return
    warm = [p[: 64 + i % 2] for i, p in enumerate(ids)]
    generate(
        model, warm, 2, sampling=o.sampling, cache=cache, chunk=pl.chunk,
        micro_batches=pl.micro,
    )  # fmt: skip
    torch.cuda.synchronize()
    if o.offload:
        cache.reset_stats()


def load(o, device, dtype):
    """The model and tokenizer: the checkpoint's, or a random model of a preset (--random, or where
    the embedded checkpoint is missing)."""
    overrides = {"attn": o.attn} if o.attn else {}
    path = checkpoint.resolve(o.checkpoint)  # the working directory's, else the repository's
    if o.random:
        if o.random not in config.PRESETS:
            raise ValueError(f"--random {o.random}: choose a preset of {sorted(config.PRESETS)}")
        return random_model(
            Config.from_preset(o.random, **overrides), device, dtype
        ), checkpoint.byte_tokenizer()
    if path != checkpoint.DEFAULT_CHECKPOINT or os.path.isdir(path):
        return checkpoint.load(path, device, dtype, **overrides)
    print(f"no checkpoint at {path!r}: using a randomly initialised tiny model (expect noise)")
    tokenizer = checkpoint.byte_tokenizer()
    cfg = Config.from_preset("tiny", vocab_size=tokenizer.get_vocab_size(), **overrides)
    return random_model(cfg, device, dtype), tokenizer


def encode(o, model, tokenizer, requests=()):
    """The prompts' texts (in the chat template with --chat), their token ids (cycled to
    --prompt-len tokens where asked), their max_new_tokens and their names in messages:
    --prompt's, then the requests' (console.parse_requests)."""
    prompts = [o.prompt] if isinstance(o.prompt, str) else list(o.prompt or [])
    news = [o.max_new_tokens] * len(prompts)
    names = [f"prompt {i + 1}" for i in range(len(prompts))]
    for text, n, line in requests:
        prompts.append(text)
        news.append(n or o.max_new_tokens)
        names.append(f"request {len(names)} (line {line} of {o.requests})")
    if not prompts:
        prompts, news, names = [console.read_prompt(PROMPT_FILE)], [o.max_new_tokens], [PROMPT_FILE]
    if o.chat:
        if not model.chat_template:
            raise ValueError(
                f"--chat: {o.checkpoint} has no chat template (tokenizer_config.json); drop --chat"
            )
        prompts = [
            console.chat_prompt(model.chat_template, p, model.special_tokens) for p in prompts
        ]
    ids = [tokenizer.encode(p, add_special_tokens=not o.chat).ids for p in prompts]
    empty = [name for name, p in zip(names, ids) if not p]
    if empty:
        raise ValueError(f"{empty[0]} is empty after tokenisation; give it some text")
    if o.prompt_len:
        ids = [(p * (o.prompt_len // len(p) + 1))[: o.prompt_len] for p in ids]
    return prompts, ids, news, names


def speed_up(o, model, pl, ids):
    """What fast.py applies on a GPU, said in one line: torch.compile of the decode step (auto: when
    batch x new tokens >= 2048, where its seconds of compiling pay) and of a prefill's chunks (auto:
    from 2M prompt tokens); micro-batches (auto: 2 for an offloaded batch of 16 or more).
    Returns the micro-batches."""
    batch = pl.batch
    micro = o.micro_batches or (2 if o.offload and batch >= 16 else 1)
    if pl.device.type != "cuda":
        return micro
    on = o.compile == "on"
    decode = on or o.compile == "auto" and batch * o.max_new_tokens >= 2048
    chunks = on or o.compile == "auto" and sum(map(len, ids)) >= 2**21
    if decode or chunks:  # (a compiled prefill compiles the decode step too)
        decode = fast.compile_model(model, prefill=chunks) is model
    print(
        f"speed: compiled decode step {'yes' if decode else 'no'}, compiled prefill "
        f"{'yes' if chunks else 'no'} (--compile {o.compile}); {micro} micro-batch(es)"
    )
    return micro


def serve_requests(o, model, tokenizer, cache, pl, requests):
    """requests [(token ids, max_new_tokens, name)] served by continuous batching (serve.py), in
    order: as each ends, its text (or a JSON line in --completions) and a line with its time to
    first token and tokens/s (console.Served); then the totals. Returns the new tokens of each."""
    reqs = [serve.Request(p, n) for p, n, _ in requests]
    names = [name for _, _, name in requests]
    budget = serve.Budget(model.cfg.n_layer, o.prefill_budget, o.max_stall)
    served = console.Served(tokenizer, reqs, names, o.completions, o.quiet)
    t0 = time.perf_counter()
    with served, console.profiler(o.profile, pl.device) as prof:
        decode = fast.GraphedDecode(model, cache, pl.micro)
        serve.serve(
            model, reqs, cache, o.sampling, eos_ids=model.eos_ids, chunk=pl.chunk,
            on_host=pl.on_host, decode=decode, budget=budget, on_done=served,
        )  # fmt: skip
    served.totals(time.perf_counter() - t0, len(cache.len), model.cfg.attn, pl.device)
    console.export_trace(prof, o.profile)
    print(budget.summary())
    console.report_cache(cache, pl.device, o.offload)
    return [r.out for r in reqs]


def cli(argv=None):
    p = argparse.ArgumentParser(description="Generate text with a NOSA model.")
    add = p.add_argument
    add(
        "--checkpoint",
        help="checkpoint directory (default: the embedded tiny model), e.g. out/tiny-nosa",
    )
    add("--prompt", action="append", help="prompt text; repeat for a batch of different prompts")
    add("--prompt-file", action="append", help="read a prompt from this file (repeatable)")
    add("--max-new-tokens", type=int, help="tokens to generate per sequence")
    add(
        "--requests",
        metavar="FILE",
        help="serve the requests in FILE: a prompt a line, or JSON lines with "
        '"prompt" and optionally "max_new_tokens"',
    )
    add("--completions", metavar="FILE.jsonl", help="write the served requests' completions here")
    add("--force", action="store_true", help="replace a --completions file that exists")
    add(
        "--prefill-budget",
        type=int,
        metavar="TOKENS",
        help="served: prompt tokens (through every layer) a decode step waits for (default: as "
        "many as keep a step within --max-stall of a step alone)",
    )
    add(
        "--max-stall",
        type=float,
        help="served: a decode step beside a prefill takes at most this many times a step alone",
    )
    add(
        "--batch",
        type=int,
        help="sequences decoded together (default: one per prompt; prompts are cycled over more, "
        "and more prompts than this are served by continuous batching)",
    )
    add("--temperature", type=float, help="0 for greedy decoding")
    add("--top-k", type=int, help="sample among the k most likely tokens (0: all)")
    add("--offload", action="store_true", help="keep the KV cache in host memory (NOSI)")
    add("--device", help="cuda or cpu (default: cuda when available)")
    add("--seed", type=int, help="seed of the sampling and of a --random model's weights")
    add("--quiet", action="store_true", help="print only the statistics, not the text")
    add("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    add("--profile", metavar="TRACE.json", help="write a profiler trace of the generation")
    add(
        "--attn",
        choices=config.MODES,
        help="override the checkpoint's attention mode (infllmv2: training-free sparse decoding)",
    )
    add(
        "--gpu-budget",
        type=float,
        metavar="GiB",
        help="GPU memory for weights, cache and activations (default: what is free)",
    )
    add(
        "--host-budget",
        type=float,
        metavar="GiB",
        help="host memory for the offloaded KV store (default: what the OS reports available, "
        "less a tenth for the process)",
    )
    add(
        "--random",
        metavar="PRESET",
        help="no checkpoint: a randomly initialised model of this "
        f"preset ({', '.join(sorted(config.PRESETS))}), to try budgets and speed",
    )
    add("--prompt-len", type=int, metavar="N", help="repeat each prompt's tokens to N tokens")
    add("--chunk", type=int, help="prefill chunk in tokens (default: the largest that fits)")
    add(
        "--compile",
        choices=("auto", "on", "off"),
        help="GPU: torch.compile the decode step and a prefill's chunks (auto: where it pays)",
    )
    add(
        "--micro-batches",
        type=int,
        help="GPU, offloaded: decode the batch in this many parts, "
        "one's transfers under the other's compute (default: 2 from a batch of 16)",
    )
    p.set_defaults(**{f.name: f.default for f in fields(Options)})  # the one source of defaults
    a = vars(p.parse_args(argv))
    files = a.pop("prompt_file") or []

    def run():
        if common.pick_device(a["device"]).type == "cpu":  # decoding a small model is a chain of
            torch.set_num_threads(1)  # small ops: one thread is as fast as two, and steadier
        a["prompt"] = (a["prompt"] or []) + [console.read_prompt(f) for f in files] or None
        return main(**a)

    return common.run_cli(run)


if __name__ == "__main__":
    cli()
