"""A run's output directory and its resume (runs.py, through train.main): defaults resolve in the
repository, --out never replaces what is not ours, one run per directory, a resume refuses another
run and means the saved one, and a kill during a save leaves a whole checkpoint."""

import json
import os
import subprocess
import sys

import pytest
import torch

import checkpoint
import saving
import train
from tests.test_train import ROOT, run, small


def test_defaults_resolve_in_the_repository_and_never_overwrite(
    corpus, tmp_path, monkeypatch, capsys
):
    """Run from another directory, train.py writes its checkpoint and data cache under the
    repository's out/ and data/ (here a stand-in root), never into the working directory, and refuses
    to write into an existing checkpoint (the embedded model included) without --resume or --force."""
    root, cwd = tmp_path / "repo", tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.setattr(checkpoint, "ROOT", str(root))
    monkeypatch.setattr(saving, "EMBEDDED", str(root / "checkpoints"))
    monkeypatch.chdir(cwd)
    kw = dict(data=corpus, steps=2, eval_every=2, **run, **small)
    train.main(**kw)
    assert checkpoint.is_checkpoint(str(root / "out" / "tiny-nosa")) and (root / "data").is_dir()
    assert not list(cwd.iterdir())
    with pytest.raises(
        FileExistsError, match="already holds a checkpoint: --resume continues it, --force"
    ):
        train.main(**kw)
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        train.main(out=checkpoint.DEFAULT_CHECKPOINT, **kw)
    train.main(force=True, **kw)
    capsys.readouterr()
    _, val = train.main(resume=True, **kw)  # the run is complete: nothing to do, and it says so
    assert (
        "is complete (step 2 of 2); to train further, --resume with a larger --steps"
        in capsys.readouterr().out
    )
    assert val == json.load(open(root / "out" / "tiny-nosa" / "train_state.json"))["val_loss"]


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import saving, train
saves, real_save_file, real_rename = 0, saving.save_file, os.rename

def save_file(*a, **kw):  # count saves; die right after writing the weights of the second one
    global saves
    saves += 1
    real_save_file(*a, **kw)
    if saves == 2 and {where!r} == "weights":
        os.kill(os.getpid(), signal.SIGKILL)

def rename(src, dst):  # or die between the two renames that put the second one in place
    real_rename(src, dst)
    if saves == 2 and {where!r} == "swap":
        os.kill(os.getpid(), signal.SIGKILL)

saving.save_file, os.rename = save_file, rename
train.main(**{kw!r})
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["weights", "swap"])
def test_a_kill_during_a_save_leaves_a_whole_checkpoint(corpus, tmp_path, where):
    """SIGKILL in the middle of the second save (step 8 of 8, checkpoints every 4): what is on disk
    is the whole step-4 checkpoint, and resuming from it reproduces the uninterrupted run exactly."""
    kw = dict(data=corpus, data_dir=str(tmp_path / "data"), steps=8, eval_every=4, **run, **small)
    ref, _ = train.main(out=str(tmp_path / "ref"), **kw)
    out = str(tmp_path / "killed")
    r = subprocess.run(
        [sys.executable, "-c", KILLER.format(root=ROOT, where=where, kw={**kw, "out": out})],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == -9, r.stderr[-2000:]
    model, _ = checkpoint.load(out)  # (killed between the renames: read where the save left it)
    assert json.load(open(os.path.join(checkpoint.located(out), "train_state.json")))["step"] == 4
    at4, _ = train.main(out=str(tmp_path / "at4"), stop_at=4, **kw)
    for (n, a), (_, b) in zip(at4.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n  # the weights are step 4's, like the state beside them
    resumed, _ = train.main(out=out, resume=True, **kw)
    for (n, a), (_, b) in zip(ref.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n


def test_out_never_replaces_what_is_not_ours(corpus, tmp_path):
    """--out may only ever replace a checkpoint of ours: a directory of the user's files, a parent of
    checkpoints (the typo --out out/), the user's files beside a checkpoint, the repository's
    checkpoints/ and an unwritable place are refused in one line before training, --force or not,
    and nothing of theirs is touched; a saved model is as readable as the files beside it."""
    kw = dict(data=corpus, data_dir=str(tmp_path / "data"), steps=2, eval_every=1, **run, **small)
    user = tmp_path / "user"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("notes")
    (user / "sub" / "thesis.tex").write_text("x")
    for force in (False, True):
        with pytest.raises(
            FileExistsError, match="holds notes.txt, sub, which is not a checkpoint of ours"
        ):
            train.main(out=str(user), force=force, **kw)
    assert (user / "notes.txt").read_text() == "notes" and (
        user / "sub" / "thesis.tex"
    ).read_text() == "x"
    runs = tmp_path / "runs"
    train.main(out=str(runs / "a"), **kw)
    with pytest.raises(FileExistsError, match="holds a, which is not a checkpoint"):
        train.main(out=str(runs), force=True, **kw)
    (runs / "a" / "notes.txt").write_text("mine")
    for flags in (dict(force=True), dict(resume=True, steps=4)):
        with pytest.raises(FileExistsError, match="holds notes.txt"):
            train.main(out=str(runs / "a"), **{**kw, **flags})
    assert (runs / "a" / "notes.txt").read_text() == "mine" and checkpoint.is_checkpoint(
        str(runs / "a")
    )
    # save itself refuses too
    with pytest.raises(FileExistsError, match="not a checkpoint of ours: not replaced"):
        saving.save(
            train.Transformer(checkpoint.load(str(runs / "a"))[0].cfg),
            checkpoint.byte_tokenizer(),
            str(runs / "a"),
        )
    assert (runs / "a" / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="training never writes into"):
        train.main(out=os.path.join(checkpoint.ROOT, "checkpoints", "tiny-nosa"), force=True, **kw)
    with pytest.raises(PermissionError, match="cannot write in"):
        train.main(out=str(user / "notes.txt" / "run"), **kw)
    mode = lambda name: os.stat(runs / "b" / name).st_mode & 0o777
    train.main(out=str(runs / "b"), **kw)
    assert mode("model.safetensors") == mode("config.json")


def test_resume_refuses_another_run(corpus, tmp_path):
    """--resume continues exactly the run saved: a different length, batch, learning rate, warm-up or
    corpus is refused in one line that names the flag."""
    kw = dict(
        data=corpus,
        data_dir=str(tmp_path / "data"),
        steps=4,
        eval_every=2,
        stop_at=2,
        **run,
        **small,
    )
    out = str(tmp_path / "ck")
    train.main(out=out, **kw)
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.py").write_text(open(os.path.join(corpus, "argparse.py")).read())
    for change, flag in (
        (dict(seq_len=64), "--seq-len"),
        (dict(batch_size=2), "--batch-size"),
        (dict(lr=1e-3), "--lr"),
        (dict(warmup=5), "--warmup"),
        (dict(data=str(other)), "--data"),
    ):
        with pytest.raises(ValueError, match=f"--resume: the run in .* give {flag}"):
            train.main(out=out, resume=True, **{**kw, **change, "stop_at": None})
    train.main(out=out, resume=True, **{**kw, "stop_at": None})
    assert json.load(open(os.path.join(out, "train_state.json")))["step"] == 4


def test_resume_means_the_saved_run_also_when_it_is_complete(corpus, tmp_path, capsys):
    """A complete run resumed with another mode or --set is refused like an unfinished one; a larger
    --steps extends it and says so; a missing or truncated optimizer.pt, or a damaged
    train_state.json, is one line that says the weights still generate; a refused --resume into a
    folder that does not exist makes no folder."""
    kw = dict(data=corpus, data_dir=str(tmp_path / "data"), steps=2, eval_every=2, **run, **small)
    out = str(tmp_path / "ck")
    train.main(out=out, **kw)
    with pytest.raises(ValueError, match="has another config"):
        train.main(out=out, resume=True, **{**kw, "attn": "infllmv2"})
    with pytest.raises(ValueError, match="has another config"):
        train.main(out=out, resume=True, **{**kw, "k": 16})
    capsys.readouterr()
    train.main(out=out, resume=True, **{**kw, "steps": 4})
    assert "--steps 4: the run of 2 steps is extended" in capsys.readouterr().out
    with open(os.path.join(out, "optimizer.pt"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="optimizer.pt is missing or damaged .* still generate"):
        train.main(out=out, resume=True, **{**kw, "steps": 6})
    os.remove(os.path.join(out, "optimizer.pt"))
    with pytest.raises(ValueError, match="optimizer.pt is missing or damaged"):
        train.main(out=out, resume=True, **{**kw, "steps": 6})
    checkpoint.load(out)  # the weights still load
    with open(os.path.join(out, "train_state.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="train_state.json is missing or damaged"):
        train.main(out=out, resume=True, **kw)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train.main(out=str(tmp_path / "a" / "b" / "run"), resume=True, **kw)
    assert not os.path.exists(tmp_path / "a")


def test_one_run_per_output_directory(corpus, tmp_path, monkeypatch):
    """A second run into an --out that a run is writing is refused in one line naming that run's
    process; once it ends, the directory is free again. An --out that is a mount point (a save
    cannot rename a directory over it) is refused before the first step."""
    kw = dict(data=corpus, data_dir=str(tmp_path / "data"), steps=2, eval_every=2, **run, **small)
    out = str(tmp_path / "ck")
    first = saving.hold(out)  # a run writing there
    with pytest.raises(ValueError, match=f"another run \\(process {os.getpid()}\\) is writing"):
        train.main(out=out, **kw)
    first.close()
    train.main(out=out, **kw)
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: p == os.path.abspath(out) or real(p))
    with pytest.raises(ValueError, match="is a mount point"):
        train.main(out=out, force=True, **kw)
