"""
What makes decoding and prefill fast without changing a result, applied to a model from outside
(only the scripts and the benchmarks import this file; the tests compare both ways):

  compile         the small torch operations around the matrix products (norms, RoPE, the eviction
                  score, SwiGLU) compiled by torch.compile into a few kernels, one compile for every
                  layer: for the decode step, and for a prefill's chunks where asked
  GraphedDecode   the whole decode step captured as one CUDA graph and replayed; at large
                  offloaded batches in micro-batches, one's transfers under the other's compute
  Turns           those micro-batches computing in strict turns, each beside the other's transfers
"""

import weakref

import torch

import offload_kernels
from model import MLP, Attention, RMSNorm

COMPILED = {}  # one torch.compile of each method, shared by every layer and model


def compile_model(model, prefill=False):
    """Compile the model's norms, Attention.qkvc and MLPs on a GPU: for inputs of one token per
    sequence (decode steps, whose shapes never change), and with prefill also for a prefill's
    chunks (a compile of seconds a process, worth it for millions of prompt tokens).
    Returns the model."""
    limit = (
        "recompile_limit"
        if hasattr(torch._dynamo.config, "recompile_limit")
        else "cache_size_limit"
    )
    setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    for m in model.modules():
        for cls, name in ((RMSNorm, "forward"), (MLP, "forward"), (Attention, "qkvc")):
            if isinstance(m, cls):
                fn = COMPILED.setdefault(
                    (cls, name), torch.compile(getattr(cls, name), dynamic=None)
                )
                setattr(m, name, _when(fn, getattr(cls, name), weakref.ref(m), prefill))
    return model


def _when(compiled, eager, ref, prefill):
    """The method of module ref() through `compiled` where it applies, else `eager`. A weak
    reference: a dropped model is freed at once, not at the next garbage collection."""
    return lambda x, *a: (compiled if prefill or x.shape[1] == 1 else eager)(ref(), x, *a)


# -----------------------------------------------------------------------------
# The whole step as a CUDA graph, in micro-batches


def decode_layers(model, tok, cache):
    """model.decode a layer at a time: yields None after each layer, then the logits (the
    micro-batches' steps are recorded layer by layer in turn)."""
    x = model.embed_tokens(tok[:, None])  # (Bz, 1, dim)
    rope = model.rope(cache.len[:, None], x.dtype)
    for layer in model.layers:
        x = layer(x, rope, cache)
        yield None
    cache.advance()
    yield model.lm_head(model.norm(x))[:, 0]


class GraphedDecode:
    """model.decode, captured once as a CUDA graph and replayed every step: the thousands of small
    launches of a step (per layer: projections, scoring, selection, set difference, gather,
    attention) become one, so a step costs what its kernels cost. Correct because nothing in a
    step asks the host: positions, lengths, tables and transfers live on the device, and shapes do
    not change while cache.graphable(). Elsewhere (CPU, a short context, past the capacity) it runs
    the eager step, which computes the same logits.

    micro_batches > 1 (an offloaded cache): the batch in parts (offload.OffloadCache.split, views of
    one cache) decoded on their own CUDA streams inside the one graph, so that one part's gathers
    (PCIe) overlap the other's compute; the weights are read once per part. in_turns (the
    default): the parts' compute in strict turns (Turns), else as the streams' priorities order
    it."""

    def __init__(self, model, cache, micro_batches=1, in_turns=True):
        self.model, self.cache = model, cache
        self.graph, self.warm = None, False
        n = micro_batches
        self.parts = cache.split(n) if n > 1 and cache.Bz >= n else None
        self.turns = None
        if self.parts and in_turns and cache.device.type == "cuda":
            self.turns = Turns(n, model.cfg.n_layer, cache.device)

    def step(self, tok):  # the eager step: the whole batch, or its parts one after the other
        if not self.parts:
            return self.model.decode(tok, self.cache)
        parts = zip(tok.tensor_split(len(self.parts)), self.parts)
        return torch.cat([self.model.decode(t, p) for t, p in parts])

    def __call__(self, tok):
        cache, pos = self.cache, int(self.cache.len_cpu.max())
        if not (tok.is_cuda and cache.graphable(pos)):
            return self.model.decode(tok, cache)
        if self.graph is None:
            if not self.warm:  # one eager step first: compiles what the graph will launch
                self.warm = True
                return self.step(tok)
            self.tok, self.graph = tok.clone(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records; cache.advance's host part runs once
                self.logits = self.side_by_side(self.tok) if self.parts else self.step(self.tok)
        else:
            self.tok.copy_(tok)
            cache.advance_host()  # the host's copy of the lengths, which a replay does not advance
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the graph's output

    def side_by_side(self, tok):
        """The parts' steps, each on a stream of its own (forked from the current one and joined to
        it), recorded layer by layer in turn: their gathers take turns on PCIe in that order
        (OffloadCache.split), so one part's gather runs while the other computes."""
        main, n = torch.cuda.current_stream(), len(self.parts)
        # the parts' gathers go first part first, so after the last part's gather PCIe waits on the
        # first part's compute: where parts compute at once, the earlier part's kernels take the
        # multiprocessors first (priority -1 for the first of two, 0 for the second)
        top = torch.cuda.Stream.priority_range()[1]  # the highest (most negative)
        streams = [torch.cuda.Stream(priority=max(top, i + 1 - n)) for i in range(n)]
        toks = tok.tensor_split(n)
        steps = [decode_layers(self.model, t, p) for t, p in zip(toks, self.parts)]
        if self.turns:  # recorded into the graph: every replay starts its turns from zero
            self.turns.count.zero_()
            for p, part in enumerate(self.parts):
                part.turn = (self.turns, p)
        for s in streams:
            s.wait_stream(main)
        for _ in range(self.model.cfg.n_layer + 1):
            out = []
            for step, s in zip(steps, streams):
                with torch.cuda.stream(s):
                    out.append(next(step))
        for s in streams:
            main.wait_stream(s)
        for part in self.parts:  # the eager step runs the parts one after the other: no turns
            part.turn = None
        return torch.cat(out)


class Turns:
    """The micro-batches of a graphed step computing in strict turns, each beside another's gather.
    Priorities alone (GraphedDecode.side_by_side) only order the thread blocks not yet running, so
    a part's kernels still slow the one PCIe waits on (docs/LOG.md, 2026-12-06). Here, on the
    device: once its gather of layer i has arrived, part p waits until part p - 1 has finished its
    own compute of layer i (seen as its gather of layer i + 1 issued); part 0 until the last part
    has finished layer i - 1. So the parts compute one at a time, layer by layer, part by part,
    while PCIe is handed on in the same order.

    count[p] = the layers part p has issued gathers for, zeroed at the start of each replay. No
    cycle: each wait names a compute that comes earlier in that order. Order only: the same blocks
    move and the same logits come out (tests/test_turns.py, test_offload.py)."""

    def __init__(self, n, n_layer, device):
        self.n, self.n_layer = n, n_layer
        self.count = torch.zeros(n, dtype=torch.int32, device=device)
        offload_kernels.turn_issued(self.count, 0, 1)  # both kernels compiled before any capture
        offload_kernels.turn_wait(self.count, 0, 1)
        self.count.zero_()

    def after(self, p, layer):
        """(q, at_least): part p's compute of `layer` waits until count[q] >= at_least; None: it
        does not wait (parts 1.. at the last layer: no gather comes after it)."""
        q, at_least = (self.n - 1, layer + 1) if p == 0 else (p - 1, layer + 2)
        return (q, at_least) if at_least <= self.n_layer else None

    def issued(self, p, layer):  # on part p's stream, right after its gather of `layer` was issued
        offload_kernels.turn_issued(self.count, p, layer + 1)

    def wait(self, p, layer):  # on part p's stream, once its gather of `layer` has arrived
        if w := self.after(p, layer):
            offload_kernels.turn_wait(self.count, *w)
