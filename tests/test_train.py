"""Training: the loss goes down, checkpoints round-trip exactly, resume is exact, bad checkpoints
fail with one clear line, and DistributedDataParallel runs on CPU."""
import json
import os
import subprocess
import sys
import sysconfig

import pytest
import torch

import checkpoint
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
small = dict(n_layer=2, dim=64, H_q=4, H_kv=2, head_dim=16, hidden_dim=128, vocab_size=300,
             B=8, l_c=4, s_c=2, n_sink=1, n_win=2, k=8, k_q=2)
run = dict(seq_len=128, batch_size=4, warmup=2, lr=3e-3, log_every=5, device="cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few standard-library modules as a small corpus."""
    d = tmp_path_factory.mktemp("corpus")
    for name in ("argparse.py", "textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "string.py", "bisect.py"):
        with open(os.path.join(sysconfig.get_paths()["stdlib"], name)) as f:
            (d / name).write_text(f.read())
    return str(d)


def test_loss_goes_down_and_checkpoint_round_trips(corpus, tmp_path):
    out = str(tmp_path / "ck")
    model, val = train.main(out=out, data=corpus, data_dir=str(tmp_path / "data"), steps=30, eval_every=30,
                            **run, **small)
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
    train.main(out=out, data=corpus, data_dir=str(tmp_path / "data"), steps=2, eval_every=2, **run, **small)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        checkpoint.load(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="lacks model.safetensors, config.json, tokenizer.json"):
        checkpoint.load(str(tmp_path / "empty"))
    weights = os.path.join(out, "model.safetensors")
    blob = open(weights, "rb").read()
    open(weights, "wb").write(blob[: len(blob) // 2])  # truncated download
    with pytest.raises(ValueError, match="corrupt or truncated"):
        checkpoint.load(out)
    open(weights, "wb").write(blob)
    cfg = json.load(open(os.path.join(out, "config.json")))
    json.dump({**cfg, "n_layer": 3}, open(os.path.join(out, "config.json"), "w"))  # config and weights disagree
    with pytest.raises(ValueError, match="does not match its config"):
        checkpoint.load(out)
    json.dump({**cfg, "k": 2}, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(ValueError, match="not a valid NOSA config"):
        checkpoint.load(out)
    json.dump({**cfg, "head_dim": 8}, open(os.path.join(out, "config.json"), "w"))
    with pytest.raises(ValueError, match="has shape"):
        checkpoint.load(out)


def test_ddp_two_processes_on_cpu(corpus, tmp_path):
    out = str(tmp_path / "ddp")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in
            dict(data=corpus, data_dir=str(tmp_path / "data"), out=out, steps=3, eval_every=3, seq_len=64,
                 batch_size=2, warmup=1, device="cpu").items()]
    args += [f"--set={k}={v}" for k, v in small.items()]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"] + args,
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "x 4 x 64 tokens" in r.stdout  # 2 processes x batch 2
    assert json.load(open(os.path.join(out, "train_state.json")))["step"] == 3
