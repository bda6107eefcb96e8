"""The corpus and the batches: text files made into token streams (cached by the files' identity,
or prepared on another machine), what is refused before the tokenizer starts, recall tasks mixed
into training, the answer weight, and vocabularies past 65536 ids."""

import json
import os

import pytest
import torch

import checkpoint
import data
import train
from tests.test_train import run, small


def test_data_that_is_not_text_is_refused(tmp_path, corpus):
    d = tmp_path / "binary"
    d.mkdir()
    for i in range(3):
        (d / f"blob{i}.bin").write_bytes(os.urandom(20000))
    with pytest.raises(ValueError, match="mostly not UTF-8 text"):
        train.main(
            out=str(tmp_path / "ck"), data=str(d), data_dir=str(tmp_path / "data"), **run, **small
        )
    # mostly text now: it trains
    (d / "notes.txt").write_text(open(os.path.join(corpus, "argparse.py")).read())
    train.main(
        out=str(tmp_path / "ck"),
        data=str(d),
        data_dir=str(tmp_path / "data"),
        steps=1,
        **run,
        **small,
    )


def test_the_corpus_cache_follows_its_files(corpus, tmp_path):
    """The token streams are cached by the files' identity (names, sizes, times), not by the --data
    path: a directory that was too small trains once text is added to it."""
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.py").write_text("x = 1\n" * 20)
    kw = dict(data=str(d), data_dir=str(tmp_path / "data"), steps=1, eval_every=1, **run, **small)
    with pytest.raises(ValueError, match="corpus too small"):
        train.main(out=str(tmp_path / "ck"), **kw)
    for name in os.listdir(corpus):  # some 300 KB more
        (d / name).write_text(open(os.path.join(corpus, name)).read())
    train.main(out=str(tmp_path / "ck"), **kw)
    state = json.load(open(tmp_path / "ck" / "train_state.json"))
    assert state["corpus"] == data.corpus_id(str(d)) and state["train_tokens"] > 10000


def test_training_on_a_prepared_corpus_without_its_files(corpus, tmp_path):
    """--corpus ID trains on the token streams prepared for that corpus (another machine's standard
    library, copied as data/ID-VOCAB) without reading any files; an id without them is refused."""
    kw = dict(data_dir=str(tmp_path / "data"), steps=2, eval_every=2, **run, **small)
    train.main(out=str(tmp_path / "a"), data=corpus, **kw)
    cid = data.corpus_id(corpus)
    _, val = train.main(out=str(tmp_path / "b"), corpus=cid, **kw)
    assert json.load(open(os.path.join(tmp_path, "b", "train_state.json")))["corpus"] == cid
    with pytest.raises(FileNotFoundError, match="--corpus 0123456789ab: no prepared token streams"):
        train.main(out=str(tmp_path / "c"), corpus="0123456789ab", **kw)


def test_recall_tasks(corpus, tmp_path):
    """tasks.py: each kind puts its first fact exactly `distance` tokens before the question's end and
    ends with the answer, the same for the same seed; training mixes them in (--tasks) and resumes
    exactly."""
    import numpy as np

    import tasks

    tok = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT)[1]
    filler = np.array(tok.encode(open(os.path.join(corpus, "argparse.py")).read()).ids)
    for kind in tasks.KINDS:
        for distance in (100, 300, 590):
            ids, at, n, fact = tasks.make_task(
                kind, tok, filler, 600, distance, np.random.default_rng(7)
            )
            again = tasks.make_task(kind, tok, filler, 600, distance, np.random.default_rng(7))[0]
            facts, question, answer = tasks.task_pieces(kind, np.random.default_rng(7))
            assert (
                len(ids) == 600
                and at + n == 600
                and at - fact == distance
                and np.array_equal(ids, again)
            )
            assert tok.decode(ids[at:].tolist()) == answer and tok.decode(
                ids[fact:].tolist()
            ).startswith(facts[0])
            assert tok.decode(ids[:at].tolist()).endswith(question)
            # the answer is token for token a copy from the fact
            answer_ids = tok.encode(answer).ids
            assert tok.encode(facts[0]).ids[-len(answer_ids) :] == answer_ids, (
                kind,
                facts[0],
                answer,
            )
            if kind != "chain":  # and what precedes it there is the question, token for token
                assert tok.encode(facts[0]).ids[: -len(answer_ids)] == tok.encode(question).ids, (
                    kind,
                    facts[0],
                )
    kw = dict(
        data=corpus,
        data_dir=str(tmp_path / "data"),
        steps=4,
        eval_every=2,
        tasks=0.5,
        **run,
        **small,
    )
    ref, _ = train.main(out=str(tmp_path / "a"), **kw)
    half, _ = train.main(out=str(tmp_path / "b"), stop_at=2, **kw)
    half = {n: t.clone() for n, t in half.state_dict().items()}
    resumed, _ = train.main(out=str(tmp_path / "b"), resume=True, **kw)
    assert all(
        torch.equal(x, y) for x, y in zip(ref.state_dict().values(), resumed.state_dict().values())
    )
    with pytest.raises(ValueError, match="--resume: the run in .* give --tasks"):
        train.main(out=str(tmp_path / "b"), resume=True, **{**kw, "tasks": 0.1, "steps": 6})
    # the same batches,
    weighted, _ = train.main(out=str(tmp_path / "c"), stop_at=2, answer_weight=50.0, **kw)
    # the answers weighing more
    assert not all(torch.equal(half[n], t) for n, t in weighted.state_dict().items())
    with pytest.raises(ValueError, match="--resume: the run in .* give --answer-weight"):
        train.main(out=str(tmp_path / "c"), resume=True, **kw)


def test_answer_weight(corpus):
    """--answer-weight: the weight lies on exactly the targets that are a task's answer (' 83520\n' after
    'assert NAME =='), and the loss is the weighted mean of the tokens' losses."""
    import re

    import numpy as np

    tok = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT)[1]
    data = np.array(
        tok.encode(open(os.path.join(corpus, "argparse.py")).read() * 3).ids, dtype=np.uint16
    )
    x, y, w = train.get_batch(
        data,
        6,
        400,
        seed=1,
        step=3,
        rank=0,
        device=torch.device("cpu"),
        tasks=1.0,
        tok=tok,
        answer_weight=8.0,
    )
    for r in range(6):
        at = (w[r] == 8.0).nonzero().flatten()
        assert (
            len(at) > 0
            and torch.equal(at, torch.arange(at[0], at[-1] + 1))
            and torch.all(w[r][w[r] != 8.0] == 1)
        )
        assert re.fullmatch(r" \d+\n", tok.decode(y[r, at].tolist())), tok.decode(y[r, at].tolist())
        assert re.search(r"assert \w+ ==$", tok.decode(x[r, : at[0] + 1].tolist()))
    assert (
        train.get_batch(
            data, 6, 400, seed=1, step=3, rank=0, device=torch.device("cpu"), tasks=1.0, tok=tok
        )[2]
        is None
    )
    logits = torch.randn(6, 400, tok.get_vocab_size())
    each = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten(), reduction="none"
    ).view(6, 400)
    assert torch.allclose(train.lm_loss(logits, y, w), (each * w).sum() / w.sum())
    assert torch.allclose(train.lm_loss(logits, y), each.mean())
    with pytest.raises(ValueError, match="--answer-weight 5.0: .* with --tasks"):
        train.main(data=corpus, steps=1, answer_weight=5.0)


@pytest.mark.slow
def test_a_vocabulary_over_65536_ids_trains(corpus, tmp_path):
    """Token streams hold ids in a type wide enough for the vocabulary (the paper preset's is
    128256: uint16 would wrap its ids above 65535), and a run with such a vocabulary trains."""
    import numpy as np

    import data

    ids = np.array([0, 65535, 65536, 128255])
    path = str(tmp_path / "t.bin")
    ids.astype(data.token_dtype(128256)).tofile(path)
    assert data.tokens(path, 128256).tolist() == ids.tolist()
    assert data.token_dtype(4096) == np.uint16
    out = str(tmp_path / "big-vocab")
    _, val = train.main(
        out=out,
        data=corpus,
        data_dir=str(tmp_path / "data"),
        steps=2,
        eval_every=2,
        **run,
        **{**small, "vocab_size": 70000},
    )
    assert val > 0 and checkpoint.load(out)[0].cfg.vocab_size == 70000


def test_a_corpus_that_would_stall_the_tokenizer_is_refused_at_once(tmp_path, capsys):
    """A text file that is one long run without whitespace (the tokenizer learns words: a 3 MB one
    took minutes) is refused in one line that says where, before the tokenizer starts."""
    import time

    d = tmp_path / "texts"
    d.mkdir()
    (d / "ok.py").write_text("def f(x):\n    return x\n" * 50)
    (d / "blob.txt").write_text("intro\n" + "a" * 300_000)
    t0 = time.time()
    with pytest.raises(SystemExit):
        train.cli(
            [
                f"--data={d}",
                f"--data-dir={tmp_path / 'data'}",
                "--device=cpu",
                f"--out={tmp_path / 'run'}",
            ]
        )
    err = capsys.readouterr().err
    assert time.time() - t0 < 30 and err.count("\n") == 1, err
    assert "blob.txt has a run of 300000 characters without whitespace (at character 6)" in err
