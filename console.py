"""
What generate.py reads from a person and shows them: prompt files and the chat template
(read_prompt, chat_prompt), a single sequence's text as it comes (Printer), a long prefill's
progress (PrefillProgress), and the files it writes, checked before any work and written whole
(check_output, export_trace, with the profiler that makes the trace).
"""

import contextlib
import os
import sys
import time

import torch

import checkpoint


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
