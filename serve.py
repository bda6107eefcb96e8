"""
Continuous batching: whole requests served over the Bz sequences of a decode cache (offloaded
or resident), each admitted when it has arrived and a sequence is free. A sequence that ends (EOS, or
its max_new_tokens) takes the next waiting request, and that request's prompt prefills a chunk at
a time between the decode steps of the other sequences: per step, the passes (a chunk through one
layer each) that a
token budget allows (Budget: a fixed number of prompt tokens through every layer, or by default as
many as keep a step within twice a step alone, the chunk shortened where one is too many), as
chunked prefill's token budget in serving engines keeps the
time between tokens bounded. On a GPU the prefill runs on a stream of its own, beside the step
(which has the higher priority), and the next step waits for the passes; on a CPU they run after
the step. generate.py serves this way when it is given more requests than --batch, or a file of them.

One prompt prefills at a time. The memory model (memory.plan_memory) sized the cache for Bz sequences of
max_len tokens and one prefill's activations beside them, so a request is admitted when a sequence
is free, no other prompt is prefilling, and its prompt and new tokens fit max_len.

Each turn of the loop:
  1. admit: a free sequence is held back (Parked: it waits at position 0) and the next arrived prompt
     starts there (with nothing running and nothing arrived, the clock skips to the next arrival:
     an idle server measures nothing, so a run at a low rate takes the time of its work)
  2. one decode step of every sequence (`decode`); the parked ones' outputs are ignored
  3. launch the prefill's next passes; the next decode step waits for them
  4. the step's tokens to the host: a sequence that ends is parked, its request done
  5. a prefill that has run to its end: its sequence starts (Parked.start) with the prompt's next token
"""

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from prefill import prefill_passes


@dataclass
class Request:
    """A prompt's tokens, when it arrives (seconds from the start of serve), and what serving it
    gave: the new tokens and when each reached the host (t_first: the first's time after the
    arrival, as time to first token is counted; t_end likewise)."""

    ids: list
    max_new_tokens: int
    arrival: float = 0.0
    out: list = field(default_factory=list)
    t_first: float = None
    t_end: float = None
    t_tokens: list = field(default_factory=list)  # each new token's time from the start

    def tokens_per_s(self):  # decoding speed after the first token (which came with the prefill)
        return (len(self.out) - 1) / max(self.t_end - self.t_first, 1e-9)

    def gaps(self):  # the time between tokens, seconds
        return [b - a for a, b in zip(self.t_tokens, self.t_tokens[1:])]


class Parked:
    """Sequence `seq` of a decode cache held back from decoding: it waits at position 0 and does not
    advance, so a step of the batch costs it one key, while a new prompt may prefill into it. What
    that prefill writes of the sequence's decode state (kvcache.Cache: the entries at position 0, the
    rings, the E-list, the tail and the tables, the length), which the batch's steps write for the
    sequence meanwhile, waits here for start()."""

    def __init__(self, cache, seq):
        self.cache, self.seq, self.writes = cache, seq, []
        cache.hold(seq)

    def prefill(self, layer, seq, k, v, c, pooled=None):  # what prefill.prefill_passes calls
        self.cache.prefill(layer, seq, k, v, c, pooled, put=self.put)

    def put(self, t, index, value):  # a prompt's buffers are reused by the next layer: a copy
        self.writes.append((t, index, value.clone() if torch.is_tensor(value) else value))

    def start(self):
        """The sequence decodes from its prefill on: the writes that waited, on the current stream
        (after the prefill's, where it ran on another)."""
        for t, index, value in self.writes:
            if torch.is_tensor(value) and value.is_cuda:  # memory not reused before the copy ran
                value.record_stream(torch.cuda.current_stream(value.device))
            t[index] = value
        self.cache.set_active(self.seq, True)


class Prefill:
    """A prompt prefilling into a held-back sequence a chunk at a time (prefill.prefill_passes), on
    `stream` (None: the current one). `chunk`: its tokens (the whole prompt if None)."""

    def __init__(self, model, req, seq, cache, stream, chunk, on_host):
        self.req, self.seq, self.stream, self.logits, self.ran = req, seq, stream, None, None
        self.chunk = min(chunk or len(req.ids), len(req.ids))
        self.parked = Parked(cache, seq)
        if stream is not None:  # after the park, and the steps before it
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            idx = torch.tensor([req.ids], device=cache.len.device)
        self.passes = prefill_passes(model, idx, self.parked, seq, chunk, stream_on_host=on_host)

    def launch(self, n):
        """Launch the next n passes (a chunk through one layer each), or the rest; returns an event on the stream
        after them (None on a CPU, where they ran as they were launched)."""
        with torch.cuda.stream(self.stream):
            for _ in range(n):
                if self.logits is None:
                    self.logits = next(self.passes)
            self.ran = self.stream and self.stream.record_event()
        return self.ran

    def done(self):  # launched to the end, and run
        return self.logits is not None and (self.ran is None or self.ran.query())


class Budget:
    """How many of the prefill's passes (a chunk of tokens through one layer) a decode step waits
    for, and how long a chunk is. Either a fixed budget of prompt tokens per step through every layer (tokens * n_layer
    / chunk passes, at least one), or, by default, the most that keep every step beside the prefill
    within `stall` times a step alone, from a model measured as serving goes: a turn of the loop
    (it syncs once) takes the step alone plus what its passes add, so each turn updates the time a
    pass adds (`per`, averaged) and the next turn takes floor((stall - 1) * alone / per) passes,
    at least one and at most twice as many as the turn before. A step alone is timed first, every
    RETIME turns after (no pass beside it), so that prompts arriving one after another cannot hold
    the budget at its start, and whenever the number of decoding sequences has changed since: a
    step's time grows with them, and a step alone of fewer would make a pass look dearer than it
    is, and the speed kept beside the prefill look lower. Where even one pass stalls a step beyond the stall for
    most of a prompt, the next prompt's chunk is half as long (the planned chunk, halved, not below
    `least` tokens); where four fit, twice as long again. With no sequence decoding, nothing waits: a
    chunk through the whole model per turn."""

    def __init__(self, n_layer, tokens=None, stall=2.0, least=512):
        self.n_layer, self.tokens, self.stall, self.least = n_layer, tokens, stall, least
        self.n, self.alone, self.per, self.beside, self.waited = 1, None, None, [], []
        self.halved, self.c, self.over, self.prompt_tokens = 0, None, [], []
        self.since_alone, self.live = 0, None  # turns since a step ran alone, and of how many
        self.alone_at, self.predicted = [], []  # per turn beside: the step alone, the model's time

    RETIME = 200  # a step alone at least every RETIME turns: its time grows with the context

    def chunk(self, planned, T=None):
        """The next prompt's chunk in tokens: `planned` (memory.plan_memory's), halved so often,
        and no longer than the prompt's T tokens."""
        c = min(max(min(self.least, planned), planned >> self.halved), T or planned)
        if self.per is not None and self.c:  # a chunk's time scales with its tokens
            self.per *= c / self.c
        self.c = c
        return c

    def passes(self, pre, running):
        if not running:
            return self.n_layer
        changed = self.live is not None and len(running) != self.live
        if self.alone is None or self.since_alone >= self.RETIME or changed:
            return 0  # the next step runs alone, and is timed (prompts may queue without end)
        if self.tokens is not None:
            return max(1, self.tokens * self.n_layer // pre.chunk)
        return self.n

    def turn(self, dt, n, live=None):
        """A turn of dt seconds whose step of `live` sequences (None: as before) waited for n
        passes (0: a step alone)."""
        if not n:
            same = self.alone is not None and live in (None, self.live)
            self.alone = 0.9 * self.alone + 0.1 * dt if same else dt
            self.since_alone, self.live = 0, self.live if live is None else live
            return
        self.since_alone += 1
        if self.per is not None and self.alone is not None:  # what the model expected of it
            self.predicted.append(self.alone + n * self.per)
        self.beside.append(dt)
        self.alone_at.append(self.alone)
        self.waited.append(n)
        self.prompt_tokens.append(n * (self.c or 0) / self.n_layer)
        if self.tokens is None and self.alone is not None:
            per = max(dt - self.alone, 0.0) / n  # what one pass added to the step
            self.per = per if self.per is None else 0.8 * self.per + 0.2 * per
            room = (self.stall - 1) * self.alone
            fit = int(room / self.per) if self.per > 0 else 2 * self.n
            self.n = max(1, min(fit, 2 * self.n))
            if n == 1:
                self.over.append(dt > self.stall * self.alone)

    def ended(self):
        """A prompt has prefilled: the next one's chunk halves where one pass stalled most of its
        steps, and doubles where four passes fit a step."""
        if self.tokens is None and self.over and 2 * sum(self.over) > len(self.over):
            self.halved += 1
        elif self.tokens is None and self.halved and self.n >= 4:
            self.halved -= 1
            self.n //= 2
        self.over = []

    def kept(self):
        """(step alone, step beside the prefill) in seconds, averaged over the turns beside it
        (each against the step alone of its time), or None before both ran."""
        if not self.beside or self.alone is None:
            return None
        alone = [a if a is not None else self.alone for a in self.alone_at]
        return sum(alone) / len(alone), sum(self.beside) / len(self.beside)

    def off_prediction(self):
        """The steps beside the prefill against the time the budget's model predicted for them (1:
        as predicted), over the turns it predicted; None before any."""
        if not self.predicted:
            return None
        return sum(self.beside[-len(self.predicted) :]) / sum(self.predicted)

    def fit(self):
        """Where the steps beside the prefill went over the model: a least-squares fit of what each
        turn added to its step alone against the passes it waited for, added = fixed + per_pass * n
        (the model has no fixed term: at a steady n it folds one into per, so a fixed cost only
        costs speed where it leaves no room for a pass; fixed and per_pass are None while every
        turn waited for the same count), and the share of turns at one pass, the least a turn
        takes, and of those beyond the stall. None before a turn beside the prefill."""
        if not self.beside or self.alone is None:
            return None
        alone = np.array([a if a is not None else self.alone for a in self.alone_at])
        n, dt = np.array(self.waited, dtype=float), np.array(self.beside)
        fixed = per_pass = None
        if len(set(self.waited)) > 1:
            per_pass, fixed = (float(x) for x in np.polyfit(n, dt - alone, 1))
        one = n == 1
        over = dt > self.stall * alone
        return dict(
            fixed=fixed,
            per_pass=per_pass,
            at_one_pass=float(one.mean()),
            one_pass_over_stall=float(over[one].mean()) if one.any() else 0.0,
        )

    def summary(self):
        """One line: the passes a step waited for, and a step beside the prefill against alone."""
        if self.kept() is None:
            return "prefill beside the steps: none timed"
        n, (alone, dt) = sum(self.waited) / len(self.waited), self.kept()
        tokens = sum(self.prompt_tokens) / len(self.prompt_tokens)
        how = f"{self.tokens} tokens" if self.tokens is not None else f"a stall of {self.stall}x"
        off = self.off_prediction()
        model = f"; {off:.2f}x the time the budget predicted" if off else ""
        return (
            f"prefill beside the steps ({how}): {n:.1f} layer passes a step (about "
            f"{tokens:.0f} prompt tokens; last chunk {self.c}), a step {1e3 * dt:.1f} ms against "
            f"{1e3 * alone:.1f} ms alone (speed kept: {alone / dt:.2f}{model})"
        )


@torch.no_grad()
def serve(model, requests, cache, pick, *, eos_ids=(), chunk=None, on_host=False, decode=None,
          budget=None, on_done=None, timings=None):  # fmt: skip
    """Serve `requests` (Request) over the cache's sequences, in order of arrival (each admitted no
    sooner than its arrival); returns them answered. pick(logits (n, vocab)) -> (n,) tokens: the
    sampling. chunk, on_host: the prefill's (memory.plan_memory). decode(tok (Bz,)) -> logits (Bz,
    vocab): the step (default model.decode; the scripts give fast.GraphedDecode). budget: a Budget,
    the prefill's chunks a decode step waits for (default: a stall of at most 2x, measured).
    on_done(request) as each ends. timings: a dict that gets the seconds of each part of the loop
    outside the GPU's work, a list per part: "admit" (a prompt's prefill set up), "launch" (the
    passes beside a step launched), "start" (a sequence starts decoding), "end", and "turn" (a
    step and its passes, launched and waited for)."""
    dev, Bz = cache.len.device, len(cache.len)
    if not all(r.ids and r.max_new_tokens >= 1 for r in requests):
        raise ValueError("every request needs a prompt of a token or more and max_new_tokens >= 1")
    V = model.cfg.vocab_size
    if bad := next((r for r in requests if min(r.ids) < 0 or max(r.ids) >= V), None):
        raise ValueError(
            f"a prompt has a token id outside 0..{V - 1} (the model's vocabulary): "
            f"{[t for t in bad.ids if not 0 <= t < V][:3]}; encode it with this model's tokenizer"
        )
    longest = max(len(r.ids) + r.max_new_tokens for r in requests)
    if Bz == 0 or longest > cache.capacity():
        raise ValueError(
            f"a request needs {longest} tokens and the cache has {Bz} sequences of "
            f"{cache.capacity()}: make it with a sequence or more and max_len={longest} or more"
        )
    cuda, eos = dev.type == "cuda", set(eos_ids)
    budget = budget or Budget(model.cfg.n_layer)
    decode_stream = torch.cuda.Stream(dev, priority=-1) if cuda else None  # above the prefill's
    prefill_stream = torch.cuda.Stream(dev) if cuda else None
    waiting = deque(sorted(requests, key=lambda r: r.arrival))
    running, pre = {}, None  # running: seq -> its request
    with torch.cuda.stream(decode_stream):
        tok = torch.zeros(Bz, dtype=torch.long, device=dev)  # each sequence's last token
        for seq in range(Bz):
            Parked(cache, seq)
        decode = decode or (lambda tok: model.decode(tok, cache))
        t0 = time.perf_counter()
        launched = 0  # passes launched beside the last step (a step on a GPU waits for them)

        def timed(part, since):
            if timings is not None:
                timings.setdefault(part, []).append(time.perf_counter() - since)

        def end(seq, req):  # the sequence has its last token
            t_end = time.perf_counter()
            req.t_end = req.t_tokens[-1] - req.arrival
            del running[seq]
            Parked(cache, seq)
            if on_done:
                on_done(req)
            timed("end", t_end)

        while waiting or running or pre:
            now = time.perf_counter() - t0
            if not running and pre is None and waiting[0].arrival > now:  # idle until the next:
                t0 -= waiting[0].arrival - now  # skipped on the clock (nothing runs to measure)
                now = waiting[0].arrival
            if pre is None and waiting and waiting[0].arrival <= now and len(running) < Bz:
                t_admit = time.perf_counter()
                seq = min(set(range(Bz)) - set(running))  # 1. admit
                req = waiting.popleft()
                c = budget.chunk(chunk or len(req.ids), len(req.ids))
                pre = Prefill(model, req, seq, cache, prefill_stream, c, on_host)
                timed("admit", t_admit)
            if running:  # 2. a decode step
                t_turn = time.perf_counter()
                nxt = pick(decode(tok))
            n = 0
            if pre:  # 3. the prefill's next passes
                n, t_launch = budget.passes(pre, running), time.perf_counter()
                if ran := pre.launch(n):
                    decode_stream.wait_event(ran)  # the next step after them
                timed("launch", t_launch)
            if running:  # 4. the step's tokens
                tok, new = nxt, nxt.tolist()
                t = time.perf_counter() - t0  # the step waited for passes (a CPU's ran after it)
                budget.turn(t0 + t - t_turn, launched if cuda else n, live=len(running))
                timed("turn", t_turn)
                for seq, req in list(running.items()):
                    req.out.append(new[seq])
                    req.t_tokens.append(t)
                    if new[seq] in eos or len(req.out) == req.max_new_tokens:
                        end(seq, req)
            launched = n
            if pre and pre.done():  # 5. a sequence starts
                t_start = time.perf_counter()
                budget.ended()
                pre.parked.start()
                if cuda:
                    pre.logits.record_stream(decode_stream)
                first = pick(pre.logits[None])
                tok[pre.seq] = first[0]
                req, running[pre.seq] = pre.req, pre.req
                req.out, req.t_tokens = first.tolist(), [time.perf_counter() - t0]
                req.t_first = req.t_tokens[0] - req.arrival
                if req.out[0] in eos or req.max_new_tokens == 1:
                    end(pre.seq, req)
                pre = None
                timed("start", t_start)
        if cuda:
            torch.cuda.current_stream().synchronize()
    return requests
