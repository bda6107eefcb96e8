"""Where an offloaded decode step's time goes on the device: the graphed step with 1, 2, ...
micro-batches (fast.GraphedDecode), with its gathers and without them (what it reads from HBM
alone), and each traced: the gather kernels against the rest on the device's timeline. What the
parts' overlap wins, and where PCIe still waits (docs/LOG.md, 2026-12-06)."""

import contextlib
import json
import os
import tempfile
import time

import torch

import bench
import fast
import memory
import offload
import offload_kernels
from bench import SHAPES
from bench.throughput import fill_random
from config import Config
from model import random_model


def union(spans):
    """The total length of the union of intervals (start, end)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def split_timeline(kernels, gathers_a_step):
    """kernels: (name, start, end) of the device's kernels over a few steps, in µs, gathers_a_step
    of them gathers (layers x micro-batches) -> per step, in ms: the step (from one step's last
    gather's end to the next's), the time a gather runs, the time anything else runs (a wait for a
    turn is not), both at once, neither (idle), and no gather (PCIe waits). The first step is left
    out: a trace starts late."""
    ends = sorted(b for name, a, b in kernels if "gather_units" in name)
    steps = len(ends) // gathers_a_step - 1
    lo, hi = ends[gathers_a_step - 1], ends[(steps + 1) * gathers_a_step - 1]
    clip = lambda spans: [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]
    gather = clip([(a, b) for name, a, b in kernels if "gather_units" in name])
    rest = [
        (a, b) for name, a, b in kernels if "gather_units" not in name and "turn_wait" not in name
    ]
    rest = clip(rest)  # (a part waiting its turn, fast.Turns, spins on one multiprocessor: idle)
    ug, ur, both = union(gather), union(rest), union(gather + rest)
    ms = lambda us: round(us / steps / 1e3, 2)
    return dict(
        step_ms=ms(hi - lo),
        gather_ms=ms(ug),
        rest_ms=ms(ur),
        overlap_ms=ms(ug + ur - both),
        idle_ms=ms(hi - lo - both),
        pcie_idle_ms=ms(hi - lo - ug),
    )


def by_kernel(kernels, steps, top):
    """The `top` kernels by time on the device a step: (ms a step, launches a step, name), names
    cut at their first '(' or 60 characters. Which kernels a step's compute is made of."""
    total, count = {}, {}
    for name, a, b in kernels:
        name = name.split("(")[0][:60]
        total[name] = total.get(name, 0.0) + (b - a)
        count[name] = count.get(name, 0) + 1
    rows = sorted(total, key=total.get, reverse=True)[:top]
    return [(round(total[n] / steps / 1e3, 3), round(count[n] / steps, 1), n) for n in rows]


@contextlib.contextmanager
def gathers(on):
    """Steps with their gathers, or without (the blocks stay as they are: timing only, the logits
    are wrong)."""
    real = offload.gather_units
    if not on:
        offload.gather_units = lambda *a, **k: None
    try:
        yield
    finally:
        offload.gather_units = real


def traced(step, tok, steps):
    """steps steps under torch.profiler -> (tok, the device's kernels as (name, start, end) in µs)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tok = step(tok)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(os.path.join(d, "trace.json"))
        with open(os.path.join(d, "trace.json")) as f:
            events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return tok, [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in kernels]


@contextlib.contextmanager
def beside_ctas(n):
    """The gather beside a micro-batch's compute on n thread blocks (None: as landed)."""
    real = offload_kernels.gather_ctas
    if n:
        offload_kernels.gather_ctas = lambda unit, beside=False: n if beside else real(unit)
    try:
        yield
    finally:
        offload_kernels.gather_ctas = real


def bench_overlap(
    shape="8b", prompt_len=131072, *, batch=26, micro_batches=(1, 2), ctas=(0,), steps=24, kernels=0
):
    """The graphed decode step of `batch` random prompts of prompt_len (random weights, an offloaded
    cache in the host memory there is) with each number of micro-batches, with and without its
    gathers, and with more than one also in turns (fast.Turns) on each number of the gather's thread
    blocks in ctas (0: as landed), and in turns without gathers: ms a step (the mean of `steps` replays), and with gathers the
    split of a trace of 4 more; with kernels > 0 also that many kernels by their time a step."""
    bench.need_gpu("overlap")
    preset, over = SHAPES[shape]
    runs = [(mb, False, on, 0) for mb in micro_batches for on in (True, False)]
    runs += [(mb, True, True, n) for mb in micro_batches if mb > 1 for n in ctas]
    # in turns without gathers: what computing one part at a time costs, apart from the gather's
    # interference with the compute beside it
    runs += [(mb, True, False, 0) for mb in micro_batches if mb > 1]
    max_len = prompt_len + (steps + 8) * len(runs) + 64
    cfg = Config.from_preset(preset, **over, attn="nosa", max_seq_len=max_len)
    torch.manual_seed(0)
    model = random_model(cfg, "cuda", torch.bfloat16)
    fast.compile_model(model)
    cache = offload.OffloadCache(
        cfg, batch, "cuda", torch.bfloat16, max_len=max_len,
        host_budget=memory.host_bytes_available(),
    )  # fmt: skip
    rows, tok = [], torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    step = lambda decode: lambda t: decode(t).argmax(-1)
    with torch.no_grad():
        fill_random(cache, cfg, batch, prompt_len, "cuda", torch.bfloat16)
        for _ in range(2):  # the first steps after the prefill gather whole selections
            tok = step(lambda t: model.decode(t, cache))(tok)
        for mb, in_turns, on, n in runs:
            with gathers(on), beside_ctas(n):
                decode = step(fast.GraphedDecode(model, cache, mb, in_turns))
                for _ in range(4):  # eager, capture, replays
                    tok = decode(tok)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    tok = decode(tok)
                torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) * 1e3 / steps
                tok, trace = traced(decode, tok, 4)
            row = dict(micro_batches=mb, in_turns=in_turns, ctas=n or None, gathers=on)
            row.update(step_ms=round(ms, 2))
            split = {} if not on else split_timeline(trace, cfg.n_layer * mb)
            row.update({f"traced_{k}": v for k, v in split.items()})
            row.update(tokens_s=round(batch / ms * 1e3, 1))
            print(row, flush=True)
            if kernels:
                row["kernels"] = by_kernel(trace, 4, kernels)
                for ms_a_step, launches, name in row["kernels"]:
                    print(f"  {ms_a_step:8.3f} ms {launches:7.1f}x  {name}")
            rows.append(row)
    return rows


def flags(p):
    bench.add_shape(p)
    p.add_argument("--batch", type=bench.at_least_one, help="sequences (default: %(default)s)")
    p.add_argument(
        "--micro-batches",
        type=bench.positive_ints,
        help="numbers of micro-batches, e.g. 1,2 (default: %(default)s)",
    )
    p.add_argument(
        "--ctas",
        type=bench.positive_ints,
        help="thread blocks of the gather beside a micro-batch's compute, in turns (default: as landed)",
    )
    p.add_argument("--steps", type=bench.at_least_one, help="timed steps (default: %(default)s)")
    p.add_argument(
        "--kernels",
        type=bench.at_least_one,
        help="also print this many kernels by their time a step (default: none)",
    )


COMMANDS = {"overlap": (bench_overlap, flags)}
