"""
Checkpoints: a directory with model.safetensors (weights), config.json (the Config) and
tokenizer.json (a `tokenizers` byte-level BPE). Loaded without pickle, checked before use.
"""
import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from model import Transformer
from nosa import Config

DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints", "tiny-nosa")


def byte_tokenizer():
    """256 byte-level tokens and no merges: what an untrained model reads and writes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def save(model, tokenizer, path, dtype=None, extra=None):
    """Write weights (in `dtype`, or as they are), config and tokenizer; `extra` (training state)
    goes to train_state.json."""
    os.makedirs(path, exist_ok=True)
    sd = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        sd.pop("lm_head.weight")
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.cfg.to_dict(), f, indent=1)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    if extra is not None:
        with open(os.path.join(path, "train_state.json"), "w") as f:
            json.dump(extra, f)


def load(path, device="cpu", dtype=None, **overrides):
    """Returns (model, tokenizer). Every failure is one line that says what to do."""
    files = {n: os.path.join(path, n) for n in ("model.safetensors", "config.json", "tokenizer.json")}
    missing = [n for n, f in files.items() if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"checkpoint {path!r} lacks {', '.join(missing)}: train one with "
                                f"`python train.py --out {path}` or pass another --checkpoint")
    try:
        with open(files["config.json"]) as f:
            cfg = Config(**{**json.load(f), **overrides})
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{files['config.json']} is not a valid NOSA config ({e}); re-save the checkpoint") from None
    try:
        sd = load_file(files["model.safetensors"], device=str(device))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{files['model.safetensors']} is corrupt or truncated ({e}); re-download or "
                         f"re-train it") from None
    with torch.device("meta"):
        model = Transformer(cfg)
    want = {k: v.shape for k, v in model.state_dict().items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    got = {k: v.shape for k, v in sd.items()}
    if want.keys() != got.keys():
        raise ValueError(f"checkpoint {path!r} does not match its config: missing {sorted(want.keys() - got.keys())[:3]}, "
                         f"unexpected {sorted(got.keys() - want.keys())[:3]}")
    bad = [k for k in want if want[k] != got[k]]
    if bad:
        raise ValueError(f"checkpoint {path!r}: {bad[0]} has shape {tuple(got[bad[0]])}, the config needs "
                         f"{tuple(want[bad[0]])}")
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    try:
        tokenizer = Tokenizer.from_file(files["tokenizer.json"])
    except Exception as e:  # tokenizers raises plain Exception on a bad file
        raise ValueError(f"{files['tokenizer.json']} is not a valid tokenizer ({e})") from None
    return model.eval(), tokenizer
