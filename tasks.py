"""
Synthetic long-range recall tasks in code form, mixed into training (train.py --tasks) and measured
by python -m bench recall: a fact is stated once, real code from the corpus follows, and at the end
an assertion needs the fact; the answer is what a model must produce.

  passkey   assert SECRET_4711 == 83520    ...  assert SECRET_4711 == 83520
  needle    assert KEY_ab_0 == 12, assert KEY_cd_1 == 907, ... (distractors)  ...  assert KEY_cd_1 == 907
  chain     a = 7  ...  b = a  ...  c = b  ...  assert c == 7        (variable tracking)

For the passkey and the needle the question ends with the very tokens that come before the value in
the fact (as RULER's passkey repeats "The pass key is"), so the value can be copied by matching
what precedes it. Stated as an assignment (`SECRET_4711 = 83520`) the two differ in the token before
the value (` =` against ` ==`) and in the name's first token (a leading space or not), and tiny
models trained with such tasks learned nothing of them (docs/LOG.md). The chain needs two hops.

A task is assembled from tokens: filler windows of the corpus, the fact's tokens at an exact distance
before the question, so that the answer's block lies where the test puts it: past the window and the
sinks once the distance exceeds (n_win + 1)·B. Everything is drawn from a numpy generator, so a seed
fixes the task.
"""

import numpy as np

KINDS = ("passkey", "needle", "chain")


def encode(tok, text):
    return tok.encode(text).ids


def task_pieces(kind, rng):
    """The texts of one task: (facts, question, answer): facts in the order they appear (the needle's
    asked one first, the farthest back; the chain's links in order), each on a line of its own in the
    filler. The answer keeps its leading space, as the fact has it (" 83520"): the tokenizer
    splits off a space with the word after it, so the answer's tokens are the fact's, and the model
    can copy them."""
    if kind == "passkey":
        name, value = f"SECRET_{rng.integers(1000, 10000)}", int(rng.integers(10000, 100000))
        return [f"\nassert {name} == {value}\n"], f"\nassert {name} ==", f" {value}\n"
    if kind == "needle":
        names = rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=(4, 2))
        keys = [f"KEY_{''.join(n)}_{i}" for i, n in enumerate(names)]
        values = [int(v) for v in rng.integers(10, 1000, size=4)]
        asked = int(rng.integers(0, 4))
        # the asked fact first: the farthest back
        order = [asked] + [i for i in range(4) if i != asked]
        facts = [f"\nassert {keys[i]} == {values[i]}\n" for i in order]
        return facts, f"\nassert {keys[asked]} ==", f" {values[asked]}\n"
    if kind == "chain":
        a, b, c = (
            f"{x}{rng.integers(0, 100)}" for x in rng.choice(list("uvwxyz"), size=3, replace=False)
        )
        value = int(rng.integers(0, 100))
        return (
            [f"\n{a} = {value}\n", f"\n{b} = {a}\n", f"\n{c} = {b}\n"],
            f"\nassert {c} ==",
            f" {value}\n",
        )
    raise ValueError(f"unknown task {kind!r}; choose one of {KINDS}")


def make_task(kind, tok, filler, length, distance, rng):
    """One task as `length` tokens ending with its answer: filler (a 1-D array of corpus tokens) around
    the facts, the first fact `distance` tokens before the question's end. Returns (ids (length,),
    where the answer starts, the answer's length, where the first fact starts)."""
    facts, question, answer = task_pieces(kind, rng)
    facts = [encode(tok, f) for f in facts]
    q, a = encode(tok, question), encode(tok, answer)
    n_fact = sum(map(len, facts))
    distance = int(min(max(distance, n_fact + len(q)), length - len(a)))
    gap = distance - n_fact - len(q)  # filler tokens between the first fact and the question
    cuts = (
        np.sort(rng.integers(0, gap + 1, size=len(facts) - 1))
        if len(facts) > 1
        else np.zeros(0, int)
    )
    spans = np.diff(np.concatenate([[0], cuts, [gap]]))  # filler after each fact
    start = int(rng.integers(0, len(filler) - length))
    pool = iter(filler[start : start + length])
    before = length - len(a) - distance
    ids = [next(pool) for _ in range(before)]
    fact_at = len(ids)
    for f, n in zip(facts, spans):
        ids += f + [next(pool) for _ in range(int(n))]
    ids += q
    answer_at = len(ids)
    ids += a
    assert len(ids) == length, (len(ids), length)
    return np.array(ids, dtype=np.int64), answer_at, len(a), fact_at


def mix_tasks(x, fraction, tok, filler, rng, min_distance=16):
    """Replace a fraction of the rows of a batch x (Bz, T+1) int64 with tasks of a random kind at a
    random distance up to the row's length (data.get_batch with --tasks), in place. Returns the
    answers' spans [(row, where the answer starts, its length)]."""
    length, answers = x.shape[1], []
    for r in range(x.shape[0]):
        if rng.random() < fraction:
            kind = KINDS[int(rng.integers(0, len(KINDS)))]
            distance = int(rng.integers(min_distance, length - 8))
            x[r], at, n, _ = make_task(kind, tok, filler, length, distance, rng)
            answers.append((r, at, n))
    return answers
