"""Requests that arrive over time, as serving is measured in the field (vLLM's bench serve,
Sarathi-Serve): arrivals of a Poisson process at a rate (seeded), prompt and output lengths drawn
from ranges (or read from a JSONL file of them), served by continuous batching (serve.py) under its
token budget, every system through the same loop at its largest batch, random weights. Per system
and rate: time to first token and time between tokens (median, p90, p99, max), output tokens/s, a
decode step alone and beside a prefill (the speed it keeps), the GPU and host peaks. Each system's
capacity: the largest rate whose p99 time between tokens and median time to first token stay
within the targets; the rates run in ascending order, and a system's sweep stops at its first miss
(a higher rate only queues longer)."""

import resource
import statistics
import time

import numpy as np
import torch

import offload
import serve
from bench.requests import free, largest_plan, seconds
from bench.throughput import SHAPES, SYSTEMS
from config import Config


def read_lengths(path):
    """A JSONL file of {"prompt_len": P, "new_tokens": G}: [(P, G)], each a count of 1 or more."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                r = serve.json_or_none(line)
                ok = isinstance(r, dict) and all(
                    type(r.get(k)) is int and r[k] >= 1 for k in ("prompt_len", "new_tokens")
                )
                if not ok:
                    raise ValueError(
                        f'--lengths {path}, line {n}: give {{"prompt_len": P, "new_tokens": G}}'
                    )
                out.append((r["prompt_len"], r["new_tokens"]))
    if not out:
        raise ValueError(f"--lengths {path}: no line in it")
    return out


def workload(n, rate, prompt_lens, new_tokens, vocab, seed=0, lengths=None):
    """n requests: arrivals of a Poisson process of `rate` a second (the first at 0), prompt and
    output lengths uniform in the ranges (lo, hi) or cycled from `lengths`, random token ids; the
    same for the same seed whatever the rate (only the gaps scale)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, n)
    arrival = np.concatenate([[0.0], np.cumsum(gaps[1:])]) / rate
    if lengths:
        P, G = zip(*(lengths[i % len(lengths)] for i in range(n)))
    else:
        P = rng.integers(prompt_lens[0], prompt_lens[1] + 1, n)
        G = rng.integers(new_tokens[0], new_tokens[1] + 1, n)
    return [
        serve.Request(rng.integers(0, vocab, int(p)).tolist(), int(g), arrival=float(a))
        for p, g, a in zip(P, G, arrival)
    ]


def spread(xs):
    """Median, p90, p99 and max of xs (seconds, 4 significant figures)."""
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]
    return [seconds(v) for v in (statistics.median(xs), at(0.9), at(0.99), xs[-1])]


@torch.no_grad()
def bench_arrivals(
    shape="8b",
    rates=(0.05, 0.1, 0.2),
    prompt_lens=(65536, 131072),
    new_tokens=(256, 4096),
    requests=32,
    budget_gb=24.0,
    systems=("nosa-offload", "full"),
    host_gb=None,
    lengths=None,
    tbt_target=0.2,
    ttft_target=30.0,
    max_stall=2.0,
    seed=0,
):
    from fast import GraphedDecode, compile_model
    from generate import random_model
    from memory import host_bytes_available

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    preset, over = SHAPES[shape]
    lengths = read_lengths(lengths) if isinstance(lengths, str) else lengths
    P_max = max(p for p, _ in lengths) if lengths else prompt_lens[1]
    max_len = P_max + (max(g for _, g in lengths) if lengths else new_tokens[1])
    budget, host = budget_gb * 2**30, host_gb * 2**30 if host_gb else host_bytes_available()
    rows, capacity = [], []
    for name in systems:
        label, attn, use_offload = SYSTEMS[name]
        torch.manual_seed(0)
        cfg = Config.from_preset(preset, **over, attn=attn, max_seq_len=max_len)
        model = random_model(cfg, dev, dtype)
        model = compile_model(model, prefill=True) if cuda else model
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        Bz, (chunk, on_host) = largest_plan(
            cfg, weights, requests, P_max, max_len, dtype, budget, host, use_offload, True
        )
        if Bz == 0:
            rows.append(dict(system=label, rate=None, batch=0))
            continue
        cache = offload.make_cache(
            cfg, Bz, dev, dtype, max_len, offload=use_offload, host_budget=host
        )
        decode = GraphedDecode(model, cache, 2 if use_offload and Bz >= 16 else 1)
        pick = lambda logits: logits.argmax(-1)
        c = chunk or 64  # compiles what the timed runs launch: chunks whole and ragged (dynamic)
        warm = [
            serve.Request(list(range(1, n + 1)), 4)
            for n in (64, c + 37, c // 2 + 5)
            if n + 4 <= max_len
        ]
        serve.serve(model, warm, cache, pick, chunk=chunk, on_host=on_host, decode=decode)
        within = []
        for rate in sorted(rates):
            reqs = workload(requests, rate, prompt_lens, new_tokens, cfg.vocab_size, seed, lengths)
            step_budget = serve.Budget(cfg.n_layer, stall=max_stall)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            serve.serve(
                model,
                reqs,
                cache,
                pick,
                chunk=chunk,
                on_host=on_host,
                decode=decode,
                budget=step_budget,
            )
            total = time.perf_counter() - t0
            ttft = spread([r.t_first for r in reqs])
            tbt = spread([g for r in reqs for g in r.gaps()] or [0.0])
            row = dict(system=label, rate=rate, batch=Bz, requests=requests)
            row.update({f"ttft_{k}_s": v for k, v in zip(("median", "p90", "p99", "max"), ttft)})
            row.update({f"tbt_{k}_s": v for k, v in zip(("median", "p90", "p99", "max"), tbt)})
            row["output_tokens_s"] = round(sum(len(r.out) for r in reqs) / total, 1)
            alone, beside = step_budget.kept() or (float("nan"),) * 2
            row.update(step_alone_ms=round(1e3 * alone, 2), step_beside_ms=round(1e3 * beside, 2))
            row["speed_kept"] = round(alone / beside, 3)
            row["total_s"] = seconds(total)
            row["gpu_peak_gb"] = (
                round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
            )
            row["host_peak_gb"] = round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1
            )
            rows.append(row)
            print(row, flush=True)
            if tbt[2] > tbt_target or ttft[0] > ttft_target:
                break  # a higher rate only waits longer: the sweep stops at the first miss
            within.append(rate)
        capacity.append(
            dict(
                system=label,
                capacity_rate=max(within) if within else 0.0,
                tbt_target_s=tbt_target,
                ttft_target_s=ttft_target,
                targets=f"p99 time between tokens <= {tbt_target} s, median time to first token "
                f"<= {ttft_target} s",
            )
        )
        del cache, model, decode  # (the graph holds both)
        free(cuda)
    return dict(runs=rows, capacity=capacity)
