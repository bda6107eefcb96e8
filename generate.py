"""
Generate text with a NOSA model.

    python generate.py                       # the embedded tiny model, GPU-resident cache
    python generate.py --offload             # the same, KV cache in host memory (NOSI)
    python generate.py --checkpoint DIR --prompt "def main(" --batch 4 --max-new-tokens 200

Prints the text (a single prompt's as it is generated), then greppable lines: tokens/sec, and with
--offload the cache hit rate and the bytes moved per step. Sequences end at the checkpoint's
end-of-sequence token, or after --max-new-tokens.
"""
import argparse
import contextlib
import os
import sys
import time
from dataclasses import replace

import torch

import checkpoint
import common
import config
import fast
import memory
import offload as nosi  # NOSI, the offloaded cache (`offload` is a flag here)
from config import Config
from kvcache import KVCache
from model import Transformer

# Long enough (about 400 tokens) that sparse selection and offloading are already at work in the prompt.
DEFAULT_PROMPT = '''"""A small key-value store that keeps recent entries in memory and the rest on disk."""

import json
import os
import threading
from collections import OrderedDict


class Store:
    """Keep at most `capacity` entries in memory; evict the least recently used to disk."""

    def __init__(self, path, capacity=128):
        self.path = path
        self.capacity = capacity
        self._memory = OrderedDict()
        self._lock = threading.Lock()
        os.makedirs(path, exist_ok=True)

    def _file(self, key):
        return os.path.join(self.path, f"{key}.json")

    def get(self, key, default=None):
        with self._lock:
            if key in self._memory:
                self._memory.move_to_end(key)
                return self._memory[key]
        try:
            with open(self._file(key)) as f:
                value = json.load(f)
        except FileNotFoundError:
            return default
        self.put(key, value)
        return value

    def put(self, key, value):
        with self._lock:
            self._memory[key] = value
            self._memory.move_to_end(key)
            while len(self._memory) > self.capacity:
                old_key, old_value = self._memory.popitem(last=False)
                with open(self._file(old_key), "w") as f:
                    json.dump(old_value, f)

    def delete(self, key):'''


# -----------------------------------------------------------------------------
# Sampling, prefill and the decode loop


def sample(logits, temperature=0.0, top_k=None):
    """logits (Bz, vocab) -> (Bz,): greedy at temperature 0, else softmax(logits / T) over the top k."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]


@torch.no_grad()
def generate(model, prompts, max_new_tokens, temperature=0.0, top_k=None, cache=None, eos_ids=(), on_token=None,
             chunk=None, on_prefill=None, stream_on_host=False):
    """Prompts: list of token lists (lengths may differ). Returns the new tokens of each. Each prompt
    is prefilled in turn, `chunk` tokens at a time (model.Transformer.prefill; on_prefill(i, fraction)
    after each of its layers), then all sequences decode together. A sequence ends at its first token
    in eos_ids (kept in its output); from then on it costs no transfers (cache.finish), and the loop
    stops once every sequence has ended. on_token(tok) receives the new tokens (Bz,) of every step."""
    if not prompts or max_new_tokens < 1:
        raise ValueError("give at least one prompt and max_new_tokens >= 1")
    model.check_length(max(len(p) for p in prompts), max_new_tokens)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt: give at least one token per sequence")
    dev = model.embed_tokens.weight.device
    max_len = max(len(p) for p in prompts) + max_new_tokens
    cache = cache or KVCache(model.cfg, len(prompts), dev, model.embed_tokens.weight.dtype, max_len)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=dev)
    tok = torch.empty(len(prompts), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        progress = (lambda f, i=i: on_prefill(i, f)) if on_prefill else None
        logits = model.prefill(torch.tensor([p], device=dev), cache, i, chunk, progress, stream_on_host,
                               fast.block_prefill)  # (vocab,)
        tok[i] = sample(logits[None], temperature, top_k)[0]
    out, done = [tok.clone()], torch.isin(tok, eos)  # (Bz,) ended
    on_token = on_token or (lambda tok: None)
    on_token(tok)
    decode = fast.GraphedDecode(model, cache)  # the decode step as a CUDA graph, in micro-batches where it helps
    for step in range(max_new_tokens - 1):
        if eos.numel() and step % 8 == 0 and bool(done.all()):  # a host sync, so only every few steps
            break
        cache.finish(done)
        tok = sample(decode(tok), temperature, top_k)
        out.append(tok)
        on_token(tok)
        done |= torch.isin(tok, eos)
    rows = torch.stack(out, 1).tolist()
    eos = set(eos_ids)
    return [r[:next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in rows]


# -----------------------------------------------------------------------------
# The script


def main(checkpoint_dir=checkpoint.DEFAULT_CHECKPOINT, prompt=DEFAULT_PROMPT, max_new_tokens=300, batch=1,
         temperature=0.8, top_k=50, offload=False, device=None, seed=1337, quiet=False, attn=None, chat=False,
         profile=None, gpu_budget=None, host_budget=None, random=None, prompt_len=None, chunk=None):
    """Generate from one prompt or several (a ragged batch); returns the new tokens of each sequence.
    A single prompt's text is streamed as it is generated (unless quiet); every sequence stops at
    the checkpoint's end-of-sequence token. chat: wrap each prompt in the checkpoint's chat template.
    profile: write a trace of the timed generation there (open it in chrome://tracing or Perfetto);
    the decode step marks its selection, transfer and attention as ranges. gpu_budget, host_budget
    (GiB): what the weights, the cache and the activations may take (memory.plan_memory), checked
    before anything is allocated; the GPU's default is its free memory. random: no checkpoint, a
    randomly initialised model of that preset (config.PRESETS). prompt_len: cycle each prompt's tokens
    to that length. chunk: the prefill's chunk (default: the largest the budget allows)."""
    for name, value, least in (("--batch", batch, 1), ("--max-new-tokens", max_new_tokens, 1), ("--top-k", top_k, 0),
                               ("--temperature", temperature, 0), ("--prompt-len", prompt_len or 1, 1),
                               ("--chunk", chunk or 1, 1), ("--gpu-budget", gpu_budget or 1, 1e-9),
                               ("--host-budget", host_budget or 1, 1e-9)):
        if value < least:
            raise ValueError(f"{name} {value}: must be at least {least}")
    device = common.pick_device(device)
    checkpoint_dir = checkpoint.resolve(checkpoint_dir)  # the working directory's, else the repository's
    if profile:  # a trace that cannot be written is found now, not after the generation
        try:
            open(profile, "a").close()
        except OSError as e:
            raise ValueError(f"--profile {profile}: cannot write it ({e.strerror}); give a writable path") from None
    torch.manual_seed(seed)
    overrides = {"attn": attn} if attn else {}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if random:
        if random not in config.PRESETS:
            raise ValueError(f"--random {random}: choose a preset of {sorted(config.PRESETS)}")
        tokenizer = checkpoint.byte_tokenizer()
        cfg = Config.from_preset(random, **overrides)
        model = random_model(cfg, device, dtype)
    elif checkpoint_dir != checkpoint.DEFAULT_CHECKPOINT or os.path.isdir(checkpoint_dir):
        model, tokenizer = checkpoint.load(checkpoint_dir, device, dtype, **overrides)
    else:
        print(f"no checkpoint at {checkpoint_dir!r}: using a randomly initialised tiny model (expect noise)")
        tokenizer = checkpoint.byte_tokenizer()
        model = random_model(Config.from_preset("tiny", vocab_size=tokenizer.get_vocab_size(), **overrides), device,
                             dtype)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)  # several prompts: a ragged batch
    if chat:
        if not model.chat_template:
            raise ValueError(f"--chat: {checkpoint_dir} has no chat template (tokenizer_config.json); drop --chat")
        prompts = [chat_prompt(model.chat_template, p, model.special_tokens) for p in prompts]
    ids = [tokenizer.encode(p, add_special_tokens=not chat).ids for p in prompts]  # the template has them
    if not all(ids):
        raise ValueError("a prompt is empty after tokenisation; give some text with --prompt")
    if prompt_len:
        ids = [(p * (prompt_len // len(p) + 1))[:prompt_len] for p in ids]
    n_prompts = len(ids)
    batch = max(batch, n_prompts)
    P, max_len = max(map(len, ids)), max(map(len, ids)) + max_new_tokens
    if random:  # any length: the random model has no trained context
        model.cfg = replace(model.cfg, max_seq_len=max(model.cfg.max_seq_len, max_len))
    model.check_length(P, max_new_tokens)  # before any cache is allocated
    if offload and model.cfg.attn == "full":
        raise ValueError("--offload needs a sparse attention mode (nosa, infllmv2 or dma); full attention reads "
                         "every block at every step")
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    gpu = gpu_budget * 2**30 if gpu_budget else (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(
        device) if device.type == "cuda" else None)
    host = host_budget * 2**30 if host_budget else (memory.host_bytes_available() if offload else None)
    chunk, on_host = memory.plan_memory(model.cfg, weights, batch, P, max_len, dtype, gpu, host, offload, chunk)
    if offload and (tight := memory.host_warning(memory.cache_bytes(model.cfg, batch, max_len, dtype)[1])):
        print(tight, file=sys.stderr)
    ids = [ids[i % n_prompts] for i in range(batch)]  # prompts are cycled over the batch
    fast.prepare(model, batch * max_new_tokens, sum(map(len, ids)))  # fused weights; compiled for long runs
    if offload:
        cache = nosi.OffloadCache(model.cfg, batch, device, dtype, max_len=max_len, host_budget=host)
    else:
        cache = KVCache(model.cfg, batch, device, dtype, max_len)
    if device.type == "cuda":  # warm-up on short prompts: build uva_copy.cu and compile the kernels (prompts of
        # two lengths, so that torch.compile makes the prefill's graph for any chunk length here, not in the run)
        generate(model, [p[:64 + i % 2] for i, p in enumerate(ids)], 2, temperature, top_k, cache=cache, chunk=chunk)
        torch.cuda.synchronize()
        if offload:
            cache.reset_stats()
    printer = Printer(tokenizer, model.eos_ids) if batch == 1 and not quiet and not prompt_len else None
    if printer:
        print(prompts[0], end="", flush=True)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])) if profile else None
    progress = PrefillProgress([len(p) for p in ids], device, quiet)
    with prof or contextlib.nullcontext():
        out = generate(model, ids, max_new_tokens, temperature, top_k, cache=cache, eos_ids=model.eos_ids,
                       on_token=printer, chunk=chunk, on_prefill=progress, stream_on_host=on_host)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_end = time.perf_counter()
    if prof:
        prof.export_chrome_trace(profile)
    if printer:
        print("\n---")
    elif not quiet:
        for i, seq in enumerate(out):
            print(f"--- sample {i} ---\n{prompts[i % n_prompts]}{tokenizer.decode(seq)}")
        print("---")
    pre, ttft = progress.done[-1] - progress.t0, [t - progress.t0 for t in progress.done]
    n_pre, n_tok = sum(map(len, ids)), sum(map(len, out)) - batch  # the first token of each comes with its prefill
    print(f"prefill: {n_pre} tokens in {pre:.2f} s ({n_pre / pre:.0f} tokens/s, chunks of {chunk}"
          f"{', the residual stream in host memory' if on_host else ''}); time to first "
          f"token {ttft[0]:.2f} s" + (f" (the first prompt), {ttft[-1]:.2f} s (the last)" if batch > 1 else ""))
    dt = max(t_end - progress.done[-1], 1e-9)  # (no decode step with --max-new-tokens 1)
    print(f"tokens/sec: {n_tok / dt:.1f} ({n_tok} tokens in {dt:.2f} s after the first, batch {batch}, prompts of "
          f"{min(map(len, ids))}-{P} tokens, {model.cfg.attn}, {device})")
    if offload:
        print(cache.stats.summary())
    if device.type == "cuda":
        print(f"GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB at the peak (weights "
              f"{weights / 2**30:.2f} GiB)" + (f", budget {gpu / 2**30:.2f} GiB" if gpu_budget else ""))
    if prof:
        print(f"profile: {profile} (chrome://tracing or ui.perfetto.dev)")
    return out


def random_model(cfg, device, dtype):
    """A randomly initialised model, made where it runs and in its dtype (an 8B one takes 16 GB)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Transformer(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


class PrefillProgress:
    """on_prefill for generate: when each prompt's prefill ended (done, host clock, the device
    synchronised), and a line on stderr every few seconds of a long prefill: tokens done, tokens/s
    and the time left (unless quiet)."""

    def __init__(self, lens, device, quiet, every=3.0):
        self.lens, self.device, self.quiet, self.every = lens, device, quiet, every
        self.t0 = self.shown = time.perf_counter()
        self.done = []

    def __call__(self, i, fraction):
        if fraction < 1 and self.quiet:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if fraction == 1:
            self.done.append(now)
        if not self.quiet and now - self.shown >= self.every:
            self.shown = now
            n = sum(self.lens[:i]) + fraction * self.lens[i]
            rate, total = n / (now - self.t0), sum(self.lens)
            print(f"prefill: {n:.0f} of {total} tokens (prompt {i + 1} of {len(self.lens)}), {rate:.0f} tokens/s, "
                  f"{(total - n) / rate:.0f} s left", file=sys.stderr, flush=True)


class Printer:
    """Prints the text of a single sequence as its tokens arrive: the decoded text grows by whole
    characters (a byte-level token may end inside one), and stops at the end of the sequence."""

    def __init__(self, tokenizer, eos_ids):
        self.tokenizer, self.eos_ids, self.ids, self.shown, self.ended = tokenizer, eos_ids, [], 0, False

    def __call__(self, tok):
        if self.ended:
            return
        self.ids.append(int(tok[0]))
        self.ended = self.ids[-1] in self.eos_ids
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd") or self.ended:
            print(text[self.shown:], end="", flush=True)
            self.shown = len(text)


def chat_prompt(template, text, special_tokens):
    """A user message in the checkpoint's (Jinja) chat template, ready for the assistant's answer."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=[{"role": "user", "content": text}],
                                                add_generation_prompt=True, **special_tokens)
    except TemplateError as e:
        raise ValueError(f"--chat: the checkpoint's chat template fails ({e})") from None


def read_prompt(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise FileNotFoundError(f"--prompt-file {path}: {e.strerror}") from None


def cli(argv=None):
    p = argparse.ArgumentParser(description="Generate text with a NOSA model.")
    p.add_argument("--checkpoint", default=checkpoint.DEFAULT_CHECKPOINT,
                   help="checkpoint directory (default: the embedded tiny model), e.g. out/tiny-nosa from train.py")
    p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch of different prompts")
    p.add_argument("--prompt-file", action="append", help="read a prompt from this file (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=300, help="tokens to generate per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences generated together (prompts are cycled)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--offload", action="store_true", help="keep the KV cache in host memory (NOSI)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--quiet", action="store_true", help="print only the statistics, not the text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--profile", metavar="TRACE.json", help="write a profiler trace of the generation")
    p.add_argument("--attn", choices=config.MODES,
                   help="override the checkpoint's attention mode (e.g. infllmv2: training-free sparse decoding)")
    p.add_argument("--gpu-budget", type=float, metavar="GiB",
                   help="GPU memory for weights, cache and activations (default: what is free)")
    p.add_argument("--host-budget", type=float, metavar="GiB",
                   help="host memory for the offloaded KV store (default: what the OS reports available, "
                        "less a tenth for the process)")
    p.add_argument("--random", metavar="PRESET",
                   help="no checkpoint: a randomly initialised model of this preset "
                        f"({', '.join(sorted(config.PRESETS))}), to try budgets and speed")
    p.add_argument("--prompt-len", type=int, metavar="N", help="repeat each prompt's tokens to N tokens")
    p.add_argument("--chunk", type=int, help="prefill chunk in tokens (default: the largest the budget allows)")
    a = p.parse_args(argv)

    def run():
        if common.pick_device(a.device).type == "cpu":  # decoding a small model is a chain of small ops: one
            torch.set_num_threads(1)  # thread is as fast as two, and does not collapse when the cores are busy
        prompt = (a.prompt or []) + [read_prompt(f) for f in a.prompt_file or []] or DEFAULT_PROMPT
        return main(a.checkpoint, prompt, a.max_new_tokens, a.batch, a.temperature, a.top_k, a.offload, a.device,
                    a.seed, a.quiet, a.attn, a.chat, a.profile, a.gpu_budget, a.host_budget, a.random, a.prompt_len,
                    a.chunk)

    return common.run_cli(run)


if __name__ == "__main__":
    cli()
