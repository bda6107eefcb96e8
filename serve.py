"""
Continuous batching: whole requests served over the Bz rows of a decode cache (offloaded or
resident). A row whose sequence ends (EOS, or its max_new_tokens) takes the next waiting request,
and that request's prompt prefills a chunk at a time between the decode steps of the other rows:
per step, `per_step` chunks of a layer each (by default a chunk's worth of the prompt through the
whole model, as the token budget of chunked prefill in serving engines). On a GPU the prefill runs
on a stream of its own, beside the step (which has the higher priority), and the next step waits
for the chunks; on a CPU they run after the step. generate.py serves this way when it is given
more requests than rows, or a file of requests.

One prompt prefills at a time. The memory model (memory.plan_memory) sized the cache for Bz rows of
max_len tokens and one prefill's activations beside them, so a request is admitted when a row is
free, no other prompt is prefilling, and its prompt and new tokens fit a row.

Each turn of the loop:
  1. admit: a free row parks (Cache.park: it waits at position 0) and the next prompt starts there
  2. one decode step of every row (`decode`); the parked rows' outputs are ignored
  3. launch the prefill's next chunks (per_step); the next decode step waits for them
  4. the step's tokens to the host: a row whose sequence ends is parked, its request done
  5. a prefill that has run to its end: its row starts (Cache.start) with the prompt's next token
"""

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from prefill import prefill_chunks


@dataclass
class Request:
    """A prompt's tokens and what serving it gave: the new tokens, and when (seconds from the start
    of serve) its first and last tokens reached the host."""

    ids: list
    max_new_tokens: int
    out: list = field(default_factory=list)
    t_first: float = None
    t_end: float = None

    def tokens_per_s(self):  # decoding speed after the first token (which came with the prefill)
        return (len(self.out) - 1) / max(self.t_end - self.t_first, 1e-9)


class Prefill:
    """A prompt prefilling into a parked row a chunk at a time (prefill.prefill_chunks), on `stream`
    (None: the current one)."""

    def __init__(self, model, req, row, cache, stream, chunk, on_host):
        self.req, self.row, self.stream, self.logits, self.ran = req, row, stream, None, None
        cache.park(row)
        if stream is not None:  # after the park, and the steps before it
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            idx = torch.tensor([req.ids], device=cache.len.device)
        self.chunks = prefill_chunks(model, idx, cache, row, chunk, stream_on_host=on_host)

    def launch(self, n):
        """Launch the next n chunks (of a layer each), or the rest; returns an event on the stream
        after them (None on a CPU, where they ran as they were launched)."""
        with torch.cuda.stream(self.stream):
            for _ in range(n):
                if self.logits is None:
                    self.logits = next(self.chunks)
            self.ran = self.stream and self.stream.record_event()
        return self.ran

    def done(self):  # launched to the end, and run
        return self.logits is not None and (self.ran is None or self.ran.query())


@torch.no_grad()
def serve(model, requests, cache, pick, eos_ids=(), chunk=None, on_host=False, decode=None,
          per_step=None, on_done=None):  # fmt: skip
    """Serve `requests` (Request) over the cache's rows, in order of arrival; returns them answered.
    pick(logits (n, vocab)) -> (n,) tokens: the sampling. chunk, on_host: the prefill's
    (memory.plan_memory). decode(tok (Bz,)) -> logits (Bz, vocab): the step (default model.decode;
    the scripts give fast.GraphedDecode). per_step: the prefill's chunks (of a layer each) per
    decode step, which waits for them (default n_layer: a chunk's worth of the prompt through the
    whole model, as the token budget of chunked prefill in serving engines). on_done(request) as
    each request ends."""
    dev, Bz = cache.len.device, len(cache.len)
    if not all(r.ids and r.max_new_tokens >= 1 for r in requests):
        raise ValueError("every request needs a prompt of a token or more and max_new_tokens >= 1")
    longest = max(len(r.ids) + r.max_new_tokens for r in requests)
    if Bz == 0 or longest > cache.capacity():
        raise ValueError(
            f"a request needs {longest} tokens and the cache has {Bz} rows of "
            f"{cache.capacity()}: make it with a row or more and max_len={longest} or more"
        )
    cuda, eos = dev.type == "cuda", set(eos_ids)
    decode_stream = torch.cuda.Stream(dev, priority=-1) if cuda else None  # above the prefill's
    prefill_stream = torch.cuda.Stream(dev) if cuda else None
    waiting, running, pre = deque(requests), {}, None  # running: row -> its request
    with torch.cuda.stream(decode_stream):
        tok = torch.zeros(Bz, dtype=torch.long, device=dev)  # each row's last token
        for row in range(Bz):
            cache.park(row)
        decode = decode or (lambda tok: model.decode(tok, cache))
        t0 = time.perf_counter()

        def end(row, req):  # the row's sequence has its last token
            req.t_end = time.perf_counter() - t0
            del running[row]
            cache.park(row)
            if on_done:
                on_done(req)

        while waiting or running or pre:
            if pre is None and waiting and len(running) < Bz:  # 1. admit
                row = min(set(range(Bz)) - set(running))
                pre = Prefill(model, waiting.popleft(), row, cache, prefill_stream, chunk, on_host)
            if running:  # 2. a decode step
                nxt = pick(decode(tok))
            if pre and (ran := pre.launch(per_step or model.cfg.n_layer)):  # 3. its next chunks
                decode_stream.wait_event(ran)  # the next step after them
            if running:  # 4. the step's tokens
                tok, new = nxt, nxt.tolist()
                for row, req in list(running.items()):
                    req.out.append(new[row])
                    if new[row] in eos or len(req.out) == req.max_new_tokens:
                        end(row, req)
            if pre and pre.done():  # 5. a row starts
                cache.start(pre.row)
                if cuda:
                    pre.logits.record_stream(decode_stream)
                first = pick(pre.logits[None])
                tok[pre.row] = first[0]
                req, running[pre.row] = pre.req, pre.req
                req.out, req.t_first = first.tolist(), time.perf_counter() - t0
                if req.out[0] in eos or req.max_new_tokens == 1:
                    end(pre.row, req)
                pre = None
        if cuda:
            torch.cuda.current_stream().synchronize()
    return requests


# -----------------------------------------------------------------------------
# Request files and completions (generate.py --requests, --completions)


def parse_requests(text, path):
    """--requests FILE's text: a prompt a line, or JSON lines (where the first line that is not
    blank is a JSON object): an object a line with "prompt" and optionally "max_new_tokens". Lines
    end at newlines only (a form feed or U+2028 belongs to its line). Returns [(text,
    max_new_tokens or None, line number)]; blank lines are skipped."""
    lines = [(n, s.removesuffix("\r")) for n, s in enumerate(text.split("\n"), 1) if s.strip()]
    if not lines:
        raise ValueError(f"--requests {path}: no request in it; give a prompt a line")
    jsonl = isinstance(json_or_none(lines[0][1]), dict)
    out = []
    for n, line in lines:
        if not jsonl:
            out.append((line, None, n))
            continue
        r = json_or_none(line)
        new = r.get("max_new_tokens") if isinstance(r, dict) else None
        if (
            not isinstance(r, dict)
            or not isinstance(r.get("prompt"), str)
            or not (new is None or type(new) is int and new >= 1)
        ):
            raise ValueError(
                f'--requests {path}, line {n}: give a JSON object with a "prompt" text and '
                f'optionally a "max_new_tokens" of 1 or more ({line[:60]})'
            )
        out.append((r["prompt"], new, n))
    return out


def json_or_none(line):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


class Completions:
    """--completions FILE: a JSON line per request as it ends, each line whole. The file is made
    when serving starts; where a write fails (a full disk) the cut line is taken back off and one
    line says which request it stopped at."""

    def __init__(self, path):
        self.path, self.f, self.n = path, None, 0

    def __enter__(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.f = open(self.path, "wb")
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, obj, name):
        at = self.f.tell()
        try:
            self.f.write((json.dumps(obj) + "\n").encode())
            self.f.flush()
        except OSError as e:
            try:
                self.f.truncate(at)
            except OSError:
                pass
            raise OSError(
                f"--completions {self.path}: could not write the completion of {name} "
                f"({e.strerror}); the file holds the {self.n} before it, each line whole"
            ) from None
        self.n += 1
