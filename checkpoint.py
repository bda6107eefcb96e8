"""
Checkpoints, loaded without pickle and checked before use.

This project's format: a directory with model.safetensors, config.json (the Config) and
tokenizer.json (a `tokenizers` byte-level BPE). The released NOSA models (openbmb/NOSA-1B, -3B, -8B)
use the Hugging Face Llama format: config.json in HF terms, safetensors in one file or in shards
with model.safetensors.index.json, tokenizer.json. Tensor names are the same in both up to the
"model." prefix, so one loader reads both.
"""

import contextlib
import json
import os
import shutil
import sys
from dataclasses import fields

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from config import Config
from model import Transformer

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


MARK = ".nosa-save"  # in every directory a save makes: what recovery may move or delete


def staging(path):
    """Where a save of path writes first, and where it moves the checkpoint it replaces: hidden
    names beside path that the project owns (.NAME.saving, .NAME.replaced)."""
    parent, name = os.path.split(os.path.normpath(path))
    return os.path.join(parent, f".{name}.saving"), os.path.join(parent, f".{name}.replaced")


def made_by_save(d):
    return os.path.isdir(d) and not os.path.islink(d) and os.path.isfile(os.path.join(d, MARK))


def save(model, tokenizer, path, dtype=None, train_state=None, optimizer=None):
    """Write weights (in `dtype`, or as they are), config, tokenizer and, for a training run, its state
    (train_state.json) and the optimizer's (optimizer.pt). Atomic: everything goes to .NAME.saving
    first, which then replaces path by renames (the previous checkpoint moved to .NAME.replaced,
    then deleted), so a process killed at any moment leaves a whole checkpoint on disk, which load
    finds and the next save or run puts in place (`recover`). Only directories a save made (they
    hold MARK) are ever moved or deleted; path is resolved by the caller (a link is refused)."""
    path = os.path.normpath(path)
    if os.path.islink(path):
        raise ValueError(f"{path} is a symbolic link; give the directory it points to")
    tmp, old = staging(path)
    recover(path)  # a killed save's directories, or one line naming what is in the way
    try:
        write(model, tokenizer, tmp, dtype, train_state, optimizer)
    except Exception as e:  # a full disk, a quota: the serializers say so in many lines
        shutil.rmtree(tmp, ignore_errors=True)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise OSError(
            f"could not save a checkpoint to {path} ({reason}); the previous one there, "
            f"if any, is intact: free disk space and --resume"
        ) from None
    replaces = os.path.isdir(path)
    if replaces:
        foreign = foreign_files(path)
        if foreign:  # check_out refused it before the run; never delete what is not ours
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(
                f"{path} holds {foreign[0]}, which is not a checkpoint of ours: not replaced"
            )
        open(os.path.join(path, MARK), "w").close()  # (one an older version saved lacks it)
        os.rename(path, old)
    os.rename(tmp, path)
    if replaces:
        shutil.rmtree(old)


def write(model, tokenizer, tmp, dtype, train_state, optimizer):
    """save's files, into the directory tmp (the mark first: a killed save's is recognised)."""
    os.makedirs(tmp)
    with open(os.path.join(tmp, MARK), "w") as f:
        f.write("a directory of checkpoint.save; its next save or run removes it when it is left\n")
    sd = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    # fused weights are views
    sd = {k: v.clone() if v.device.type == "cpu" else v.cpu() for k, v in sd.items()}
    if model.cfg.tie_embeddings:
        sd.pop("lm_head.weight")
    save_file(sd, os.path.join(tmp, "model.safetensors"))
    umask = os.umask(0)
    os.umask(umask)
    # as readable as the files beside it
    os.chmod(os.path.join(tmp, "model.safetensors"), 0o666 & ~umask)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(model.cfg.to_dict(), f, indent=1)
    tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    # how the model generates, as side_files reads it back: its end-of-sequence ids, the special
    # tokens its chat template refers to, the template
    for name, obj in (
        (
            "generation_config.json",
            {"eos_token_id": sorted(model.eos_ids)} if model.eos_ids else None,
        ),
        ("tokenizer_config.json", model.special_tokens or None),
    ):
        if obj:
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(obj, f, indent=1)
    if model.chat_template:
        with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(model.chat_template)
    if train_state is not None:
        with open(os.path.join(tmp, "train_state.json"), "w") as f:
            json.dump(train_state, f)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))


# what save writes
FILES = (
    MARK,
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "generation_config.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "train_state.json",
    "optimizer.pt",
)


def foreign_files(path):
    """What a directory holds besides the files of a checkpoint of ours (a save replaces it whole)
    and the locks of runs into what it holds (hold: .NAME.lock beside NAME, holding a process id)."""

    def lock(f):
        if not (
            f.startswith(".")
            and f.endswith(".lock")
            and os.path.lexists(os.path.join(path, f[1:-5]))
        ):
            return False
        with open(os.path.join(path, f), errors="replace") as fh:
            return fh.read(32).strip().isdigit()

    return sorted(f for f in os.listdir(path) if f not in FILES and not lock(f))


def check_out(path):
    """Before a run writes its first checkpoint to path: refuse, in one line, a path inside the
    repository's checkpoints/ (the embedded models), a file, a directory that holds anything but a
    checkpoint of ours (save replaces the directory whole), and a place that cannot be written
    (a probe file beside it, where save writes first)."""
    path = os.path.abspath(path)
    embedded = os.path.realpath(os.path.join(ROOT, "checkpoints"))
    if os.path.commonpath([os.path.realpath(path), embedded]) == embedded:  # links resolved
        raise ValueError(
            f"--out {path}: training never writes into {embedded} (the embedded models); write "
            f"elsewhere and copy a model there yourself"
        )
    recover(path)
    if os.path.isfile(path):
        raise FileExistsError(f"--out {path} is a file; give a directory")
    if os.path.ismount(path):  # a save renames a new directory into place: not over a mount point
        raise ValueError(
            f"--out {path} is a mount point, which a save cannot replace; give a "
            f"directory inside it"
        )
    if os.path.isdir(path):
        foreign = foreign_files(path)
        if foreign:
            raise FileExistsError(
                f"--out {path} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, "
                f"which is not a checkpoint of ours, and a save replaces the directory whole: "
                f"give a new or empty directory"
            )
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        probe = os.path.join(parent, f".{os.path.basename(path)}.{os.getpid()}.probe")
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as e:
        raise PermissionError(
            f"--out {path}: cannot write in {parent} ({e.strerror}); give a writable directory"
        ) from None


def hold(path):
    """A lock on the output directory path for the life of this process (released at its exit, a
    crash included): a second run into it is refused in one line that names the first one's
    process. Returns the lock file, to keep open."""
    import fcntl

    path = os.path.abspath(path)
    lock = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")
    f = open(lock, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise ValueError(
            f"--out {path}: another run (process {pid}) is writing there; wait for "
            f"it to end, or give another --out"
        ) from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def recover(path):
    """Before a save or a run writes path: where a save was killed, the newest whole checkpoint put
    at path, said in one line (killed between its renames: the previous one moved back; after
    them: the previous one deleted; while writing: the unfinished one deleted). A directory in the
    staging places that a save did not make is left alone, and refused in one line."""
    path = os.path.normpath(path)
    tmp, old = staging(path)
    for d in (tmp, old):
        if os.path.lexists(d) and not made_by_save(d):
            raise FileExistsError(
                f"{d} is in the way of saving {path} and was not made by a save of this "
                f"project; move it elsewhere"
            )
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
        print(f"recovered {path}: removed {tmp}, a save that was killed", file=sys.stderr)
    if not os.path.isdir(old):
        return
    if os.path.isdir(path):
        shutil.rmtree(old)
        print(f"recovered {path}: removed {old}, which a killed save left behind", file=sys.stderr)
    else:
        os.rename(old, path)
        print(f"recovered {path}: the checkpoint a killed save had moved aside", file=sys.stderr)


def located(path):
    """Where the checkpoint of path is to be read: path, or, where a save was killed between its
    renames, the previous checkpoint it had moved aside (read where it is: loading never moves or
    deletes anything)."""
    old = staging(path)[1]
    if not os.path.exists(path) and made_by_save(old):
        return old
    return path


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
