"""Continuous batching (serve.py): every request gets the tokens it gets alone, and a row that a
new request reuses holds nothing of the old one where the new one reads."""

import copy
import json
import os
import random
import sysconfig
import time

import pytest
import torch

import checkpoint
import fast
import generate
import serve
from kvcache import KVCache
from offload import OffloadCache
from prefill import prefill, prefill_passes


@pytest.fixture(scope="module")
def embedded():
    model, tokenizer = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT, dtype=torch.float32)
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py")) as f:
        text = tokenizer.encode(f.read()).ids
    return model, text


def prompts(text, lens):  # prompts of these lengths from different places of a real text
    return [text[97 * i : 97 * i + n] for i, n in enumerate(lens)]


GPU = pytest.mark.gpu


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("Cache", [KVCache, OffloadCache])
def test_served_requests_get_the_tokens_they_get_alone(embedded, Cache, device):
    """Ragged prompts (3 to 600 tokens, sparsity at work from 256) and lengths, an end-of-sequence
    token in the middle of some, six requests over two rows: each request's greedy tokens equal
    those of its own generation (on a GPU: decode steps as CUDA graphs, the prefills on a stream of
    their own beside them)."""
    model, text = embedded
    model = copy.deepcopy(model).to(device) if device == "cuda" else model
    ids, news = prompts(text, [600, 30, 420, 3, 300, 150]), [40, 25, 60, 12, 30, 45]
    alone = [generate.generate(model, [p], n)[0] for p, n in zip(ids, news)]
    eos = alone[0][len(alone[0]) // 2]  # a token that comes in the middle of the first answer
    alone = [a[: a.index(eos) + 1] if eos in a else a for a in alone]
    assert sum(len(a) < n for a, n in zip(alone, news)) >= 2  # some end early, at EOS
    assert sum(len(a) == n for a, n in zip(alone, news)) >= 2  # some at their length
    reqs = [serve.Request(p, n) for p, n in zip(ids, news)]
    cache = Cache(model.cfg, 2, device, torch.float32, max(len(p) + n for p, n in zip(ids, news)))
    ended = []
    step = fast.GraphedDecode(model, cache)  # as the scripts serve
    serve.serve(
        model,
        reqs,
        cache,
        lambda x: x.argmax(-1),
        eos_ids={eos},
        chunk=32,
        decode=step,
        on_done=ended.append,
    )
    assert [r.out for r in reqs] == alone
    assert sorted(map(id, ended)) == sorted(map(id, reqs)) and all(
        r.t_end >= r.t_first for r in reqs
    )


def row_state(cache, seq, T):
    """What a decode step of row seq at position T reads of its cache (KVCache or OffloadCache)."""
    cfg, H, sub = cache.cfg, cache.cfg.H_kv, cache.sub
    r, M = slice(seq * H, (seq + 1) * H), (T - cfg.l_c) // cfg.s_c + 1
    state = [cache.len[seq : seq + 1], cache.active[seq : seq + 1]]
    for i in range(cfg.n_layer):
        state += [cache.c[i][seq, :, :T], sub.K_sub[i][seq, :, :M], sub.c_sub[i][seq, :, :M]]
        state += [
            sub.ring_k[i][seq],
            sub.ring_c[i][seq],
            sub.e_list_ids[i][seq],
            sub.e_list_E[i][seq],
        ]
        if isinstance(cache, KVCache):
            state += [cache.k[i][seq, :, :T], cache.v[i][seq, :, :T]]
        else:
            n = T // cfg.B
            state += [cache.host[i][r, :n], cache.tail[i][r, :, : T - n * cfg.B]]
            state += [cache.slot_block[i][r], cache.block_slot[i][r], cache.fresh[i][r]]
    return state


@pytest.mark.parametrize("Cache", [KVCache, OffloadCache])
def test_a_reused_row_holds_nothing_of_the_old_request(embedded, Cache):
    """Row 0 serves a 500-token request, then a 200-token one prefills into it while row 1 keeps
    decoding: all that a step reads of row 0 equals a fresh cache's after that prompt alone, and so
    does the next step's output."""
    model, text = embedded
    old, other, new = prompts(text, [500, 300, 200])
    cache = Cache(model.cfg, 2, "cpu", torch.float32, 600)
    for seq, p in enumerate((old, other)):
        prefill(model, torch.tensor([p]), cache, seq)
    tok = torch.tensor([old[-1], other[-1]])
    with torch.no_grad():
        for _ in range(20):
            tok = model.decode(tok, cache).argmax(-1)
        parked = serve.Parked(cache, 0)
        for _ in prefill_passes(model, torch.tensor([new]), parked, 0, chunk=32):
            tok = model.decode(tok, cache).argmax(-1)  # the batch decodes (row 0 parked)
        parked.start()
        fresh = Cache(model.cfg, 1, "cpu", torch.float32, 600)
        prefill(model, torch.tensor([new]), fresh, 0, chunk=32)
        for a, b in zip(row_state(cache, 0, len(new)), row_state(fresh, 0, len(new)), strict=True):
            assert torch.equal(a, b)
        tok[0] = 17
        logits = model.decode(tok, cache)[0], model.decode(tok[:1], fresh)[0]
    torch.testing.assert_close(*logits, rtol=1e-5, atol=1e-5)


def test_generate_serves_a_file_of_requests(tmp_path, capsys):
    """generate.py --requests: more requests than rows, per-request max_new_tokens, completions as
    JSON lines, a line per request with its time to first token, the same tokens as alone."""
    lines = [
        {"prompt": "import os\n", "max_new_tokens": 12},
        {"prompt": "def add(a, b):\n    return a + b\n"},
        {"prompt": "class Point:", "max_new_tokens": 5},
    ]
    path, out = tmp_path / "r.jsonl", tmp_path / "out.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    # fmt: skip
    got = generate.main(
        requests=str(path),
        completions=str(out),
        batch=2,
        max_new_tokens=20,
        temperature=0.0,
        offload=True,
        device="cpu",
    )
    # fmt: skip
    alone = [
        generate.main(
            prompt=r["prompt"],
            max_new_tokens=r.get("max_new_tokens", 20),
            temperature=0.0,
            device="cpu",
            quiet=True,
        )[0]
        for r in lines
    ]
    assert got == alone and [len(g) for g in got] == [12, 20, 5]
    printed = capsys.readouterr().out
    assert (
        printed.count("first token after") == 3 and "served: 3 requests over 2 sequences" in printed
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["request"] for r in rows) == [0, 1, 2]
    assert all(r["new_tokens"] == len(got[r["request"]]) and r["ttft_s"] > 0 for r in rows)


@pytest.mark.parametrize(
    "content, msg",
    [
        ('{"prompt": 3}\n', 'line 1: give a JSON object with a "prompt" text'),
        ('{"prompt": "x"}\nnot json\n', "line 2: give a JSON object"),
        ('{"prompt": "x", "max_new_tokens": 0}\n', "line 1:"),
        ("\n\n", "no request in it"),
    ],
)
def test_a_bad_requests_file_is_one_line(tmp_path, content, msg):
    path = tmp_path / "r.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=msg):
        generate.main(requests=str(path), device="cpu")


def test_served_bench_small():
    """python -m bench requests --served, tiny shape: every request runs, each system at the batch
    its memory plan gives, and the steps beside a prefill are timed."""
    from bench.requests import bench_served

    rows = bench_served(shape="tiny", prompt_len=300, max_new_tokens=(8,), requests=3, gpu_budget=0.7,
                        steps=2, systems=("nosa-offload", "full"))  # fmt: skip
    for r in rows:
        assert r["batch"] == 3 and r["G8"]["total_s"] > 0 and r["G8"]["output_tokens_s"] > 0
        assert 0 < r["G8"]["ttft_median_s"] <= r["G8"]["ttft_p90_s"] <= r["G8"]["ttft_max_s"]
        assert r["step_alone_ms"] > 0 and r["prefill_beside_decode_s"] > 0
        assert r["G8"]["static_composed_s"] > 3 * r["prefill_alone_s"]  # 3 prefills, then steps
    assert rows[1]["G8"]["vs_full"] == 1.0


def test_a_served_plan_holds_a_prefill_beside_the_decode_step():
    """Serving prefills beside the decoding batch: the GPU budget must hold both working memories,
    where a static batch needs the larger."""
    import memory
    from config import Config

    cfg, dtype, Bz, P, L, weights = (
        Config.from_preset("paper-8b"),
        torch.bfloat16,
        8,
        2**17,
        2**17 + 1024,
        2**34,
    )
    fixed = weights + memory.cache_bytes(cfg, Bz, L, dtype, True)[0]
    step = memory.decode_bytes(cfg, Bz, L, dtype)

    def plan(room, served):  # -> (chunk, on_host)
        pl = memory.plan_memory(
            cfg, weights, Bz, P, L, dtype, gpu_budget=fixed + room, chunk=4096, served=served
        )
        return pl.chunk, pl.on_host

    for on_host in (False, True):  # the residual stream on the GPU, or waiting in host memory
        pre = memory.prefill_bytes(cfg, P, 4096, dtype, on_host)
        assert pre > step and plan(pre, False) == (4096, on_host)
        assert plan(pre + step, True) == (4096, on_host)
    with pytest.raises(MemoryError, match="at most"):
        plan(pre + step / 2, True)


def test_requests_that_cannot_be_served_are_one_line(embedded):
    model, _ = embedded
    cache = KVCache(model.cfg, 2, "cpu", torch.float32, 64)
    argmax = lambda x: x.argmax(-1)
    with pytest.raises(ValueError, match="a prompt of a token or more"):
        serve.serve(model, [serve.Request([], 4)], cache, argmax)
    with pytest.raises(ValueError, match="needs 70 tokens .* max_len=70 or more"):
        serve.serve(model, [serve.Request([1] * 60, 10)], cache, argmax)
    # an id past the vocabulary fails before any work, not in the embedding on the GPU
    V = model.cfg.vocab_size
    with pytest.raises(ValueError, match=f"token id outside 0..{V - 1} .*: \\[{V}\\]"):
        serve.serve(model, [serve.Request([1, 2], 4), serve.Request([3, V, 5], 4)], cache, argmax)


def test_requests_arriving_over_time(embedded):
    """Requests that arrive apart: none is admitted before its arrival (its first token comes
    after it), time to first token counts from the arrival, an idle server skips to the next (on
    its clock, not the wall's), and each gets the tokens it gets alone; the loop's parts are timed,
    each as often as it ran."""
    model, text = embedded
    ids, news = prompts(text, [200, 40, 300]), [6, 9, 4]
    alone = [generate.generate(model, [p], n)[0] for p, n in zip(ids, news)]
    arrivals = [0.3, 0.0, 600.0]  # the last comes when the others are done: the server idles
    reqs = [serve.Request(p, n, arrival=a) for p, n, a in zip(ids, news, arrivals)]
    cache = KVCache(model.cfg, 2, "cpu", torch.float32, 320)
    timings, wall = {}, time.perf_counter()
    serve.serve(model, reqs, cache, lambda x: x.argmax(-1), timings=timings)
    assert time.perf_counter() - wall < 120  # the ten idle minutes skipped
    assert [r.out for r in reqs] == alone
    assert [len(timings[p]) for p in ("admit", "start", "end")] == [3, 3, 3]
    # a turn per step of the running sequences: each token after a sequence's first came from one
    assert len(timings["turn"]) >= max(news) - 1 and min(min(t) for t in timings.values()) >= 0
    for r in reqs:
        assert r.t_tokens[0] >= r.arrival and r.t_first == r.t_tokens[0] - r.arrival
        assert len(r.gaps()) == len(r.out) - 1 and min(r.gaps()) >= 0
    assert reqs[2].t_tokens[0] >= 600  # (the others end long before it: the server idles)
    assert reqs[2].t_first < 60  # and it is served as soon as it comes


def test_a_fixed_token_budget_sets_the_chunks_a_step_waits_for(embedded):
    """--prefill-budget TOKENS: a step beside the prefill waits for TOKENS * n_layer / chunk
    layer passes (at least one), counted; served tokens stay those alone."""
    model, text = embedded
    ids, news = prompts(text, [30, 400, 250]), [60, 8, 8]
    alone = [generate.generate(model, [p], n)[0] for p, n in zip(ids, news)]
    reqs = [serve.Request(p, n) for p, n in zip(ids, news)]
    cache = KVCache(model.cfg, 2, "cpu", torch.float32, 420)
    budget = serve.Budget(model.cfg.n_layer, tokens=32)
    serve.serve(model, reqs, cache, lambda x: x.argmax(-1), chunk=64, budget=budget)
    assert [r.out for r in reqs] == alone
    assert set(budget.waited) == {32 * model.cfg.n_layer // 64}  # 2 of the 4 layers a step
    assert "2.0 layer passes a step (about 32 prompt tokens; last chunk 64)" in budget.summary()


def test_a_halved_chunk_serves_the_same_tokens(embedded):
    """Prompts prefilled in chunks a quarter of the planned one (the stall budget halved it twice)
    give the tokens they give alone."""
    model, text = embedded
    ids, news = prompts(text, [30, 300, 170]), [40, 6, 6]
    alone = [generate.generate(model, [p], n)[0] for p, n in zip(ids, news)]
    reqs = [serve.Request(p, n) for p, n in zip(ids, news)]
    budget = serve.Budget(model.cfg.n_layer, least=16)
    budget.halved, budget.ended = 2, lambda: None  # held there, whatever the CPU's timing
    cache = KVCache(model.cfg, 2, "cpu", torch.float32, 320)
    serve.serve(model, reqs, cache, lambda x: x.argmax(-1), chunk=64, budget=budget)
    assert [r.out for r in reqs] == alone
    assert budget.c == 16


def test_the_stall_budget_takes_the_chunks_that_fit_within_the_stall():
    """A step alone takes 10 ms and a chunk adds 1.9 ms: within 2x five chunks fit a step, and the
    budget grows to five (doubling at most a turn) and stays; chunks that turn slower (4.5 ms)
    bring it down to the two that fit."""
    b = serve.Budget(n_layer=32, stall=2.0)
    b.turn(0.010, 0)  # a step alone: 10 ms
    seen = []
    for _ in range(6):
        seen.append(b.n)
        b.turn(0.010 + 0.0019 * b.n, b.n)
    assert seen == [1, 2, 4, 5, 5, 5]
    for _ in range(20):
        b.turn(0.010 + 0.0045 * b.n, b.n)
    assert b.n == 2
    assert b.passes(None, running={}) == 32  # nothing decoding: nothing waits
    fresh = serve.Budget(32)
    assert fresh.passes(None, running={0: None}) == 0  # a step alone is timed first


def test_the_stall_budget_keeps_half_the_speed_where_a_chunk_costs_most_of_a_step():
    """Coarse chunks (as at 128K on the H200, where one layer pass adds 0.6 of a step) that
    vary by 30% from chunk to chunk: the steps beside the prefill take no more than twice a step
    alone on average, so decoding keeps half its speed (growing a chunk a turn while within, as
    the budget did before, kept 0.45-0.49 here)."""
    rnd = random.Random(0)
    for cost in (0.3, 0.6, 0.8):  # of a step alone
        b = serve.Budget(n_layer=32, stall=2.0)
        for _ in range(3000):
            n = b.passes(None, running={0: None})
            dt = 0.010 * (1 + 0.02 * rnd.gauss(0, 1))
            dt += sum(0.010 * cost * max(0.05, 1 + 0.3 * rnd.gauss(0, 1)) for _ in range(n))
            b.turn(dt, n)
        alone, beside = b.kept()
        assert alone / beside >= 0.5, (cost, alone / beside)
        assert sum(b.waited) / len(b.waited) >= 0.9 * int(1 / cost), cost  # and not far fewer


def test_the_stall_budget_times_a_step_alone_while_prompts_queue_without_end():
    """Prompts prefilling back to back (as when they arrive faster than they prefill) leave no
    step alone by chance: the budget makes one, first and every RETIME turns, and grows between."""
    b, pre, running = serve.Budget(n_layer=32, stall=2.0), None, {0: None}
    waited = []
    for _ in range(2 * serve.Budget.RETIME + 10):
        n = b.passes(pre, running)
        b.turn(0.010 if n == 0 else 0.010 + 0.0005 * n, n)  # half a ms a chunk beside the step
        waited.append(n)
    assert waited[0] == 0 and b.alone == pytest.approx(0.010)
    assert waited.count(0) == 3  # the first turn, then every RETIME turns
    assert max(waited) > 15  # within 2x the step takes up to 20 chunks: the budget grew to it


def test_the_stall_budget_halves_the_chunk_where_one_chunk_stalls_and_doubles_it_back():
    b = serve.Budget(n_layer=32, stall=2.0, least=1024)
    assert b.chunk(8192) == 8192
    b.turn(0.010, 0)
    for dt in (0.025, 0.030, 0.015, 0.026):  # one chunk, over 2x in 3 turns of 4
        b.turn(dt, 1)
        b.n = 1
    b.ended()
    assert (b.chunk(8192), b.n) == (4096, 1)
    for _ in range(30):  # the next prompt: its chunks add 4 ms, two fit
        b.turn(0.010 + 0.004 * b.n, b.n)
    b.ended()
    assert b.chunk(8192) == 4096 and b.n == 2
    for _ in range(30):  # the next: 1.9 ms a chunk, five fit
        b.turn(0.010 + 0.0019 * b.n, b.n)
    assert b.n == 5
    b.ended()  # four fit: twice as long again
    assert (b.chunk(8192), b.n) == (8192, 2)
    assert b.chunk(8192, T=3000) == 3000  # no longer than the prompt
    b.halved = 5
    assert b.chunk(8192) == 1024 and b.chunk(600) == 600  # not below `least`, nor above the plan
    fixed = serve.Budget(32, tokens=64)
    fixed.turn(0.010, 0)
    fixed.turn(0.050, 1)
    fixed.ended()
    assert fixed.chunk(8192) == 8192  # a fixed budget keeps the planned chunk


def test_the_stall_budget_times_a_step_alone_of_as_many_sequences_as_decode():
    """A step's time grows with the sequences decoding: where their number changes (a request
    admitted or ended), the next step runs alone and is timed, and the speed kept compares each
    step beside the prefill with the step alone of its time (not one of fewer sequences, which
    made the prefill look dearer); the budget reports its steps against its model's prediction."""
    b = serve.Budget(n_layer=32, stall=2.0)
    alone = lambda live: 0.002 * live  # 2 ms a sequence
    running, kept = {0: None}, []
    for turn in range(400):
        if turn == 120:  # (before RETIME turns have passed)
            running = {i: None for i in range(4)}  # three more sequences decode from here on
        n = b.passes(None, running)
        b.turn(alone(len(running)) + 0.001 * n, n, live=len(running))  # 1 ms a pass
        kept.append(n)
    assert kept[0] == 0 and kept[120] == 0 and kept[121] > 0  # timed alone again at the change
    assert b.alone == pytest.approx(0.008) and b.live == 4
    a, beside = b.kept()
    assert a / beside >= 0.5  # each against its own step alone: within the stall
    assert b.off_prediction() == pytest.approx(1.0, abs=0.05)  # the model predicted these steps
    assert "the time the budget predicted" in b.summary()


def test_the_stall_budget_splits_what_a_turn_added_into_a_fixed_cost_and_one_per_pass():
    """Turns that add 3 ms whatever they wait for and 1 ms a pass, against a 10 ms step alone: the
    fit finds both, where the budget's own model (no fixed term) sees a dearer pass and still
    settles within the stall. A fixed cost beyond the room (12 ms) leaves every turn at one pass,
    over the stall: then the speed kept falls below half, and the fit says where the turns sat."""
    rnd = random.Random(1)
    for fixed, kept_half in ((0.003, True), (0.012, False)):
        b = serve.Budget(n_layer=32, stall=2.0)
        b.turn(0.010, 0)
        for _ in range(300):
            n = b.passes(None, running={0: None})
            b.turn(0.010 + (fixed + 0.001 * n if n else 0) + 0.0001 * rnd.gauss(0, 1), n)
        fit = b.fit()
        alone, beside = b.kept()
        assert (alone / beside >= 0.5) == kept_half, fixed
        if kept_half:
            assert fit["fixed"] == pytest.approx(0.003, abs=3e-4)
            assert fit["per_pass"] == pytest.approx(0.001, abs=1e-4)
            assert b.per > 0.0013 and fit["at_one_pass"] < 0.05  # the model: a dearer pass
        else:
            assert fit["fixed"] is None and fit["per_pass"] is None  # one count only
            assert fit["at_one_pass"] == 1.0 and fit["one_pass_over_stall"] == 1.0
    assert serve.Budget(32).fit() is None
