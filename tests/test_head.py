"""Teaching the eviction head (docs/METHOD.md §8): the teacher is the dense attention block by block,
the distillation loss is the KL it says, it reaches both A and W_δ from a fresh head, it teaches E to
rank the blocks later queries attend to, and a run with the warm-up resumes bit for bit."""

import json
import math
import os

import pytest
import torch

import distill
import eviction
import pooling
import train
from config import Config
from model import Transformer
from tests.test_train import run, small

cfg = Config.from_preset(
    "tiny", B=8, l_c=4, s_c=2, n_sink=1, n_win=2, k=8, k_q=2, H_q=4, H_kv=2, head_dim=16
)


def test_the_teacher_is_the_dense_attention_summed_per_block():
    """attention_by_block against a loop over queries, heads and keys (fp64), with and without a bias."""
    Bz, S, d = 2, 50, 16
    q = torch.randn(Bz, 4, S, d, dtype=torch.float64)
    k = torch.randn(Bz, 2, S, d, dtype=torch.float64)
    bias = torch.randn(Bz, 2, S, dtype=torch.float64)
    t = torch.tensor([3, 17, 40, 49])
    for b in (None, bias):
        mass = eviction.attention_by_block(q[:, :, t], k, t, cfg, b)
        nb = cfg.n_blocks(S)
        ref = torch.zeros(Bz, 2, len(t), nb, dtype=torch.float64)
        for z in range(Bz):
            for h in range(4):
                for i, ti in enumerate(t.tolist()):
                    s = k[z, h // 2, : ti + 1] @ q[z, h, ti] / math.sqrt(d)
                    s = s + (0 if b is None else b[z, h // 2, : ti + 1])
                    p = torch.softmax(s, 0)
                    for j in range(ti + 1):
                        ref[z, h // 2, i, j // cfg.B] += p[j] / 2  # the mean over the group's 2
        torch.testing.assert_close(mass, ref)
        torch.testing.assert_close(mass.sum(-1), torch.ones(Bz, 2, len(t), dtype=torch.float64))


def test_the_output_teacher_is_each_blocks_change_of_the_output():
    """attention_by_block with v against a loop (fp64): per query head, |Σ_{j in b} p_j (v_j - o)|,
    o its output, averaged over the group; in passes of a few queries as in one; and a block whose
    values all equal the output changes nothing, whatever its mass."""
    Bz, S, d = 2, 50, 16
    q = torch.randn(Bz, 4, S, d, dtype=torch.float64)
    k = torch.randn(Bz, 2, S, d, dtype=torch.float64)
    v = torch.randn(Bz, 2, S, d, dtype=torch.float64)
    t = torch.tensor([3, 17, 40, 49])
    got = eviction.attention_by_block(q[:, :, t], k, t, cfg, v=v)
    nb = cfg.n_blocks(S)
    ref = torch.zeros(Bz, 2, len(t), nb, dtype=torch.float64)
    for z in range(Bz):
        for h in range(4):
            for i, ti in enumerate(t.tolist()):
                p = torch.softmax(k[z, h // 2, : ti + 1] @ q[z, h, ti] / math.sqrt(d), 0)
                o = p @ v[z, h // 2, : ti + 1]
                for b in range(ti // cfg.B + 1):  # a block after the query's: nothing
                    j = torch.arange(b * cfg.B, min((b + 1) * cfg.B, ti + 1))
                    a = (p[j, None] * (v[z, h // 2, j] - o)).sum(0)
                    ref[z, h // 2, i, b] += a.norm() / 2  # the mean over the group's 2
    torch.testing.assert_close(got, ref)
    old = eviction.OUTPUT_PASS
    try:
        eviction.OUTPUT_PASS = 1  # one query a pass
        torch.testing.assert_close(eviction.attention_by_block(q[:, :, t], k, t, cfg, v=v), got)
    finally:
        eviction.OUTPUT_PASS = old
    # one query, whose keys are all in blocks 0-1 and whose values are all one vector: no change
    flat = v.clone()
    flat[:, :, :16] = 1.0
    one = eviction.attention_by_block(q[:, :, [15]], k, torch.tensor([15]), cfg, v=flat)
    assert one.abs().max() < 1e-12 and got.gt(0).any()


def test_the_distillation_loss_is_the_kl_over_each_querys_candidates():
    """Against a loop: the teacher's mass on C(t), renormalised, against the softmax of E / tau over
    C(t); zero where the student equals the teacher, positive elsewhere."""
    Bz, S, tau = 2, 96, 0.3
    c = torch.randn(Bz, 2, S, dtype=torch.float64)
    t = torch.tensor([64, 71, 80, 95])
    mass = torch.rand(Bz, 2, len(t), cfg.n_blocks(S), dtype=torch.float64)
    loss = eviction.distillation_loss(c, mass, t, cfg, tau)
    E = eviction.eviction_block_scores(pooling.pool_mean(c, cfg), cfg.n_blocks(S), cfg)
    total = 0.0
    for z in range(Bz):
        for h in range(2):
            for i, ti in enumerate(t.tolist()):
                C = list(range(cfg.n_sink, ti // cfg.B - cfg.n_win))
                p = mass[z, h, i, C] / mass[z, h, i, C].sum()
                s = torch.softmax(E[z, h, C] / tau, 0)
                total += (p * (p / s).log()).sum()
    torch.testing.assert_close(loss, total / (Bz * 2 * len(t)))
    assert loss > 0
    # a teacher that is the student's own distribution: no loss
    b = torch.arange(E.shape[-1])
    cand = (b >= cfg.n_sink) & (b < (t // cfg.B)[:, None] - cfg.n_win)
    own = torch.softmax((E[:, :, None] / tau).masked_fill(~cand, -math.inf), -1)
    assert eviction.distillation_loss(c, own, t, cfg, tau).abs() < 1e-12


def test_at_A_zero_the_warmup_reaches_both_A_and_W_delta():
    """A fresh head (A = 0) gives W_δ exactly no gradient, from this loss as from the language
    model's; the warm-up starts A at TAU, and then every layer's A and W_δ learn."""
    model = Transformer(Config.from_preset("tiny", **small)).double()
    teacher = distill.Teacher(model)
    x = torch.randint(0, small["vocab_size"], (2, 128))
    for start in (False, True):
        model.zero_grad()
        if start:
            distill.start_head(model)
        teacher.queries(128, seed=0, step=0, rank=0, device="cpu")
        with torch.no_grad():  # as a warm-up step: no gradient through the model
            model(x)
        teacher.loss().backward()
        for layer in model.layers:
            a = layer.self_attn
            assert a.A.grad.abs().min() > 0
            assert (a.delta.weight.grad.abs().max() > 0) == start
            assert a.qkv_proj.weight.grad is None  # the rest of the model is not taught
    assert all(
        torch.equal(l.self_attn.A, torch.full((2,), distill.TAU, dtype=torch.float64))
        for l in model.layers
    )
    model(x)  # outside a training step the hooks stand aside
    assert teacher.losses == []


def test_distillation_teaches_E_to_keep_the_blocks_later_queries_attend_to():
    """A planted case: the keys of a dozen tokens match every query, and their values carry a mark.
    Taught by the loss alone (Adam, 200 steps), the head's core holds most of what the in-sample
    oracle's holds of the candidates' attention; the recent blocks (a fresh head's core) half as much."""
    from bench.eviction import mass_share, rule_scores

    g = torch.Generator().manual_seed(0)
    S, d, H = 256, 16, 2
    u = torch.randn(d, generator=g)
    u = 4 * u / u.norm()  # what every query looks for
    q = torch.randn(1, 2 * H, S, d, generator=g) + u
    k = torch.randn(1, H, S, d, generator=g)
    v = torch.randn(1, H, S, d, generator=g)
    key = torch.randint(0, S - 64, (12,), generator=g)
    k[0, :, key] += u
    v[0, :, key, 0] += 3.0  # their mark
    t = torch.arange(cfg.k * cfg.B, S)
    mass = eviction.attention_by_block(q[:, :, t], k, t, cfg)
    A = torch.full((H,), distill.TAU, requires_grad=True)
    W = (torch.randn(H, H * d, generator=g) / math.sqrt(H * d)).requires_grad_()
    opt = torch.optim.Adam([A, W], lr=3e-2)
    for _ in range(200):
        loss = eviction.distillation_loss(eviction.eviction_score(v, A, W), mass, t, cfg, 0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    nb = cfg.n_blocks(S)
    b, q_blk = torch.arange(nb), (t // cfg.B)[:, None]
    cand = (b >= cfg.n_sink) & (b < q_blk - cfg.n_win)

    def held(E):  # the candidates' attention the core by E holds
        core = eviction.core_blocks(E[:, None].expand(H, len(t), nb), cand, cfg.n_core)
        return mass_share(mass[0], core, cand).mean()

    c = eviction.eviction_score(v, A, W).detach()
    E = eviction.eviction_block_scores(pooling.pool_mean(c, cfg), nb, cfg)[0]
    rules = rule_scores(eviction.attention_by_block(q, k, torch.arange(S), cfg)[0], None, cfg, 0, g)
    oracle, recency = held(rules["oracle"]), held(rules["recency"])
    assert held(E) > 0.8 * oracle and recency < 0.5 * held(E), (held(E), oracle, recency)


@pytest.mark.parametrize("target", ["mass", "output"])
def test_a_run_with_the_warmup_resumes_exactly(corpus, tmp_path, target):  # noqa: F811
    """Stopped inside the warm-up and resumed, the run ends bit for bit where it would have, with
    either teacher; the warm-up moves the head alone; a resume must teach as the run did."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    kw = dict(data=corpus, data_dir=str(tmp_path / "data"), steps=7, eval_every=100)
    kw.update(run, log_every=1, head_warmup=4, head_distill=0.5, head_target=target, **small)
    torch.manual_seed(1337)  # the model train.main makes
    fresh = Transformer(Config.from_preset("tiny", **small))
    ref, _ = train.main(out=a, **kw)
    train.main(out=b, stop_at=2, **kw)
    assert json.load(open(os.path.join(b, "train_state.json")))["step"] == 2
    resumed, _ = train.main(out=b, resume=True, **kw)
    for (n, x), (_, y) in zip(ref.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(x, y), n
    warm, _ = train.main(out=str(tmp_path / "c"), stop_at=4, **kw)  # the warm-up alone
    for (n, x), (_, y) in zip(fresh.state_dict().items(), warm.state_dict().items()):
        assert torch.equal(x, y) != n.endswith(("self_attn.A", "delta.weight")), n
    with pytest.raises(ValueError, match="head_warmup=4"):
        train.main(out=b, resume=True, **{**kw, "head_warmup": 2})
    other = {"mass": "output", "output": "mass"}[target]
    with pytest.raises(ValueError, match=f"head_target='{target}'"):
        train.main(out=b, resume=True, **{**kw, "head_target": other})
