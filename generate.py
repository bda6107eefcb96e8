"""
Generate text with a NOSA model.

    python generate.py                       # the embedded tiny model, GPU-resident cache
    python generate.py --offload             # the same, KV cache in host memory (NOSI)
    python generate.py --checkpoint DIR --prompt "def main(" --batch 4 --max-new-tokens 200

Prints the text, then greppable lines: tokens/sec, and with --offload the cache hit rate and the
bytes moved per step.
"""
import argparse
import os
import time

import torch

import checkpoint
from model import Transformer
from nosa import Config

DEFAULT_PROMPT = '''import os
import sys


def main(argv=None):
    """Parse the command line and run.'''


def main(checkpoint_dir=checkpoint.DEFAULT_CHECKPOINT, prompt=DEFAULT_PROMPT, max_new_tokens=200, batch=1,
         temperature=0.8, top_k=50, offload=False, device=None, seed=1337, quiet=False, attn=None):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    overrides = {"attn": attn} if attn else {}
    if checkpoint_dir != checkpoint.DEFAULT_CHECKPOINT or os.path.isdir(checkpoint_dir):
        model, tokenizer = checkpoint.load(checkpoint_dir, device, torch.bfloat16 if device.startswith("cuda")
                                           else torch.float32, **overrides)
    else:
        print(f"no checkpoint at {checkpoint_dir!r}: using a randomly initialised tiny model (expect noise)")
        tokenizer = checkpoint.byte_tokenizer()
        model = Transformer(Config.from_preset("tiny", vocab_size=tokenizer.get_vocab_size(), **overrides))
        model = model.to(device).eval()
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ValueError("the prompt is empty after tokenisation; give some text with --prompt")
    model.check_length(len(ids), max_new_tokens)  # before any cache is allocated

    def new_cache():
        if not offload:
            return None
        import offload as nosi
        return nosi.OffloadCache(model.cfg, batch, device, model.embed_tokens.weight.dtype,
                                 max_len=len(ids) + max_new_tokens)

    if device.startswith("cuda"):  # warm-up: build uva_copy.cu and compile the kernels outside the timing
        model.generate([ids] * batch, 2, temperature, top_k, cache=new_cache())
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # give the warm-up cache back before the budget check of the real one
    cache = new_cache()
    t0 = time.perf_counter()
    out = model.generate([ids] * batch, max_new_tokens, temperature, top_k, cache=cache)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if not quiet:
        for i, seq in enumerate(out):
            print(f"--- sample {i} ---\n{prompt}{tokenizer.decode(seq)}")
        print("---")
    n_tok = batch * max_new_tokens
    print(f"tokens/sec: {n_tok / dt:.1f} ({n_tok} tokens in {dt:.2f} s, batch {batch}, prompt {len(ids)} tokens, "
          f"{model.cfg.attn}, {device})")
    if cache is not None:
        print(cache.stats.summary())
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Generate text with a NOSA model.")
    p.add_argument("--checkpoint", default=checkpoint.DEFAULT_CHECKPOINT,
                   help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--prompt-file", help="read the prompt from this file instead")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences generated together")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--offload", action="store_true", help="keep the KV cache in host memory (NOSI)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--quiet", action="store_true", help="print only the statistics, not the text")
    p.add_argument("--attn", choices=["nosa", "full", "infllmv2", "dma"],
                   help="override the checkpoint's attention mode (e.g. infllmv2: training-free sparse decoding)")
    a = p.parse_args()
    prompt = open(a.prompt_file).read() if a.prompt_file else a.prompt
    main(a.checkpoint, prompt, a.max_new_tokens, a.batch, a.temperature, a.top_k, a.offload, a.device, a.seed, a.quiet, a.attn)
