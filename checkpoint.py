"""
Checkpoints, loaded without pickle and checked before use.

This project's format: a directory with model.safetensors, config.json (the Config) and
tokenizer.json (a `tokenizers` byte-level BPE). The released NOSA models (openbmb/NOSA-1B, -3B, -8B)
use the Hugging Face Llama format: config.json in HF terms, safetensors in one file or in shards
with model.safetensors.index.json, tokenizer.json. Tensor names are the same in both up to the
"model." prefix, so one loader reads both. saving.py writes them, so that nothing is lost.
"""

import contextlib
import json
import os
from dataclasses import fields

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from config import Config
from model import Transformer
from saving import located

# defaults resolve here, whatever the working directory
ROOT = os.path.dirname(os.path.abspath(__file__))
EOT = "<|endoftext|>"  # the document separator of train.py's token streams: this format's end of sequence
# Config fields older checkpoints lack; their absence means what they meant then
ADDED_LATER = {"rope_scaling", "hh_recency"}
# the embedded model; train.py never writes it
DEFAULT_CHECKPOINT = os.path.join(ROOT, "checkpoints", "tiny-nosa")


def resolve(path):
    """A checkpoint path as the scripts take it: relative to the working directory where it exists
    there, else to the repository (where train.py writes out/), whatever the working directory."""
    if os.path.isabs(path) or os.path.exists(path) or not os.path.exists(os.path.join(ROOT, path)):
        return path
    return os.path.join(ROOT, path)


def byte_tokenizer():
    """256 byte-level tokens and no merges: what an untrained model reads and writes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def is_checkpoint(path):
    return os.path.isfile(os.path.join(located(path), "config.json"))


@contextlib.contextmanager
def weights_not_drawn():
    """Modules made without drawing initial weights, which the checkpoint's replace: drawn on the
    meta device they go through torch's Python decompositions, whose first use imports
    torch._dynamo, seconds of a start where nothing is compiled."""
    saved = {
        name: getattr(torch.nn.init, name) for name in ("normal_", "uniform_", "kaiming_uniform_")
    }
    for name in saved:
        setattr(torch.nn.init, name, lambda t, *a, **k: t)
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(torch.nn.init, name, f)


def load(path, device="cpu", dtype=None, **overrides):
    """Returns (model, tokenizer) from this project's checkpoint directory or a Hugging Face Llama-format
    one (config.json, model.safetensors or shards with model.safetensors.index.json, tokenizer.json).
    `overrides` change config fields (e.g. attn="infllmv2"). Every failure is one line that says what
    to do, and comes before any tensor is loaded: nothing is half-loaded."""
    path = located(path)
    check_files(path)
    raw, cfg = read_config(path, **overrides)
    eos_ids, chat_template, special_tokens, tokenizer = side_files(path, raw, cfg)
    shapes, where = tensor_headers(path)  # every header first: names and shapes before any data
    with torch.device("meta"), weights_not_drawn():
        model = Transformer(cfg)
    check_tensors(path, model, shapes, where)
    model.load_state_dict(read_tensors(path, where, device, dtype), strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eos_ids, model.chat_template, model.special_tokens = (
        eos_ids,
        chat_template,
        special_tokens,
    )
    return model.eval(), tokenizer


def check_files(path):
    """A checkpoint directory with its files (load), or one line that says what to give."""
    if os.path.isfile(path):
        raise FileNotFoundError(
            f"{path!r} is a file, not a checkpoint directory; give the directory train.py "
            f"wrote (e.g. out/tiny-nosa) or a Hugging Face model directory"
        )
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"no checkpoint directory at {path!r}: train one with `python train.py --out "
            f"{path}`, or give the path of an existing one"
        )
    index = os.path.join(path, "model.safetensors.index.json")
    missing = [
        n for n in ("config.json", "tokenizer.json") if not os.path.isfile(os.path.join(path, n))
    ]
    if not (os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(index)):
        missing.insert(0, "model.safetensors")
    if missing:
        raise FileNotFoundError(
            f"checkpoint {path!r} lacks {', '.join(missing)}: train one with "
            f"`python train.py --out {path}`, or give the path of an existing one"
        )


def tensor_headers(path):
    """The safetensors headers of the checkpoint (one file, or the shards its index names): per
    tensor name (without "model."), its shape and (file, name in the file). Floating point only."""
    index = os.path.join(path, "model.safetensors.index.json")
    weight_map = read_json(path, "model.safetensors.index.json").get("weight_map")
    if os.path.isfile(index) and not (
        isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
    ):
        raise ValueError(f"{index}: no weight_map (tensor name -> shard file); re-download it")
    shapes, where = {}, {}
    for fname in sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]:
        try:
            with safe_open(os.path.join(path, fname), framework="pt") as f:
                for name in f.keys():
                    kind = f.get_slice(name).get_dtype()
                    if kind not in ("F16", "BF16", "F32", "F64"):
                        raise ValueError(
                            f"{os.path.join(path, fname)}: {name} is stored as {kind}; a model's weights "
                            f"are floating point: re-export or re-train the checkpoint"
                        )
                    shapes[name.removeprefix("model.")] = tuple(f.get_slice(name).get_shape())
                    where[name.removeprefix("model.")] = (fname, name)
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"{os.path.join(path, fname)} is corrupt or truncated ({e}); re-download or "
                f"re-train it"
            ) from None
    return shapes, where


def check_tensors(path, model, shapes, where):
    """The checkpoint's tensors (tensor_headers) are the model's, name for name and shape for shape
    (a mode without the eviction head reads a NOSA checkpoint too: its head is dropped from where)."""
    cfg = model.cfg
    want = {
        k: tuple(v.shape)
        for k, v in model.state_dict().items()
        if not (cfg.tie_embeddings and k == "lm_head.weight")
    }
    if cfg.attn in ("full", "infllmv2"):
        for key in [k for k in shapes if k.endswith((".self_attn.A", ".self_attn.delta.weight"))]:
            del shapes[key], where[key]
    lacking, extra = sorted(want.keys() - shapes.keys()), sorted(shapes.keys() - want.keys())
    if lacking:
        hint = (
            " (not a NOSA checkpoint? load it with attn='infllmv2' or 'full' for training-free decoding)"
            if lacking[0].endswith((".A", ".delta.weight"))
            else ""
        )
        raise ValueError(
            f"checkpoint {path!r} does not match its config: missing tensor {lacking[0]}"
            f"{f' and {len(lacking) - 1} more' if len(lacking) > 1 else ''}{hint}"
        )
    if extra:
        raise ValueError(
            f"checkpoint {path!r} does not match its config: unexpected tensor {extra[0]}"
            f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}"
        )
    bad = [k for k in want if want[k] != shapes[k]]
    if bad:
        raise ValueError(
            f"checkpoint {path!r}: {bad[0]} has shape {shapes[bad[0]]}, the config needs {want[bad[0]]}"
        )


def read_tensors(path, where, device, dtype):
    """The state dict, one tensor at a time straight to its device (in dtype, else its own); a NaN or
    an infinity is an error."""
    sd = {}
    for fname in sorted({f for f, _ in where.values()}):
        with safe_open(os.path.join(path, fname), framework="pt", device="cpu") as f:
            for key, (fn, name) in where.items():
                if fn == fname:
                    t = f.get_tensor(name)
                    sd[key] = t.to(device=device, dtype=dtype or t.dtype)
                    if not torch.isfinite(sd[key]).all():
                        raise ValueError(
                            f"checkpoint {path!r}: {name} holds NaN or infinite values; the checkpoint "
                            f"is damaged (a diverged run?): re-download or re-train it"
                        )
    return sd


def read_config(path, **overrides):
    """The checkpoint's config.json as it is (a dict) and as a Config with `overrides`: this
    project's format, or Hugging Face's (checked, with its documented defaults)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        if "hidden_size" in raw:  # Hugging Face: documented defaults for the keys it leaves out
            return raw, Config.from_hf(raw, **overrides)
        # this project's format writes every field: a missing one is an error, not a default
        lacking = [
            f.name for f in fields(Config) if f.name not in raw and f.name not in ADDED_LATER
        ]
        if lacking:
            raise ValueError(f"it lacks {', '.join(map(repr, lacking))}")
        return raw, Config(**{**raw, **overrides})
    except ValueError as e:  # the Config's own checks say what is wrong
        raise ValueError(f"{os.path.join(path, 'config.json')}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError) as e:
        raise ValueError(
            f"{os.path.join(path, 'config.json')} is not a valid NOSA config ({e})"
        ) from None


def side_files(path, raw, cfg):
    """What a checkpoint says besides its weights, each field checked (one line naming the file and
    the field): the end-of-sequence ids (config.json, generation_config.json: one id or a list), the
    chat template (chat_template.jinja, else tokenizer_config.json) and the special tokens it refers
    to (tokenizer_config.json), and the tokenizer,
    whose ids must fit the model's vocabulary. Returns (eos_ids, chat_template, special_tokens,
    tokenizer)."""
    f = os.path.join(path, "tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(f)
    except Exception as e:  # tokenizers raises plain Exception on a bad file
        raise ValueError(f"{f} is not a valid tokenizer ({e})") from None
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    if n > cfg.vocab_size:
        raise ValueError(
            f"{f}: {n} token ids, more than the model's vocab_size={cfg.vocab_size}: "
            f"the tokenizer is not this model's"
        )
    eos_ids = set()
    for name in ("config.json", "generation_config.json"):
        ids = read_json(path, name).get("eos_token_id")
        ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
        if not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.vocab_size for i in ids
        ):
            raise ValueError(
                f"{os.path.join(path, name)}: eos_token_id={ids!r}: give a token id "
                f"below {cfg.vocab_size}, or a list of them"
            )
        eos_ids |= set(ids)
    if "hidden_size" not in raw and tokenizer.token_to_id(EOT) is not None:
        eos_ids.add(tokenizer.token_to_id(EOT))  # this format ends where a document ends
    tok_cfg = read_json(path, "tokenizer_config.json")
    template = tok_cfg.get("chat_template")
    jinja = os.path.join(path, "chat_template.jinja")  # where current tools write it
    if os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as fh:
                template = fh.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if isinstance(template, list):  # Hugging Face's named templates: the default one
        template = next(
            (
                t.get("template")
                for t in template
                if isinstance(t, dict) and t.get("name") == "default"
            ),
            None,
        )
    if template is not None and not isinstance(template, str):
        raise ValueError(
            f"{os.path.join(path, 'tokenizer_config.json')}: chat_template must be a "
            f"string (found {type(template).__name__})"
        )
    special = {}
    for k in ("bos_token", "eos_token"):
        v = tok_cfg.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{os.path.join(path, 'tokenizer_config.json')}: {k} must be a string")
        if v:
            special[k] = v
    return eos_ids, template, special, tokenizer


def read_json(path, name):
    """A JSON object of a checkpoint as a dict ({} if absent); one line if it is not one."""
    f = os.path.join(path, name)
    if not os.path.isfile(f):
        return {}
    try:
        with open(f, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{f}: a JSON object is needed, found a {type(obj).__name__}")
    return obj
