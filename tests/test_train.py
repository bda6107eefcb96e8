"""Training: the loss goes down, checkpoints round-trip exactly, resume is exact, bad checkpoints
fail with one clear line, and DistributedDataParallel runs on CPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

import checkpoint
import train
from tests.conftest import processes_env
from tests.conftest import small as conftest_small

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
small = dict(conftest_small, hidden_dim=128, vocab_size=300)  # a vocabulary for the corpus
run = dict(seq_len=128, batch_size=4, warmup=2, lr=3e-3, log_every=5, device="cpu")


def test_loss_goes_down_and_checkpoint_round_trips(corpus, tmp_path):
    out = str(tmp_path / "ck")
    model, val = train.main(
        out=out,
        data=corpus,
        data_dir=str(tmp_path / "data"),
        steps=30,
        eval_every=30,
        **run,
        **small,
    )
    state = json.load(open(os.path.join(out, "train_state.json")))
    assert state["step"] == 30 and val < 5.0  # log(300) = 5.7 at the start
    loaded, tok = checkpoint.load(out)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    assert tok.decode(tok.encode("def f(x):\n    return x").ids) == "def f(x):\n    return x"


def test_resume_is_exact(corpus, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    kw = dict(data=corpus, data_dir=str(tmp_path / "data"), steps=8, eval_every=100, **run, **small)
    ref, _ = train.main(out=a, **kw)
    train.main(out=b, stop_at=5, **kw)
    assert json.load(open(os.path.join(b, "train_state.json")))["step"] == 5
    resumed, _ = train.main(out=b, resume=True, **kw)
    assert json.load(open(os.path.join(b, "train_state.json")))["step"] == 8
    for (n, x), (_, y) in zip(ref.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(x, y), n


def test_bad_checkpoints_fail_clearly(corpus, tmp_path):
    out = str(tmp_path / "ck")
    train.main(
        out=out, data=corpus, data_dir=str(tmp_path / "data"), steps=2, eval_every=2, **run, **small
    )
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        checkpoint.load(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        FileNotFoundError, match="lacks model.safetensors, config.json, tokenizer.json"
    ):
        checkpoint.load(str(tmp_path / "empty"))
    weights = os.path.join(out, "model.safetensors")
    blob = open(weights, "rb").read()
    open(weights, "wb").write(blob[: len(blob) // 2])  # truncated download
    with pytest.raises(ValueError, match="corrupt or truncated"):
        checkpoint.load(out)
    open(weights, "wb").write(blob)
    cfg = json.load(open(os.path.join(out, "config.json")))
    # config and weights disagree
    json.dump({**cfg, "n_layer": 3}, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(ValueError, match="does not match its config"):
        checkpoint.load(out)
    json.dump({**cfg, "k": 2}, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(ValueError, match="config.json: invalid NOSA config: k_e = k - k_q"):
        checkpoint.load(out)
    json.dump({**cfg, "k": 16.5}, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(ValueError, match="k=16.5 must be an integer"):
        checkpoint.load(out)
    json.dump({**cfg, "head_dim": 8}, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(ValueError, match="has shape"):
        checkpoint.load(out)
    json.dump(
        {k: v for k, v in cfg.items() if k != "k"}, open(os.path.join(out, "config.json"), "w")
    )
    # our format writes every field: none defaults
    with pytest.raises(ValueError, match="lacks 'k'"):
        checkpoint.load(out)
    # but those added after checkpoints were written: their absence means what it meant then
    older = {k: v for k, v in cfg.items() if k not in checkpoint.ADDED_LATER}
    json.dump(older, open(os.path.join(out, "config.json"), "w"))
    model = checkpoint.load(out)[0]
    assert model.cfg.hh_recency == 0.0 and model.cfg.rope_scaling is None


@pytest.mark.slow
def test_ddp_two_processes_on_cpu(corpus, tmp_path):
    out = str(tmp_path / "ddp")
    args = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in dict(
            data=corpus,
            data_dir=str(tmp_path / "data"),
            out=out,
            steps=3,
            eval_every=3,
            seq_len=64,
            batch_size=2,
            warmup=1,
            device="cpu",
        ).items()
    ]
    args += [f"--set={k}={v}" for k, v in small.items()]
    ddp = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
    ]
    r = subprocess.run(
        ddp + args, cwd=ROOT, capture_output=True, text=True, timeout=300, env=processes_env(2)
    )
    assert r.returncode == 0, f"stdout: {r.stdout[-3000:]}\nstderr (both ranks): {r.stderr[-8000:]}"
    assert "x 4 x 64 tokens" in r.stdout  # 2 processes x batch 2
    assert json.load(open(os.path.join(out, "train_state.json")))["step"] == 3


@pytest.mark.slow
def test_fsdp_two_processes_equals_ddp_and_resumes(corpus, tmp_path):
    """train.py --fsdp under torchrun (FSDP2 over gloo): three steps give the weights DDP gives,
    saved gathered, loadable as any checkpoint; the run resumes from its own checkpoint."""
    from safetensors.torch import load_file

    flags = dict(data=corpus, data_dir=str(tmp_path / "data"), steps=3, eval_every=3, seq_len=64)
    flags.update(batch_size=2, warmup=1, device="cpu")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    args += [f"--set={k}={v}" for k, v in small.items()]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

    def run(out, *more):
        cmd = torchrun + ["train.py", f"--out={out}", *args, *more]
        r = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=processes_env(2)
        )
        assert r.returncode == 0, f"stdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-8000:]}"
        return r.stdout

    ddp, fsdp = str(tmp_path / "ddp"), str(tmp_path / "fsdp")
    run(ddp)
    run(fsdp, "--fsdp")
    saved = torch.load(os.path.join(fsdp, "optimizer.pt"), weights_only=True)
    n_params = sum(len(g["params"]) for g in saved["param_groups"])
    assert len(saved["state"]) == n_params  # every parameter's moments, the root module's too
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (ddp, fsdp))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), k
    model, _ = checkpoint.load(fsdp)  # what generate.py reads
    assert model.cfg.n_layer == small["n_layer"]
    out = run(fsdp, "--fsdp", "--resume", "--steps=5")
    assert (
        "resumed from" in out
        and json.load(open(os.path.join(fsdp, "train_state.json")))["step"] == 5
    )
    r = subprocess.run(torchrun + ["train.py", f"--out={fsdp}", *args, "--resume", "--steps=6"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=processes_env(2))  # fmt: skip
    assert r.returncode != 0 and "fsdp=True" in r.stdout + r.stderr  # that run was sharded


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--set", "attn=full"], "has its own flag, --attn"),
        (["--set", "k"], "write FIELD=VALUE"),
        (["--set", "k=abc"], "k takes an integer"),
        (["--set", "nope=1"], "unknown config field"),
        (["--set", "k=3"], "invalid NOSA config"),
        (["--set", "hh_recency=0.5"], "blends recency into nosa-hh's E: set attn=nosa-hh"),
        (["--attn", "nosa-hh", "--set", "hh_recency=-1"], "hh_recency=-1.0 must be a finite"),
        (
            ["--resume", "--out", "/nonexistent/run"],
            "--resume: no checkpoint in '/nonexistent/run'",
        ),
        (["--eval-every", "0"], "--eval-every 0: must be at least 1"),
        (["--batch-size", "0"], "--batch-size 0"),
        (["--seq-len", "0"], "--seq-len 0"),
        (["--steps", "0"], "--steps 0"),
        (["--lr", "-1"], "--lr -1.0: must be positive"),
        (["--lr", "inf"], "--lr inf: give a finite number"),
        (["--stop-at", "0"], "--stop-at 0: must be at least 1"),
        (["--evict-lr-mult", "nan"], "--evict-lr-mult nan: give a finite number"),
        (["--evict-lr-mult", "-1"], "--evict-lr-mult -1.0: 0 or more (0: the head stays off)"),
        (
            ["--evict-lr-mult", "0", "--head-warmup", "2"],
            "--evict-lr-mult 0 keeps the eviction head off",
        ),
        (["--answer-weight", "inf", "--tasks", "0.2"], "--answer-weight inf: give a finite number"),
        (["--out", checkpoint.DEFAULT_CHECKPOINT], "training never writes into"),
        (["--head-warmup", "120"], "--head-warmup 120: the first steps of the run's --steps 120"),
        (["--head-warmup", "-1"], "--head-warmup -1"),
        (["--head-distill", "nan"], "--head-distill nan: a weight of at least 0"),
        (["--head-target", "output"], "--head-target output: what --head-warmup or --head-distill"),
        (["--attn", "infllmv2", "--head-warmup", "5"], "which --attn infllmv2 lacks"),
    ]
    + ([(["--device", "cuda"], "sees no CUDA device")] if not torch.cuda.is_available() else []),
)
def test_train_flags_fail_in_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        train.cli(argv)
    err = capsys.readouterr().err
    assert (
        e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and msg in err
    ), err


def test_init_from_a_dense_model(corpus, tmp_path):
    """The paper's recipe: NOSA continued from a dense model. Before any NOSA step the new model
    computes exactly what the dense one did on sequences of at most k·B tokens (every block selected,
    the eviction head's A = 0), and training goes on from there."""
    import json as _json

    # k·B = 64
    kw = dict(data=corpus, data_dir=str(tmp_path / "data"), **{**run, "seq_len": 64}, **small)
    dense, _ = train.main(out=str(tmp_path / "full"), attn="full", steps=6, eval_every=6, **kw)
    init, _ = train.main(
        out=str(tmp_path / "nosa"),
        attn="nosa",
        steps=1,
        eval_every=1,
        lr=1e-12,
        warmup=0,
        init_from=str(tmp_path / "full"),
        **{k: v for k, v in kw.items() if k not in ("lr", "warmup")},
    )
    assert init.cfg.attn == "nosa" and init.layers[0].self_attn.A.abs().max() < 1e-9
    idx = torch.randint(0, 300, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(init(idx), dense(idx), rtol=0, atol=1e-5)
    state = _json.load(open(os.path.join(str(tmp_path / "nosa"), "train_state.json")))
    assert state["init_from"] == str(tmp_path / "full")
    with pytest.raises(ValueError, match="--init-from starts a new run"):
        train.main(out=str(tmp_path / "nosa"), resume=True, init_from=str(tmp_path / "full"), **kw)


def test_a_head_kept_off_stays_off(corpus, tmp_path):
    """--evict-lr-mult 0: NOSA trained with its eviction head off throughout (A stays exactly 0,
    W_δ as it started, the core by recency), the rest of the model trained as with the head."""
    kw = dict(data=corpus, data_dir=str(tmp_path / "data"), **run, **small, attn="nosa")
    torch.manual_seed(0)
    start = train.main(out=str(tmp_path / "s"), steps=1, eval_every=1, lr=1e-30, warmup=0,
                       **{k: v for k, v in kw.items() if k not in ("lr", "warmup")})[0]  # fmt: skip
    torch.manual_seed(0)
    off, _ = train.main(out=str(tmp_path / "off"), steps=6, eval_every=6, evict_lr_mult=0, **kw)
    for a, b in zip(start.layers, off.layers):
        assert torch.equal(b.self_attn.A, torch.zeros_like(b.self_attn.A))
        assert torch.equal(a.self_attn.delta.weight, b.self_attn.delta.weight)
        assert not torch.equal(a.self_attn.o_proj.weight, b.self_attn.o_proj.weight)


def test_checks_before_work_and_one_line_errors(corpus, tmp_path, monkeypatch, capsys):
    """Ctrl-C in training says where the last checkpoint is (exit 130); --init-from a missing dense
    model says how to train it, and --set cannot change its shape; a checkpoint whose tensors are
    integers or hold NaN, or a file given as a checkpoint, is one line."""
    out = str(tmp_path / "ck")
    argv = [
        f"--out={out}",
        f"--data={corpus}",
        f"--data-dir={tmp_path / 'data'}",
        "--steps=6",
        "--eval-every=2",
        "--seq-len=128",
        "--device=cpu",
    ] + [f"--set={k}={v}" for k, v in small.items()]
    real = train.get_batch

    # Ctrl-C as training step 3 (0-based) begins
    def interrupt(data, batch_size, T, **kw):
        if kw["step"] == 3 and kw["seed"] != 0:  # (evaluation draws with seed 0)
            raise KeyboardInterrupt
        return real(data, batch_size, T, **kw)

    monkeypatch.setattr(train, "get_batch", interrupt)
    with pytest.raises(SystemExit) as e:
        train.cli(argv)
    err = capsys.readouterr().err
    assert e.value.code == 130 and err.count("\n") == 1, err
    assert (
        f"training stopped at step 3; the last checkpoint, step 2, is in {out}: --resume continues it"
        in err
    )
    monkeypatch.setattr(train, "get_batch", real)
    with pytest.raises(
        FileNotFoundError, match="train the model to start from first, e.g. `python train.py --attn"
    ):
        train.main(
            out=str(tmp_path / "n"),
            init_from=str(tmp_path / "no-full"),
            data=corpus,
            **run,
            **small,
        )
    with pytest.raises(ValueError, match="--set dim=32: --init-from keeps the shape"):
        train.main(
            out=str(tmp_path / "n"),
            init_from=out,
            data=corpus,
            data_dir=str(tmp_path / "data"),
            **run,
            **{**small, "dim": 32},
        )
    import safetensors.torch

    weights = os.path.join(out, "model.safetensors")
    sd = safetensors.torch.load_file(weights)
    name = next(iter(sd))
    for bad, msg in (
        (sd[name].to(torch.int32), "is stored as I32"),
        (sd[name] * float("nan"), "NaN or infinite"),
    ):
        safetensors.torch.save_file({**sd, name: bad}, weights)
        with pytest.raises(ValueError, match=msg):
            checkpoint.load(out)
    with pytest.raises(FileNotFoundError, match="is a file, not a checkpoint directory"):
        checkpoint.load(os.path.join(ROOT, "README.md"))


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--set", "tie_embeddings=maybe"], "tie_embeddings takes true or false"),
        (["--seed", "-1"], "--seed -1: give a whole number"),
        (["--data-dir", "FILE"], "is a file; give a directory"),
    ],
)
def test_values_that_are_no_values_are_one_line(argv, msg, capsys, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        train.cli([str(f) if a == "FILE" else a for a in argv] + ["--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and msg in err, err
