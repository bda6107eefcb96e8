"""
The training data: a corpus's documents -> a byte-level BPE -> token streams cached on disk, and
random windows of them (with long-range recall tasks mixed in, tasks.py). The default corpus is the
Python standard library's own source and pydoc topics, read from the running interpreter: text that
every machine has, no download.
"""

import glob
import hashlib
import json
import os
import re
import sysconfig

import numpy as np
import torch

import tasks as recall
from checkpoint import EOT

# CPython 3.11.7's standard library (9.0M training tokens): the embedded model's and BENCHMARKS.md's
STDLIB_CORPUS = "fd99d1cd9f50"
LONGEST_WORD = 10000  # characters without whitespace a corpus's text may run to


def source_files(data=None):
    """The files a corpus is read from: under `data` (a file or a directory), else the standard
    library's .py sources (and pydoc_data's topics)."""
    if not data:
        from pydoc_data import topics

        root = sysconfig.get_paths()["stdlib"]
        return sorted(
            p
            for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
            if "site-packages" not in p
        ) + [topics.__file__]
    paths = [data] if os.path.isfile(data) else walk(data)
    if not paths:
        raise FileNotFoundError(
            f"--data {data!r}: no files found; give a text file or a directory of them"
        )
    return paths


def walk(root):
    """The files under root, sorted, hidden ones left out, each file and directory once however
    many links lead to it (a link to a folder above it is not a loop)."""
    seen_dirs, seen_files, out = set(), set(), []
    for d, dirs, files in os.walk(root, followlinks=True):
        if os.path.realpath(d) in seen_dirs:
            dirs[:] = []
            continue
        seen_dirs.add(os.path.realpath(d))
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for f in files:
            p = os.path.join(d, f)
            if not f.startswith(".") and os.path.isfile(p):
                out.append(p)
    out.sort()
    unique = []
    for p in out:  # the first of the paths to one file
        if os.path.realpath(p) not in seen_files:
            seen_files.add(os.path.realpath(p))
            unique.append(p)
    return unique


def corpus_id(data=None):
    """A hash of the corpus's files (their names and contents): the cache of its token streams is
    rebuilt when any of them changes, and a checkpoint records what it was trained on; the same
    files give the same hash on any machine."""
    h = hashlib.sha1()
    for p in source_files(data):
        h.update(os.path.relpath(p, data or sysconfig.get_paths()["stdlib"]).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(hashlib.sha1(f.read()).digest())
    return h.hexdigest()[:12]


def documents(data=None):
    """(name, text) pairs: the UTF-8 text files under `data` (a file or a directory), else the standard
    library's .py sources and pydoc topics. Files that are not text are skipped, and said so; input
    that is mostly not text is refused."""
    paths = source_files(data)
    if not data:
        from pydoc_data import topics

        docs = [(f"pydoc:{k}", v) for k, v in sorted(topics.topics.items())]
        for p in paths[:-1]:
            with open(p, encoding="utf-8", errors="replace") as f:
                docs.append((p, f.read()))
        return docs
    docs, skipped, n_text, n_all = [], 0, 0, 0
    for p in paths:
        with open(p, "rb") as f:
            raw = f.read()
        n_all += len(raw)
        try:
            if b"\0" in raw:
                raise UnicodeDecodeError("utf-8", raw, 0, 1, "NUL byte")
            docs.append((p, raw.decode("utf-8")))
            n_text += len(raw)
        except UnicodeDecodeError:
            skipped += 1
    print(
        f"--data {data}: {len(docs)} text files, {n_text / 1e6:.2f} MB of text ({100 * n_text / max(n_all, 1):.0f}% "
        f"of the input); skipped {skipped} files that are not UTF-8 text"
    )
    if n_text == 0 or n_text < n_all / 2:
        raise ValueError(
            f"--data {data!r} is mostly not UTF-8 text ({n_text} of {n_all} bytes): point it at text "
            f"files"
        )
    for name, text in docs:  # a tokenizer learns words: a run this long would stall it for minutes
        run = re.search(r"\S{%d,}" % LONGEST_WORD, text)
        if run:
            raise ValueError(
                f"--data: {name} has a run of {len(run.group())} characters without whitespace "
                f"(at character {run.start()}), longer than a tokenizer can learn from in time "
                f"(at most {LONGEST_WORD}); split it, or leave the file out"
            )
    return docs


def is_val(name):
    """Split by document (5% to validation), stable across machines and runs."""
    return int(hashlib.sha1(os.path.basename(name).encode()).hexdigest(), 16) % 20 == 0


def token_dtype(vocab_size):
    """How the token streams store an id: uint16 while the vocabulary fits, else uint32."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def tokens(path, vocab_size):
    """A token stream on disk, as a read-only array."""
    return np.memmap(path, dtype=token_dtype(vocab_size), mode="r")


def fingerprint(tok):
    """A tokenizer's identity, the same on any machine and `tokenizers` version: its vocabulary
    and how it cuts a probe text (merges and pre-tokenizer)."""
    h = hashlib.sha1(json.dumps(sorted(tok.get_vocab(with_added_tokens=True).items())).encode())
    probe = "def f(x):\n\tif x == 12345:  # It's\n        return [x, 'y']  ünï €\r\n"
    h.update(str(tok.encode(probe * 3, add_special_tokens=False).ids).encode())
    return h.hexdigest()[:8]


def streams_dir(data_dir, corpus, vocab_size, tokenizer=None):
    """Where a corpus's token streams are cached: CORPUS-VOCAB for the BPE learned from it, and
    CORPUS-tokFINGERPRINT for a model's own tokenizer (CORPUS-VOCAB where it is that same BPE)."""
    own = os.path.join(data_dir, f"{corpus}-{vocab_size}")
    if tokenizer is None:
        return own
    from tokenizers import Tokenizer

    fp, learned = fingerprint(tokenizer), os.path.join(own, "tokenizer.json")
    if os.path.isfile(learned) and fingerprint(Tokenizer.from_file(learned)) == fp:
        return own
    return os.path.join(data_dir, f"{corpus}-tok{fp}")


def prepare(data_dir, vocab_size, data=None, tokenizer=None, end=EOT):
    """Write train.bin / val.bin (token_dtype) once, and reuse them after: the text encoded with
    `tokenizer` (a model's own, for continued training), else with a BPE learned from it here.
    Each document ends with the token `end`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_path = os.path.join(data_dir, "tokenizer.json")
    if all(
        os.path.exists(os.path.join(data_dir, f))
        for f in ("tokenizer.json", "train.bin", "val.bin")
    ):
        return Tokenizer.from_file(tok_path)
    if tokenizer is not None and tokenizer.token_to_id(end or "") is None:
        raise ValueError(
            f"the model's tokenizer has no {end or 'end-of-text'} token to end documents"
        )
    docs = documents(data)
    os.makedirs(data_dir, exist_ok=True)
    val = {name for name, _ in docs if is_val(name)}
    # too few documents to hold some out: hold out the last 5% of each instead
    if len(val) in (0, len(docs)):
        cut = [(name, int(0.95 * len(text))) for name, text in docs]
        docs = [(f"{n}:train", t[:c]) for (n, t), (_, c) in zip(docs, cut)] + [
            (f"{n}:val", t[c:]) for (n, t), (_, c) in zip(docs, cut)
        ]
        val = {name for name, _ in docs if name.endswith(":val")}
    mb = sum(map(len, (t for _, t in docs))) / 1e6
    how = "the model's tokenizer" if tokenizer else f"a {vocab_size}-token BPE learned from it"
    print(
        f"preparing the corpus (once): {mb:.1f} MB of text, with {how}, as token streams in "
        f"{data_dir}",
        flush=True,
    )
    tok = tokenizer
    if tok is None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator((text for name, text in docs if name not in val), trainer)
    eot = tok.token_to_id(end)
    for split in ("train", "val"):
        texts = [text for name, text in docs if (name in val) == (split == "val")]
        encoded = tok.encode_batch(texts, add_special_tokens=False)  # no BOS: EOT separates
        ids = [i for enc in encoded for i in enc.ids + [eot]]
        np.array(ids, dtype=token_dtype(vocab_size)).tofile(os.path.join(data_dir, f"{split}.bin"))
    tok.save(tok_path)
    return tok


def get_batch(
    data, batch_size, T, *, seed, step, rank, device, tasks=0.0, tok=None, answer_weight=1.0
):
    """Random windows of T+1 tokens, a fraction `tasks` of them replaced by long-range recall tasks
    (tasks.py, their filler from the same data); the draw depends only on (seed, step, rank), so a
    resumed run sees exactly the batches the uninterrupted one would have. Returns inputs, targets
    and the targets' weights in the loss: None (all alike) unless the tasks' answers weigh more."""
    rng = np.random.default_rng([seed, step, rank])
    ix = rng.integers(0, len(data) - T - 1, size=batch_size)
    x = np.stack([data[i : i + T + 1].astype(np.int64) for i in ix])
    answers = recall.mix_tasks(x, tasks, tok, data, rng) if tasks else []
    w = None
    if answer_weight != 1.0:
        w = np.ones((batch_size, T), dtype=np.float32)
        for r, at, n in answers:
            w[r, at - 1 : at - 1 + n] = answer_weight  # target i is token i + 1
        w = torch.from_numpy(w).to(device, non_blocking=True)
    x = torch.from_numpy(x).to(device, non_blocking=True)
    return x[:, :-1], x[:, 1:], w
