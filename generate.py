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
import time

import torch

import checkpoint
import nosa
from kvcache import KVCache
from model import Transformer
from nosa import Config

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
def generate(model, prompts, max_new_tokens, temperature=0.0, top_k=None, cache=None, eos_ids=(), on_token=None):
    """Prompts: list of token lists (lengths may differ). Returns the new tokens of each. A sequence
    ends at its first token in eos_ids (kept in its output); from then on it costs no transfers
    (cache.finish), and the loop stops once every sequence has ended. on_token(tok) receives the
    new tokens (Bz,) of every step, for streaming."""
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
    for i, p in enumerate(prompts):  # prefill one sequence at a time: lengths may differ
        logits = model(torch.tensor([p], device=dev), cache, seq=i)
        tok[i] = sample(logits[:, -1], temperature, top_k)[0]
    out, done = [tok.clone()], torch.isin(tok, eos)  # (Bz,) ended
    on_token = on_token or (lambda tok: None)
    on_token(tok)
    # offload at a batch of 16 or more: two micro-batches, one's gathers under the other's compute
    # (BENCHMARKS.md: 8b, 128K: batch 16 19.75 ms a step instead of 21.89; batch 27 25.8 ms instead of 32.3)
    decode = GraphedDecode(model, cache, 2 if hasattr(cache, "split") and cache.Bz >= 16 else 1)
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


class GraphedDecode:
    """model.decode, captured once as a CUDA graph and replayed every step: the thousands of
    small launches of a step (per layer: projections, scoring, selection, set difference, gather,
    attention) become one, so a step costs what its kernels cost. This is correct because nothing
    in a step asks the host: positions, lengths, tables and transfers live on the device, and shapes
    do not change while every position is below cache.capacity(). Elsewhere (CPU, dense attention,
    a short context, past the capacity) it runs the eager step, which computes the same logits."""

    def __init__(self, model, cache, micro_batches=1):
        self.model, self.cache = model, cache
        self.graph, self.warm = None, False
        # micro-batches (offload.OffloadCache.split): the batch in parts decoded on their own CUDA streams
        # inside the one graph, so that one part's gathers (PCIe) overlap the other's compute
        self.parts = cache.split(micro_batches) if micro_batches > 1 and cache.Bz >= micro_batches else None

    def step(self, tok):  # the eager step: the whole batch, or its parts one after the other
        if not self.parts:
            return self.model.decode(tok, self.cache)
        return torch.cat([self.model.decode(t, p) for t, p in zip(tok.tensor_split(len(self.parts)), self.parts)])

    def __call__(self, tok):
        cache, pos = self.cache, int(self.cache.len_cpu.max())
        if not (tok.is_cuda and self.model.cfg.l_c <= pos + 1 and pos < cache.capacity()):
            return self.model.decode(tok, cache)
        if self.graph is None:
            if not self.warm:  # one eager step first: compiles and initialises what the graph will launch
                self.warm = True
                return self.step(tok)
            self.tok, self.graph = tok.clone(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records, runs nothing; cache.advance's host part runs once
                self.logits = self.step(self.tok) if not self.parts else self.side_by_side(self.tok)
        else:
            self.tok.copy_(tok)
            cache.advance_host()
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the graph's output

    def side_by_side(self, tok):
        """The parts' steps, each on a stream of its own (forked from the current one and joined to
        it), recorded layer by layer in turn: their gathers take turns on PCIe in that order
        (OffloadCache.split), so one part's gather runs while the other computes."""
        main = torch.cuda.current_stream()
        streams = [torch.cuda.Stream() for _ in self.parts]
        steps = [self.model.decode_layers(t, p) for t, p in zip(tok.tensor_split(len(self.parts)), self.parts)]
        for s in streams:
            s.wait_stream(main)
        for _ in range(self.model.cfg.n_layer + 1):
            out = []
            for step, s in zip(steps, streams):
                with torch.cuda.stream(s):
                    out.append(next(step))
        for s in streams:
            main.wait_stream(s)
        return torch.cat(out)


# -----------------------------------------------------------------------------
# The script


def main(checkpoint_dir=checkpoint.DEFAULT_CHECKPOINT, prompt=DEFAULT_PROMPT, max_new_tokens=300, batch=1,
         temperature=0.8, top_k=50, offload=False, device=None, seed=1337, quiet=False, attn=None, chat=False,
         profile=None):
    """Generate from one prompt or several (a ragged batch); returns the new tokens of each sequence.
    A single prompt's text is streamed as it is generated (unless quiet); every sequence stops at
    the checkpoint's end-of-sequence token. chat: wrap each prompt in the checkpoint's chat template.
    profile: write a trace of the timed generation there (open it in chrome://tracing or Perfetto);
    the decode step marks its selection, transfer and attention as ranges."""
    for name, value, least in (("--batch", batch, 1), ("--max-new-tokens", max_new_tokens, 1), ("--top-k", top_k, 0),
                               ("--temperature", temperature, 0)):
        if value < least:
            raise ValueError(f"{name} {value}: must be at least {least}")
    device = checkpoint.pick_device(device)
    torch.manual_seed(seed)
    overrides = {"attn": attn} if attn else {}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if checkpoint_dir != checkpoint.DEFAULT_CHECKPOINT or os.path.isdir(checkpoint_dir):
        model, tokenizer = checkpoint.load(checkpoint_dir, device, dtype, **overrides)
    else:
        print(f"no checkpoint at {checkpoint_dir!r}: using a randomly initialised tiny model (expect noise)")
        tokenizer = checkpoint.byte_tokenizer()
        model = Transformer(Config.from_preset("tiny", vocab_size=tokenizer.get_vocab_size(), **overrides))
        model = model.to(device).eval()
        model.eos_ids, model.chat_template, model.special_tokens = set(), None, {}  # what checkpoint.load reads
    model.fuse_projections()  # a decode step: one matrix product for q, k, v, one for gate and up
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)  # several prompts: a ragged batch
    prompts = [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]
    batch = len(prompts)
    if chat:
        if not getattr(model, "chat_template", None):
            raise ValueError(f"--chat: {checkpoint_dir} has no chat template (tokenizer_config.json); drop --chat")
        prompts = [chat_prompt(model.chat_template, p, model.special_tokens) for p in prompts]
    ids = [tokenizer.encode(p, add_special_tokens=not chat).ids for p in prompts]  # the template has them
    if not all(ids):
        raise ValueError("a prompt is empty after tokenisation; give some text with --prompt")
    model.check_length(max(map(len, ids)), max_new_tokens)  # before any cache is allocated

    def new_cache():
        if not offload:
            return None
        import offload as nosi
        return nosi.OffloadCache(model.cfg, batch, device, model.embed_tokens.weight.dtype,
                                 max_len=max(map(len, ids)) + max_new_tokens)

    if device.type == "cuda":  # warm-up: build uva_copy.cu and compile the kernels outside the timing
        generate(model, ids, 2, temperature, top_k, cache=new_cache())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # give the warm-up cache back before the budget check of the real one
    cache = new_cache()
    stream = Stream(tokenizer, model.eos_ids) if batch == 1 and not quiet else None
    if stream:
        print(prompts[0], end="", flush=True)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])) if profile else None
    with prof or contextlib.nullcontext():
        t0 = time.perf_counter()
        out = generate(model, ids, max_new_tokens, temperature, top_k, cache=cache, eos_ids=model.eos_ids,
                       on_token=stream)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    if prof:
        prof.export_chrome_trace(profile)
    if stream:
        print("\n---")
    elif not quiet:
        for i, seq in enumerate(out):
            print(f"--- sample {i} ---\n{prompts[i]}{tokenizer.decode(seq)}")
        print("---")
    n_tok = sum(map(len, out))
    print(f"tokens/sec: {n_tok / dt:.1f} ({n_tok} tokens in {dt:.2f} s, batch {batch}, prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"{model.cfg.attn}, {device})")
    if cache is not None:
        print(cache.stats.summary())
    if prof:
        print(f"profile: {profile} (chrome://tracing or ui.perfetto.dev)")
    return out


class Stream:
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
    p.add_argument("--attn", choices=nosa.MODES,
                   help="override the checkpoint's attention mode (e.g. infllmv2: training-free sparse decoding)")
    a = p.parse_args(argv)

    def run():
        if checkpoint.pick_device(a.device).type == "cpu":  # decoding a small model is a chain of small ops: one
            torch.set_num_threads(1)  # thread is as fast as two, and does not collapse when the cores are busy
        prompt = (a.prompt or []) + [read_prompt(f) for f in a.prompt_file or []] or DEFAULT_PROMPT
        return main(a.checkpoint, prompt, a.max_new_tokens, a.batch, a.temperature, a.top_k, a.offload, a.device,
                    a.seed, a.quiet, a.attn, a.chat, a.profile)

    return checkpoint.run_cli(run)


if __name__ == "__main__":
    cli()
