"""bench arrivals: requests arriving over time at a rate, each system's capacity by the targets, and
a sweep over several calls joined in one results file."""

import json
import random

import pytest


def test_arriving_workload_and_its_bench_small():
    """bench requests --served --rate: the same requests for one seed at every rate (the gaps scale
    as 1/rate), lengths within their ranges; every system served at each rate, percentiles in
    order, a capacity per system."""
    from bench.arrivals import bench_arrivals, workload

    a = workload(5, 1.0, (10, 20), (3, 4), 97, seed=3)
    b = workload(5, 4.0, (10, 20), (3, 4), 97, seed=3)
    assert [r.ids for r in a] == [r.ids for r in b] and a[0].arrival == 0.0
    assert all(abs(x.arrival - 4 * y.arrival) < 1e-9 for x, y in zip(a, b))
    assert all(10 <= len(r.ids) <= 20 and 3 <= r.max_new_tokens <= 4 for r in a)
    tables = bench_arrivals(shape="tiny", rates=(50.0,), prompt_lens=(40, 120), max_new_tokens=(4, 8),
                            requests=4, gpu_budget=1.0)  # fmt: skip
    assert [r["system"] for r in tables["runs"]] == ["nosa + offload", "full, resident cache"]
    for r in tables["runs"]:
        assert r["batch"] >= 1 and r["output_tokens_s"] > 0
        assert r["ttft_median_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"] <= r["ttft_max_s"]
        assert r["tbt_median_s"] <= r["tbt_p90_s"] <= r["tbt_p99_s"] <= r["tbt_max_s"]
        # no gap between tokens is longer than a turn and the parts of the loop between two turns
        parts = sum(r[f"{p}_max_ms"] for p in ("admit", "launch", "start", "end", "turn"))
        assert 0 < r["turn_max_ms"] and 1e3 * r["tbt_max_s"] <= parts * 1.05 + 1
    assert {c["system"] for c in tables["capacity"]} == {"nosa + offload", "full, resident cache"}
    for c in tables["capacity"]:  # bounded only by a miss; the requests done a second, as served
        mine = [r for r in tables["runs"] if r["system"] == c["system"]]
        missed = any(r["tbt_p99_s"] > 0.2 or r["ttft_median_s"] > 30.0 for r in mine)
        assert c["bounded"] == missed and ("more --requests" in c["targets"]) != missed
        assert c["requests_s_at_highest"] == pytest.approx(4 / mine[-1]["total_s"], rel=1e-2)
    assert all(r["compiles"] == 0 for r in tables["runs"])  # the warm-up compiled what serving ran
    assert all(len(r["ends_s"]) == 4 and r["ends_s"] == sorted(r["ends_s"]) for r in tables["runs"])


def fifo(arrivals, durations, batch):
    """Completion times of requests served first come, first served by `batch` rows."""
    free, ends = [0.0] * batch, []
    for a, d in zip(arrivals, durations):
        row = min(range(batch), key=free.__getitem__)
        free[row] = max(free[row], a) + d
        ends.append(free[row])
    return ends


def test_the_saturated_rate_leaves_out_filling_and_draining():
    """bench arrivals' requests_s_saturated: with equal service times D at `batch` rows it is
    batch / D exactly, however long the drain; with random ones every instant of its window has
    more than `batch` requests arrived and unfinished (saturated), and it counts the completions
    inside the window."""
    from bench.arrivals import saturated_rate

    ends = fifo([0.0] * 20, [3.0] * 19 + [500.0], 4)  # the last request's long drain
    assert saturated_rate([0.0] * 20, ends, 4) == pytest.approx(4 / 3.0, abs=1e-4)
    assert 20 / max(ends) < 0.1  # what requests_s says of the same run
    assert saturated_rate([0.0] * 4, fifo([0.0] * 4, [1.0] * 4, 4), 4) is None  # never queued
    rng = random.Random(0)
    for _ in range(200):
        n, batch = rng.randint(2, 30), rng.randint(1, 6)
        arrivals = sorted(rng.uniform(0, 10) * rng.random() for _ in range(n))
        ends = fifo(arrivals, [rng.uniform(0.5, 8) for _ in range(n)], batch)
        got = saturated_rate(arrivals, ends, batch)
        if got is None:
            continue
        s = sorted(ends)
        lo = next(e for e in s if e >= max(arrivals))
        hi = s[n - batch - 1]
        for t in (lo + (hi - lo) * i / 50 for i in range(50)):
            assert sum(a <= t < e for a, e in zip(arrivals, ends)) > batch, (t, lo, hi)
        assert got == pytest.approx(sum(lo < e <= hi for e in ends) / (hi - lo), abs=1e-4)


def test_a_sweep_over_calls_joins_one_results_file(tmp_path, monkeypatch):
    """bench arrivals --add-to: calls of one sweep join their rows in one file (a rate run again
    replaces its row) and the capacities are taken over all of them as one call's would be; a file
    of another workload, or not a results file, is refused in one line before any work and kept;
    a call cut off in a rate keeps the rates it finished."""
    import bench.arrivals
    from bench.arrivals import bench_arrivals

    f = str(tmp_path / "sweep.json")
    kw = dict(
        shape="tiny", prompt_lens=(40, 120), max_new_tokens=(4, 8), requests=4, gpu_budget=1.0
    )
    kw |= dict(tbt_target=60.0, ttft_target=600.0)  # no miss ends a sweep on a slow, busy CPU
    bench_arrivals(rates=(50.0,), systems=("nosa-offload",), add_to=f, **kw)
    out = bench_arrivals(rates=(50.0, 100.0), add_to=f, **kw)  # both systems, 50/s again
    held = json.load(open(f))
    assert held["workload"] == "tiny, 4 requests of 40-120 + 4-8 tokens" and held["date"]
    pairs = [(r["system"], r["rate"]) for r in held["runs"]]
    assert (
        sorted(pairs) == pairs
        and len(pairs) == 4
        and set(pairs)
        == {(s, r) for s in ("nosa + offload", "full, resident cache") for r in (50.0, 100.0)}
    )
    assert held["runs"] == out["runs"] and held["capacity"] == out["capacity"]
    one = bench_arrivals(rates=(50.0, 100.0), systems=("full",), **kw)["capacity"][0]
    got = next(c for c in held["capacity"] if c["system"] == "full, resident cache")
    assert got.keys() == one.keys() and got["capacity_rate"] == one["capacity_rate"]
    before = open(f).read()
    with pytest.raises(ValueError, match="holds the workload .* one file holds one sweep"):
        bench_arrivals(rates=(50.0,), add_to=f, **(kw | dict(requests=5)))
    with pytest.raises(
        ValueError, match=r"holds the targets \[60.0, 600.0\], this run has \[0.5, 600.0\]"
    ):
        bench_arrivals(rates=(50.0,), add_to=f, **(kw | dict(tbt_target=0.5)))
    with pytest.raises(ValueError, match=r"holds the max_stall None, this run has 4.0"):
        bench_arrivals(rates=(50.0,), add_to=f, max_stall=4.0, **kw)
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a results file of bench arrivals"):
        bench_arrivals(rates=(50.0,), add_to=str(tmp_path / "other.json"), **kw)
    assert open(f).read() == before

    served, calls = bench.arrivals.served_at_rate, []

    def cut_off_at_the_second_rate(*a, **k):  # as a time limit kills a call
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return served(*a, **k)

    monkeypatch.setattr(bench.arrivals, "served_at_rate", cut_off_at_the_second_rate)
    g = str(tmp_path / "cut.json")
    with pytest.raises(KeyboardInterrupt):
        bench_arrivals(rates=(50.0, 100.0), systems=("full",), add_to=g, **kw)
    assert [r["rate"] for r in json.load(open(g))["runs"]] == [50.0]


def test_a_capacity_is_the_highest_rate_before_the_first_miss():
    """bench arrivals' capacity from a system's rows in any order: the rates held up to the first
    that misses a target; bounded by that miss, with the requests completed a second there; where
    none misses, unbounded, at the highest rate, and the targets say to give more requests."""
    from bench.arrivals import capacity_of

    row = lambda rate, tbt, ttft, req_s: dict(
        system="s", rate=rate, tbt_p99_s=tbt, ttft_median_s=ttft, requests_s=req_s
    )
    rows = [row(0.1, 0.05, 5, 0.1), row(0.2, 0.1, 20, 0.2), row(0.4, 0.1, 31, 0.3)]
    rows += [row(0.8, 0.1, 10, 0.5), dict(system="t", rate=None, batch=0)]  # held after the miss
    random.Random(0).shuffle(rows)
    c = capacity_of("s", rows, 8, 0.2, 30.0)
    assert (c["capacity_rate"], c["bounded"], c["requests_s_at_highest"]) == (0.2, True, 0.3)
    assert "more --requests" not in c["targets"]
    rows = [r for r in rows if r.get("rate") in (0.1, 0.2)]
    c = capacity_of("s", rows, 8, 0.2, 30.0)
    assert (c["capacity_rate"], c["bounded"], c["requests_s_at_highest"]) == (0.2, False, 0.2)
    assert "give more --requests than 8" in c["targets"]
    c = capacity_of("s", [row(0.1, 0.3, 5, 0.1)], 8, 0.2, 30.0)  # the first rate misses
    assert (c["capacity_rate"], c["bounded"], c["requests_s_at_highest"]) == (0.0, True, 0.1)
