"""
What several files share: the numerics rule for scores, the one rule that picks a kernel or its
torch twin, what the kernels have in common, and the scripts' set-up (device, processes under
torchrun, one-line errors).
"""

import contextlib
import math
import os
import sys

import torch
import torch.distributed as dist
import triton
from triton.tools.tensor_descriptor import TensorDescriptor


def fp32(x):
    """x in at least fp32 (bf16 -> fp32; fp64 stays fp64, for the exact tests): scores, bias and
    softmax are computed in it."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def pow2(n, least=1):
    return n >= least and n & (n - 1) == 0


_forced = None  # set by kernels(on) for a block of code


@contextlib.contextmanager
def kernels(on):
    """Within the block use_kernels says `on` (where dtype and shapes allow): the tests run the
    twins on a GPU, as the oracle, and the kernels on a CPU, in the Triton interpreter."""
    global _forced
    before, _forced = _forced, on
    try:
        yield
    finally:
        _forced = before


def use_kernels(x, cfg=None):
    """The one dispatch rule: the Triton (or CUDA) kernel for CUDA tensors, the torch twin elsewhere
    and in fp64 (the exact tests). With a config, also its shapes: the kernels' tiles need head dims
    and blocks that are powers of two of at least 16 (tl.dot), and whole sub-blocks per block."""
    if x.dtype == torch.float64 or not (x.is_cuda if _forced is None else _forced):
        return False
    if cfg is None:
        return True
    r, p = cfg.r, cfg.p  # sub-blocks of a block, and of the one before
    return pow2(cfg.head_dim, 16) and pow2(cfg.B, 16) and pow2(r) and p <= r


# -----------------------------------------------------------------------------
# What the kernels share


def n_sm(x):
    """Multiprocessors of x's GPU (the interpreter on a CPU: an H200's 132)."""
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132


def gp(G):
    """Rows for the G query heads of a KV head in a kernel's dot: tl.dot needs at least 16."""
    return max(16, triton.next_power_of_2(G))


def tile_size(G, B):
    """Query tokens per tile of the parallel forward's kernels: about 64 rows (tokens x the group's
    heads), within one block, at most 32 (one bit each). Smaller tiles read fewer blocks that no row
    of them needs."""
    return max(1, min(B, 32, 64 // triton.next_power_of_2(G)))


def tma_descriptor(x, block):
    """x as tiles of shape `block` for a kernel's desc.load([...]): on Hopper each SM's tensor memory
    accelerator copies a tile to shared memory, with no addresses or masks in registers, and fills
    what lies past x's ends with zeros. The base and strides must be 16-byte aligned and the last
    dim contiguous: other layouts are copied first."""
    elt = x.element_size()
    if x.stride(-1) != 1 or x.data_ptr() % 16 or any(s * elt % 16 for s in x.stride()[:-1]):
        x = x.contiguous()
    return TensorDescriptor(x, list(x.shape), list(x.stride()), list(block))


# -----------------------------------------------------------------------------
# The scripts' set-up


def pick_device(name=None):
    """'cuda' when available unless `name` says otherwise; one line for a device this torch lacks."""
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: give cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {name}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: give cpu, cuda or cuda:N")
    return dev


def start_processes(name=None):
    """(rank, world, device): under torchrun the process group started (NCCL on GPUs, gloo on CPUs
    or where --device cpu asks) and this process's GPU; alone (0, 1, pick_device(name)). More
    processes on a machine than it has GPUs is refused before any work."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, pick_device(name)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    here, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", world)), torch.cuda.device_count()
    try:  # one line, from the first process; the others leave quietly
        cuda = pick_device(name).type == "cuda"  # (--device cuda without CUDA fails here)
        if cuda and here > gpus:
            raise ValueError(
                f"{here} processes but {gpus} GPU{'s' * (gpus != 1)}: run with --device cpu, or "
                f"--nproc_per_node {gpus}"
            )
    except ValueError:
        if rank == 0:
            raise
        sys.exit(2)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return rank, world, device


def check_flags(o, finite=(), at_least=None):
    """One line for the first flag of o (a script's Options) out of range: a number that must be
    finite, or one below its least value (at_least: {name: least}; None: not given)."""
    flag = lambda name: f"--{name.replace('_', '-')} {getattr(o, name)}"
    for name in finite:
        value = getattr(o, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{flag(name)}: give a finite number")
    for name, least in (at_least or {}).items():
        value = getattr(o, name)
        if value is not None and value < least:
            raise ValueError(f"{flag(name)}: must be at least {least}")


ANTICIPATED = (ValueError, OSError, MemoryError)  # bad input: the message says what to do


def run_cli(main, *args, **kwargs):
    """Run a script's main(); an anticipated error (a bad flag, a missing or corrupt checkpoint, a
    budget that does not fit) is its one-line message and exit code 2. Anything else is a bug and
    keeps its traceback."""
    try:
        out = main(*args, **kwargs)
    except ANTICIPATED as e:  # (an allocator's MemoryError says nothing: say what it was)
        say = str(e) or (
            "out of memory; make the batch or the sequences smaller"
            if isinstance(e, MemoryError)
            else type(e).__name__
        )
        print(f"error: {say}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # Ctrl-C: one line (train.py says where its checkpoint is)
        print(f"interrupted{f': {e}' if str(e) else ''}", file=sys.stderr)
        sys.exit(130)
    end_processes()
    return out


def end_processes():
    """Under torchrun, leave together: every process past a barrier, the process group destroyed,
    then out without the interpreter's teardown, whose destructors of gloo's threads abort the
    process ('terminate called without an active exception', 3 runs in 4) or deadlock."""
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def grow(t, n, dim):
    """Return t with at least n entries along `dim`, doubling: no buffer is sized once up front."""
    if t.shape[dim] >= n:
        return t
    shape = list(t.shape)
    shape[dim] = max(n, 2 * t.shape[dim]) - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim)
