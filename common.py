"""
What several files share: the numerics rule for scores, the launch sizes of the kernels and the
tiles they load, and the scripts' set-up (the device, one-line errors).
"""
import sys

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor


def fp32(x):
    """x in at least fp32 (bf16/fp16 -> fp32; fp64 stays fp64, for the exact tests): scores, bias and
    softmax are computed in it."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def n_sm(x):
    """Multiprocessors of x's GPU (the interpreter on a CPU: an H200's 132)."""
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132


def gp(G):
    """Rows for the G query heads of a KV head in a kernel's dot: tl.dot needs at least 16."""
    return max(16, triton.next_power_of_2(G))


def tma_descriptor(x, block):
    """x as tiles of shape `block` for a kernel's desc.load([...]): on Hopper and later each SM's tensor
    memory accelerator copies a tile to shared memory, with no address arithmetic or masks in
    registers, and fills what lies past x's ends with zeros. The hardware wants the base and the
    strides 16-byte aligned and the last dim contiguous: other layouts are copied first."""
    elt = x.element_size()
    if x.stride(-1) != 1 or x.data_ptr() % 16 or any(s * elt % 16 for s in x.stride()[:-1]):
        x = x.contiguous()
    return TensorDescriptor(x, list(x.shape), list(x.stride()), list(block))


def pick_device(name=None):
    """'cuda' when available unless `name` says otherwise; a clear error for a device this torch lacks."""
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: give cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device; "
                         f"use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: give cpu, cuda or cuda:N")
    return dev


ANTICIPATED = (ValueError, OSError, MemoryError)  # bad input: the message says what to do


def run_cli(main, *args, **kwargs):
    """Run a script's main(); an anticipated error (bad flag, missing or corrupt checkpoint, a budget
    that does not fit) is printed as its one-line message, exit code 2 (as for a bad flag). Anything
    else is a bug and keeps its traceback."""
    try:
        return main(*args, **kwargs)
    except ANTICIPATED as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # Ctrl-C: one line (train.py says where its last checkpoint is)
        print(f"interrupted{f': {e}' if str(e) else ''}", file=sys.stderr)
        sys.exit(130)
