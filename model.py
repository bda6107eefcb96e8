"""
A Llama-style decoder whose every layer is NOSA attention (docs/METHOD.md §2-3), with a KV cache for
step-by-step decoding (the sampling is generate.py's).

Notation: Bz batch, T tokens, dim model width, H_q / H_kv query / KV heads, d = head_dim,
G = H_q / H_kv, c eviction score (eviction.py), K̃ compressed keys (pooling.py).

Two paths through every attention layer compute the same function:
  forward(idx)          the parallel (training) forward over whole sequences
  decode(tok, cache)    one new token per sequence, each at its own position, against a cache
(a prompt enters the cache through prefill.py, a chunk at a time, by the first path). The tests
check that their logits are equal; that is the whole promise of NOSA (no training / inference
mismatch). Checkpoints name the parameters as Hugging Face Llama does, so released NOSA checkpoints
map onto this model one to one (checkpoint.py); q, k, v and gate, up are each one Linear here.
random_model makes one of any preset without a checkpoint, to try shapes and speed.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import eviction
import memory
import nosa
from common import fp32


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = fp32(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.weight


def rope_frequencies(cfg, device):
    """RoPE's inverse frequencies (d/2,), with the long-context scaling of Llama checkpoints:
    linear  every frequency divided by `factor` (positions stretched);
    llama3  wavelengths longer than original_max_position_embeddings / low_freq_factor divided by
            `factor`, shorter than .../high_freq_factor kept, and a smooth blend in between."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (
        torch.arange(0, d, 2, device=device, dtype=torch.float64) / d
    )
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs["rope_type"] == "linear":
        return inv_freq / rs["factor"]
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0: long wavelengths, 1: short ones
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_tables(pos, inv_freq, dtype):
    """cos and sin (Bz, 1, T, d/2) of the rotation angles pos * inv_freq, computed in fp64 (positions
    reach 1e5 and more) once per forward, prefill or decode step and shared by every layer. pos (Bz, T)."""
    ang = pos[:, None, :, None].to(torch.float64) * inv_freq  # (Bz, 1, T, d/2)
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def apply_rope(x, rope):
    """Rotary embedding in the Hugging Face (rotate-half) layout: dims i and i + d/2 turn by angle i.
    x (Bz, H, T, d), rope = (cos, sin) (Bz, 1, T, d/2)."""
    cos, sin = rope
    x1, x2 = fp32(x).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def fused_linear(module, name, parts, sizes, dim):
    """module.<name>: one Linear whose output is the outputs of the Linears `parts` (Hugging Face's
    names, of out_features `sizes`), so a step makes one matrix product where it would make several.
    Checkpoints keep the parts: state_dict() splits the weight into them, load_state_dict() joins
    them (gpt-fast's way)."""
    setattr(module, name, nn.Linear(dim, sum(sizes), bias=False))

    def split(mod, state_dict, prefix, local_metadata):
        w = state_dict.pop(prefix + name + ".weight")
        for part, t in zip(parts, w.split(sizes)):
            state_dict[prefix + part + ".weight"] = t

    def join(mod, state_dict, prefix, *args):
        keys = [prefix + part + ".weight" for part in parts]
        if all(k in state_dict for k in keys):
            state_dict[prefix + name + ".weight"] = torch.cat([state_dict.pop(k) for k in keys])

    module._register_state_dict_hook(split)
    module.register_load_state_dict_pre_hook(join)


class Attention(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.cfg, self.layer = cfg, layer  # layer: its index, where a decode cache keeps its keys
        d = cfg.head_dim
        sizes = [cfg.H_q * d, cfg.H_kv * d, cfg.H_kv * d]
        fused_linear(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"], sizes, cfg.dim)
        self.o_proj = nn.Linear(cfg.H_q * d, cfg.dim, bias=False)
        if cfg.eviction_head:  # ED-DMA: W_δ and A, A = 0 at init
            self.delta = nn.Linear(cfg.H_kv * d, cfg.H_kv, bias=False)
            self.delta.init_std = (cfg.H_kv * d) ** -0.5  # see Transformer._init_weights
            self.A = nn.Parameter(torch.zeros(cfg.H_kv))

    def qkvc(self, x, rope):
        """Projections, RoPE on q and k, and the eviction score c: x (Bz, T, dim) ->
        q (Bz, H_q, T, d), k, v (Bz, H_kv, T, d), c (Bz, H_kv, T) or None."""
        cfg, (Bz, T, _) = self.cfg, x.shape
        d = cfg.head_dim
        q, k, v = self.qkv_proj(x).split([cfg.H_q * d, cfg.H_kv * d, cfg.H_kv * d], -1)
        q = q.view(Bz, T, cfg.H_q, d).transpose(1, 2)  # (Bz, H_q, T, d)
        k = k.view(Bz, T, cfg.H_kv, d).transpose(1, 2)  # (Bz, H_kv, T, d)
        v = v.view(Bz, T, cfg.H_kv, d).transpose(1, 2)  # (Bz, H_kv, T, d)
        c = self.eviction(v) if cfg.eviction_head else None
        return apply_rope(q, rope), apply_rope(k, rope), v, c

    def eviction(self, v):  # c (Bz, H_kv, T) from v (Bz, H_kv, T, d): ED-DMA's head (eviction.py)
        return eviction.eviction_score(v, self.A, self.delta.weight)

    def forward(self, x, rope, cache=None, prompt=None):
        """x (Bz, T, dim) -> (Bz, T, dim), one of three ways:
        training   the whole sequence at once (nosa.nosa_attention);
        prompt     a chunk of a prompt (prefill.PromptLayer keeps the layer's keys of the earlier
                   chunks): its queries attend over those and its own, as the whole forward would;
        cache      one new token per sequence against a decode cache (nosa.nosa_decode)."""
        Bz, T, _ = x.shape
        q, k, v, c = self.qkvc(x, rope)
        if cache is not None:
            o = nosa.nosa_decode(q, k, v, c, self.cfg, layer=self.layer, cache=cache)
        elif prompt is not None:
            start = prompt.len
            k, v, c, selects_from = prompt.write(k, v, c, q)  # the prompt's keys so far
            o, _ = nosa.nosa_attention(q, k, v, c, self.cfg, start=start, selects_from=selects_from)
        else:
            o, _ = nosa.nosa_attention(q, k, v, c, self.cfg)
        return self.o_proj(o.transpose(1, 2).reshape(Bz, T, -1))  # (Bz, H_q, T, d) -> (Bz, T, dim)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        sizes = [cfg.hidden_dim, cfg.hidden_dim]
        fused_linear(self, "gate_up_proj", ["gate_proj", "up_proj"], sizes, cfg.dim)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class Block(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, cache=None, prompt=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, prompt)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init_weights)
        self.inv_freq = None  # RoPE frequencies, made once on the device of the first call
        # how its checkpoint says to generate (checkpoint.load fills them): tokens that end a sequence,
        # the chat template and the special tokens it refers to
        self.eos_ids, self.chat_template, self.special_tokens = set(), None, {}

    def rope(self, pos, dtype):
        if self.inv_freq is None or self.inv_freq.device != pos.device:
            self.inv_freq = rope_frequencies(self.cfg, pos.device)
        return rope_tables(pos, self.inv_freq, torch.promote_types(dtype, torch.float32))

    @staticmethod
    def _init_weights(m):
        """std 0.02 (GPT-2, Llama), except W_δ, at 1/sqrt(fan-in) so that W_δ v is of the size of v. The
        eviction head is a product: A = 0 at init, and A's gradient is the covariance, over tokens, of
        softplus(W_δ v) with the logit gradient (a constant bias changes no softmax); at std 0.02 that
        softplus is nearly the same for every token, which leaves A little to learn from."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=getattr(m, "init_std", 0.02))

    def forward(self, idx):
        """Parallel (training) forward: idx (Bz, T) from position 0 -> logits (Bz, T, vocab)."""
        Bz, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {T} tokens is longer than max_seq_len={self.cfg.max_seq_len}"
            )
        x = self.embed_tokens(idx)
        rope = self.rope(torch.arange(T, device=idx.device).expand(Bz, T), x.dtype)
        for layer in self.layers:
            x = layer(x, rope)
        return self.lm_head(self.norm(x))

    def decode(self, tok, cache):
        """One step: tok (Bz,) the next token of every sequence -> logits (Bz, vocab)."""
        x = self.embed_tokens(tok[:, None])  # (Bz, 1, dim)
        rope = self.rope(cache.len[:, None], x.dtype)
        for layer in self.layers:
            x = layer(x, rope, cache)
        cache.advance()
        return self.lm_head(self.norm(x))[:, 0]

    def check_length(self, prompt_len, max_new_tokens):
        if prompt_len + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(
                f"prompt + max_new_tokens = {prompt_len + max_new_tokens} tokens exceeds max_seq_len="
                f"{self.cfg.max_seq_len}; shorten the prompt or generate fewer tokens"
            )


def random_model(cfg, device, dtype):
    """A randomly initialised model, made where it runs and in its dtype (an 8B one takes 16 GB);
    a MemoryError first where its weights do not fit the memory there is."""
    with torch.device("meta"):
        need = sum(p.numel() for p in Transformer(cfg).parameters()) * dtype.itemsize
    device = torch.device(device)
    have = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else memory.mem_available()
    if have is not None and need > have:
        raise MemoryError(
            f"a random model of this shape takes {memory.gib(need)} of weights in "
            f"{dtype}, and {memory.gib(have)} is free on {device}: choose a smaller "
            f"preset (tiny, paper) or a machine with more memory"
        )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Transformer(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()
