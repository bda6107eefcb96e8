"""The quality benchmarks on CPU (bench eviction, quality, recall, pretrained's paired difference):
planted blocks and facts found, a gradient against a finite difference, captured attention against a
slow reference, and each bench end to end on the embedded model."""

import pytest
import torch

import pooling
from config import Config


def test_eviction_diagnostic_finds_planted_blocks():
    """Where the bias c makes attention go to a few old blocks, the core chosen by E holds (nearly)
    all of the candidates' attention mass, recency and random choices little of it."""
    from bench.eviction import layer_shares, mass_share

    assert mass_share(
        torch.tensor([1.0, 2.0, 3.0, 4.0]),
        torch.tensor([False, True, False, True]),
        torch.tensor([True, True, False, True]),
    ).item() == pytest.approx(6.0 / 7.0)
    cfg = Config.from_preset(
        "tiny", B=8, l_c=4, s_c=2, n_sink=1, n_win=2, k=8, k_q=2, H_q=4, H_kv=2, head_dim=16
    )
    T = 400
    q, k = 0.1 * torch.randn(1, 4, T, 16), 0.1 * torch.randn(1, 2, T, 16)
    c = torch.zeros(1, 2, T)
    for b in (2, 5, 9):  # three old blocks that every later query should attend to
        c[..., b * cfg.B : (b + 1) * cfg.B] = 8.0
    by_e, by_recency, at_random = layer_shares(
        q, k, c, cfg, cfg.k * cfg.B, torch.Generator().manual_seed(0)
    )
    assert by_e > 0.99 and by_recency < 0.2 and at_random < 0.5


@pytest.mark.slow
def test_eviction_at_the_question_finds_a_planted_fact(monkeypatch):
    """bench recall's view of the eviction head: where c is large on the fact's tokens (planted), c
    stands far above the rest, E ranks the fact's block first and the dense attention goes there;
    with the model's own c the same measures are ordinary values."""
    import numpy as np

    import checkpoint
    import eviction
    import tasks
    from bench.recall import eviction_at_the_question, value_at

    model, tok = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT)
    filler = np.array(tok.encode(open(tasks.__file__).read() * 20).ids)
    case = tasks.make_task("passkey", tok, filler, 500, 400, np.random.default_rng(0))
    ids, at, n, fact_at = case
    v = value_at(case)
    assert fact_at < v < at and ids[v : v + n].tolist() == ids[at:].tolist()
    with torch.no_grad():
        own = eviction_at_the_question(model, ids.tolist(), at - 1, v, n)
    assert all(0 <= r["E_rank_fact"] <= 1 and 0 <= r["dense_fact"] <= 1 for r in own.values())
    score = eviction.eviction_score

    def planted(values, A, W):
        c = torch.zeros_like(score(values, A, W))
        c[..., v : v + n] = 30.0  # as a bias inside the softmax it outweighs any logit of the model
        return c

    monkeypatch.setattr(eviction, "eviction_score", planted)
    with torch.no_grad():
        rows = eviction_at_the_question(model, ids.tolist(), at - 1, v, n)
    assert all(
        r["c_fact_z"] > 3 and r["E_rank_fact"] == 1 and r["dense_fact"] > 0.9 for r in rows.values()
    ), rows


def test_gradient_on_the_value_is_the_loss_derivative():
    """bench recall's gradient of the answer's loss by c on the fact's value: a finite difference of
    the loss, with c moved by ±eps on the value's tokens of every layer and head, agrees (fp64). The
    task is shorter than k·B, so every block is selected and c acts through the bias alone (the
    selection by E has no gradient, which is the point of the measure)."""
    import numpy as np

    import checkpoint
    import tasks
    from bench.recall import gradient_on_the_value, value_at

    model, tok = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT)
    model = model.double()
    filler = np.array(tok.encode(open(tasks.__file__).read() * 20).ids)
    case = tasks.make_task("passkey", tok, filler, 240, 200, np.random.default_rng(1))
    ids, at, n, _ = case
    on, elsewhere = gradient_on_the_value(model, case)
    eps = 1e-4
    slope = (gradient_on_the_value(model, case, eps) - gradient_on_the_value(model, case, -eps)) / (
        2 * eps
    )
    entries = n * model.cfg.n_layer * model.cfg.H_kv  # on is a mean of -dL/dc over these
    assert value_at(case) > case[3] and elsewhere > 0
    assert slope == pytest.approx(-on * entries, rel=1e-4, abs=1e-9)


@pytest.mark.slow
def test_quality_bench_on_the_embedded_model(tmp_path):
    """python -m bench quality, small: the embedded model's loss is a trained model's, its generation
    through the offload engine keeps the theorem's hit rate, and bad arguments fail before any work."""
    import shutil

    import checkpoint
    from bench.quality import bench_quality

    shutil.copytree(checkpoint.DEFAULT_CHECKPOINT, tmp_path / "tiny-nosa")
    with pytest.raises(ValueError, match="unknown system"):
        bench_quality(tmp_path, systems=("nosa", "sliding"))
    # the default judge is tiny-full
    with pytest.raises(FileNotFoundError, match="train.py --attn full"):
        bench_quality(tmp_path, systems=("nosa",))
    (row,) = bench_quality(
        tmp_path,
        systems=("nosa",),
        judge=checkpoint.DEFAULT_CHECKPOINT,
        max_new_tokens=300,
        windows=2,
        n_prompts=2,
    )
    cfg = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT)[0].cfg
    assert row["val_loss_sparse_part"] < 3.5  # an untrained model: ln(vocab) = 8.3
    assert cfg.k_e / (cfg.k - 1) <= row["hit_rate"] <= 1
    assert 0 < row["gen_distinct_4grams_last_kB"] <= 1 and row["gen_judge_loss_last_kB"] > 0


@pytest.mark.slow
def test_eviction_bench_on_the_embedded_model():
    """python -m bench eviction end to end (one short window): a row per rule and InfLLMv2's, each
    share between 0 and 1, the oracle at least recency's, and "held" the mean of the layers."""
    from bench.eviction import RULES, bench_eviction

    rows = bench_eviction(windows=1, T=400)
    by = {r["E by"]: r for r in rows}
    assert set(by) == set(RULES) | {"InfLLMv2 (no core)"}
    for r in rows:
        assert len(r["layers"]) == 4 and all(0 < x <= 1 for x in r["layers"])
        assert r["held"] == pytest.approx(sum(r["layers"]) / 4, abs=1e-3)
    assert by["oracle"]["held"] >= by["recency"]["held"]


def test_captured_attention_matches_a_slow_reference():
    """layer_captured against a loop over heads and queries that builds Γ(t) by hand: the forced
    blocks, the k_q - 1 best others by Q (ties: the later block), then the core, the n_core best of
    the rest by E (recency: the latest; heavy hitter and oracle computed from the mass here), or
    for InfLLMv2 k_q - 1 + n_core more by Q."""
    from bench.eviction import block_mass, layer_captured

    torch.manual_seed(0)
    cfg = Config.from_preset(
        "tiny", B=8, l_c=4, s_c=2, n_sink=1, n_win=2, k=7, k_q=3, H_q=4, H_kv=2, head_dim=16
    )
    T, t0 = 120, cfg.k * cfg.B
    q, k = torch.randn(1, cfg.H_q, T, 16), torch.randn(1, cfg.H_kv, T, 16)
    c = torch.rand(1, cfg.H_kv, T)
    mass = block_mass(q, k, c, cfg, 0)  # (H_kv, T, nb)
    got = layer_captured(q, k, c, mass, cfg, t0, generator=torch.Generator().manual_seed(0))
    nb = mass.shape[-1]
    Q = pooling.query_aware_scores(
        q[:, :, t0:], pooling.compress_keys(k, cfg), torch.arange(t0, T)[None], nb, cfg
    )[0]
    blk = torch.arange(T) // cfg.B
    heavy = torch.stack(
        [mass[:, (blk >= b) & (blk <= b + cfg.n_win), b].sum(1) for b in range(nb)], -1
    )
    seen = [[t for t in range(t0, T) if cfg.n_sink <= b < blk[t] - cfg.n_win] for b in range(nb)]
    oracle = torch.stack(
        [mass[:, s, b].mean(1) if s else torch.zeros(cfg.H_kv) for b, s in enumerate(seen)], -1
    )
    E = {"recency": torch.zeros(cfg.H_kv, nb), "heavy hitter": heavy, "oracle": oracle}

    def best(score, blocks, n):  # the n best of blocks by score, ties to the later block
        return sorted(blocks, key=lambda b: (score[b], b), reverse=True)[:n]

    for rule in ("recency", "heavy hitter", "oracle", "infllmv2"):
        held = []
        for h in range(cfg.H_kv):
            for i, t in enumerate(range(t0, T)):
                qb = int(blk[t])
                forced = [b for b in range(qb + 1) if b < cfg.n_sink or b >= qb - cfg.n_win]
                cand = [b for b in range(qb + 1) if b not in forced]
                n_q = cfg.k - len(forced) if rule == "infllmv2" else cfg.k_q - 1
                by_q = best(Q[h, i].tolist(), cand, n_q)
                rest = [b for b in cand if b not in by_q]
                core = [] if rule == "infllmv2" else best(E[rule][h].tolist(), rest, cfg.n_core)
                held.append(sum(mass[h, t, b].item() for b in forced + by_q + core))
        assert got[rule][0] == pytest.approx(sum(held) / len(held), abs=1e-5), rule


@pytest.mark.slow
def test_recall_bench_on_the_embedded_model(tmp_path, monkeypatch):
    """python -m bench recall, small: accuracy per distance, the offload engine's hit rate within the
    theorem's bound, and where the fact's block stood (shares that add up to 1); a bin the context
    cannot hold is skipped."""
    import json
    import shutil

    import checkpoint
    from bench.recall import bench_recall

    shutil.copytree(checkpoint.DEFAULT_CHECKPOINT, tmp_path / "tiny-nosa")
    cfg = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT)[0].cfg
    # cases of max_seq_len tokens: with the longest answer after every prompt, too long
    far = cfg.max_seq_len - 64
    rows = bench_recall(
        tmp_path,
        systems=("nosa",),
        distances=(100, 400, far),
        n=3,
        where_cases=2,
        json_path=tmp_path / "rows.json",
    )
    assert [r["distance"] for r in rows] == [100, 400] and all(
        0 <= r["accuracy"] <= 1 for r in rows
    )
    assert json.load(open(tmp_path / "rows.json")) == rows
    import generate  # a run that stops in its second bin has written the first

    calls, real = [], generate.generate

    def stop_in_the_second_bin(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(generate, "generate", stop_in_the_second_bin)
    with pytest.raises(KeyboardInterrupt):
        bench_recall(
            tmp_path,
            systems=("nosa",),
            distances=(100, 400),
            n=3,
            where_cases=2,
            json_path=tmp_path / "stopped.json",
        )
    assert json.load(open(tmp_path / "stopped.json")) == rows[:1]
    for r in rows:
        assert cfg.k_e / (cfg.k - 1) <= r["hit_rate"] <= 1
        assert sum(r[f"fact_{k}"] for k in ("forced", "Q", "E", "none")) == pytest.approx(
            1, abs=0.01
        )
    assert rows[0]["fact_forced"] == 1  # at 100 tokens every block is selected (k·B = 256)
    assert rows[1]["fact_forced"] < 1  # at 400 the fact lies past the window
    assert 0 <= rows[1]["dense_fact"] <= 1 and 0 <= rows[1]["E_rank_fact"] <= 1


@pytest.mark.slow
def test_head_only_training_moves_the_head_alone():
    """bench head: train_head changes A and W_δ and nothing else; from A = 1, W_δ = 0 c is constant (no
    standing of the value to report) until a step has trained W_δ."""
    import numpy as np

    import checkpoint
    from bench.recall import bench_head, held_out_tokens, train_head

    model, tok = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    val = held_out_tokens(checkpoint.DEFAULT_CHECKPOINT, tok)
    losses = train_head(model, tok, val, 2, np.random.default_rng(0), batch=1, length=400)
    assert len(losses) == 2 and all(np.isfinite(losses))
    moved = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and all(k.endswith(("self_attn.A", "self_attn.delta.weight")) for k in moved), (
        moved
    )
    rows = bench_head(steps=1, distances=(300,), n=2, where_cases=1)
    assert [(r["init"], r["phase"]) for r in rows] == [
        ("as trained", "before"),
        ("as trained", "after"),
        ("A = 1, W_δ = 0", "before"),
        ("A = 1, W_δ = 0", "after"),
    ]
    assert (
        rows[2]["c_fact_z"] is None
        and rows[3]["c_fact_z"] is not None
        and rows[2]["mean_abs_A"] == 1
    )
    for r in rows:
        assert np.isfinite(r["answer_loss"]) and np.isfinite(r["text_loss"])
        assert sum(r[f"fact_{k}"] for k in ("Q", "E", "none")) <= 1 + 1e-9


def test_paired_difference_against_a_hand_computation():
    """bench pretrained's error of a difference: taken window by window, so a system 2% behind on
    every window is 2% behind with no error, however far apart the windows are."""
    from bench.pretrained import paired

    mean, se = paired([1.02, 2.04, 0.51], [1.0, 2.0, 0.5])
    assert abs(mean - 2) < 1e-9 and se < 1e-9
    mean, se = paired([1.01, 1.03], [1.0, 1.0])  # 1% and 3%: mean 2, sd sqrt(2), se 1
    assert abs(mean - 2) < 1e-9 and abs(se - 1) < 1e-9
