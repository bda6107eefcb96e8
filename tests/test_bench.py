"""The speed benchmarks and the bench command line on CPU (random weights, small sizes): throughput's
memory model, the locality bound in the measured hit rate and the rows it reports, whole requests,
the overlap's timeline split, tensor parallelism, the flags' one-line errors and the documents'
commands. Speed is measured on the GPU, not here."""

import os

import pytest
import torch

from bench.throughput import PHASES, bench_throughput
from config import Config
from tests.conftest import processes_env


@pytest.mark.slow
def test_throughput_bench_small():
    """On CPU, or on a GPU, with a budget small enough that the caches, not the batch cap, set the
    batch (on a GPU it also holds the weights and the measured activations)."""
    gpu_budget = 0.25 if torch.cuda.is_available() else 0.02
    rows = bench_throughput(
        shape="tiny",
        prompt_len=512,
        gpu_budget=gpu_budget,
        steps=4,
        warmup=1,
        eager_steps=2,
        max_batch=4096,
    )
    by = {r["system"]: r for r in rows}
    assert set(by) == {
        "full, resident cache",
        "infllmv2 + offload",
        "nosa + offload",
        "nosa, resident cache",
    }
    # offload fits more sequences
    assert by["nosa + offload"]["batch"] > by["nosa, resident cache"]["batch"] > 0
    cfg = Config.from_preset("tiny")
    # the theorem: the k_e query-agnostic blocks of the k - 1 selected non-tail blocks are resident
    assert (
        by["nosa + offload"]["hit_rate"]
        >= by["nosa + offload"]["hit_rate_bound"]
        == round(cfg.k_e / (cfg.k - 1), 3)
    )
    nosa = by["nosa + offload"]
    # K and V of one block
    unit_mb = 2 * cfg.B * cfg.head_dim * (2 if torch.cuda.is_available() else 4) / 1e6
    # at most k_q - 1 new blocks per (sequence, layer, KV head) and step
    assert (
        0
        < nosa["mb_per_step"]
        <= round((cfg.k_q - 1) * nosa["batch"] * cfg.n_layer * cfg.H_kv * unit_mb, 2)
    )
    for r in rows:
        # both are rounded (tokens/s to 0.1, the step to 0.01 ms): a slow CPU gives a few tokens/s
        assert r["tokens_s"] == pytest.approx(r["batch"] / r["step_ms"] * 1e3, rel=0.01, abs=0.05)
        assert (
            all(r[f"{p}_ms"] >= 0 for p in PHASES) and r["weights_ms"] > 0 and r["attention_ms"] > 0
        )
    assert (
        by["full, resident cache"]["selection_ms"] == by["full, resident cache"]["transfer_ms"] == 0
    )
    assert by["nosa + offload"]["transfer_ms"] > 0 and by["nosa + offload"]["mb_per_step"] > 0


@pytest.mark.slow
def test_requests_bench_small():
    """python -m bench requests, tiny shape (in fp32 on CPU, bf16 on a GPU): each system's batch comes from
    the memory plan, the composition of static batches adds up, and offloading fits more sequences than full
    attention."""
    from bench.requests import bench_requests, compose

    ttft, total = compose(5, 2, 10, 1.0, 0.1)
    assert ttft == [1.0, 2.0, 3.9, 4.9, 6.8] and total == pytest.approx(5 * 1.0 + 3 * 9 * 0.1)
    ttft, total = compose(5, 2, 10, 1.0, 0.1, 0.05)  # the last batch, of one, steps faster
    assert ttft == [1.0, 2.0, 3.9, 4.9, 6.8] and total == pytest.approx(
        5 * 1.0 + 2 * 9 * 0.1 + 9 * 0.05
    )
    import memory

    cfg, P, G = Config.from_preset("tiny", attn="full"), 600, 16
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # what the bench runs in
    weights = dtype.itemsize * sum(
        p.numel() for p in __import__("model").Transformer(cfg).parameters()
    )
    need = lambda n: (
        weights
        + memory.cache_bytes(cfg, n, P + G, dtype, False)[0]
        + max(memory.decode_bytes(cfg, n, P + G, dtype), memory.prefill_bytes(cfg, P, 512, dtype))
    )
    budget = (need(2) + need(3)) / 2 / 2**30  # full attention fits 2 sequences
    rows = bench_requests(
        shape="tiny",
        prompt_len=P,
        max_new_tokens=(G,),
        requests=5,
        gpu_budget=budget,
        steps=2,
        systems=("nosa-offload", "full"),
    )
    by = {r["system"]: r for r in rows}
    assert by["nosa + offload"]["batch"] > by["full, resident cache"]["batch"] == 2
    for r in rows:
        assert r["G16"]["total_s"] > 0 and r["decode_tokens_s"] > 0 and r["ttft_one_s"] > 0
        # a smaller last batch: its own step
        assert ("last_batch" in r) == (5 % r["batch"] > 0 and r["batch"] < 5)
        if "last_batch" in r:
            assert r["last_batch"] == 5 % r["batch"] and r["last_step_ms"] > 0
    assert by["full, resident cache"]["G16"]["vs_full"] == 1.0


def test_distances_flag():
    """python -m bench recall --distances: comma-separated positive bins, anything else refused by argparse."""
    import argparse

    from bench import positive_ints

    assert positive_ints("128,256,4000") == (128, 256, 4000)
    for bad in ("x", "0,5", "", "128,"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive whole numbers"):
            positive_ints(bad)


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["throughput", "--micro-batches", "abc"], "positive whole numbers"),
        (["requests", "--max-new-tokens", "x"], "positive whole numbers"),
        (["throughput", "--systems", "bogus"], "--systems: bogus: choose among"),
        (["quality", "--systems", "nosa,sliding"], "--systems: sliding: choose among"),
        (["eviction", "--json", "MISSING/x.json"], "x.json: cannot write"),
        (["eviction", "--set", "k"], "--set: write FIELD=VALUE"),
        (["throughput", "--max-batch", "0"], "--max-batch: '0': give a whole number, at least 1"),
        (["recall", "--cases", "0"], "--cases: '0': give a whole number, at least 1"),
        (["pretrained", "--checkpoint", "x", "--windows", "1"], "--windows: '1': at least 2"),
        (["throughput", "--gpu-budget", "nan"], "--gpu-budget: 'nan': give a positive, finite"),
        (["requests", "--host-budget", "inf"], "--host-budget: 'inf': give a positive, finite"),
        (["quality", "--max-new-tokens", "-5"], "--max-new-tokens: '-5': give a whole number"),
        (["throughput", "--prompt-len", "0"], "--prompt-len: '0'"),
        (["arrivals", "--prompt-lens", "9:3"], "--prompt-lens: '9:3': give LO:HI"),
        (
            ["arrivals", "--max-stall", "0.5"],
            "--max-stall: '0.5': give a finite number, at least 1",
        ),
        (["throughput", "--shape", "8b", "--gpu-budget", "1"], "its weights take"),
        (["requests", "--shape", "8b", "--gpu-budget", "0.5"], "its weights take"),
        (["throughput", "--json", "DIR", "--gpu-budget", "0.02"], "is a directory"),
        # a flag the benchmark does not read, and the old flat parser's flags
        (["eviction", "--shape", "8b"], "unrecognized arguments: --shape 8b"),
        (["requests", "--served"], "unrecognized arguments: --served"),
        (["gather", "--steps", "3"], "unrecognized arguments: --steps 3"),
        (["throughput", "--budget-gb", "3"], "unrecognized arguments: --budget-gb 3"),
        (["decode", "--tp", "2"], "unrecognized arguments: --tp 2"),
        (["nonesuch"], "invalid choice: 'nonesuch'"),
    ]
    + (
        [(["throughput"], "on a CPU"), (["overlap"], "measures the GPU machine")]
        if not torch.cuda.is_available()
        else []
    ),
)
def test_bench_arguments_fail_in_one_line_before_any_work(argv, msg, capsys, monkeypatch, tmp_path):
    """python -m bench: a bad number, system or output path, and a CPU asked for a GPU-sized run,
    stop before any work with an error that says what to give: one line, or argparse's usage and
    its line."""
    import bench.__main__ as cli
    from bench import eviction, requests, throughput

    for m, name in ((eviction, "bench_eviction"), (throughput, "random_model")):
        monkeypatch.setattr(m, name, lambda *a, **k: pytest.fail("work started"))
    monkeypatch.setattr(requests, "system", lambda *a, **k: pytest.fail("work started"))
    argv = [a.replace("MISSING", str(tmp_path / "missing")) for a in argv]
    with pytest.raises(SystemExit) as e:
        cli.cli([str(tmp_path) if a == "DIR" else a for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err.splitlines()[-1], err
    assert err.startswith("usage:") or (err.startswith("error: ") and err.count("\n") == 1), err


def test_bench_plot_without_matplotlib_says_how_to_get_it(monkeypatch, capsys):
    import builtins

    import bench.__main__ as cli

    real = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit):
        cli.cli(["plot"])
    assert (
        capsys.readouterr().err
        == "error: bench plot draws with matplotlib: pip install matplotlib\n"
    )


@pytest.mark.slow
def test_throughput_bench_with_tensor_parallelism_small():
    """python -m bench throughput --tp 2 starts itself in two processes (torchrun; gloo on CPU),
    each with half the KV heads, and the first prints the rows."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "bench", "throughput", "--shape", "tiny", "--tp", "2"]
    cmd += ["--gpu-budget", "0.02", "--steps", "4", "--systems", "nosa-offload"]
    r = subprocess.run(
        cmd, cwd=root, capture_output=True, text=True, timeout=300, env=processes_env(2)
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [
        line for line in r.stdout.splitlines() if line.startswith("{'system': 'nosa + offload'")
    ]
    assert len(rows) == 1 and "'tp': 2" in rows[0] and "'batch': 0" not in rows[0]


def test_the_overlap_split_of_a_timeline_against_a_slow_reference():
    """bench overlap's split of a trace (the gathers against the rest, the first step left out):
    random kernels on two streams, 3 gathers a step, against a count of ticks."""
    from bench.overlap import split_timeline

    g = torch.Generator().manual_seed(0)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    for _ in range(20):
        kernels, G = [], 3
        for stream, n in (("gather_units_kernel", G * draw(2, 5)), ("other", draw(1, 20))):
            t = 0
            for _ in range(n):
                t += draw(0, 30)
                d = draw(1, 40)
                kernels.append((stream, t, t + d))
                t += d
        ends = sorted(b for n, a, b in kernels if n.startswith("gather"))
        steps = len(ends) // G - 1
        lo, hi = ends[G - 1], ends[-1]
        ticks = [{n for n, a, b in kernels if a <= t < b} for t in range(lo, hi)]
        is_g = lambda names: any("gather_units" in n for n in names)
        is_r = lambda names: any("gather_units" not in n for n in names)
        want = dict(
            step_ms=hi - lo,
            gather_ms=sum(map(is_g, ticks)),
            rest_ms=sum(map(is_r, ticks)),
            overlap_ms=sum(is_g(s) and is_r(s) for s in ticks),
            idle_ms=sum(not s for s in ticks),
            pcie_idle_ms=sum(not is_g(s) for s in ticks),
        )
        want = {k: round(v / steps, 2) for k, v in want.items()}
        got = split_timeline([(n, a * 1000, b * 1000) for n, a, b in kernels], G)  # a tick: 1 ms
        assert got == want, (got, want)


def test_the_overlap_kernel_table_sums_each_kernel_a_step():
    """bench overlap --kernels: the kernels by their time a step, names cut at '(' (one kernel's
    instances of several signatures count together), the largest first."""
    from bench.overlap import by_kernel

    trace = [("mm(a)", 0, 3000), ("mm(b)", 5000, 6000), ("top_k", 3000, 3500), ("gather", 0, 500)]
    trace += [("gather", 600, 1100), ("top_k", 7000, 7100)]
    assert by_kernel(trace, 2, 2) == [(2.0, 1.0, "mm"), (0.5, 1.0, "gather")]
    assert by_kernel(trace, 1, 9)[-1] == (0.6, 2.0, "top_k")


def test_every_bench_command_in_the_documents_parses():
    """Each `python -m bench ...` line of README.md, BENCHMARKS.md and bench/__init__.py names a
    benchmark and flags it reads (the parser refuses any other), with the shell variables the
    document sets before it (A="..."): the documents' commands still run."""
    import re
    import shlex

    from bench.__main__ import parser

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = 0
    for name in ("README.md", "BENCHMARKS.md", os.path.join("bench", "__init__.py")):
        text = open(os.path.join(root, name)).read().replace("\\\n", " ")
        env = {}
        for line in text.splitlines():
            if m := re.fullmatch(r'([A-Z]\w*)="([^"]*)"', line.strip()):
                env[m[1]] = m[2]
            line = re.sub(r"\$([A-Z]\w*)", lambda m: env.get(m[1], m[0]), line)
            for cmd in line.split("&&"):
                if "python -m bench " not in cmd or "`python -m bench" in cmd:
                    continue  # (a command quoted inside prose is a name, not a run)
                cmd = re.sub(r"\[[^]]*\]", "", cmd)  # [--json out.json]: optional
                parser().parse_args(shlex.split(cmd.split("python -m bench ", 1)[1].split("#")[0]))
                found += 1
    assert found >= 20
