"""Tensor parallelism over KV heads (tp.py) on CPUs, gloo between processes: the sharded model's
offloaded decode gives the single process's logits in every mode, each rank moves exactly the blocks
one process moves for its heads, and a shape that does not divide is one line."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tp
from config import Config
from kvcache import KVCache
from offload import OffloadCache
from tests.conftest import decode_logits, make_model, processes_env, small

MODES = ("nosa", "infllmv2", "dma", "full", "nosa-hh")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_cache(cfg, Bz):
    if cfg.attn == "full":
        return KVCache(cfg, Bz, "cpu", torch.float64, 200)
    return OffloadCache(cfg, Bz, "cpu", torch.float64, max_len=200)


def worker(rank, world, port, shape):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for attn in MODES:
            torch.manual_seed(0)  # the same model and tokens in every process
            model = make_model(attn, torch.float64, **shape)
            cfg = model.cfg
            idx = torch.randint(0, cfg.vocab_size, (3, 170))
            lens = [5, 37, 90]  # ragged; 80+ tokens decoded after the longest
            whole = new_cache(cfg, 3)
            ref = decode_logits(model, idx, lens, whole)
            tp.shard(model, rank, world)
            part = new_cache(model.cfg, 3)
            got = decode_logits(model, idx, lens, part)
            for r, g in zip(ref, got):
                assert (r - g).abs().max() <= 1e-9, (attn, rank, float((r - g).abs().max()))
            if attn != "full":  # the rank's rows (sequence, KV head) of the single process's
                h = model.cfg.H_kv
                rows = [s * cfg.H_kv + rank * h + j for s in range(3) for j in range(h)]
                assert torch.equal(part.stats.moved, whole.stats.moved[:, rows]), (attn, rank)
                assert torch.equal(part.stats.needed, whole.stats.needed[:, rows]), (attn, rank)
                assert part.stats.moved.sum() > 0 or attn == "dma"  # (DMA: resident already)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world, shape", [(2, {}), (3, dict(H_q=6, H_kv=3))])
def test_tensor_parallel_decode_equals_one_process(world, shape):
    mp.spawn(worker, args=(world, free_port(), shape), nprocs=world)


def test_a_shape_that_does_not_divide_is_one_line():
    cfg = Config.from_preset("tiny", **small)  # H_kv = 2
    with pytest.raises(ValueError, match="cannot share H_kv=2"):
        tp.check(cfg, 3)
    with pytest.raises(ValueError, match="hidden_dim=96 is not a multiple of 5"):
        tp.check(Config.from_preset("tiny", **{**small, "H_q": 10, "H_kv": 5}), 5)


@pytest.mark.slow
def test_torchrun_generate_prints_what_one_process_prints():
    """`torchrun --nproc_per_node=2 generate.py --offload`: the two processes of the embedded model
    print the text one process prints (greedy)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = ["generate.py", "--offload", "--max-new-tokens", "24", "--temperature", "0"]
    env = processes_env(2)  # both runs on the same device: the same greedy text
    run = lambda cmd: (
        subprocess.run(
            cmd + flags, cwd=root, capture_output=True, text=True, timeout=300, check=True, env=env
        ).stdout
    )
    text = lambda out: [line for line in out.splitlines() if "tokens/s" not in line]
    one = run([sys.executable])
    two = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])
    assert text(one) == text(two) and len(text(one)) > 3


@pytest.mark.slow
def test_torchrun_refuses_serving_and_heads_that_do_not_divide():
    """Serving's schedule follows each process's clock, so under torchrun it is refused in one
    line; so are 3 processes for the embedded model's 2 KV heads."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = lambda n, *flags: subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
        + ["generate.py"]
        + list(flags),
        cwd=root, capture_output=True, text=True, timeout=300, env=processes_env(n),
    )  # fmt: skip
    r = run(2, "--requests", "requests.jsonl", "--batch", "1", "--max-new-tokens", "4")
    assert r.returncode != 0 and "serving requests under torchrun is not supported" in r.stderr
    r = run(3, "--max-new-tokens", "4")
    assert r.returncode != 0 and "3 processes cannot share H_kv=2" in r.stderr


@pytest.mark.parametrize("rank", [0, 1])
def test_more_processes_than_gpus_is_one_line_before_any_work(rank, monkeypatch, capsys):
    """2 processes on a machine with 1 GPU (faked): the first says what to do in one line, the other
    leaves without a word; neither asks for a GPU it lacks. With --device cpu they may run."""
    import common

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("asked for a GPU"))
    with pytest.raises(SystemExit) as e:
        common.run_cli(common.start_processes)
    err = capsys.readouterr().err
    assert e.value.code == 2
    if rank == 0:
        want = "error: 2 processes but 1 GPU: run with --device cpu, or --nproc_per_node 1\n"
        assert err == want
    else:
        assert err == ""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # (no process group is started here)
    assert common.start_processes("cpu") == (rank, 2, torch.device("cpu"))


def test_device_cuda_without_cuda_is_one_line_under_torchrun_too(monkeypatch, capsys):
    import common

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for rank, want in ((0, "sees no CUDA device; use --device cpu"), (1, "")):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(SystemExit) as e:
            common.run_cli(common.start_processes, "cuda")
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and err.count("\n") == (rank == 0)
