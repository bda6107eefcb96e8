"""Whole requests at a GPU memory budget: N prompts of P tokens, G new tokens each, every system at
the largest batch the memory model (memory.plan_memory) gives it, in static batches (a batch is
prefilled one prompt at a time, then decodes; the next batch waits). Reported per system: time to
first token, prefill and decode speed, the whole run's time and its output tokens/s.

What is timed, on random weights: one P-token prefill through prefill.prefill at the chunk the plan
chooses (after an untimed one, which compiles the kernels), with the decode cache of the whole batch
allocated beside it (its peak memory beyond the weights and the cache is reported), and graphed
decode steps of the whole batch at context P (the other rows filled with random K, V and c), and
of the last, smaller batch where N is not a multiple of the batch. The N requests are then composed
from those times: every prefill of a shape costs the same, and a step at context P is no slower
than the steps after it for the sparse systems and faster for full attention, whose reads grow with
the context, so the composition favours the baseline.

`bench served` (bench_served) runs the N requests for real, served by continuous batching
(serve.py).
"""

import resource
import statistics
import time

import torch

import bench
import memory
import offload
import serve
from bench import SHAPES, SYSTEMS
from bench.throughput import fill_random
from config import Config
from prefill import prefill


def largest_plan(cfg, weights, requests, prompt_len, max_len, dtype, *, budgets, use_offload,
                 served=False):  # fmt: skip
    """The largest batch up to `requests` that plan_memory accepts, its chunk and stream_on_host."""
    plan = lambda Bz: memory.plan_memory(
        cfg, weights, Bz, prompt_len, max_len, dtype, gpu_budget=budgets[0],
        host_budget=budgets[1] if use_offload else None, offload=use_offload, served=served,
    )  # fmt: skip

    def fits(Bz):
        try:
            return bool(plan(Bz))
        except MemoryError:
            return False

    Bz = memory.largest(fits, requests)
    pl = plan(Bz) if Bz else None
    return (Bz, pl.chunk, pl.on_host) if pl else (0, None, False)


def system(name, shape, max_len, requests, prompt_len, budgets, *, served=False):
    """One system of SYSTEMS at the largest batch its memory plan accepts: a random model of the
    shape (its small operations compiled for prefill and decode on a GPU) and (label, use_offload,
    batch, chunk, stream_on_host). budgets: GPU and host bytes."""
    from fast import compile_model
    from model import random_model

    label, attn, use_offload = SYSTEMS[name]
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    preset, over = SHAPES[shape]
    model = random_model(
        Config.from_preset(preset, **over, attn=attn, max_seq_len=max_len), dev, dtype
    )
    if cuda:  # every system prefills and decodes with its small operations compiled
        compile_model(model, prefill=True)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    Bz, chunk, on_host = largest_plan(
        model.cfg, weights, requests, prompt_len, max_len, dtype, budgets=budgets,
        use_offload=use_offload, served=served,
    )  # fmt: skip
    return model, (label, use_offload, Bz, chunk, on_host)


def budgets(gpu_budget, host_budget):
    """The budgets in bytes, the host's what is available where not given."""
    return gpu_budget * 2**30, host_budget * 2**30 if host_budget else memory.host_bytes_available()


def seconds(t):
    """Seconds to 4 significant figures: a tiny model's prefill on a GPU takes milliseconds."""
    return float(f"{t:.4g}")


def compose(N, Bz, G, t_prefill, t_step, t_step_last=None):
    """Static batches of Bz: (times to first token of the N requests, total seconds). t_step_last: the
    step of the last batch where it is smaller (N % Bz sequences), else t_step."""
    ttft, t = [], 0.0
    for first in range(0, N, Bz):
        n = min(Bz, N - first)
        ttft += [t + (i + 1) * t_prefill for i in range(n)]
        t += n * t_prefill + (G - 1) * (t_step if n == Bz or t_step_last is None else t_step_last)
    return ttft, t


@torch.no_grad()
def bench_requests(
    shape="8b", prompt_len=131072, *, max_new_tokens=(1024, 8192), requests=28, gpu_budget=24.0,
    host_budget=None, systems=("nosa-offload", "full", "infllmv2-offload"), steps=48,
):  # fmt: skip
    """Whole requests at a GPU memory budget, static batches composed from timed parts (the module's
    docstring): per system and G, time to first token, the whole time and output tokens/s."""
    bench.check_decode_run(shape, gpu_budget)
    max_len, rows = prompt_len + max(max_new_tokens), []
    gpu, host = budgets(gpu_budget, host_budget)
    for name in systems:
        model, (label, use_offload, Bz, chunk, on_host) = system(
            name, shape, max_len, requests, prompt_len, (gpu, host)
        )
        cfg, dtype = model.cfg, model.embed_tokens.weight.dtype
        row = dict(system=label, shape=shape, prompt_len=prompt_len, batch=Bz, chunk=chunk)
        row["stream_on_host"] = on_host
        rows.append(row)
        tight = (
            use_offload
            and Bz
            and memory.host_warning(memory.cache_bytes(cfg, Bz, max_len, dtype)[1])
        )
        if tight:
            print(tight, flush=True)
        if Bz:
            row.update(
                static_parts(
                    model,
                    row,
                    use_offload=use_offload,
                    requests=requests,
                    prompt_len=prompt_len,
                    max_len=max_len,
                    steps=steps,
                    host=host,
                )
            )
        times = row.pop("_t", None)
        for G in max_new_tokens if Bz else ():
            ttft, total = compose(requests, Bz, G, *times)
            row[f"G{G}"] = dict(
                ttft_median_s=seconds(statistics.median(ttft)),
                ttft_max_s=seconds(max(ttft)),
                total_s=seconds(total),
                output_tokens_s=round(requests * G / total, 1),
            )
        print(row, flush=True)
        del model
        bench.free(torch.cuda.is_available())
    return vs_full(rows, max_new_tokens)


def static_parts(model, row, *, use_offload, requests, prompt_len, max_len, steps, host):
    """The timed parts of the static schedule: one P-token prefill at the plan's chunk (after an
    untimed one, which compiles every kernel the timed one launches: the selection kernel once per
    power of two of the block count, which grows with the prompt), with the batch's decode cache
    beside it; graphed steps of the whole batch at context P (the other rows filled with random K,
    V and c), and of the last, smaller batch where N is not a multiple of the batch."""
    from fast import GraphedDecode

    cfg, w, Bz = model.cfg, model.embed_tokens.weight, row["batch"]
    dev, dtype, cuda = w.device, w.dtype, w.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    new_cache = lambda n: offload.make_cache(
        cfg, n, dev, dtype, max_len, offload=use_offload, host_budget=host
    )
    cache, chunk, on_host = new_cache(Bz), row["chunk"], row["stream_on_host"]
    idx = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=dev)
    prefill(model, idx, cache, 0, chunk, stream_on_host=on_host)
    sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    prefill(model, idx, cache, 0, chunk, stream_on_host=on_host)
    sync()
    t_prefill = time.perf_counter() - t0
    prefill_peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    if Bz > 1:  # the other rows: random prompts of the same length, as if prefilled
        fill_random(cache, cfg, Bz, prompt_len, dev, dtype, first=1)
    t_step = timed_steps(GraphedDecode(model, cache), Bz, cfg, steps, dev, sync)
    out = dict(
        ttft_one_s=seconds(t_prefill),
        prefill_tokens_s=round(prompt_len / t_prefill),
        decode_tokens_s=round(Bz / t_step, 1),
        step_ms=round(t_step * 1e3, 2),
        prefill_gb_beyond=round(prefill_peak / 2**30, 2),
        modelled_gb=round(memory.prefill_bytes(cfg, prompt_len, chunk, dtype, on_host) / 2**30, 2),
        gpu_peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        _t=[t_prefill, t_step, None],  # for compose
    )
    last = requests % Bz if requests > Bz else 0  # the last batch's sequences, where it is smaller
    if last:  # its own step, on a cache of that many rows
        del cache
        bench.free(cuda)
        cache = new_cache(last)
        fill_random(cache, cfg, last, prompt_len, dev, dtype)
        t_last = timed_steps(GraphedDecode(model, cache), last, cfg, steps, dev, sync)
        out.update(last_batch=last, last_step_ms=round(t_last * 1e3, 2))
        out["_t"][2] = t_last
    return out


def vs_full(rows, new_tokens):
    """Each row's total against full attention's, per G (in place); returns the rows."""
    for G in new_tokens:
        done = [r for r in rows if f"G{G}" in r]
        base = next((r[f"G{G}"]["total_s"] for r in done if r["system"].startswith("full")), None)
        for r in done:
            if base:
                r[f"G{G}"]["vs_full"] = round(base / r[f"G{G}"]["total_s"], 2)
    return rows


def timed_steps(step, Bz, cfg, steps, dev, sync):
    """Seconds per graphed decode step of Bz sequences (after 8 untimed ones: the first gather whole
    selections, compile and capture)."""
    tok = torch.randint(0, cfg.vocab_size, (Bz,), device=dev)
    for _ in range(8):
        tok = step(tok).argmax(-1)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = step(tok).argmax(-1)
    sync()
    return (time.perf_counter() - t0) / steps


@torch.no_grad()
def bench_served(
    shape="8b", prompt_len=131072, *, max_new_tokens=(1024,), requests=28, gpu_budget=24.0,
    host_budget=None, systems=("nosa-offload", "full"), steps=48,
):  # fmt: skip
    """The N requests served for real (serve.serve: continuous batching), every system through the
    same scheduler at its largest batch, random weights and random prompts, greedy. Per system and
    G: time to first token (median, p90, max), output tokens/s, the whole time, GPU and host memory
    peaks; and, on a full batch at context P, decode steps alone against steps while a P-token
    prompt prefills beside them (its prefill time then, against alone). Beside each total, the
    static schedule's composed from this run's prefill and steps (bench_requests' composition; the
    last, smaller batch's step runs with the other rows parked)."""
    from fast import GraphedDecode

    bench.check_decode_run(shape, gpu_budget)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    max_len, rows = prompt_len + max(max_new_tokens), []
    gpu, host = budgets(gpu_budget, host_budget)
    for name in systems:
        model, (label, use_offload, Bz, chunk, on_host) = system(
            name, shape, max_len, requests, prompt_len, (gpu, host), served=True
        )
        cfg, w = model.cfg, model.embed_tokens.weight
        dev, dtype = w.device, w.dtype
        row = dict(system=label, shape=shape, prompt_len=prompt_len, batch=Bz, chunk=chunk)
        rows.append(row)
        if Bz == 0:
            print(row, flush=True)
            continue
        micro = 2 if use_offload and Bz >= 16 else 1
        cache = offload.make_cache(
            cfg, Bz, dev, dtype, max_len, offload=use_offload, host_budget=host
        )
        prompt = lambda: torch.randint(0, cfg.vocab_size, (prompt_len,)).tolist()
        for i, G in enumerate((8,) + tuple(max_new_tokens)):  # 0: compiles what the others launch
            reqs = [serve.Request(prompt(), G) for _ in range(requests if i else 1)]
            figures = served_once(
                model, reqs, cache, GraphedDecode(model, cache, micro), chunk, on_host
            )
            if i:
                row[f"G{G}"] = figures
        fill_random(cache, cfg, Bz, prompt_len, dev, dtype)
        cache.set_active(slice(None), True)  # serve left the rows parked
        decode = GraphedDecode(model, cache, micro)
        row.update(
            beside_prefill(
                model, cache, decode, prompt(), chunk=chunk, on_host=on_host, steps=steps, sync=sync
            )
        )
        last = requests % Bz if requests > Bz else 0  # the static schedule's smaller last batch
        for seq in range(last, Bz if last else 0):
            serve.Parked(cache, seq)
        t_last = last and timed_steps(decode, Bz, cfg, steps, dev, sync)
        for G in max_new_tokens:  # static batches composed from this run's prefill and steps
            times = row["prefill_alone_s"], row["step_alone_ms"] / 1e3, t_last or None
            row[f"G{G}"]["static_composed_s"] = seconds(compose(requests, Bz, G, *times)[1])
        row["host_peak_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)
        print(row, flush=True)
        del cache, model, decode  # (the graph holds both)
        bench.free(cuda)
    return vs_full(rows, max_new_tokens)


def served_once(model, reqs, cache, decode, chunk, on_host):
    """reqs served greedily (serve.serve); the whole time, output tokens/s, times to first token and
    the GPU's peak memory."""
    cuda = cache.len.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    pick = lambda logits: logits.argmax(-1)
    serve.serve(model, reqs, cache, pick, chunk=chunk, on_host=on_host, decode=decode)
    total, ttft = time.perf_counter() - t0, sorted(r.t_first for r in reqs)
    return dict(
        total_s=seconds(total),
        output_tokens_s=round(sum(len(r.out) for r in reqs) / total, 1),
        ttft_median_s=seconds(statistics.median(ttft)),
        ttft_p90_s=seconds(ttft[(9 * len(ttft)) // 10]),
        ttft_max_s=seconds(ttft[-1]),
        gpu_peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    )


def beside_prefill(model, cache, decode, ids, *, chunk, on_host, steps, sync):
    """Decode steps of the batch (row 0 parked for a new prompt) alone, and a prompt's prefill into
    row 0 on serve.py's streams alone, then both side by side: each one's time there against alone.
    Row 0 decodes the prompt afterwards."""
    cuda, Bz, dev = cache.len.is_cuda, len(cache.len), cache.len.device
    with torch.cuda.stream(torch.cuda.Stream(priority=-1) if cuda else None):
        serve.Parked(cache, 0)
        t_step = timed_steps(decode, Bz, model.cfg, steps, dev, sync)
        tok, times = torch.zeros(Bz, dtype=torch.long, device=dev), []
        for beside in (False, True):
            side = torch.cuda.Stream() if cuda else None
            pre = serve.Prefill(model, serve.Request(ids, 1), 0, cache, side, chunk, on_host)
            t0, n = time.perf_counter(), 0
            while not pre.done():
                if beside:
                    tok = decode(tok).argmax(-1)
                ran = pre.launch(model.cfg.n_layer)  # as serve.serve, at its default
                if beside:
                    if ran is not None:  # the next step after them
                        torch.cuda.current_stream().wait_event(ran)
                    tok.tolist()  # the step's tokens to the host, as serve's
                    n += 1
            times.append(time.perf_counter() - t0)
    pre.parked.start()  # row 0 decodes the prompt from here on
    return dict(
        step_alone_ms=round(t_step * 1e3, 2),
        step_beside_prefill_ms=round(times[1] / n * 1e3, 2),
        decode_kept=round(t_step * n / times[1], 2),
        prefill_alone_s=seconds(times[0]),
        prefill_beside_decode_s=seconds(times[1]),
    )


def flags(p):
    bench.add_shape(p)
    p.add_argument(
        "--max-new-tokens",
        type=bench.positive_ints,
        help="tokens generated a request, one run each, e.g. 1024,8192 (default: %(default)s)",
    )
    p.add_argument("--requests", type=bench.at_least_one, help="how many (default: %(default)s)")
    bench.add_budgets(p)
    bench.add_systems(p, SYSTEMS)
    p.add_argument(
        "--steps", type=bench.at_least_one, help="timed decode steps (default: %(default)s)"
    )


COMMANDS = {"requests": (bench_requests, flags), "served": (bench_served, flags)}
