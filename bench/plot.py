"""python -m bench plot: the figures of BENCHMARKS.md, drawn from the benchmarks' JSON rows in
bench/results/ (written with --json) into docs/figures/. Needs matplotlib (not a requirement of the
rest of the project)."""

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS, FIGURES = os.path.join(ROOT, "bench", "results"), os.path.join(ROOT, "docs", "figures")


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def plot_prefill(plt):
    """One layer's forward (and forward + backward) against dense SDPA, by sequence length."""
    rows = load("prefill.json")
    nosa = [r for r in rows if r.get("mode", "nosa") == "nosa"]
    T = [r["T"] // 1024 for r in nosa]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(T, [r["sdpa_fwd_ms"] for r in nosa], "o-", label="dense SDPA (at its best), forward")
    ax.plot(T, [r["fa2_fwd_ms"] for r in nosa], "o:", label="FlashAttention-2, forward")
    ax.plot(T, [r["nosa_fwd_ms"] for r in nosa], "o-", label="nosa, forward")
    inf = [r for r in rows if r.get("mode") == "infllmv2"]
    if inf:
        ax.plot(
            [r["T"] // 1024 for r in inf],
            [r["nosa_fwd_ms"] for r in inf],
            "o:",
            label="infllmv2, forward",
        )
    fb = [r for r in nosa if "nosa_fwd_bwd_ms" in r]
    ax.plot(
        [r["T"] // 1024 for r in fb],
        [r["sdpa_fwd_bwd_ms"] for r in fb],
        "s--",
        label="dense SDPA, fwd + bwd",
    )
    ax.plot(
        [r["T"] // 1024 for r in fb],
        [r["nosa_fwd_bwd_ms"] for r in fb],
        "s--",
        label="nosa, fwd + bwd",
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length (K tokens)",
        ylabel="ms, one layer",
        title="Prefill attention, 32 q / 2 KV heads of 128, H200",
    )
    ax.set_xticks(T, [str(t) for t in T])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_requests(plt):
    """Whole requests: total time of 28 (8b) or 112 (1b) requests, prefill and decode, per system."""
    runs = [
        ("8b, 32K", "requests_8b_32k.json"),
        ("8b, 128K", "requests_8b_128k.json"),
        ("1b, 32K", "requests_1b_32k.json"),
        ("1b, 128K", "requests_1b_128k.json"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=False)
    for ax, G in zip(axes, ("G1024", "G8192")):
        labels, systems = [name for name, _ in runs], {}
        for i, (_, f) in enumerate(runs):
            for r in load(f):
                if G in r:
                    systems.setdefault(r["system"], {})[i] = r[G]["output_tokens_s"]
        width = 0.8 / len(systems)
        for j, (system, by_run) in enumerate(systems.items()):
            xs = [i + j * width for i in by_run]
            ax.bar(xs, list(by_run.values()), width, label=system)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))], labels)
        ax.set(ylabel="output tokens/s, prefill included", title=f"{G[1:]} new tokens per request")
    axes[0].legend(fontsize=8)
    fig.suptitle("Whole requests at a 24 GiB GPU budget (H200, random weights)")
    fig.tight_layout()
    return fig


def plot_arrivals(
    plt,
    names=(
        "arrivals_8b_128k_32.json",
        "arrivals_8b_128k_16.json",
        "arrivals_8b_128k.json",
        "arrivals_8b_32k.json",
    ),
):
    """Requests arriving over time (python -m bench arrivals ... --add-to): time to first token
    (median) and time between tokens (p99) against the request rate, per system, with the targets
    that define a capacity; a row of panels a workload (the files that exist of `names`)."""
    files = [n for n in names if os.path.exists(os.path.join(RESULTS, n))]
    fig, axes = plt.subplots(len(files), 2, figsize=(9, 3.4 * len(files)), squeeze=False)
    systems = sorted({r["system"] for n in files for r in load(n)["runs"]})  # a colour each
    for row, name in zip(axes, files):
        runs = load(name)
        served = [r for r in runs["runs"] if r["rate"]]
        for system in dict.fromkeys(r["system"] for r in served):
            rs = sorted((r for r in served if r["system"] == system), key=lambda r: r["rate"])
            color, label = f"C{systems.index(system)}", f"{system} (batch {rs[0]['batch']})"
            for ax, key in zip(row, ("ttft_median_s", "tbt_p99_s")):
                x, y = [r["rate"] for r in rs], [r[key] for r in rs]
                ax.plot(x, y, "o-", color=color, label=label)
        target = runs["capacity"][0] if runs["capacity"] else {}
        for ax, what, key in (
            (row[0], "time to first token, median", "ttft_target_s"),
            (row[1], "time between tokens, p99", "tbt_target_s"),
        ):
            if key in target:
                ax.axhline(
                    target[key], color="grey", linestyle=":", label=f"target {target[key]:g} s"
                )
            ax.set(xscale="log", yscale="log", xlabel="requests a second (Poisson)", ylabel="s")
            lo, hi = min(r["rate"] for r in served), max(r["rate"] for r in served)
            ticks = [t for t in (0.02, 0.05, 0.1, 0.2, 0.4, 1, 2, 4, 10) if lo <= t <= hi]
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
            ax.set_title(f"{runs.get('workload', name)}:\n{what}", fontsize=9)
            ax.legend(fontsize=7)
    first = load(files[0])
    device = ", ".join(first[k] for k in ("device", "date") if k in first) or "one GPU"
    fig.suptitle(f"Requests arriving over time, 24 GiB GPU budget ({device}, random weights)")
    fig.tight_layout()
    return fig


def plot_decode(plt):
    """Decode tokens/s at 128K and 24 GiB, each system at its largest batch."""
    rows = load("throughput_128k.json")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, shape in zip(axes, ("8b", "1b")):
        rs = [r for r in rows if r["shape"] == shape]
        ax.bar(
            range(len(rs)), [r["tokens_s"] for r in rs], color=["C0", "C1", "C2", "C3"][: len(rs)]
        )
        ax.set_xticks(
            range(len(rs)), [f"{r['system']}\nbatch {r['batch']}" for r in rs], fontsize=7
        )
        ax.set(ylabel="decode tokens/s", title=f"{shape} shape, 128K context")
    fig.suptitle(
        "Steady-state decode at a 24 GiB GPU budget (H200, cache filled without a prefill)"
    )
    fig.tight_layout()
    return fig


def plot_recall(plt):
    """Exact-match recall of the tasks against the distance from the fact, per system: every token
    weighing alike in training (left), the answers weighing more (middle), the tasks-first schedule
    against a fifth of tasks throughout (right)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), sharey=True)

    def named(file, names):
        return [
            dict(r, system=names[r["system"], r["training"]])
            for r in load(file)
            if (r["system"], r["training"]) in names
        ]

    for ax, rows, title in (
        (axes[0], load("recall.json"), "every token alike"),
        (axes[1], named("recall_weighted.json", WEIGHTED), "the answers weigh 100 (or 30)"),
        (axes[2], named("recall_staged_gpu.json", STAGED), "tasks first, then a fifth (x30)"),
    ):
        for system in dict.fromkeys(r["system"] for r in rows):
            rs = [r for r in rows if r["system"] == system]
            style = dict(
                color=COLOURS[system.split(",")[0]],
                ls="--" if "scratch" in system or "throughout" in system else "-",
                alpha=0.5 if "x30" in system or "seed 2" in system else 1.0,
            )
            ax.plot(
                [r["distance"] for r in rs],
                [100 * r["accuracy"] for r in rs],
                "o",
                label=system,
                **style,
            )
        ax.axvline(1024, color="grey", lw=0.8, ls=":")
        ax.text(1024, 100, " training length", fontsize=7, va="top")
        ds = sorted({r["distance"] for r in rows})
        ax.set(xscale="log", xlabel="distance from the fact to the question (tokens)", title=title)
        ax.set_xticks(ds, [str(d) for d in ds])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.legend(fontsize=7)
    axes[0].set_ylabel("exact match, %")
    fig.suptitle("Recall tasks, tiny models (200 cases per point)")
    fig.tight_layout()
    return fig


COLOURS = {"nosa": "C0", "full": "C1", "infllmv2": "C2", "dma": "C3", "full-as-infllmv2": "C4"}
WEIGHTED = {  # the curves of recall_weighted.json drawn, by (system, training)
    ("full", "from scratch, answers x100"): "full",
    ("infllmv2", "from scratch, answers x100"): "infllmv2",
    ("full-as-infllmv2", "full from scratch, answers x100 (a second run)"): "full-as-infllmv2",
    ("nosa", "recipe (full 1200, nosa 300), answers x100"): "nosa, recipe",
    ("nosa", "from scratch, answers x30, seed 2"): "nosa, from scratch, x30 (seed 2)",
    ("nosa", "from scratch, answers x100"): "nosa, from scratch",
}
STAGED = {  # the curves of recall_staged_gpu.json drawn, by (system, training)
    (
        "full",
        "staged: tasks only for 500 steps, then a fifth for 1000, seed 1, answers x30",
    ): "full, staged",
    (
        "full-as-infllmv2",
        "staged: tasks only for 500 steps, then a fifth for 1000, seed 1, answers x30",
    ): "full-as-infllmv2",
    (
        "nosa",
        "staged: tasks only for 500 steps, then a fifth for 1000, seed 1, answers x30",
    ): "nosa, staged",
    (
        "nosa",
        "staged: tasks only for 500 steps, then a fifth for 1000, seed 2, answers x30",
    ): "nosa, staged, seed 2",
    ("nosa", "a fifth of tasks for 1500 steps, seed 1, answers x30"): "nosa, a fifth throughout",
    (
        "nosa",
        "a fifth of tasks for 1500 steps, seed 2, answers x30",
    ): "nosa, a fifth throughout, seed 2",
}


def main():
    """BENCHMARKS.md's figures from bench/results/*.json, into docs/figures/."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ValueError("bench plot draws with matplotlib: pip install matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(FIGURES, exist_ok=True)
    rows = []
    for name, fn in (
        ("prefill", plot_prefill),
        ("requests", plot_requests),
        ("decode", plot_decode),
        ("recall", plot_recall),
        ("arrivals", plot_arrivals),
    ):
        if name == "arrivals" and not os.path.exists(
            os.path.join(RESULTS, "arrivals_8b_128k.json")
        ):
            continue  # not run yet (python -m bench arrivals ... --add-to it)
        path = os.path.join(FIGURES, f"{name}.png")
        fn(plt).savefig(path, dpi=110)
        rows.append(dict(figure=os.path.relpath(path, ROOT)))
    return rows


COMMANDS = {"plot": (main, lambda p: None)}
