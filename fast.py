"""
What makes decoding fast and changes no result, applied to the model from outside: model.py is a
plain model, and everything here computes what it computes (the tests compare the two).

  fused           chains of small torch operations (norms, RoPE, cache writes, ranks, masks, counters)
                  compiled by torch.compile into a few Triton kernels on a GPU; the torch code is its
                  own twin and runs as written elsewhere, or with NOSA_FUSE=0
  prepare         a model's q, k, v weights (and its gate, up weights) stored as one tensor each, so
                  that decode (model.decode made fast) and a prefill's blocks (block_prefill) run one
                  matrix product per group, with the small operations around them fused
  GraphedDecode   the whole step captured as one CUDA graph and replayed; at large offloaded batches
                  in two micro-batches, one's transfers under the other's compute
"""
import functools
import os
import warnings

import torch
import torch.nn.functional as F

# NOSA_FUSE=0: run fused functions op by op, as their twins; unset, prepare() compiles for long runs only:
# FUSE for the decode step, FUSE_PREFILL for a prefill's chunks
FUSE = FUSE_PREFILL = os.environ.get("NOSA_FUSE", "1") != "0"


def fused(fn, when=lambda: FUSE):
    """fn, on CUDA tensors, compiled by torch.compile into a few Triton kernels (its chains of small
    ops fused; matrix products stay cuBLAS calls), elsewhere run as written: the torch code is its own
    twin. For the decode step, whose shapes are static, so it compiles once per shape (generate.py's
    warm-up); modules may be arguments (their weights are inputs: one compile serves every layer).
    when(): whether to compile (FUSE unless told)."""
    compiled = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled
        if not (when() and next(a for a in args if hasattr(a, "is_cuda")).is_cuda):  # the first tensor's device
            return fn(*args)
        if compiled is None:  # the first call compiles (before any CUDA graph capture)
            limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
            if getattr(torch._dynamo.config, limit) < 64:  # one compile per shape: batches, configs
                setattr(torch._dynamo.config, limit, 64)
            try:
                compiled = torch.compile(fn, dynamic=None)  # a second shape (batch) compiles a dynamic one
                return compiled(*args)
            except Exception as e:  # an inductor or toolchain problem: run unfused, slower, but right
                warnings.warn(f"torch.compile of {fn.__name__} failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}); it runs unfused")
                compiled = fn
        return compiled(*args)
    return run


# -----------------------------------------------------------------------------
# The decode step of a block: fused projections, fused small operations


def prepare(model, tokens=None, prompt_tokens=None):
    """The model, ready for decode below (same logits as model.decode): each block's q, k, v weights
    stored as one tensor, and its gate and up weights (block.fused), so a step runs one matrix product
    for each group. The parameters keep their names and values (views of those tensors): training
    and checkpoints see no difference. Call it after .to(); a later .to() gives the parameters
    storage of their own again, and decode notices and runs the plain block step.
    tokens: how many tokens the run will decode (batch x new tokens); torch.compile costs seconds a
    process (imports, compiles, cache reads), worth it from 2048 on. prompt_tokens: how many it will
    prefill; the compiled chunks of a prefill (block_prefill) cost about 9 s once and save about 5 ms
    per 1K prompt tokens at the 8b shape (H200, BENCHMARKS.md), worth it from 2M on. NOSA_FUSE=1/0
    decides both instead."""
    global FUSE, FUSE_PREFILL
    if "NOSA_FUSE" not in os.environ:
        FUSE = FUSE if tokens is None else tokens >= 2048
        FUSE_PREFILL = FUSE_PREFILL if prompt_tokens is None else prompt_tokens >= 2**21
    for block in model.layers:
        a, m = block.self_attn, block.mlp
        w_qkv, w_gate_up = fuse_linears(a.q_proj, a.k_proj, a.v_proj), fuse_linears(m.gate_proj, m.up_proj)
        block.fused = (w_qkv, w_gate_up)
    return model


def fuse_linears(*linears):
    """Store the weights of these Linear layers (same input) as one tensor, rows one after the other,
    each layer's weight a view of its slice (values unchanged, no copy kept). Returns that tensor."""
    w = torch.cat([l.weight.detach() for l in linears])
    row = 0
    for l in linears:
        n = l.weight.shape[0]
        l.weight.data = w[row:row + n]
        row += n
    return w


def is_fused(w, *linears):
    """Whether the layers' weights are still the consecutive slices of w (see fuse_linears)."""
    at, size = w.data_ptr(), w.element_size() * w.shape[1]
    for l in linears:
        if l.weight.data_ptr() != at or l.weight.device != w.device or l.weight.dtype != w.dtype:
            return False
        at += size * l.weight.shape[0]
    return True


def decode(model, tok, cache):
    """model.decode (one step: tok (Bz,) -> logits (Bz, vocab)) through block_decode."""
    *_, logits = decode_layers(model, tok, cache)
    return logits


def decode_layers(model, tok, cache):
    """decode one layer at a time: yields None after each layer, then the logits (for micro-batches)."""
    x = model.embed_tokens(tok[:, None])  # (Bz, 1, dim)
    rope = model.rope(cache.len[:, None], x.dtype)
    for i, layer in enumerate(model.layers):
        x = block_decode(layer, x, i, rope, cache)
        yield None
    cache.advance()
    yield model.lm_head(model.norm(x))[:, 0]


def block_decode(block, x, layer, rope, cache):
    """model.Block.decode with the fused weights (prepare) while they are still the parameters."""
    if not prepared(block):
        return block.decode(x, layer, rope, cache)
    w_qkv, w_gate_up = block.fused
    o = block.self_attn.decode(*step_in(block, x, rope, w_qkv), layer, cache)
    return step_out(block, x, o, w_gate_up)


def block_prefill(block, x, rope, prompt, start):
    """model.Block.forward for one chunk of a prefill (model.Transformer.prefill's `block`), with the
    fused weights (prepare) while they are still the parameters."""
    if not prepared(block):
        return block(x, rope, prompt, start)
    w_qkv, w_gate_up = block.fused
    o = block.self_attn.attend(*chunk_in(block, x, rope, w_qkv), prompt, start)
    return chunk_out(block, x, o, w_gate_up)


def prepared(block):
    """Whether prepare's fused weights are still the block's parameters (a .to() since separates them)."""
    a, m = block.self_attn, block.mlp
    w_qkv, w_gate_up = getattr(block, "fused", (None, None))
    return w_qkv is not None and is_fused(w_qkv, a.q_proj, a.k_proj, a.v_proj) and is_fused(
        w_gate_up, m.gate_proj, m.up_proj)


def block_in(block, x, rope, w_qkv):  # input norm, projections, RoPE and eviction score
    a = block.self_attn
    sizes = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
    return a.heads(*F.linear(block.input_layernorm(x), w_qkv).split(sizes, -1), rope)


def block_out(block, x, o, w_gate_up):  # output projection, residuals and MLP
    x = x + block.self_attn.o_proj(o)
    gate, up = F.linear(block.post_attention_layernorm(x), w_gate_up).chunk(2, -1)
    return x + block.mlp.down_proj(F.silu(gate) * up)


# compiled apart: a decode step's (static shapes; for long decodes) and a prefill's chunks' (for long prefills)
step_in, step_out = fused(block_in), fused(block_out)
chunk_in, chunk_out = fused(block_in, lambda: FUSE_PREFILL), fused(block_out, lambda: FUSE_PREFILL)


# -----------------------------------------------------------------------------
# The whole step as a CUDA graph, in micro-batches


def default_micro_batches(cache):
    """An offloaded batch of 16 or more decodes in two parts, one's transfers under the other's compute."""
    return 2 if hasattr(cache, "split") and cache.Bz >= 16 else 1


class GraphedDecode:
    """decode, captured once as a CUDA graph and replayed every step: the thousands of
    small launches of a step (per layer: projections, scoring, selection, set difference, gather,
    attention) become one, so a step costs what its kernels cost. This is correct because nothing
    in a step asks the host: positions, lengths, tables and transfers live on the device, and shapes
    do not change while cache.graphable(). Elsewhere (CPU, dense attention, a short context, past
    the capacity) it runs the eager step, which computes the same logits."""

    def __init__(self, model, cache, micro_batches=None):
        self.model, self.cache = model, cache
        self.graph, self.warm = None, False
        n = default_micro_batches(cache) if micro_batches is None else micro_batches
        # micro-batches (offload.OffloadCache.split): the batch in parts decoded on their own CUDA streams
        # inside the one graph, so that one part's gathers (PCIe) overlap the other's compute
        self.parts = cache.split(n) if n > 1 and cache.Bz >= n else None

    def step(self, tok):  # the eager step: the whole batch, or its parts one after the other
        if not self.parts:
            return decode(self.model, tok, self.cache)
        return torch.cat([decode(self.model, t, p) for t, p in zip(tok.tensor_split(len(self.parts)), self.parts)])

    def __call__(self, tok):
        cache, pos = self.cache, int(self.cache.len_cpu.max())
        if not (tok.is_cuda and cache.graphable(pos)):
            return decode(self.model, tok, cache)
        if self.graph is None:
            if not self.warm:  # one eager step first: compiles and initialises what the graph will launch
                self.warm = True
                return self.step(tok)
            self.tok, self.graph = tok.clone(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records, runs nothing; cache.advance's host part runs once
                self.logits = self.step(self.tok) if not self.parts else self.side_by_side(self.tok)
        else:
            self.tok.copy_(tok)
            cache.advance_host()  # the host's copy of the lengths, which a replay does not advance
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the graph's output

    def side_by_side(self, tok):
        """The parts' steps, each on a stream of its own (forked from the current one and joined to
        it), recorded layer by layer in turn: their gathers take turns on PCIe in that order
        (OffloadCache.split), so one part's gather runs while the other computes."""
        main = torch.cuda.current_stream()
        streams = [torch.cuda.Stream() for _ in self.parts]
        steps = [decode_layers(self.model, t, p) for t, p in zip(tok.tensor_split(len(self.parts)), self.parts)]
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

