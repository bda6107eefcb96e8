"""The shape of the code as a reader meets it: a decode step's torch path runs in the method and
system files alone, kernels are leaves, and speed is applied from outside."""

import ast
import glob
import os
import sys

import pytest
import torch

import common
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


METHOD = {"model.py", "nosa.py", "pooling.py", "eviction.py", "attention.py"}  # pass 1
SYSTEM = {"kvcache.py", "offload.py", "memory.py"}  # pass 2: the caches, which only store


@pytest.mark.parametrize("kernels", [False, True])
def test_a_decode_step_consults_the_cache_as_a_store_in_the_methods_order(kernels):
    """The order of one offloaded decode step, traced call by call (torch path, and the kernel
    path: compiled on a GPU, interpreted on a CPU): nosa.nosa_decode consults the cache three times a layer (write, blocks,
    flush), model.decode once a step (advance), each call returning straight to the method, so
    the step crosses between the method's files and the system's at most 6 times a layer and 2 a
    step; and no system file ever calls into the method's files."""
    dev = "cuda" if kernels and torch.cuda.is_available() else "cpu"  # kernels: compiled there
    model = make_model("nosa", torch.float32).to(dev)
    cache = OffloadCache(model.cfg, 2, dev, torch.float32, max_len=200)
    idx = torch.randint(0, 97, (2, 150), device=dev)
    from prefill import prefill

    calls, wrong = [], []

    def trace(frame, event, arg):
        if event != "call" or os.path.dirname(frame.f_code.co_filename) != ROOT:
            return
        callee = os.path.basename(frame.f_code.co_filename)
        caller = frame.f_back and os.path.basename(frame.f_back.f_code.co_filename)
        calls.append(callee)
        if caller in SYSTEM and callee in METHOD:
            wrong.append(
                f"{caller}:{frame.f_back.f_code.co_name} -> {callee}:{frame.f_code.co_name}"
            )

    with torch.no_grad(), common.kernels(kernels):
        for i in range(2):
            prefill(model, idx[i : i + 1], cache, i)
        sys.setprofile(trace)
        try:
            model.decode(idx[:, -1], cache)
        finally:
            sys.setprofile(None)
    side = [1 if n in METHOD else 2 for n in calls if n in METHOD | SYSTEM]
    crossings = sum(a != b for a, b in zip(side, side[1:]))
    assert not wrong, wrong
    assert crossings <= 6 * model.cfg.n_layer + 2, crossings


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


def test_every_kernel_file_has_the_twin_the_readme_names():
    """README's third pass: each X_kernels.py is listed, and its torch twins are in X.py (or the file
    the README names for it), whose docstrings name the kernels ("Kernel: X_kernels.f")."""
    import re

    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    para = readme[readme.index("**Pass 3, the kernels.**") :].split("\n\n")[0]
    elsewhere = dict(re.findall(r"`(\w+_kernels)\.py`'s in `(\w+)\.py`", para))
    kernel_files = sorted(glob.glob(os.path.join(ROOT, "*_kernels.py")))
    assert kernel_files
    for path in kernel_files:
        stem = os.path.basename(path)[:-3]
        assert f"`{stem}.py`" in para, f"README's third pass does not list {stem}.py"
        twin = os.path.join(ROOT, elsewhere.get(stem, stem.removesuffix("_kernels")) + ".py")
        assert os.path.isfile(twin), f"{stem}.py: no twin file {os.path.basename(twin)}"
        source = open(twin, encoding="utf-8").read()
        assert re.search(rf"Kernels?: {stem}\.\w+", source), f"{twin} names no kernel of {stem}"
