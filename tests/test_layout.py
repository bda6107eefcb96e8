"""The shape of the code as a reader meets it: a decode step's torch path runs in the method and
system files alone, kernels are leaves, and speed is applied from outside."""

import ast
import glob
import os
import sys

import torch

from offload import OffloadCache
from tests.conftest import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imports(path):
    """The top-level names a module imports."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_an_offloaded_decode_step_runs_in_seven_files_and_the_shared_two():
    """The Python frames of one offloaded decode step on a CPU (the torch path): model, nosa,
    pooling, eviction, attention, kvcache, offload, and config and common; no kernel file, no fast."""
    model = make_model("nosa", torch.float32)
    cache = OffloadCache(model.cfg, 2, "cpu", torch.float32, max_len=200)
    idx = torch.randint(0, 97, (2, 150))
    from prefill import prefill

    with torch.no_grad():
        for i in range(2):
            prefill(model, idx[i : i + 1], cache, i)
        files = set()

        def trace(frame, event, arg):
            path = frame.f_code.co_filename
            if event == "call" and os.path.dirname(path) == ROOT:
                files.add(os.path.basename(path))

        sys.setprofile(trace)
        try:
            model.decode(idx[:, -1], cache)
        finally:
            sys.setprofile(None)
    steps = {
        "model.py",
        "nosa.py",
        "pooling.py",
        "eviction.py",
        "attention.py",
        "kvcache.py",
        "offload.py",
    }
    assert steps <= files <= steps | {"config.py", "common.py"}, files


def test_kernels_are_leaves_and_speed_comes_from_outside():
    """Every X_kernels.py imports only config and common of the project; no method or system file
    imports fast.py; every method file has no Triton kernel of its own."""
    project = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))}
    for path in glob.glob(os.path.join(ROOT, "*_kernels.py")):
        assert imports(path) & project <= {"config", "common"}, path
    for name in (
        "config pooling eviction nosa attention model kvcache prefill offload memory serve".split()
    ):
        path = os.path.join(ROOT, f"{name}.py")
        assert "fast" not in imports(path), path
        assert "@triton.jit" not in open(path, encoding="utf-8").read(), path
