"""python -m bench NAME from the repository, or python PATH/TO/bench NAME from anywhere: see bench/__init__.py."""

import argparse
import inspect
import json
import os
import subprocess
import sys

# the repository's modules
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench  # noqa: E402
import common  # noqa: E402
from bench import (  # noqa: E402
    arrivals,
    eviction,
    gather,
    kernels,
    overlap,
    plot,
    pretrained,
    quality,
    recall,
    requests,
    throughput,
)

# the files that hold benchmarks; a new one is one more name here
MODULES = (gather, kernels, quality, eviction, throughput, overlap, requests, arrivals)
MODULES += (recall, pretrained, plot)


def parser():
    """One subcommand a benchmark: its module's flags, with its function's defaults, and --json."""
    examples = bench.__doc__.split("\n\n")[1]  # the package's docstring: a line a benchmark
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="NOSA / NOSI benchmarks; `python -m bench NAME --help` gives one's flags",
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="name", required=True)
    for m in MODULES:
        for name, (fn, add_flags) in m.COMMANDS.items():
            q = sub.add_parser(name, description=inspect.getdoc(fn))
            q.add_argument(
                "--json", dest="json_path", metavar="FILE", help="also write the rows here"
            )
            add_flags(q)
            params = inspect.signature(fn).parameters
            dests = [a.dest for a in q._actions if a.dest not in ("help", "json_path")]
            unread = [d for d in dests if d not in params]
            assert not unread, f"bench {name}: flags {unread} are no parameters of {fn.__name__}"
            q.set_defaults(
                bench=(m, fn.__name__),
                **{d: params[d].default for d in dests if params[d].default is not params[d].empty},
            )
            for a in q._actions:  # a tuple default as it is typed: 1024,8192 or 65536:131072
                if isinstance(a.default, tuple) and a.help:
                    sep = ":" if a.type is bench.length_range else ","
                    a.help = a.help.replace("%(default)s", sep.join(map(str, a.default)))
    return p


def main(a):
    """Run the benchmark a names; its rows (or tables of rows) printed, then written to --json."""
    check_json(a.json_path)
    module, name = a.bench
    fn = getattr(module, name)  # (looked up when it runs: a test may stand in for it)
    params = inspect.signature(fn).parameters
    out = fn(**{k: v for k, v in vars(a).items() if k in params})  # the flags it declared
    tables = out if isinstance(out, dict) else {None: out}
    for title, rows in tables.items():
        if title:
            print(f"\n# {title}")
        print_table(rows)  # first: a file that cannot be written loses nothing
    write_json(a.json_path, out)
    rows = [r for rs in tables.values() for r in rs]
    if rows and all("batch" in r for r in rows) and not any(r["batch"] for r in rows):
        raise ValueError(
            f"bench {a.name}: --gpu-budget {a.gpu_budget} fits no batch of any system; give a "
            f"larger budget or a smaller --prompt-len"
        )


def check_json(path):
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--json {path} is a directory; give a file in it")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"--json {path}: cannot write there; give a path in a writable folder")


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


def cli(argv=None):
    a = parser().parse_args(argv)
    if (
        getattr(a, "tp", 1) > 1 and "WORLD_SIZE" not in os.environ
    ):  # the same command in N processes
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv = sys.argv[1:] if argv is None else argv
        sys.exit(subprocess.call(run + [f"--nproc_per_node={a.tp}", __file__, *argv]))
    if int(os.environ.get("RANK", "0")):  # one process prints and writes
        sys.stdout, a.json_path = open(os.devnull, "w"), None
    return common.run_cli(main, a)


if __name__ == "__main__":
    cli()
