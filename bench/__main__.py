"""python -m bench WHAT from the repository, or python PATH/TO/bench WHAT from anywhere: see bench/__init__.py."""

import argparse
import json
import math
import os
import subprocess
import sys

# the repository's modules
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import checkpoint  # noqa: E402
import common  # noqa: E402
from bench import arrivals, eviction, gather, kernels, plot, pretrained, quality, recall
from bench import requests as requests_
from bench import throughput as throughput_


def main(
    what,
    json_path=None,
    ckpts=os.path.join(checkpoint.ROOT, "out"),
    trained=False,
    checkpoint_dir=checkpoint.DEFAULT_CHECKPOINT,
    judge=None,
    gen_len=1024,
    systems=None,
    cases=200,
    distances=None,
    corpus=None,
    reference=None,
    sets=(),
    **throughput,
):
    check(what, json_path, systems, dict(throughput, cases=cases, gen_len=gen_len, trained=trained))
    if what == "pretrained" or throughput.get("rates"):  # several tables
        if what == "pretrained":
            tables = pretrained.bench_pretrained(checkpoint_dir, corpus=corpus, recall_n=cases)
        else:  # requests --served --rate: arriving over time
            keys = ("shape", "budget_gb", "host_gb", "requests", "rates", "prompt_lens")
            kw = {k: throughput[k] for k in keys} | dict(
                systems=systems or ("nosa-offload", "full")
            )
            for k in ("new_lens", "lengths", "tbt_target", "ttft_target"):
                kw[k.replace("new_lens", "new_tokens")] = throughput[k]
            tables = arrivals.bench_arrivals(**kw)
        for name, rows in tables.items():
            print(f"\n# {name}")
            print_table(rows)
        write_json(json_path, tables)
        return
    if what == "quality":
        rows = quality.bench_quality(ckpts, systems or tuple(quality.SYSTEMS), judge, gen_len)
    elif what == "eviction":
        from config import parse_overrides

        rows = eviction.bench_eviction(checkpoint_dir, reference, **parse_overrides(sets))
    elif what == "recall":
        systems = systems or tuple(quality.SYSTEMS)
        distances = distances or recall.DISTANCES
        rows = recall.bench_recall(ckpts, systems, distances, n=cases, json_path=json_path)
    elif what == "head":
        rows = recall.bench_head(checkpoint_dir)
    elif what == "plot":
        rows = plot.main()
    elif what == "requests":
        for k in ("rates", "prompt_lens", "new_lens", "lengths", "tbt_target", "ttft_target"):
            throughput.pop(k)
        served = throughput.pop("served")
        systems = systems or ("nosa-offload", "full") + ((), ("infllmv2-offload",))[not served]
        bench = requests_.bench_served if served else requests_.bench_requests
        rows = bench(**throughput, systems=systems)
    elif what == "throughput":
        systems = systems or throughput_.SYSTEMS
        rows = throughput_.bench_throughput(
            **throughput, systems=systems, ckpts=ckpts if trained else None
        )
    else:
        print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")
        benches = dict(
            gather=gather.bench_gather,
            prefill=kernels.bench_prefill,
            decode=kernels.bench_decode,
            sdpa=kernels.bench_sdpa,
        )
        rows = benches[what]()
    print_table(rows)  # first: a file that cannot be written loses nothing
    write_json(json_path, rows)
    if what in ("throughput", "requests") and rows and not any(r.get("batch") for r in rows):
        raise ValueError(
            f"bench {what}: --budget-gb {throughput['budget_gb']} fits no batch of any system; "
            f"give a larger budget or a smaller --prompt-len"
        )


def write_json(path, rows):
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    except OSError as e:
        raise OSError(
            f"--json {path}: could not write it ({e.strerror}); the rows are above"
        ) from None


def print_table(rows):
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))


def check(what, json_path, systems, throughput):
    """One line for arguments that cannot work, before any work."""
    if json_path:
        folder = os.path.dirname(os.path.abspath(json_path))
        if os.path.isdir(json_path):
            raise ValueError(f"--json {json_path} is a directory; give a file in it")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(
                f"--json {json_path}: cannot write there; give a path in a writable folder"
            )
    known = dict(
        quality=quality.SYSTEMS,
        recall=quality.SYSTEMS,
        requests=throughput_.SYSTEMS,
        throughput=throughput_.SYSTEMS,
    ).get(what, {})
    unknown = [s for s in systems or () if s not in known]
    if unknown:
        raise ValueError(
            f"--systems {unknown[0]}: choose among {', '.join(known) or 'none (bench ' + what + ' takes no systems)'}"
        )
    for name, flag in dict(budget_gb="--budget-gb", host_gb="--host-gb").items():
        value = throughput.get(name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} {value}: give a positive, finite number of GiB")
    flags = dict(
        batch_limit="--max-batch",
        cases="--cases",
        steps="--steps",
        requests="--requests",
        prompt_len="--prompt-len",
        gen_len="--gen-len",
    )
    for name, flag in flags.items():
        if throughput.get(name) is not None and throughput[name] < 1:
            raise ValueError(f"{flag} {throughput[name]}: must be at least 1")
    cuda = torch.cuda.is_available()
    if what in ("gather", "prefill", "decode", "sdpa") and not cuda:
        raise ValueError(f"bench {what} measures the GPU machine: no CUDA device here")
    if what in ("throughput", "requests") and not cuda and throughput["budget_gb"] > 1:
        raise ValueError(
            f"bench {what} on a CPU: the batch grows to --budget-gb "
            f"{throughput['budget_gb']}, more than a CPU decodes in time; give at most "
            f"1 (e.g. --budget-gb 0.02), or run it on a GPU"
        )
    if what in ("throughput", "requests") and not throughput.get("trained"):
        check_weights(throughput["shape"], throughput["budget_gb"], cuda)
    if what == "plot":
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            raise ValueError("bench plot draws with matplotlib: pip install matplotlib") from None


def check_weights(shape, budget_gb, cuda):
    """The shape's weights (bf16 on a GPU, fp32 on a CPU) fit the budget and, on a CPU, the memory
    there is: one line before a model is made."""
    from config import Config
    from memory import host_bytes_available
    from model import Transformer

    preset, over = throughput_.SHAPES[shape]
    with torch.device("meta"):
        n = sum(p.numel() for p in Transformer(Config.from_preset(preset, **over)).parameters())
    weights = n * (2 if cuda else 4) / 2**30
    room = budget_gb if cuda else min(budget_gb, host_bytes_available() / 2**30)
    if weights >= room:
        raise ValueError(
            f"--shape {shape}: its weights take {weights:.1f} GiB, more than the "
            f"{room:.1f} GiB there are (--budget-gb{'' if cuda else ', and this machine'}); "
            f"give a smaller shape or a larger budget"
        )


def positive_floats(text):
    """An argparse type: '0.05,0.1' -> (0.05, 0.1)."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers separated by commas")
    return values


def length_range(text):
    """An argparse type: '8192:131072' -> (8192, 131072)."""
    lo, _, hi = text.partition(":")
    try:
        r = (int(lo), int(hi or lo))
    except ValueError:
        r = (0, 0)
    if not 1 <= r[0] <= r[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: give LO:HI, whole numbers, 1 <= LO <= HI")
    return r


def positive_ints(text):
    """An argparse type: '128,256' -> (128, 256)."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give positive whole numbers separated by commas, e.g. 128,256"
        )
    return values


def cli(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description="NOSA / NOSI benchmarks (GPU)")
    p.add_argument(
        "what",
        choices=[
            "gather",
            "prefill",
            "decode",
            "sdpa",
            "quality",
            "eviction",
            "throughput",
            "requests",
            "plot",
            "recall",
            "head",
            "pretrained",
        ],
        help="which benchmark",
    )
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument(
        "--ckpts",
        default=os.path.join(checkpoint.ROOT, "out"),
        help="quality, throughput --trained: where train.py wrote tiny-nosa/, tiny-full/, ... "
        "(default: out/)",
    )
    p.add_argument(
        "--checkpoint",
        default=checkpoint.DEFAULT_CHECKPOINT,
        help="eviction, head: the model to diagnose (default: the embedded one); pretrained: the "
        "imported dense model DIR, continued by train.py into DIR-full, DIR-infllmv2, DIR-nosa",
    )
    p.add_argument(
        "--reference",
        metavar="CKPT",
        help="eviction: the model whose dense attention measures the selections (default: the "
        "checkpoint's own), e.g. the dense model a NOSA model was continued from",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="eviction: a selection field to read the checkpoint at, e.g. --set k=16",
    )
    p.add_argument(
        "--corpus",
        help="pretrained: the id of the corpus the models were trained on (train_state.json's; "
        "default: the standard library here), whose held-out files are read from data/",
    )
    p.add_argument(
        "--shape",
        default="tiny",
        choices=sorted(throughput_.SHAPES),
        help="throughput: model shape",
    )
    p.add_argument(
        "--prompt-len", type=int, default=4096, help="throughput: context before decoding"
    )
    p.add_argument("--budget-gb", type=float, default=24.0, help="throughput: GPU memory budget")
    p.add_argument("--steps", type=int, default=256, help="throughput: timed decode steps")
    p.add_argument(
        "--host-gb", type=float, help="throughput: host memory budget (default: what is available)"
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=256,
        help="throughput: no system runs a larger batch than this (e.g. 1: every system at batch 1)",
    )
    p.add_argument(
        "--micro-batches",
        type=positive_ints,
        default=(2,),
        help="throughput: offloading systems once per count, e.g. 1,2 (parts decoded side by side)",
    )
    p.add_argument(
        "--trained",
        action="store_true",
        help="throughput: the trained models in --ckpts, real prompts",
    )
    p.add_argument(
        "--systems",
        help=f"throughput: some of {','.join(throughput_.SYSTEMS)} (default: all); "
        f"quality: some of {','.join(quality.SYSTEMS)} (default: all)",
    )
    p.add_argument(
        "--new-tokens",
        type=positive_ints,
        default=(1024, 8192),
        help="requests: tokens generated per request, e.g. 1024,8192",
    )
    p.add_argument("--requests", type=int, default=28, help="requests: how many")
    p.add_argument(
        "--served",
        action="store_true",
        help="requests: serve them for real, by continuous batching (default: static batches, "
        "composed from timed parts)",
    )
    p.add_argument(
        "--cases", type=int, default=200, help="recall, pretrained: tasks per distance or length"
    )
    p.add_argument(
        "--rate",
        type=positive_floats,
        dest="rates",
        help="requests --served: requests arriving at these rates a second (Poisson, seeded), "
        "one run each, e.g. 0.05,0.1,0.2",
    )
    p.add_argument(
        "--prompt-lens",
        type=length_range,
        default=(65536, 131072),
        help="requests --served --rate: prompt lengths drawn from LO:HI",
    )
    p.add_argument(
        "--new-lens",
        type=length_range,
        default=(256, 4096),
        help="requests --served --rate: new tokens drawn from LO:HI",
    )
    p.add_argument(
        "--lengths",
        metavar="FILE.jsonl",
        help='requests --served --rate: lengths from lines {"prompt_len": P, "new_tokens": G}',
    )
    p.add_argument("--tbt-target", type=float, default=0.2, help="--rate: p99 time between tokens")
    p.add_argument("--ttft-target", type=float, default=30.0, help="--rate: median first token")
    p.add_argument(
        "--distances",
        type=positive_ints,
        help="recall: the distance bins in tokens, e.g. 128,256,512 (default: 128 ... 4000)",
    )
    p.add_argument(
        "--judge", help="quality: the model that scores the generations (default: CKPTS/tiny-full)"
    )
    p.add_argument(
        "--gen-len",
        type=int,
        default=1024,
        help="quality: tokens generated (and teacher-forced window)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="throughput: tensor parallelism over the KV heads in this many processes (tp.py; "
        "one GPU each, started with torchrun)",
    )
    a = p.parse_args(argv)
    if a.tp < 1 or a.tp > 1 and a.what != "throughput":
        p.error("--tp N: N >= 1, with throughput")
    if a.tp > 1 and "WORLD_SIZE" not in os.environ:  # the same command in N processes
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv = sys.argv[1:] if argv is None else argv
        sys.exit(subprocess.call(run + [f"--nproc_per_node={a.tp}", __file__, *argv]))
    if int(os.environ.get("RANK", "0")):  # one process prints and writes
        sys.stdout, a.json = open(os.devnull, "w"), None
    kw = {}
    if a.what in ("throughput", "requests"):  # the flags the two share, then each one's own
        kw = dict(shape=a.shape, prompt_len=a.prompt_len, budget_gb=a.budget_gb, steps=a.steps)
        kw["host_gb"] = a.host_gb
    if a.what == "throughput":
        kw.update(batch_limit=a.max_batch, trained=a.trained, micro_batches=a.micro_batches)
        kw.update(tp=a.tp)
    if a.what == "requests":
        kw.update(requests=a.requests, new_tokens=a.new_tokens, served=a.served)
        if a.rates and not a.served:
            p.error("--rate serves requests as they arrive: give --served with it")
        kw.update(rates=a.rates, prompt_lens=a.prompt_lens, new_lens=a.new_lens, lengths=a.lengths)
        kw.update(tbt_target=a.tbt_target, ttft_target=a.ttft_target)
    return common.run_cli(
        main,
        a.what,
        a.json,
        a.ckpts,
        checkpoint_dir=a.checkpoint,
        judge=a.judge,
        gen_len=a.gen_len,
        cases=a.cases,
        distances=a.distances,
        corpus=a.corpus,
        reference=a.reference,
        sets=a.set,
        systems=a.systems.split(",") if a.systems else None,
        **kw,
    )


if __name__ == "__main__":
    cli()
