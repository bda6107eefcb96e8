"""
Benchmarks, run on the GPU machine; every figure is a ratio against a limit measured in the same run.

    python -m bench gather [--json out.json]    # UVA gather (CUDA, Triton) vs contiguous pinned copy (PCIe roofline)
    python -m bench prefill                     # sparse attention fwd+bwd vs dense SDPA (flash), paper defaults
    python -m bench decode                      # decode kernels vs HBM bandwidth, batch 1..64
    python -m bench sdpa                        # dense decode under each SDPA backend
    python -m bench quality                     # out/tiny-{nosa,full,infllmv2,dma} from train.py: long-context quality
    python -m bench eviction [--checkpoint DIR] # how much attention Γ(t) holds, per rule for E (CPU)
    python -m bench throughput --shape 8b --prompt-len 32768 --gpu-budget 24   # decode at a fixed GPU budget
    python -m bench throughput --ckpts out/ --prompt-len 8192                  # the same, trained tiny models
    python -m bench overlap --shape 8b --batch 26                              # where an offloaded step's time goes
    python -m bench requests --shape 8b --prompt-len 131072 --gpu-budget 24    # whole requests: prefill + decode
    python -m bench served --shape 8b --prompt-len 131072                      # the same, served (serve.py)
    python -m bench arrivals --rates 0.05,0.1 --prompt-lens 65536:131072       # served, arriving over time
    python -m bench pretrained --checkpoint out/smollm2-135m   # an imported model and the recipe's runs
    python -m bench recall --ckpts out/                 # long-range recall (tasks.py) of the tiny models, by distance
    python -m bench head [--checkpoint DIR]             # can the eviction head alone learn to keep a fact? (CPU)
    python -m bench plot                                # BENCHMARKS.md's figures from bench/results/*.json

`python -m bench NAME --help` lists a benchmark's own flags; a flag it does not read is an error.

One file per benchmark (or a few that share their parts). Each names its benchmarks in COMMANDS,
NAME: (its function, a function that declares its flags), and bench/__main__.py lists the files: a
flag's destination is the function's parameter of the same name, and its default is the
function's. The timing helpers, the machine's limits and the flags several benchmarks share are
here. Record results with their command in BENCHMARKS.md.
"""

import argparse
import gc
import math
import os
import statistics
import time

# torch.profiler leaves CUPTI attached after a profile unless told to tear it down, which is known
# to slow what runs later in the process; a benchmark that profiles one system must not slow the
# timings of the next
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch
from triton.testing import do_bench


def wall(fn, reps=20, warmup=3):
    """Median wall time of fn() in seconds, the device synchronised around each call (so host-side
    work such as a CPU index_select is counted too)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def hbm_bandwidth():
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    return 2 * x.numel() / (t * 1e-3) / 1e9  # bytes read + written


def graph_time(fn, n=20):
    """Median time (ms) of fn captured n times in one CUDA graph, per call: launch overhead removed."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return do_bench(g.replay, warmup=5, rep=100, return_mode="median") / n


def free(cuda):
    """Give the memory of what was deleted back before the next system's run: the GPU's cache and
    the pinned host memory's."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()


def pinned_bandwidth(nbytes=256 * 2**20):
    """Contiguous pinned host -> device copy, GB/s: the PCIe limit the gathers are held to."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / wall(lambda: dst.copy_(src, non_blocking=True)) / 1e9


# -----------------------------------------------------------------------------
# flags several benchmarks share (their names are generate.py's where the quantity is the same)

# random-weight models: config.PRESETS
SHAPES = {"tiny": ("tiny", {}), "1b": ("paper", {}), "8b": ("paper-8b", {})}
# the systems a decoding benchmark compares: name -> (label, attention, offloaded)
SYSTEMS = {
    "full": ("full, resident cache", "full", False),
    "infllmv2-offload": ("infllmv2 + offload", "infllmv2", True),
    "nosa-offload": ("nosa + offload", "nosa", True),
    "nosa-resident": ("nosa, resident cache", "nosa", False),
}


def at_least_one(text):
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, at least 1")
    return value


def finite(what, least=0.0, strict=True):
    """An argparse type: a finite number above `least` (or at least `least` where not strict); its
    error says 'give {what}'."""

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > least if strict else value >= least)):
            raise argparse.ArgumentTypeError(f"{text!r}: give {what}")
        return value

    return parse


gib = finite("a positive, finite number of GiB")
seconds = finite("a positive, finite number of seconds")


def comma_separated(cast, what):
    """An argparse type: 'a,b' -> (cast(a), cast(b)), each positive and finite."""

    def parse(text):
        try:
            values = tuple(cast(x) for x in text.split(","))
        except ValueError:
            values = ()
        if not values or not all(math.isfinite(v) and v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: give {what}")
        return values

    return parse


positive_ints = comma_separated(int, "positive whole numbers separated by commas, e.g. 128,256")
positive_floats = comma_separated(float, "positive numbers separated by commas, e.g. 0.1,0.2")


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


def add_systems(p, known):
    """--systems: some of `known` (a dict name -> ...), comma-separated."""

    def systems(text):
        names = tuple(text.split(","))
        for s in names:
            if s not in known:
                raise argparse.ArgumentTypeError(f"{s}: choose among {','.join(known)}")
        return names

    p.add_argument(
        "--systems", type=systems, help=f"some of {','.join(known)} (default: %(default)s)"
    )


def add_shape(p):
    """A random-weight model of a preset's shape, and the context it decodes at."""
    p.add_argument("--shape", choices=sorted(SHAPES), help="model shape (default: %(default)s)")
    p.add_argument(
        "--prompt-len", type=at_least_one, help="tokens of context (default: %(default)s)"
    )


def add_budgets(p):
    """The memory budgets, in GiB, as generate.py's --gpu-budget and --host-budget."""
    p.add_argument("--gpu-budget", type=gib, help="GPU memory, GiB (default: %(default)s)")
    p.add_argument(
        "--host-budget", type=gib, help="pinned host memory, GiB (default: what is available)"
    )


def add_checkpoint(p, help):
    import checkpoint

    p.add_argument("--checkpoint", dest="checkpoint_dir", metavar="DIR", help=help)
    p.set_defaults(checkpoint_dir=checkpoint.DEFAULT_CHECKPOINT)


def add_ckpts(p, help):
    p.add_argument("--ckpts", metavar="DIR", help=help)


def need_gpu(name):
    """A benchmark of the GPU machine: one line where there is none, else the device it measures."""
    if not torch.cuda.is_available():
        raise ValueError(f"bench {name} measures the GPU machine: no CUDA device here")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")


def check_decode_run(shape, gpu_budget):
    """A random-weight decoding run that can work here: on a CPU a budget a CPU decodes in time, and
    the shape's weights (bf16 on a GPU, fp32 on a CPU) within the budget and, on a CPU, the memory
    there is. One line before a model is made."""
    from config import Config
    from memory import host_bytes_available
    from model import Transformer

    cuda = torch.cuda.is_available()
    if not cuda and gpu_budget > 1:
        raise ValueError(
            f"on a CPU the batch grows to --gpu-budget {gpu_budget}, more than a CPU decodes in "
            f"time; give at most 1 (e.g. --gpu-budget 0.02), or run it on a GPU"
        )
    preset, over = SHAPES[shape]
    with torch.device("meta"):
        n = sum(p.numel() for p in Transformer(Config.from_preset(preset, **over)).parameters())
    weights = n * (2 if cuda else 4) / 2**30
    room = gpu_budget if cuda else min(gpu_budget, host_bytes_available() / 2**30)
    if weights >= room:
        raise ValueError(
            f"--shape {shape}: its weights take {weights:.1f} GiB, more than the "
            f"{room:.1f} GiB there are (--gpu-budget{'' if cuda else ', and this machine'}); "
            f"give a smaller shape or a larger budget"
        )
