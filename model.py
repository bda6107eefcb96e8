"""
A Llama-style decoder whose every layer is NOSA attention (METHOD.md §2-3), with a KV cache for
step-by-step decoding and greedy / temperature / top-k sampling.

Notation: Bz batch, T tokens, dim model width, H_q / H_kv query / KV heads, d = head_dim,
G = H_q / H_kv, c eviction score (eviction.py), K̃ compressed keys (pooling.py).

Two paths through every attention layer compute the same function:
  forward(idx)          the parallel (training / prefill) forward over whole sequences
  decode(tok, cache)    one new token per sequence, each at its own position, against a cache
The tests check that their logits are equal; that is the whole promise of NOSA (no training /
inference mismatch). Module and parameter names follow Hugging Face Llama, so released NOSA
checkpoints map onto this model one to one (METHOD.md §7).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attention
import eviction
import nosa
import pooling

TIMELINE = None  # bench.py puts a recorder here to split a decode step by phase; None costs nothing


def phase(name):
    """From here on the decode step is in phase `name`: weights, selection, transfer or attention."""
    if TIMELINE is not None:
        TIMELINE.mark(name)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = pooling.fp32(x)
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
    factor, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0: long wavelengths, 1: short ones
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def apply_rope(x, pos, inv_freq):
    """Rotary embedding in the Hugging Face (rotate-half) layout. x (Bz, H, T, d), pos (Bz, T)."""
    d = x.shape[-1]
    ang = pos[:, None, :, None].to(torch.float64) * inv_freq  # (Bz, 1, T, d/2), in fp64: positions reach 1e5+
    cos, sin = (f(ang).to(pooling.fp32(x).dtype).repeat(1, 1, 1, 2) for f in (torch.cos, torch.sin))  # (Bz, 1, T, d)
    xf = pooling.fp32(x)
    rot = torch.cat((-xf[..., d // 2:], xf[..., : d // 2]), dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.H_q * d, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.H_kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.H_kv * d, bias=False)
        self.o_proj = nn.Linear(cfg.H_q * d, cfg.dim, bias=False)
        if cfg.attn in ("nosa", "dma"):  # the eviction head (ED-DMA): W_δ and A, A = 0 at init
            self.delta = nn.Linear(cfg.H_kv * d, cfg.H_kv, bias=False)
            self.A = nn.Parameter(torch.zeros(cfg.H_kv))

    def qkvc(self, x, pos):
        """Projections, RoPE on q and k, and the eviction score c. x (Bz, T, dim), pos (Bz, T)."""
        cfg, (Bz, T, _) = self.cfg, x.shape
        q = self.q_proj(x).view(Bz, T, cfg.H_q, cfg.head_dim).transpose(1, 2)  # (Bz, H_q, T, d)
        k = self.k_proj(x).view(Bz, T, cfg.H_kv, cfg.head_dim).transpose(1, 2)  # (Bz, H_kv, T, d)
        v = self.v_proj(x).view(Bz, T, cfg.H_kv, cfg.head_dim).transpose(1, 2)  # (Bz, H_kv, T, d)
        inv_freq = rope_frequencies(cfg, x.device)
        q, k = apply_rope(q, pos, inv_freq), apply_rope(k, pos, inv_freq)
        c = eviction.eviction_score(v, self.A, self.delta.weight) if hasattr(self, "A") else None  # (Bz, H_kv, T)
        return q, k, v, c

    def forward(self, x, layer, cache=None, seq=None):
        """Parallel forward from position 0; with a cache, also write sequence `seq` into it (prefill)."""
        Bz, T, _ = x.shape
        q, k, v, c = self.qkvc(x, torch.arange(T, device=x.device).expand(Bz, T))
        o, _ = nosa.nosa_attention(q, k, v, c, self.cfg)  # (Bz, H_q, T, d)
        if cache is not None:
            cache.prefill(layer, seq, k[0], v[0], None if c is None else c[0])
        return self.o_proj(o.transpose(1, 2).reshape(Bz, T, -1))

    def decode(self, x, layer, cache):
        """One token per sequence: x (Bz, 1, dim), each sequence at its own position cache.len."""
        cfg, Bz = self.cfg, x.shape[0]
        pos = cache.len  # (Bz,)
        q, k, v, c = self.qkvc(x, pos[:, None])
        cache.append(layer, k[:, :, 0], v[:, :, 0], None if c is None else c[:, :, 0])
        block_mask = None
        if cfg.attn != "full":
            phase("selection")
            # score and select exactly as the parallel forward does, from the pooled caches
            K_sub, c_sub = cache.sub[layer]
            block_mask = nosa.select(q, K_sub, None if c is None else c_sub, pos[:, None], cache.n_blocks(), cfg)
        o = cache.attend(layer, q, block_mask)  # (Bz, H_q, 1, d)
        phase("weights")
        return self.o_proj(o.transpose(1, 2).reshape(Bz, 1, -1))


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

    def forward(self, x, layer, cache=None, seq=None, decode=False):
        h = self.input_layernorm(x)
        h = self.self_attn.decode(h, layer, cache) if decode else self.self_attn(h, layer, cache, seq)
        x = x + h
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

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, cache=None, seq=None):
        """Parallel forward: idx (Bz, T) from position 0 -> logits (Bz, T, vocab).
        With a cache, idx is one sequence (Bz = 1) written into cache row `seq` (prefill)."""
        if idx.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than max_seq_len={self.cfg.max_seq_len}")
        x = self.embed_tokens(idx)
        for i, layer in enumerate(self.layers):
            x = layer(x, i, cache, seq)
        return self.lm_head(self.norm(x))

    def decode(self, tok, cache):
        """One step: tok (Bz,) the next token of every sequence -> logits (Bz, vocab)."""
        phase("weights")
        x = self.embed_tokens(tok[:, None])  # (Bz, 1, dim)
        for i, layer in enumerate(self.layers):
            x = layer(x, i, cache, decode=True)
        cache.advance()
        return self.lm_head(self.norm(x))[:, 0]

    def check_length(self, prompt_len, max_new_tokens):
        if prompt_len + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens = {prompt_len + max_new_tokens} tokens exceeds max_seq_len="
                             f"{self.cfg.max_seq_len}; shorten the prompt or generate fewer tokens")

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, temperature=0.0, top_k=None, cache=None, eos_ids=(), on_token=None):
        """Prompts: list of token lists (lengths may differ). Returns the new tokens of each. A sequence
        ends at its first token in eos_ids (kept in its output); from then on it costs no transfers
        (cache.finish), and the loop stops once every sequence has ended. on_token(tok) receives the
        new tokens (Bz,) of every step, for streaming."""
        if not prompts or max_new_tokens < 1:
            raise ValueError("give at least one prompt and max_new_tokens >= 1")
        self.check_length(max(len(p) for p in prompts), max_new_tokens)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("empty prompt: give at least one token per sequence")
        dev = self.embed_tokens.weight.device
        max_len = max(len(p) for p in prompts) + max_new_tokens
        cache = cache or KVCache(self.cfg, len(prompts), dev, self.embed_tokens.weight.dtype, max_len)
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=dev)
        tok = torch.empty(len(prompts), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):  # prefill one sequence at a time: lengths may differ
            logits = self(torch.tensor([p], device=dev), cache, seq=i)
            tok[i] = sample(logits[:, -1], temperature, top_k)[0]
        out, done = [tok.clone()], torch.isin(tok, eos)  # (Bz,) ended
        on_token = on_token or (lambda tok: None)
        on_token(tok)
        decode = GraphedDecode(self, cache)
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
    """Transformer.decode, captured once as a CUDA graph and replayed every step: the thousands of
    small launches of a step (per layer: projections, scoring, selection, set difference, gather,
    attention) become one, so a step costs what its kernels cost. This is correct because nothing
    in a step asks the host: positions, lengths, tables and transfers live on the device, and shapes
    do not change while every position is below cache.capacity(). Elsewhere (CPU, dense attention,
    a short context, past the capacity) it runs the eager step, which computes the same logits."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.graph, self.warm = None, False

    def __call__(self, tok):
        cache, pos = self.cache, int(self.cache.len_cpu.max())
        if not (tok.is_cuda and self.model.cfg.l_c <= pos + 1 and pos < cache.capacity()):
            return self.model.decode(tok, cache)
        if self.graph is None:
            if not self.warm:  # one eager step first: compiles and initialises what the graph will launch
                self.warm = True
                return self.model.decode(tok, cache)
            self.tok, self.graph = tok.clone(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records, runs nothing; cache.advance's host part runs once
                self.logits = self.model.decode(self.tok, cache)
        else:
            self.tok.copy_(tok)
            cache.advance_host()
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the graph's output


def sample(logits, temperature=0.0, top_k=None):
    """logits (Bz, vocab) -> (Bz,): greedy at temperature 0, else softmax(logits / T) over the top k."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]


# -----------------------------------------------------------------------------
# KV cache kept whole on the device (offload.py keeps it in host memory instead)


def grow(t, n, dim):
    """Return t with at least n entries along `dim`, doubling: no buffer is sized once up front."""
    if t.shape[dim] >= n:
        return t
    shape = list(t.shape)
    shape[dim] = max(n, 2 * t.shape[dim]) - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)


class SubBlockCache:
    """Per layer: the pooled caches K̃ (Bz, H_kv, M, d) and c̃ (Bz, H_kv, M), kept up to date
    one token at a time from a ring of the last l_c keys and scores. Both caches use it."""

    def __init__(self, cfg, Bz, device, dtype, max_len=0):
        self.cfg = cfg
        L, H, d, l_c = cfg.n_layer, cfg.H_kv, cfg.head_dim, cfg.l_c
        M = pooling.n_subblocks(max_len, cfg)  # preallocated for max_len tokens; grows past it
        self.ring_k = [torch.zeros(Bz, H, l_c, d, device=device, dtype=dtype) for _ in range(L)]
        cdt = torch.promote_types(dtype, torch.float32)  # c and its pools stay in fp32 (or fp64)
        self.ring_c = [torch.zeros(Bz, H, l_c, device=device, dtype=cdt) for _ in range(L)]
        self.K_sub = [torch.zeros(Bz, H, M, d, device=device, dtype=dtype) for _ in range(L)]
        self.c_sub = [torch.zeros(Bz, H, M, device=device, dtype=cdt) for _ in range(L)]

    def __getitem__(self, layer):
        return self.K_sub[layer], self.c_sub[layer]

    def prefill(self, layer, seq, k, c):
        """k (H_kv, T, d), c (H_kv, T) or None: one whole sequence."""
        cfg, T = self.cfg, k.shape[1]
        K_sub = pooling.compress_keys(k, cfg)  # (H_kv, M, d)
        M = K_sub.shape[1]
        self.K_sub[layer] = grow(self.K_sub[layer], M, 2)
        self.c_sub[layer] = grow(self.c_sub[layer], M, 2)
        self.K_sub[layer][seq, :, :M] = K_sub
        tail = torch.arange(max(T - cfg.l_c, 0), T, device=k.device)
        self.ring_k[layer][seq][:, tail % cfg.l_c] = k[:, tail]
        if c is not None:
            self.c_sub[layer][seq, :, :M] = pooling.pool_mean(c, cfg)
            self.ring_c[layer][seq][:, tail % cfg.l_c] = c[:, tail]

    def append(self, layer, k, c, pos, max_pos):
        """k (Bz, H_kv, d), c (Bz, H_kv) or None, written at positions pos (Bz,); when a sub-block
        completes (every s_c tokens, per sequence) its mean joins K̃ and c̃. max_pos: the largest
        position, known on the host, so that nothing here waits for the device."""
        cfg, rows = self.cfg, torch.arange(k.shape[0], device=k.device)
        self.ring_k[layer][rows, :, pos % cfg.l_c] = k
        if c is not None:
            self.ring_c[layer][rows, :, pos % cfg.l_c] = c
        if max_pos + 1 < cfg.l_c:
            return
        self.K_sub[layer] = grow(self.K_sub[layer], pooling.n_subblocks(max_pos + 1, cfg), 2)
        self.c_sub[layer] = grow(self.c_sub[layer], pooling.n_subblocks(max_pos + 1, cfg), 2)
        start = pos + 1 - cfg.l_c  # first token of the sub-block that ends at pos, (Bz,)
        done = ((start >= 0) & (start % cfg.s_c == 0))[:, None]  # (Bz, 1)
        m = (start // cfg.s_c).clamp(min=0)  # (Bz,)
        order = (start[:, None] + torch.arange(cfg.l_c, device=k.device)) % cfg.l_c  # ring in token order
        new = self.ring_k[layer][rows[:, None], :, order].mean(1)  # (Bz, H_kv, d)
        self.K_sub[layer][rows, :, m] = torch.where(done[..., None], new, self.K_sub[layer][rows, :, m])
        if c is not None:
            new = self.ring_c[layer][rows[:, None], :, order].mean(1)  # (Bz, H_kv)
            self.c_sub[layer][rows, :, m] = torch.where(done, new, self.c_sub[layer][rows, :, m])


class KVCache:
    """The whole cache on one device: K, V (Bz, H_kv, S, d), c (Bz, H_kv, S) per layer, lengths (Bz,).
    With max_len, the buffers are allocated once for max_len tokens and sparse modes attend over
    all of them (static shapes, so a decode step can be a CUDA graph: GraphedDecode); without,
    they grow with the sequences."""

    def __init__(self, cfg, Bz, device, dtype, max_len=None):
        self.cfg, self.max_len = cfg, max_len
        L, H, d, S = cfg.n_layer, cfg.H_kv, cfg.head_dim, max_len or 0
        self.len = torch.zeros(Bz, dtype=torch.long, device=device)  # tokens per sequence
        self.len_cpu = torch.zeros(Bz, dtype=torch.long)  # the same, on the host
        self.k = [torch.zeros(Bz, H, S, d, device=device, dtype=dtype) for _ in range(L)]
        self.v = [torch.zeros(Bz, H, S, d, device=device, dtype=dtype) for _ in range(L)]
        cdt = torch.promote_types(dtype, torch.float32)
        self.c = [torch.zeros(Bz, H, S, device=device, dtype=cdt) for _ in range(L)]
        self.sub = SubBlockCache(cfg, Bz, device, dtype, S)

    def prefill(self, layer, seq, k, v, c):
        T = k.shape[1]
        self._grow(layer, T)
        self.k[layer][seq, :, :T], self.v[layer][seq, :, :T] = k, v
        if c is not None:
            self.c[layer][seq, :, :T] = c
        self.sub.prefill(layer, seq, k, c)
        if layer == self.cfg.n_layer - 1:
            self.len[seq] = self.len_cpu[seq] = T

    def advance(self):
        self.len += 1
        self.advance_host()

    def advance_host(self):  # the host-side part of advance, which a CUDA graph replay does not run
        self.len_cpu += 1

    def finish(self, done):  # sequences that ended (Bz,): nothing to save on a resident cache
        pass

    def capacity(self):
        """Positions below which a decode step keeps its shapes (GraphedDecode); 0: they change every step."""
        return self.max_len if self.max_len and self.cfg.attn != "full" else 0

    def S(self):  # tokens attention spans: all preallocated ones in sparse modes, else exactly the context
        return max(self.capacity(), int(self.len_cpu.max()) + 1)

    def n_blocks(self):  # the blocks selection ranges over
        return pooling.n_blocks(self.S(), self.cfg)

    def append(self, layer, k, v, c):
        pos, rows = self.len, torch.arange(k.shape[0], device=k.device)
        max_pos = int(self.len_cpu.max())
        self._grow(layer, max_pos + 1)
        self.k[layer][rows, :, pos], self.v[layer][rows, :, pos] = k, v
        if c is not None:
            self.c[layer][rows, :, pos] = c
        self.sub.append(layer, k, c, pos, max_pos)

    def attend(self, layer, q, block_mask):
        """q (Bz, H_q, 1, d) at positions self.len -> (Bz, H_q, 1, d) over the cached tokens."""
        phase("attention")
        S = self.S()
        if self.cfg.attn == "full":
            return self._dense_decode(layer, q, S)
        c = self.c[layer][:, :, :S] if self.cfg.attn in ("nosa", "dma") else None
        bias = None if c is None else eviction.attention_bias(c, self.cfg.attn)
        return attention.sparse_attention(q, self.k[layer][:, :, :S], self.v[layer][:, :, :S], bias, block_mask,
                                          self.len[:, None], self.cfg)

    def _grow(self, layer, n):
        self.k[layer], self.v[layer] = grow(self.k[layer], n, 2), grow(self.v[layer], n, 2)
        self.c[layer] = grow(self.c[layer], n, 2)

    def _dense_decode(self, layer, q, S):
        """Full attention, one query per sequence: the G query heads of a KV head are G rows of one
        SDPA call (flash, splitting the keys when the batch is small), so K and V are read once and
        never copied G times; a mask only where sequences differ in length."""
        Bz, H_q, _, d = q.shape
        H_kv = self.cfg.H_kv
        mask = None
        if int(self.len_cpu.min()) != int(self.len_cpu.max()):
            mask = (torch.arange(S, device=q.device) <= self.len[:, None])[:, None, None]  # (Bz, 1, 1, S)
        # not cuDNN, which SDPA prefers here: 4.7x slower than flash for these shapes on an H200 (BENCHMARKS.md)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            o = F.scaled_dot_product_attention(q.reshape(Bz, H_kv, H_q // H_kv, d), self.k[layer][:, :, :S],
                                               self.v[layer][:, :, :S], attn_mask=mask)
        return o.reshape(Bz, H_q, 1, d)
