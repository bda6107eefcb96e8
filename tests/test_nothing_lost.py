"""Nothing lost: the project moves or deletes only what it made, an output never replaces an input,
every path is resolved once, request files are read as their formats say, and bad input is one
line before any work (each case below lost data, or failed with a traceback, before)."""

import json
import os
import shutil

import pytest
import torch

import checkpoint
import console
import generate
import runs
import saving
import train
from config import Config
from model import Transformer


def tiny():
    return Transformer(Config.from_preset("tiny", n_layer=1, dim=32, hidden_dim=64))


def one_line(capsys, call, *args):
    """Run a cli; assert exit code 2 and one line on stderr; return it."""
    with pytest.raises(SystemExit) as e:
        call(*args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


# -----------------------------------------------------------------------------
# 1. Recovery touches only what a save made


def test_loading_and_saving_leave_the_users_folders_alone(tmp_path, capsys):
    """A user's RUN.old, RUN.tmp and proj.old beside a checkpoint: loading moves nothing, saving
    deletes none of them; a folder of theirs where a save stages is refused in one line."""
    model, tok = tiny(), checkpoint.byte_tokenizer()
    run = tmp_path / "run"
    saving.save(model, tok, str(run))
    for name in ("run.old", "run.tmp", "proj.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("mine")
    assert checkpoint.is_checkpoint(str(run)) and checkpoint.load(str(run))
    saving.save(model, tok, str(run))
    for name in ("run.old", "run.tmp", "proj.old"):
        assert (tmp_path / name / "mine.txt").read_text() == "mine"
    assert not (tmp_path / "proj").exists() and capsys.readouterr().err == ""
    staged = tmp_path / ".run.saving"
    staged.mkdir()
    (staged / "mine.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="was not made by a save of this project"):
        saving.save(model, tok, str(run))
    assert (staged / "mine.txt").read_text() == "mine" and checkpoint.load(str(run))


def test_force_never_deletes_a_users_lock_named_file(tmp_path):
    """--force replaces a checkpoint of ours, never a file of the user's inside it."""
    model, tok = tiny(), checkpoint.byte_tokenizer()
    out = tmp_path / "run"
    saving.save(model, tok, str(out))
    (out / ".notes.lock").write_text("my notes")
    with pytest.raises(FileExistsError, match=".notes.lock"):
        saving.check_out(str(out))
    with pytest.raises(FileExistsError, match=".notes.lock"):
        saving.save(model, tok, str(out))
    assert (out / ".notes.lock").read_text() == "my notes"


# -----------------------------------------------------------------------------
# 2. Completions never overwrite an input, are made only when serving starts, lines whole


@pytest.fixture
def requests_file(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "import os", "max_new_tokens": 4}\n{"prompt": "def f():"}\n')
    return path


def test_completions_never_replace_the_requests(tmp_path, requests_file, capsys):
    before = requests_file.read_text()
    link = tmp_path / "link.jsonl"
    link.symlink_to(requests_file)
    for out in (requests_file, link):
        args = ["--requests", str(requests_file), "--completions", str(out), "--device", "cpu"]
        assert "is an input of this run" in one_line(capsys, generate.cli, args)
    assert requests_file.read_text() == before


def test_an_existing_completions_file_is_kept_unless_forced(tmp_path, requests_file, capsys):
    out = tmp_path / "c.jsonl"
    out.write_text("earlier results\n")
    args = ["--requests", str(requests_file), "--completions", str(out), "--device", "cpu"]
    assert "--force replaces it" in one_line(capsys, generate.cli, args + ["--max-new-tokens", "3"])
    assert out.read_text() == "earlier results\n"
    generate.cli(args + ["--max-new-tokens", "3", "--force", "--quiet"])
    assert len(out.read_text().splitlines()) == 2


def test_a_refused_run_makes_no_completions_file(tmp_path, requests_file, capsys):
    for out in (tmp_path / "c.jsonl", tmp_path / "new" / "c.jsonl"):
        args = ["--requests", str(requests_file), "--completions", str(out), "--device", "cpu"]
        one_line(capsys, generate.cli, args + ["--max-new-tokens", "100000"])  # too long
        assert not out.exists() and not (tmp_path / "new").exists()


def test_a_full_disk_leaves_whole_completion_lines(tmp_path, monkeypatch):
    """The second line fails to write (a full disk): the file keeps the first whole line only,
    and the one-line error names the request it stopped at."""
    path = tmp_path / "c.jsonl"
    with console.Completions(str(path)) as c:
        c.write({"request": 0, "completion": "a"}, "request 0 (line 1 of r.jsonl)")
        real = c.f.write

        def full(data):
            real(data[:5])  # part of the line reaches the disk
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(c.f, "write", full)
        with pytest.raises(OSError) as e:
            c.write({"request": 1, "completion": "b"}, "request 1 (line 2 of r.jsonl)")
    msg = str(e.value)
    assert "request 1 (line 2 of r.jsonl)" in msg and "No space left" in msg and "\n" not in msg
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"request": 0, "completion": "a"}
    ]


# -----------------------------------------------------------------------------
# 3. A symbolic link as --out: resolved once


def test_out_through_a_symbolic_link(tmp_path):
    """Saves through a link write the directory it points to, the link stays a link, every save
    succeeds; a run through the link and one through the real path share one lock."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    model, tok = tiny(), checkpoint.byte_tokenizer()
    o = train.Options(out=str(link), device="cpu")
    runs.check_options(o)
    assert o.out == str(real)
    for _ in range(2):
        saving.save(model, tok, o.out)
    assert link.is_symlink() and checkpoint.is_checkpoint(str(link))
    assert not (tmp_path / "link.old").exists() and not (tmp_path / "link.tmp").exists()
    lock = saving.hold(o.out)
    o2 = train.Options(out=str(real), device="cpu")
    runs.check_options(o2)
    with pytest.raises(ValueError, match="another run"):
        saving.hold(o2.out)
    lock.close()
    with pytest.raises(ValueError, match="symbolic link"):
        saving.save(model, tok, str(link))  # a caller that did not resolve it is refused


# -----------------------------------------------------------------------------
# 4. Request files as the formats say


@pytest.mark.parametrize("name", ["r.json", "r.JSONL", "requests"])
def test_json_lines_are_known_by_their_content(tmp_path, name):
    path = tmp_path / name
    path.write_text('{"prompt": "a\u2028b\u0085c", "max_new_tokens": 7}\n\n{"prompt": "x"}\n')
    got = console.parse_requests(path.read_text(), str(path))
    assert got == [("a\u2028b\u0085c", 7, 1), ("x", None, 3)]


def test_plain_text_requests_split_at_newlines_only(tmp_path):
    text = "first\fstill first\nsecond\u2028line\r\n\nthird\n"
    assert console.parse_requests(text, "r.txt") == [
        ("first\fstill first", None, 1),
        ("second\u2028line", None, 2),
        ("third", None, 4),
    ]


def test_a_request_that_cannot_be_served_names_its_line(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "import os"}\n{"prompt": "x", "max_new_tokens": 100000}\n')
    err = one_line(capsys, generate.cli, ["--requests", str(path), "--device", "cpu"])
    assert f"line 2 of {path}" in err and "exceeds max_seq_len" in err


# -----------------------------------------------------------------------------
# 5. Nothing reported that was not done


def test_a_profile_that_cannot_be_written_is_one_line_and_no_file(tmp_path, monkeypatch, capsys):
    trace = tmp_path / "t.json"

    def full(self, path):
        open(path, "w").write("{")  # a part reached the disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", full)
    args = ["--profile", str(trace), "--max-new-tokens", "3", "--quiet", "--device", "cpu"]
    err = one_line(capsys, generate.cli, args)
    assert "No space left" in err and os.listdir(tmp_path) == []


def test_resume_with_fewer_steps_is_refused(tmp_path):
    run = dict(seq_len=64, batch_size=2, warmup=1, device="cpu", n_layer=1, dim=32)
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    kw = dict(data=str(corpus), data_dir=str(tmp_path / "data"), out=str(tmp_path / "o"), **run)
    train.main(steps=4, eval_every=2, stop_at=2, **kw)
    with pytest.raises(ValueError, match="--steps 3: the run in .* has a schedule of 4 steps"):
        train.main(steps=3, eval_every=2, resume=True, **kw)


def test_stop_at_says_so_and_tokens_per_s_counts_the_steps_run(tmp_path, capsys, monkeypatch):
    run = dict(seq_len=64, batch_size=2, warmup=1, device="cpu", n_layer=1, dim=32)
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    kw = dict(data=str(corpus), data_dir=str(tmp_path / "data"), out=str(tmp_path / "o"), **run)
    clock = iter(range(0, 10**6, 1))  # every call of time.time() one second later
    monkeypatch.setattr(train.time, "time", lambda: float(next(clock)))
    train.main(steps=12, log_every=10, eval_every=100, stop_at=12, **kw)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("step 12/12"))
    rate = float(line.split(" tokens/s")[0].split("| ")[-1])
    assert rate < 2 * 2 * 64  # 2 steps of 128 tokens over at least 2 seconds, not 10 steps' worth
    train.main(steps=20, log_every=10, eval_every=100, stop_at=14, resume=True, **kw)
    assert "stopped at step 14 of 20 (--stop-at)" in capsys.readouterr().out


def test_a_data_folder_with_a_link_to_itself_is_read_once(tmp_path):
    import data

    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a.py").write_text("a")
    (d / "sub" / "b.py").write_text("b")
    (d / "sub" / "loop").symlink_to(d, target_is_directory=True)
    (d / "again.py").symlink_to(d / "a.py")
    assert [os.path.relpath(p, d) for p in data.source_files(str(d))] == ["a.py", "sub/b.py"]


# -----------------------------------------------------------------------------
# 6. and 7. One line, before work, that says what to do


def test_a_chat_template_that_raises_anything_is_one_line():
    with pytest.raises(ValueError, match="chat template fails .*OverflowError"):
        console.chat_prompt("{{ 10.0 ** 400 }}", "hi", {})


def test_numbers_in_a_config_file_are_checked_finite(tmp_path):
    path = tmp_path / "run"
    saving.save(tiny(), checkpoint.byte_tokenizer(), str(path))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps(cfg).replace('"rope_theta": 10000.0', '"rope_theta": NaN')
    )
    with pytest.raises(ValueError, match="rope_theta=nan must be a positive, finite number"):
        checkpoint.load(str(path))


def test_bench_prints_its_rows_before_a_json_file_that_fails(tmp_path, capsys, monkeypatch):
    import bench.__main__ as bm

    monkeypatch.setattr(bm.eviction, "bench_eviction", lambda *a: [dict(layer=0, share=0.5)])
    real_open = open

    def full_open(path, mode="r", *a, **kw):
        if str(path).endswith("rows.json") and "w" in mode:
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr("builtins.open", full_open)
    with pytest.raises(SystemExit):
        bm.cli(["eviction", "--json", str(tmp_path / "rows.json")])
    cap = capsys.readouterr()
    assert "layer | share" in cap.out and "0 | 0.5" in cap.out
    assert "the rows are above" in cap.err and cap.err.count("\n") == 1


def test_bench_eviction_reads_a_checkpoint_whose_k_B_is_long(tmp_path):
    """A released model selects k·B = 4096 tokens, more than the default windows: they grow to
    2 k·B within max_seq_len, and where no window can be longer than k·B, one line (it was a
    negative shape)."""
    from bench.eviction import bench_eviction

    path = tmp_path / "long"
    cfg = Config.from_preset("tiny", n_layer=1, dim=32, hidden_dim=64, B=16, k=16, max_seq_len=256)
    saving.save(Transformer(cfg), checkpoint.byte_tokenizer(), str(path))
    with pytest.raises(ValueError, match="no window is sparse"):
        bench_eviction(str(path), windows=1, T=100)


def test_a_prompt_file_that_is_not_a_file_and_an_oom_are_one_line(capsys, monkeypatch):
    err = one_line(capsys, generate.cli, ["--prompt-file", "/dev/zero", "--device", "cpu"])
    assert "/dev/zero is not a regular file" in err

    def oom(**kw):
        raise MemoryError()

    monkeypatch.setattr(generate, "main", oom)
    assert "out of memory" in one_line(capsys, generate.cli, ["--device", "cpu"])


def test_a_batch_far_too_large_is_one_line_before_work(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("x = 1\n" * 100)
    args = ["--data", str(corpus), "--data-dir", str(tmp_path / "d"), "--out", str(tmp_path / "o")]
    err = one_line(capsys, train.cli, args + ["--batch-size", "10000000", "--device", "cpu"])
    assert "the logits alone take" in err and not (tmp_path / "d").exists()


def test_a_negative_step_in_train_state_is_refused(tmp_path):
    run = dict(seq_len=64, batch_size=2, warmup=1, device="cpu", n_layer=1, dim=32)
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    kw = dict(data=str(corpus), data_dir=str(tmp_path / "data"), out=str(tmp_path / "o"), **run)
    train.main(steps=2, eval_every=2, **kw)
    state = tmp_path / "o" / "train_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": -3}))
    with pytest.raises(ValueError, match="its step is -3, not a count of steps"):
        train.main(steps=2, resume=True, **kw)


# -----------------------------------------------------------------------------
# 8. The README's examples from anywhere


def test_the_shipped_prompt_and_requests_work_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = generate.cli(
        ["--prompt-file", "prompt.txt", "--max-new-tokens", "2", "--quiet", "--device", "cpu"]
    )
    assert len(out) == 1
    # fmt: skip
    got = generate.cli(
        [
            "--requests",
            "requests.jsonl",
            "--batch",
            "2",
            "--offload",
            "--completions",
            "out/c.jsonl",
            "--max-new-tokens",
            "3",
            "--quiet",
            "--device",
            "cpu",
        ]
    )
    assert len(got) == 3 and len((tmp_path / "out" / "c.jsonl").read_text().splitlines()) == 3
    shutil.rmtree(tmp_path / "out")


def test_a_bench_budget_that_fits_no_batch_is_not_a_result(capsys):
    """The weights fit, no batch does: the rows are printed (batch 0), and the run fails in one
    line instead of reporting them as a result."""
    from bench.__main__ import cli

    args = ["requests", "--shape", "tiny", "--gpu-budget", "0.019", "--prompt-len", "64"]
    with pytest.raises(SystemExit) as e:
        cli(args + ["--requests", "1", "--max-new-tokens", "8", "--steps", "2"])
    cap = capsys.readouterr()
    assert e.value.code == 2 and "fits no batch of any system" in cap.err
    assert cap.err.count("\n") == 1
