"""
What generate.py reads from a person and shows them: prompt files and the chat template
(read_prompt, chat_prompt), a single sequence's text as it comes (Printer), a long prefill's
progress (PrefillProgress), the greppable statistics (report, report_cache), and the files it
reads and writes, checked before any work and written whole (check_output, export_trace with the
profiler that makes the trace; a --requests file, parse_requests; served requests as they end,
Served, with their --completions).
"""

import contextlib
import json
import os
import sys
import time

import torch

import checkpoint
import tp


def check_output(flag, path, inputs, replace):
    """An output file before any work: never an input (links resolved), never a directory, an
    existing file only where replacing it is asked, and a place that can be written; nothing is
    made here."""
    real = os.path.realpath(path)
    if real in inputs:
        raise ValueError(f"{flag} {path} is an input of this run; give another file")
    if os.path.isdir(real):
        raise ValueError(f"{flag} {path} is a directory; give a file in it")
    if os.path.exists(real) and os.path.getsize(real) and not replace:
        raise FileExistsError(f"{flag} {path} exists and is not empty; --force replaces it")
    folder = os.path.dirname(real)
    while not os.path.exists(folder):  # folders it lacks are made with the file
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: cannot write in {folder}; give a writable path")


def export_trace(prof, path):
    """The profiler's trace to path, whole or not at all: written beside it, then renamed."""
    if not prof:
        return
    part = f"{path}.{os.getpid()}.part"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        prof.export_chrome_trace(part)
        os.replace(part, path)
    except (OSError, RuntimeError) as e:
        for p in (part, part + ".tmp"):
            if os.path.exists(p):
                os.remove(p)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise OSError(
            f"--profile {path}: could not write the trace ({reason}); none written"
        ) from None
    print(f"profile: {path} (chrome://tracing or ui.perfetto.dev)")


def profiler(path, device):
    """A torch.profiler context where a trace is asked for (its ranges: the step's selection,
    transfer and attention), else a context that does nothing."""
    if not path:
        return contextlib.nullcontext()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


class PrefillProgress:
    """on_prefill for generate: when each prompt's prefill ended (done, host clock, the device
    synchronised), and a line on stderr every few seconds of a long prefill: tokens done, tokens/s
    and the time left (unless quiet)."""

    def __init__(self, lens, device, quiet, every=3.0):
        self.lens, self.device, self.quiet, self.every = lens, device, quiet, every
        self.t0 = self.shown = time.perf_counter()
        self.done, self.t_end = [], None  # t_end: when the generation ended (main sets it)

    def __call__(self, i, fraction):
        if fraction < 1 and self.quiet:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if fraction == 1:
            self.done.append(now)
        if not self.quiet and now - self.shown >= self.every:
            self.shown = now
            n = sum(self.lens[:i]) + fraction * self.lens[i]
            rate, total = n / (now - self.t0), sum(self.lens)
            print(
                f"prefill: {n:.0f} of {total} tokens (prompt {i + 1} of {len(self.lens)}), {rate:.0f} tokens/s, "
                f"{(total - n) / rate:.0f} s left",
                file=sys.stderr,
                flush=True,
            )


class Printer:
    """Prints the text of a single sequence as its tokens arrive: the decoded text grows by whole
    characters (a byte-level token may end inside one), and stops at the end of the sequence."""

    def __init__(self, tokenizer, eos_ids):
        self.tokenizer, self.eos_ids, self.ids, self.shown, self.ended = (
            tokenizer,
            eos_ids,
            [],
            0,
            False,
        )

    def __call__(self, tok):
        if self.ended:
            return
        self.ids.append(int(tok[0]))
        self.ended = self.ids[-1] in self.eos_ids
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd") or self.ended:
            print(text[self.shown :], end="", flush=True)
            self.shown = len(text)


def chat_prompt(template, text, special_tokens):
    """A user message in the checkpoint's (Jinja) chat template, ready for the assistant's answer."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=[{"role": "user", "content": text}],
            add_generation_prompt=True,
            **special_tokens,
        )
    except Exception as e:  # TemplateError, and whatever the template's own code raises
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        raise ValueError(f"--chat: the checkpoint's chat template fails ({reason})") from None


def read_prompt(path, flag="--prompt-file"):
    """A text file a flag names: relative to the working directory where it is there, else to the
    repository (prompt.txt from anywhere); a regular file of UTF-8 text."""
    path = checkpoint.resolve(path)
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{flag} {path} is not a regular file; give a text file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise FileNotFoundError(f"{flag} {path}: {e.strerror}") from None


def report(cache, pl, ids, out, progress, *, offload, gpu_budget=None):
    """generate.py's greppable lines: prefill, tokens/sec, then report_cache's."""
    batch, chunk, on_host, device, t_end = len(ids), pl.chunk, pl.on_host, pl.device, progress.t_end
    pre, ttft = progress.done[-1] - progress.t0, [t - progress.t0 for t in progress.done]
    n_pre, n_tok = sum(map(len, ids)), sum(map(len, out)) - batch  # the first comes with prefill
    print(
        f"prefill: {n_pre} tokens in {pre:.2f} s ({n_pre / pre:.0f} tokens/s, chunks of {chunk}"
        f"{', the residual stream in host memory' if on_host else ''}); time to first token "
        f"{ttft[0]:.2f} s"
        + (f" (the first prompt), {ttft[-1]:.2f} s (the last)" if batch > 1 else "")
    )
    dt = max(t_end - progress.done[-1], 1e-9)  # (no decode step with --max-new-tokens 1)
    print(
        f"tokens/sec: {n_tok / dt:.1f} ({n_tok} tokens in {dt:.2f} s after the first, batch "
        f"{batch}, prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, "
        f"{cache.cfg.attn}, {device})"
    )
    budget = f", budget {pl.gpu / 2**30:.2f} GiB" if gpu_budget else ""
    report_cache(cache, device, offload, f" (weights {pl.weights / 2**30:.2f} GiB){budget}")


def report_cache(cache, device, offload, note=""):
    """The offload's statistics (every rank's heads, under torchrun) and the GPU memory's peak."""
    if offload:
        tp.gather_stats(cache.stats)
        print(cache.stats.summary())
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"GPU memory: {peak:.2f} GiB at the peak{note}")


class Served:
    """What serving prints: as each request ends (call it with the request), its text (or a JSON
    line in completions) and a line with its time to first token and tokens/s; totals() at the end.
    As a context, the completions file is open (made when serving starts)."""

    def __init__(self, tokenizer, reqs, names, completions=None, quiet=False):
        self.tokenizer, self.reqs, self.names, self.quiet = tokenizer, reqs, names, quiet
        self.number = {id(r): i for i, r in enumerate(reqs)}
        self.jsonl = Completions(completions) if completions else None

    def __enter__(self):
        if self.jsonl:
            self.jsonl.__enter__()
        return self

    def __exit__(self, *exc):
        if self.jsonl:
            self.jsonl.__exit__(*exc)

    def __call__(self, req):
        i, text = self.number[id(req)], self.tokenizer.decode(req.out)
        ttft, rate = req.t_first, req.tokens_per_s()
        if self.jsonl:
            line = dict(request=i, completion=text, new_tokens=len(req.out), ttft_s=ttft)
            self.jsonl.write(dict(line, tokens_per_s=rate), self.names[i])
        elif not self.quiet:
            print(f"--- request {i} ---\n{self.tokenizer.decode(req.ids)}{text}\n---")
        print(
            f"request {i}: {len(req.ids)} prompt tokens, {len(req.out)} new; first token after "
            f"{ttft:.2f} s, then {rate:.1f} tokens/s"
        )

    def totals(self, seconds, n_seq, attn, device):
        ttft, n_tok = sorted(r.t_first for r in self.reqs), sum(len(r.out) for r in self.reqs)
        print(
            f"served: {len(self.reqs)} requests over {n_seq} sequences in {seconds:.2f} s, {n_tok} "
            f"new tokens ({n_tok / seconds:.1f} tokens/s); time to first token: median "
            f"{ttft[len(ttft) // 2]:.2f} s, p90 {ttft[(9 * len(ttft)) // 10]:.2f} s, max "
            f"{ttft[-1]:.2f} s ({attn}, {device})"
        )


# -----------------------------------------------------------------------------
# Request files and completions (--requests, --completions)


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
