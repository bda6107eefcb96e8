"""Requests that arrive over time, as serving is measured in the field (vLLM's bench serve,
Sarathi-Serve): arrivals of a Poisson process at a rate (seeded), prompt and output lengths drawn
from ranges (or read from a JSONL file of them), served by continuous batching (serve.py) under its
token budget, every system through the same loop at its largest batch, random weights. Per system
and rate: time to first token and time between tokens (median, p90, p99, max), output tokens/s, a
decode step alone and beside a prefill (the speed it keeps), the GPU and host peaks. Each system's
capacity: the largest rate whose p99 time between tokens and median time to first token stay
within the targets; the rates run in ascending order, and a system's sweep stops at its first miss
(a higher rate only queues longer). Where no rate misses, the workload ended before a queue grew
(`bounded` false): the capacity lies higher, and the requests completed a second at the highest
rate (`requests_s`) say what the system sustains if it was saturated there. That figure counts
the batch filling at the start and draining at the end; `requests_s_saturated` counts only the
span where every row was busy and a request waited (more requests than the batch, all arrived)."""

import contextlib
import json
import os
import resource
import statistics
import time

import numpy as np
import torch

import bench
import console
import offload
import serve
from bench.requests import budgets, seconds, system


def read_lengths(path):
    """A JSONL file of {"prompt_len": P, "new_tokens": G}: [(P, G)], each a count of 1 or more."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                r = console.json_or_none(line)
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


def workload(n, rate, prompt_lens, new_tokens, vocab, *, seed=0, lengths=None):
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
    shape="8b", rates=(0.05, 0.1, 0.2), *, prompt_lens=(65536, 131072), max_new_tokens=(256, 4096),
    requests=32, gpu_budget=24.0, host_budget=None, systems=("nosa-offload", "full"), lengths=None,
    tbt_target=0.2, ttft_target=30.0, max_stall=2.0, seed=0, add_to=None,
):  # fmt: skip
    """Requests arriving over time, served by continuous batching (the module's docstring): per
    system and rate, times to first token and between tokens, and each system's capacity;
    max_stall: how many times a step alone a step beside a prefill may take (serve.Budget). With
    add_to, a results file of the same sweep (workload, targets, GPU), the rows join the file's (a
    system's row at a rate replaced), the capacities are taken over all of them, and the file is
    rewritten: one sweep over several calls."""
    from fast import GraphedDecode

    bench.check_decode_run(shape, gpu_budget)
    lengths_from = lengths if isinstance(lengths, str) else None
    lengths = read_lengths(lengths) if lengths_from else lengths
    g = f"{max_new_tokens[0]}-{max_new_tokens[1]}"
    sweep = dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        workload=f"{shape}, {requests} requests of "
        + (f"the lengths in {os.path.basename(lengths_from)}" if lengths_from else
           f"{kilo(prompt_lens[0])}-{kilo(prompt_lens[1])} + {g} tokens"),
        targets=[tbt_target, ttft_target],
    )  # fmt: skip
    if max_stall != 2.0:  # (files of the default carry no key)
        sweep["max_stall"] = max_stall
    add_to = add_to and os.path.realpath(add_to)  # (resolved once)
    inputs = {os.path.realpath(lengths_from)} if lengths_from else set()
    earlier = read_sweep(add_to, sweep, inputs) if add_to else []  # (before any work)
    P_max = max(p for p, _ in lengths) if lengths else prompt_lens[1]
    max_len = P_max + (max(g for _, g in lengths) if lengths else max_new_tokens[1])
    rows, capacity = [], []
    gpu, host = budgets(gpu_budget, host_budget)
    for name in systems:
        model, (label, use_offload, Bz, chunk, on_host) = system(
            name, shape, max_len, requests, P_max, (gpu, host), served=True
        )
        if Bz == 0:
            rows.append(dict(system=label, rate=None, batch=0))
            continue
        cfg, w = model.cfg, model.embed_tokens.weight
        dev, dtype = w.device, w.dtype
        cache = offload.make_cache(
            cfg, Bz, dev, dtype, max_len, offload=use_offload, host_budget=host
        )
        decode = GraphedDecode(model, cache, 2 if use_offload and Bz >= 16 else 1)
        serve_ = lambda reqs, budget=None, timings=None: serve.serve(
            model, reqs, cache, lambda logits: logits.argmax(-1), chunk=chunk, on_host=on_host,
            decode=decode, budget=budget, timings=timings,
        )  # fmt: skip
        # compiles what the timed runs launch: chunks whole, ragged (dynamic shapes) and of one
        # token (the decode path's kernels), and the longest prompt, whose growing lists of blocks
        # pass through every power-of-two tile count the others need (the lengths themselves are
        # not specialized on: the kernels' do_not_specialize)
        c = chunk or 64
        serve_(
            [
                serve.Request([1 + i % (cfg.vocab_size - 1) for i in range(n)], 4)
                for n in (64, c + 37, c // 2 + 5, c + 1, P_max)
                if n + 4 <= max_len
            ]
        )
        for rate in sorted(rates):
            reqs = workload(
                requests, rate, prompt_lens, max_new_tokens, cfg.vocab_size, seed=seed,
                lengths=lengths,
            )  # fmt: skip
            row = dict(system=label, rate=rate, batch=Bz, requests=requests)
            rows.append(row | served_at_rate(serve_, reqs, cfg.n_layer, max_stall, tbt_target, Bz))
            print(rows[-1], flush=True)
            if add_to:  # each rate kept as it ends (a call may be cut off by its time limit)
                join_sweep(add_to, sweep, earlier, rows, requests, tbt_target, ttft_target)
            if rows[-1]["tbt_p99_s"] > tbt_target or rows[-1]["ttft_median_s"] > ttft_target:
                break  # a higher rate only waits longer: the sweep stops at the first miss
        capacity.append(capacity_of(label, rows, requests, tbt_target, ttft_target))
        cache = model = decode = serve_ = None  # (the graph holds both)
        bench.free(torch.cuda.is_available())
    if add_to:
        rows, capacity = join_sweep(add_to, sweep, earlier, rows, requests, tbt_target, ttft_target)
    return dict(runs=rows, capacity=capacity)


def join_sweep(path, sweep, earlier, rows, requests, tbt_target, ttft_target):
    """The file's earlier rows joined with this run's (a system's row at a rate replaced), the
    capacities taken over all of them, the file replaced whole: written after every rate, so a
    call cut off by a time limit keeps the rates it finished."""
    new = {(r["system"], r["rate"]) for r in rows}
    rows = [r for r in earlier if (r["system"], r["rate"]) not in new] + rows
    rows.sort(key=lambda r: (r["system"], r["rate"] or 0))
    systems_ = dict.fromkeys(r["system"] for r in rows if r["rate"])
    capacity = [capacity_of(s, rows, requests, tbt_target, ttft_target) for s in systems_]
    out = dict(sweep, date=time.strftime("%Y-%m-%d"), runs=rows, capacity=capacity)
    part = f"{path}.{os.getpid()}.part"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(part, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(part, path)  # whole, or as it was
    return rows, capacity


def capacity_of(label, rows, requests, tbt_target, ttft_target):
    """A system's capacity from its rows (rates in ascending order up to its first miss): the
    highest rate held; bounded where a rate missed, and the requests completed a second at the
    highest rate run up to that miss."""
    mine = sorted((r for r in rows if r["system"] == label and r["rate"]), key=lambda r: r["rate"])
    within = []
    for r in mine:
        if r["tbt_p99_s"] > tbt_target or r["ttft_median_s"] > ttft_target:
            break  # a higher rate only waits longer
        within.append(r)
    missed = len(within) < len(mine)
    return dict(
        system=label,
        capacity_rate=within[-1]["rate"] if within else 0.0,
        # no miss: the requests ran out before a queue could grow past the targets (a burst of
        # them held), so the capacity lies above the highest rate, unknown
        bounded=missed,
        requests_s_at_highest=mine[len(within) if missed else -1]["requests_s"],
        tbt_target_s=tbt_target,
        ttft_target_s=ttft_target,
        targets=f"p99 time between tokens <= {tbt_target} s, median time to first token "
        f"<= {ttft_target} s"
        + ("" if missed else f"; all held: give more --requests than {requests}"),
    )


def read_sweep(path, sweep, inputs):
    """The rows of a results file that a run adds to (bench_arrivals' add_to), checked to be of the
    same sweep (and, as any output, not an input nor a directory, in a place that can be written:
    console.check_output); a file not there yet starts one."""
    console.check_output("--add-to", path, inputs, replace=True)
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            held = json.load(f)
        runs = held["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(
            f"--add-to {path}: not a results file of bench arrivals --add-to; give another path"
        ) from None
    for key, mine in sweep.items():
        if held.get(key) != mine:
            raise ValueError(
                f"--add-to {path}: holds the {key} {held.get(key)!r}, this run has {mine!r}: one "
                f"file holds one sweep; give another path"
            )
    return runs


def kilo(n):
    """65536 -> '64K', 1000 -> '1000'."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def saturated_rate(arrivals, ends, batch):
    """Requests completed a second while the system was saturated, or None: from the first
    completion after the last arrival to the completion that leaves `batch` requests unfinished.
    In between every row is busy and a request waits, so no drain at the end and no filling at
    the start enters (requests_s counts both)."""
    ends = sorted(ends)
    if len(ends) <= batch:
        return None
    start = next((e for e in ends if e >= max(arrivals)), None)
    end = ends[len(ends) - batch - 1]
    done = sum(start < e <= end for e in ends) if start is not None else 0
    return round(done / (end - start), 4) if done >= 2 else None


def served_at_rate(serve_, reqs, n_layer, max_stall, tbt_target=0.2, batch=None):
    """One run of arriving requests: the spreads of times to first token and between tokens, output
    tokens/s, a step alone and beside a prefill (the speed it keeps), where the longest gaps between
    tokens come from (the slowest of each part of serving's loop, serve.serve's timings, and the
    turns over the target), the GPU and host peaks."""
    cuda = torch.cuda.is_available()
    step_budget = serve.Budget(n_layer, stall=max_stall)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    timings = {}
    with compiles() as compiled:
        serve_(reqs, step_budget, timings)
    wall = time.perf_counter() - t0
    total = max(r.arrival + r.t_end for r in reqs)  # on serving's clock, which skips idle time
    ttft = spread([r.t_first for r in reqs])
    tbt = spread([g for r in reqs for g in r.gaps()] or [0.0])
    row = {f"ttft_{k}_s": v for k, v in zip(("median", "p90", "p99", "max"), ttft)}
    row.update({f"tbt_{k}_s": v for k, v in zip(("median", "p90", "p99", "max"), tbt)})
    row["output_tokens_s"] = round(sum(len(r.out) for r in reqs) / total, 1)
    # requests completed a second over the span: what a system sustains where it was saturated
    row["requests_s"] = round(len(reqs) / total, 4)
    ends = [r.arrival + r.t_end for r in reqs]
    row["requests_s_saturated"] = batch and saturated_rate([r.arrival for r in reqs], ends, batch)
    row["ends_s"] = [round(e, 1) for e in sorted(ends)]
    alone, beside = step_budget.kept() or (float("nan"),) * 2
    row.update(step_alone_ms=round(1e3 * alone, 2), step_beside_ms=round(1e3 * beside, 2))
    row["speed_kept"] = round(alone / beside, 3)
    off = step_budget.off_prediction()
    row["beside_over_predicted"] = round(off, 3) if off else None
    fit = step_budget.fit() or {}  # what a turn beside the prefill added: fixed + per pass
    ms = lambda x: None if x is None else round(1e3 * x, 2)
    row.update(added_fixed_ms=ms(fit.get("fixed")), added_per_pass_ms=ms(fit.get("per_pass")))
    row.update(model_per_pass_ms=ms(step_budget.per))
    row.update(turns_at_one_pass=round(fit.get("at_one_pass", 0.0), 3))
    row.update(one_pass_over_stall=round(fit.get("one_pass_over_stall", 0.0), 3))
    # a gap between tokens is a turn and the parts of the loop between two turns
    for part in ("admit", "launch", "start", "end", "turn"):
        row[f"{part}_max_ms"] = ms(max(timings.get(part, [0.0])))
    row["turns_over_tbt"] = sum(dt > tbt_target for dt in timings.get("turn", []))
    row["launches_over_tbt"] = sum(dt > tbt_target for dt in timings.get("launch", []))
    row["compiles"] = len(compiled)  # the warm-up should have left none
    for what in compiled:
        print(f"compiled while serving: {what}", flush=True)
    row.update(total_s=seconds(total), wall_s=seconds(wall))
    row["gpu_peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
    row["host_peak_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)
    return row


@contextlib.contextmanager
def compiles():
    """What was compiled inside the block: a list, one line per torch.compile graph (Dynamo's count
    of graphs made) and per Triton kernel specialization (its JIT cache missed: a compile, or a read
    from the disk cache)."""
    import triton
    from torch._dynamo.utils import counters

    out, graphs = [], counters["stats"]["unique_graphs"]
    runtime = triton.knobs.runtime
    hook = runtime.jit_cache_hook

    def missed(*a, **kw):  # called before Triton compiles a specialization; None: go on
        out.append(f"triton {kw.get('repr', '?')}")
        return hook(*a, **kw) if hook else None

    runtime.jit_cache_hook = missed
    try:
        yield out
    finally:
        runtime.jit_cache_hook = hook
        out.extend(["torch.compile graph"] * (counters["stats"]["unique_graphs"] - graphs))


def flags(p):
    p.add_argument(
        "--shape", choices=sorted(bench.SHAPES), help="model shape (default: %(default)s)"
    )
    p.add_argument(
        "--rates",
        type=bench.positive_floats,
        help="requests arriving at these rates a second (Poisson, seeded), one run each, e.g. "
        "0.05,0.1,0.2 (default: %(default)s)",
    )
    p.add_argument(
        "--prompt-lens",
        type=bench.length_range,
        help="prompt lengths drawn from LO:HI (default: %(default)s)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=bench.length_range,
        help="new tokens a request drawn from LO:HI (default: %(default)s)",
    )
    p.add_argument(
        "--lengths",
        metavar="FILE.jsonl",
        help='lengths from lines {"prompt_len": P, "new_tokens": G} in place of the ranges',
    )
    p.add_argument("--requests", type=bench.at_least_one, help="how many (default: %(default)s)")
    bench.add_budgets(p)
    bench.add_systems(p, bench.SYSTEMS)
    p.add_argument(
        "--tbt-target", type=bench.seconds, help="p99 time between tokens, s (default: %(default)s)"
    )
    p.add_argument(
        "--ttft-target",
        type=bench.seconds,
        help="median time to first token, s (default: %(default)s)",
    )
    p.add_argument(
        "--max-stall",
        type=bench.finite("a finite number, at least 1 (e.g. 2)", least=1.0, strict=False),
        help="a step beside a prefill takes at most this many times a step alone; more gives the "
        "prefills more of the GPU (default: %(default)s, keeping half a step's speed)",
    )
    p.add_argument(
        "--add-to",
        metavar="FILE.json",
        help="join the rows to this results file of the same sweep (workload, targets, GPU; made "
        "if not there), the capacities taken over all its rows: a sweep over several calls",
    )


COMMANDS = {"arrivals": (bench_arrivals, flags)}
