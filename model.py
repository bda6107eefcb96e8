"""
A Llama-style decoder whose every layer is NOSA attention (docs/METHOD.md §2-3), with a KV cache for
step-by-step decoding and greedy / temperature / top-k sampling.

Notation: Bz batch, T tokens, dim model width, H_q / H_kv query / KV heads, d = head_dim,
G = H_q / H_kv, c eviction score (eviction.py), K̃ compressed keys (pooling.py).

Two paths through every attention layer compute the same function:
  forward(idx)          the parallel (training / prefill) forward over whole sequences
  decode(tok, cache)    one new token per sequence, each at its own position, against a cache
The tests check that their logits are equal; that is the whole promise of NOSA (no training /
inference mismatch). Module and parameter names follow Hugging Face Llama, so released NOSA
checkpoints map onto this model one to one (checkpoint.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import eviction
import nosa
from common import fp32
from kvcache import PromptLayer, ResidualStream


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = fp32(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_frequencies(cfg, device):
    """RoPE's inverse frequencies (d/2,), with the long-context scaling of Llama checkpoints:
      linear  every frequency divided by `factor` (positions stretched);
      llama3  wavelengths longer than original_max_position_embeddings / low_freq_factor divided by
              `factor`, shorter than .../high_freq_factor kept, and a smooth blend in between."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float64) / d)
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


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.H_q * d, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.H_kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.H_kv * d, bias=False)
        self.o_proj = nn.Linear(cfg.H_q * d, cfg.dim, bias=False)
        if cfg.eviction_head:  # ED-DMA: W_δ and A, A = 0 at init
            self.delta = nn.Linear(cfg.H_kv * d, cfg.H_kv, bias=False)
            self.delta.init_std = (cfg.H_kv * d) ** -0.5  # see Transformer._init_weights
            self.A = nn.Parameter(torch.zeros(cfg.H_kv))

    def qkvc(self, x, rope):
        """Projections, RoPE on q and k, and the eviction score c. x (Bz, T, dim), rope (cos, sin)."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), rope)

    def heads(self, q, k, v, rope):
        """The projections q (Bz, T, H_q * d), k, v (Bz, T, H_kv * d) as heads, RoPE on q and k, and c."""
        cfg, (Bz, T, _) = self.cfg, q.shape
        q = q.view(Bz, T, cfg.H_q, cfg.head_dim).transpose(1, 2)  # (Bz, H_q, T, d)
        return apply_rope(q, rope), *self.kv_heads(k, v, rope)

    def kv_heads(self, k, v, rope):
        """The projections k, v (Bz, T, H_kv * d) as heads, RoPE on k, and c: (k, v, c)."""
        cfg, (Bz, T, _) = self.cfg, k.shape
        k = k.view(Bz, T, cfg.H_kv, cfg.head_dim).transpose(1, 2)  # (Bz, H_kv, T, d)
        v = v.view(Bz, T, cfg.H_kv, cfg.head_dim).transpose(1, 2)  # (Bz, H_kv, T, d)
        c = eviction.eviction_score(v, self.A, self.delta.weight) if cfg.eviction_head else None  # (Bz, H_kv, T)
        return apply_rope(k, rope), v, c

    def forward(self, x, rope, prompt=None, start=0):
        """x (Bz, T, dim) at positions start .. start+T-1 -> (Bz, T, dim)."""
        return self.o_proj(self.attend(*self.qkvc(x, rope), prompt, start))

    def attend(self, q, k, v, c, prompt=None, start=0):
        """The attention of q, k, v, c from qkvc, before o_proj -> (Bz, T, H_q * d). Training: a whole
        sequence (start = 0). A prefill's chunk: prompt (kvcache.PromptLayer) holds this layer's keys of
        the earlier chunks and takes this one's, and the chunk attends over all of them."""
        Bz, _, T, _ = q.shape
        pooled = None
        if prompt is not None:
            k, v, c, pooled = prompt.write(start, k, v, c)
        o, _ = nosa.nosa_attention(q, k, v, c, self.cfg, start, pooled)  # (Bz, H_q, T, d)
        return o.transpose(1, 2).reshape(Bz, T, -1)

    def decode(self, q, k, v, c, layer, cache):
        """One token per sequence, each at its own position cache.len: q (Bz, H_q, 1, d), k, v
        (Bz, H_kv, 1, d), c (Bz, H_kv, 1) or None from qkvc -> the attention output (Bz, 1, H_q * d)."""
        o = nosa.nosa_decode(q, k, v, c, layer, cache, self.cfg)  # (Bz, H_q, 1, d)
        return o.transpose(1, 2).reshape(q.shape[0], 1, -1)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, prompt=None, start=0):
        x = x + self.self_attn(self.input_layernorm(x), rope, prompt, start)
        return x + self.mlp(self.post_attention_layernorm(x))

    def prefill_keys(self, x, rope, prompt, start):
        """What a prefill's last layer computes of a chunk that does not hold the prompt's last position:
        its keys, values and c alone, into prompt (kvcache.PromptLayer). The layer's output there would
        feed nothing (the logits are the last position's), and it is nearly all of the layer's work."""
        a, h = self.self_attn, self.input_layernorm(x)
        prompt.write(start, *a.kv_heads(a.k_proj(h), a.v_proj(h), rope))

    def decode(self, x, layer, rope, cache):
        """forward for one new token per sequence against the cache; layer: this block's index."""
        a = self.self_attn
        x = x + a.o_proj(a.decode(*a.qkvc(self.input_layernorm(x), rope), layer, cache))
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
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
            raise ValueError(f"sequence of {T} tokens is longer than max_seq_len={self.cfg.max_seq_len}")
        x = self.embed_tokens(idx)
        rope = self.rope(torch.arange(T, device=idx.device).expand(Bz, T), x.dtype)
        for layer in self.layers:
            x = layer(x, rope)
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def prefill(self, idx, cache, seq, chunk=None, progress=None, stream_on_host=False, block=Block.__call__):
        """A prompt idx (1, T) into row `seq` of the cache -> the logits of its last position (vocab,).

        Layer by layer, `chunk` tokens at a time (default: all): each chunk's queries select and attend
        exactly as the parallel forward's would, over the keys of this and the earlier chunks; when a
        layer has read the whole prompt, its keys, values and eviction scores go to the cache. The last
        layer computes only its keys but in the chunk that holds the last position (Block.prefill_keys).
        So the memory beyond the cache is the prompt's residual stream (T, dim), one layer's K, V and c,
        the RoPE tables (T, d/2), and one chunk's activations (memory.prefill_bytes), never the logits of
        every position.
        stream_on_host: keep the residual stream in pinned host memory, a chunk at a time on the GPU
        (for a budget where it does not fit beside the cache). progress(fraction) after each layer.
        block(layer, x, rope, prompt, start): a block's forward (fast.block_prefill computes the same faster)."""
        T, dev = idx.shape[1], idx.device
        self.check_length(T, 0)
        C, dtype = chunk or T, self.embed_tokens.weight.dtype
        x = ResidualStream(T, self.cfg.dim, C, dev, dtype, stream_on_host and dev.type == "cuda",
                           first=lambda s: self.embed_tokens(idx[:, s:s + C]))
        prompt = PromptLayer(self.cfg, T, dev, dtype, self.cfg.eviction_head)  # reused by every layer
        cos, sin = self.rope(torch.arange(T, device=dev)[None], dtype)  # (1, 1, T, d/2), for every layer
        for i, layer in enumerate(self.layers):
            more = i + 1 < len(self.layers)
            for s, h in x.chunks(more):
                rope = cos[:, :, s:s + h.shape[1]], sin[:, :, s:s + h.shape[1]]
                if more or s + h.shape[1] == T:
                    x.write(s, block(layer, h, rope, prompt, s))
                else:  # the last layer, before the last chunk: only its keys are used
                    layer.prefill_keys(h, rope, prompt, s)
            cache.prefill(i, seq, prompt.k[0], prompt.v[0], None if prompt.c is None else prompt.c[0],
                          prompt.pooled() if self.cfg.sparse else None)
            if progress:
                progress((i + 1) / len(self.layers))
        return self.lm_head(self.norm(x.last()))[0]

    def decode(self, tok, cache):
        """One step: tok (Bz,) the next token of every sequence -> logits (Bz, vocab)."""
        x = self.embed_tokens(tok[:, None])  # (Bz, 1, dim)
        rope = self.rope(cache.len[:, None], x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.decode(x, i, rope, cache)
        cache.advance()
        return self.lm_head(self.norm(x))[:, 0]

    def check_length(self, prompt_len, max_new_tokens):
        if prompt_len + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens = {prompt_len + max_new_tokens} tokens exceeds max_seq_len="
                             f"{self.cfg.max_seq_len}; shorten the prompt or generate fewer tokens")
