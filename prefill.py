"""
A prompt into a decode cache, layer by layer and a chunk at a time (docs/METHOD.md §6).

Each chunk's queries select and attend exactly as the parallel forward's would, over the keys of
this and the earlier chunks of the layer (PromptLayer holds them, with what selection reads: K̃,
c̃ and each query block's list of its best candidates by E, carried from chunk to chunk by the
eviction policy). When a layer has read the whole prompt, its keys, values and eviction scores go
to the cache, and the next layer reads the residual stream the layer wrote (ResidualStream). So the
memory beyond the cache is the prompt's residual stream (T, dim), one layer's keys, the RoPE tables
and one chunk's activations (memory.prefill_bytes), never the logits of every position.
"""

import torch

import eviction
import pooling


def prefill(model, idx, cache, seq, chunk=None, *, progress=None, stream_on_host=False):
    """A prompt idx (1, T) into sequence `seq` of the cache -> the logits of its last position (vocab,).

    chunk: tokens a chunk (default: all). The last layer computes only the keys of the chunks
    before the one that holds the last position: its output there would feed nothing.
    stream_on_host: keep the residual stream in pinned host memory, a chunk at a time on the GPU
    (for a budget where it does not fit beside the cache). progress(fraction) after each layer."""
    for logits in prefill_passes(
        model, idx, cache, seq, chunk, progress=progress, stream_on_host=stream_on_host
    ):
        pass
    return logits


@torch.no_grad()  # (around each step of the generator)
def prefill_passes(model, idx, cache, seq, chunk=None, *, progress=None, stream_on_host=False):
    """prefill a chunk at a time: yields None after each pass (one chunk of tokens through one
    layer; its work launched), then the logits. Between two passes a caller may do other work
    (serve.py decodes a batch)."""
    cfg, (_, T), dev = model.cfg, idx.shape, idx.device
    model.check_length(T, 0)
    C, dtype = chunk or T, model.embed_tokens.weight.dtype
    x = ResidualStream(
        T,
        cfg.dim,
        C,
        dev,
        dtype,
        stream_on_host and dev.type == "cuda",
        first=lambda s: model.embed_tokens(idx[:, s : s + C]),
    )
    prompt = PromptLayer(cfg, T, dev, dtype)  # reused by every layer
    cos, sin = model.rope(torch.arange(T, device=dev)[None], dtype)  # (1, 1, T, d/2)
    for i, layer in enumerate(model.layers):
        more = i + 1 < len(model.layers)
        prompt.rewind()
        for s, h in x.chunks(more):
            rope = cos[:, :, s : s + h.shape[1]], sin[:, :, s : s + h.shape[1]]
            if more or s + h.shape[1] == T:
                x.write(s, layer(h, rope, prompt=prompt))
            else:  # the last layer, before the last chunk: only its keys are used
                q, k, v, c = layer.self_attn.qkvc(layer.input_layernorm(h), rope)
                prompt.write(k, v, c, q)  # (nosa-hh: its queries' attention to their windows)
            yield None
        c = None if prompt.c is None else prompt.c[0]
        cache.prefill(i, seq, prompt.k[0], prompt.v[0], c, prompt.pooled() if cfg.sparse else None)
        if progress:
            progress((i + 1) / len(model.layers))
    yield model.lm_head(model.norm(x.last()))[0]


class PromptLayer:
    """One layer's keys, values and eviction scores of one prompt as its chunks arrive, with what
    selection reads of the keys so far, kept up to date a chunk at a time: the compressed keys K̃,
    the sub-block means c̃, and each query block's list of its best candidates by E, carried from
    chunk to chunk by the eviction policy (eviction.e_lists_by_block). `len`: the tokens written so
    far."""

    def __init__(self, cfg, T, device, dtype):
        H, d, M = cfg.H_kv, cfg.head_dim, cfg.n_subblocks(T)
        cdt = torch.promote_types(dtype, torch.float32)  # c and its pools stay in fp32 (or fp64)
        self.cfg = cfg
        self.k = torch.empty(1, H, T, d, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        with_c = cfg.eviction_head
        self.c = torch.empty(1, H, T, device=device, dtype=cdt) if with_c else None
        self.K_sub = torch.empty(1, H, M, d, device=device, dtype=dtype) if cfg.sparse else None
        self.c_sub = (
            torch.empty(1, H, M, device=device, dtype=cdt) if cfg.sparse and with_c else None
        )
        self.h = torch.empty(1, H, cfg.n_blocks(T), device=device, dtype=cdt)
        self.h = self.h if cfg.heavy_hitters else None
        self.rewind()

    def rewind(self):  # a new layer
        self.len, self.e_list_carry = (
            0,
            None,
        )  # e_list_carry: the list of the last query block (e_lists_by_block)
        if self.h is not None:
            self.h.zero_()

    def write(self, k, v, c, q=None):
        """A chunk's k, v (1, H_kv, C, d) and c (1, H_kv, C) or None at positions len .. e-1 (and its
        queries q (1, H_q, C, d), which nosa-hh's h needs) -> the keys so far: k, v, c of positions
        0 .. e-1 (views), and what nosa.nosa_attention selects from (its `selects_from`): K̃ and the
        lists of the chunk's query blocks (None without E-picks)."""
        cfg, start = self.cfg, self.len
        e = self.len = start + k.shape[2]
        self.k[:, :, start:e], self.v[:, :, start:e] = k, v
        if c is not None:
            self.c[:, :, start:e] = c
        if not cfg.sparse:
            return self.k[:, :, :e], self.v[:, :, :e], None, None
        # the sub-blocks it completes
        m0, m1 = cfg.n_subblocks(start), cfg.n_subblocks(e)
        if m1 > m0:
            t0 = m0 * cfg.s_c  # the first token of sub-block m0, at or before start
            self.K_sub[:, :, m0:m1] = pooling.compress_keys(self.k[:, :, t0:e], cfg)
            if c is not None:
                self.c_sub[:, :, m0:m1] = pooling.pool_mean(self.c[:, :, t0:e], cfg)
        lists = None
        if c is not None and cfg.n_core > 0:
            scores = self.c_sub[:, :, :m1]
            if cfg.heavy_hitters:  # what the chunk's queries pay their windows, before its lists
                scores = self.h[:, :, : cfg.n_blocks(e)]
                eviction.heavy_hitters(q, self.k[:, :, :e], self.c[:, :, :e], cfg, start, scores)
                scores = eviction.hh_scores(scores, cfg)
            lists, self.e_list_carry = eviction.e_lists_by_block(
                scores, start // cfg.B, (e - 1) // cfg.B, cfg, self.e_list_carry
            )
        return (
            self.k[:, :, :e],
            self.v[:, :, :e],
            None if c is None else self.c[:, :, :e],
            (self.K_sub[:, :, :m1], lists),
        )

    def pooled(self):
        """What the decode cache keeps of the whole prompt (nosa.PooledState.prefill): K̃ (H_kv, M, d),
        c̃ (H_kv, M), the list of the last query block (ids, E) (H_kv, n) and h (H_kv, nb), each
        None where the mode has none."""
        e_list = (
            None
            if self.e_list_carry is None
            else (self.e_list_carry[0][0], self.e_list_carry[1][0])
        )
        c_sub, h = (None if x is None else x[0] for x in (self.c_sub, self.h))
        return self.K_sub[0], c_sub, e_list, h


class ResidualStream:
    """A prompt's residual stream (1, T, dim) between the layers of a chunked prefill, read and
    written C positions at a time, a pass a layer (prefill). The first pass reads
    the layer's input as `first(s)` makes it (the embeddings of the chunk at s), the others what the
    pass before wrote. On the device, or in pinned host memory where it does not fit beside the cache:
    then the copies run on a stream of their own, the next chunk's to the GPU and the last one's back
    while the current chunk computes (during a pass's last chunk, the next pass's first)."""

    def __init__(self, T, dim, C, device, dtype, on_host, first):
        self.T, self.C, self.device, self.first = T, C, device, first
        self.x = torch.empty(
            1, T, dim, dtype=dtype, device="cpu" if on_host else device, pin_memory=on_host
        )
        self.copies = torch.cuda.Stream(device) if on_host else None
        self.ahead = None  # the next pass's first chunk, on its way

    def chunks(self, more):
        """(start, the chunk (1, C, dim) on the device) in order, the next one already on its way.
        more: another pass follows this one."""
        first, self.first = self.first, None
        nxt, self.ahead = self.ahead, None
        for s in range(0, self.T, self.C):
            if first is not None:  # the first pass: its input as it is made
                h = first(s)
            elif self.copies is None:
                h = self.x[:, s : s + self.C]
            else:
                h, ready = nxt or self.fetch(s)
                # this chunk is here (the copies after it may run on)
                torch.cuda.current_stream().wait_event(ready)
                # its memory is not reused before the compute is done
                h.record_stream(torch.cuda.current_stream())
            if self.copies is not None:  # what comes next, on its way
                if s + self.C < self.T:
                    nxt = None if first is not None else self.fetch(s + self.C)
                # queued after this pass's writes of the chunks before, chunk 0's among them
                elif more and s > 0:
                    self.ahead = self.fetch(0)
            yield s, h

    def fetch(self, s):  # chunk s to the device on the copy stream, after the writes before it
        with torch.cuda.stream(self.copies):
            h = self.x[:, s : s + self.C].to(self.device, non_blocking=True)
            return h, self.copies.record_event()

    def write(self, s, h):
        """The chunk at s is now h (1, C, dim), on the device."""
        if self.copies is None:
            self.x[:, s : s + h.shape[1]] = h
            return
        self.copies.wait_stream(torch.cuda.current_stream())  # once h is computed
        with torch.cuda.stream(self.copies):
            self.x[:, s : s + h.shape[1]].copy_(h, non_blocking=True)
        h.record_stream(self.copies)

    def last(self):
        """The last position (1, dim), on the device."""
        if self.copies is not None:
            torch.cuda.current_stream().wait_stream(self.copies)
        return self.x[:, -1].to(self.device)
