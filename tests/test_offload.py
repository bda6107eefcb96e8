"""NOSI offloading: same logits as the resident cache and the parallel forward, exact slot-pool
bookkeeping, transfers equal to the set differences, clear errors for budgets that do not fit."""

import pytest
import torch

import fast
import memory
import offload
import offload_kernels
from generate import generate
from kvcache import KVCache
from offload import OffloadCache
from tests.conftest import decode_logits, make_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class CheckedCache(OffloadCache):
    """Checks the slot pool after every layer's step (at its flush): it holds exactly the selected non-tail blocks,
    bit-equal to the host store, the two tables are inverse, and what was gathered is exactly the
    set difference between the selection and what was resident before."""

    moves = []  # blocks gathered per (row, layer, step), rows past their first step after prefill

    def capacity(self):  # no CUDA graph (fast.GraphedDecode): the checks read the tables every step
        return 0

    def blocks(self, layer, block_mask):
        self.before, self.cold = self.slot_block[layer].clone(), self.fresh[layer].clone()
        self.block_mask = block_mask
        return super().blocks(layer, block_mask)

    def flush(self, layer):  # the layer's step is done: check it
        super().flush(layer)
        before, cold, block_mask = self.before, self.cold, self.block_mask
        cfg, R = self.cfg, self.Bz * self.cfg.H_kv
        pos = self.len_cpu.repeat_interleave(cfg.H_kv)
        sel = block_mask.reshape(R, -1).cpu()
        sb, fetch = self.slot_block[layer].cpu(), self.fetch[layer].cpu()
        for r in range(R):
            q_blk = int(pos[r]) // cfg.B
            need = {b for b in torch.nonzero(sel[r])[:, 0].tolist() if b != q_blk}
            was = {b for b in before[r].tolist() if b >= 0}
            resident = [b for b in sb[r].tolist() if b >= 0]
            flushed = int(pos[r]) % cfg.B == cfg.B - 1  # the full tail just joined a free slot
            assert len(resident) == len(set(resident)), "a block holds two slots"
            assert set(resident) == need | ({q_blk} if flushed else set())
            assert sorted(b for b in fetch[r].tolist() if b >= 0) == sorted(need - was), (
                "transfers != set difference"
            )
            if not cold[r]:
                self.moves.append(len(need - was))
                if cfg.attn == "nosa":  # the locality theorem, per row and step
                    assert len(need - was) <= cfg.k_q - 1, (r, int(pos[r]))
            for s, b in enumerate(sb[r].tolist()):
                if b >= 0:
                    assert int(self.block_slot[layer][r, b]) == s
                    assert torch.equal(self.pool[layer][r, s].cpu(), self.host[layer][r, b]), (
                        "slot differs from host"
                    )
            assert int((self.block_slot[layer][r] >= 0).sum()) == len(resident), "a slot leaked"


@pytest.mark.parametrize("attn", ["nosa", "infllmv2", "dma", "nosa-hh", "nosa-hh, hh_recency=0.7"])
def test_offloaded_decode_equals_parallel_and_resident(attn):
    attn, *over = attn.split(", hh_recency=")  # nosa-hh with recency blended into its E
    model = make_model(attn, torch.float64, **{"hh_recency": float(r) for r in over}).to(DEV)
    cfg = model.cfg
    # mixed lengths; k*B = 64, and 4*k*B = 256 tokens are generated after the longest
    prompt_lens = [5, 37, 70]
    T = max(prompt_lens) + 4 * cfg.k * cfg.B + 3
    idx = torch.randint(0, cfg.vocab_size, (3, T), device=DEV)
    with torch.no_grad():
        ref = model(idx)
    # max_len far too small on purpose: the host store and tables must grow while decoding
    off = decode_logits(
        model, idx, prompt_lens, CheckedCache(cfg, 3, DEV, torch.float64, max_len=40)
    )
    res = decode_logits(model, idx, prompt_lens, KVCache(cfg, 3, DEV, torch.float64))
    # over all T blocks
    static = decode_logits(model, idx, prompt_lens, KVCache(cfg, 3, DEV, torch.float64, max_len=T))
    for i, P in enumerate(prompt_lens):
        torch.testing.assert_close(
            off[i], ref[i, P - 1 : P - 1 + off[i].shape[0]], rtol=0, atol=1e-9
        )
        torch.testing.assert_close(off[i], res[i], rtol=0, atol=1e-9)
        torch.testing.assert_close(static[i], res[i], rtol=0, atol=1e-9)


def test_offload_stats_and_locality_bound():
    """Per row and step at most k_q - 1 blocks cross (checked in CheckedCache), the device-side
    counters agree with what the pool went through, and the hit rate respects the theorem's bound."""
    model = make_model("nosa", torch.float32).to(DEV)
    cfg = model.cfg
    # sized exactly, as generate.py does
    cache = CheckedCache(cfg, 2, DEV, torch.float32, max_len=90 + 300)
    cache.moves = []
    generate(model, [[1, 2, 3] * 30, [4] * 7], max_new_tokens=300, cache=cache)
    most = max(cache.moves)
    assert 0 < most <= cfg.k_q - 1 and cache.stats.row_max.max().item() == most
    assert cache.stats.moved.sum().item() == sum(cache.moves)
    # the first step gathers whole selections, counted apart
    assert cache.stats.cold.sum().item() > 0
    hit = 1 - cache.stats.moved.sum().item() / cache.stats.needed.sum().item()
    assert hit >= cfg.k_e / (cfg.k - 1)  # k_e of the k - 1 selected non-tail blocks were resident
    assert f"most blocks one row moved in a step: {most}" in cache.stats.summary()


def test_budgets_and_modes_raise_before_allocating():
    model = make_model("nosa", torch.float32)
    with pytest.raises(MemoryError, match="host KV store needs .* lower the batch"):
        OffloadCache(model.cfg, 4, "cpu", torch.float32, max_len=1 << 20, host_budget=1 << 20)
    with pytest.raises(MemoryError, match="GPU slot pool needs .* lower the batch"):
        OffloadCache(model.cfg, 64, "cpu", torch.float32, max_len=1024, gpu_budget=1 << 16)
    # the largest batch that fits is accepted, one more is refused
    gpu, host = memory.cache_bytes(model.cfg, 10, 1024, torch.float32)
    n = memory.max_batch(model.cfg, 1024, torch.float32, gpu_budget=gpu + 1, host_budget=host * 2)
    assert n == 10
    OffloadCache(
        model.cfg, n, "cpu", torch.float32, max_len=1024, gpu_budget=gpu + 1, host_budget=host * 2
    )
    with pytest.raises(MemoryError, match="GPU slot pool needs"):
        OffloadCache(
            model.cfg,
            n + 1,
            "cpu",
            torch.float32,
            max_len=1024,
            gpu_budget=gpu + 1,
            host_budget=host * 2,
        )
    resident = memory.max_batch(model.cfg, 1024, torch.float32, gpu_budget=gpu + 1, offload=False)
    assert 0 < resident < n  # the point of offloading: more sequences in the same GPU memory
    with pytest.raises(ValueError, match="sparse attention mode"):
        OffloadCache(make_model("full", torch.float32).cfg, 1, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("offloaded", [True, False])
def test_graphed_decode_equals_eager(offloaded):
    # B >= 16
    model = fast.compile_model(make_model("nosa", torch.float32, B=16, l_c=8, s_c=4).to(DEV))
    cfg = model.cfg
    prompt_lens = [5, 37, 70]
    T = max(prompt_lens) + 3 * cfg.k * cfg.B
    idx = torch.randint(0, cfg.vocab_size, (3, T), device=DEV)
    new = lambda: (
        OffloadCache(cfg, 3, DEV, torch.float32, max_len=T)
        if offloaded
        else KVCache(cfg, 3, DEV, torch.float32, T)
    )
    eager_cache, graph_cache = new(), new()
    eager = decode_logits(model, idx, prompt_lens, eager_cache)
    graphed = decode_logits(model, idx, prompt_lens, graph_cache, graphed=True)
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert torch.equal(eager_cache.len, graph_cache.len) and torch.equal(
        eager_cache.len_cpu, graph_cache.len_cpu
    )
    if offloaded:
        assert (
            torch.equal(eager_cache.stats.moved, graph_cache.stats.moved)
            and eager_cache.stats.moved.sum() > 0
        )
        assert eager_cache.stats.steps == graph_cache.stats.steps
        assert all(
            torch.equal(a, b) for a, b in zip(eager_cache.slot_block, graph_cache.slot_block)
        )


@pytest.mark.parametrize(
    "graphed", [False] + (["side by side", "in turns"] if torch.cuda.is_available() else [])
)
def test_micro_batches_decode_like_the_whole_batch(graphed):
    """The batch split in two parts (OffloadCache.split: views of one cache), decoded one part after
    the other, or on two streams inside one CUDA graph (their compute in turns: fast.Turns): the
    same logits, selections and counters."""
    dtype = torch.float32 if DEV == "cuda" else torch.float64
    model = make_model("nosa", dtype, B=16, l_c=8, s_c=4).to(DEV)
    cfg = model.cfg
    prompt_lens = [5, 37, 70, 20, 90]  # parts of 3 and 2 sequences
    T = max(prompt_lens) + cfg.k * cfg.B + 40
    idx = torch.randint(0, cfg.vocab_size, (len(prompt_lens), T), device=DEV)
    caches = [OffloadCache(cfg, len(prompt_lens), DEV, dtype, max_len=T) for _ in range(2)]
    whole = decode_logits(model, idx, prompt_lens, caches[0])
    parts = decode_logits(
        model, idx, prompt_lens, caches[1], bool(graphed), 2, in_turns=graphed == "in turns"
    )
    for a, b in zip(whole, parts):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)
    a, b = (c.stats for c in caches)
    assert torch.equal(a.moved, b.moved) and torch.equal(a.needed, b.needed) and a.moved.sum() > 0
    assert a.steps == b.steps == T - max(prompt_lens) - 1
    assert torch.equal(caches[0].len, caches[1].len) and torch.equal(
        caches[0].len_cpu, caches[1].len_cpu
    )
    assert all(torch.equal(x, y) for x, y in zip(caches[0].slot_block, caches[1].slot_block))
    # its last sequence has reached max_len: one more step would need to grow
    part = caches[1].split(2)[1]
    with pytest.raises(ValueError, match="cannot grow"):
        model.decode(idx[3:, -1], part)


class CountingCache(OffloadCache):
    """Records, per step, the blocks each row gathered (eager steps: no CUDA graph)."""

    capacity = CheckedCache.capacity

    def flush(self, layer):
        super().flush(layer)
        self.log.append((self.len_cpu.clone(), (self.fetch[layer] >= 0).sum(1).cpu()))


def test_a_sequence_stops_at_its_end_token_while_another_continues():
    """Row 0 ends at an end-of-sequence token; row 1 goes on with exactly the tokens it produces
    alone, and row 0 gathers nothing once it has ended."""
    model = make_model("nosa", torch.float32).to(DEV)
    prompts = [list(range(1, 90)), [5, 6, 7] * 30]
    free = generate(model, prompts, 120)  # greedy, no end token
    # a token row 0 makes and row 1 never does
    eos = next(t for t in free[0][10:] if t not in free[1])
    end = free[0].index(eos) + 1
    cache = CountingCache(model.cfg, 2, DEV, torch.float32, max_len=90 + 120)
    cache.log = []
    out = generate(model, prompts, 120, cache=cache, eos_ids={eos})
    assert out[0] == free[0][:end] and out[1] == free[1]
    # row 0's position when its first step after the end token runs
    ended_at = len(prompts[0]) + end
    after = [moved[: model.cfg.H_kv] for pos, moved in cache.log if pos[0] >= ended_at]
    assert after and all(int(m.sum()) == 0 for m in after)
    # row 1 kept moving blocks
    assert sum(int(moved[model.cfg.H_kv :].sum()) for _, moved in cache.log) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True])
def test_offload_without_the_cuda_extension_on_a_gpu(graphed, monkeypatch):
    """A GPU machine without nvcc: the Triton transfer kernels and the sync-free set difference,
    eager and as a CUDA graph, decode exactly like the torch twins of every transfer (the same
    attention kernels on both sides, so bit for bit: fp32 against the resident cache, a near tie of
    two block scores can flip, and test_kernels compares those with a tolerance)."""
    model = make_model("nosa", torch.float32, B=16, l_c=8, s_c=4).to(DEV)
    cfg = model.cfg
    prompt_lens = [5, 37, 70]
    T = max(prompt_lens) + 3 * cfg.k * cfg.B
    idx = torch.randint(0, cfg.vocab_size, (3, T), device=DEV)
    with monkeypatch.context() as m:  # offload.py's twins, on the GPU
        m.setattr(offload, "use_kernels", lambda *a: False)
        twins = decode_logits(
            model, idx, prompt_lens, OffloadCache(cfg, 3, DEV, torch.float32, max_len=T)
        )
    monkeypatch.setattr(offload_kernels, "_ext", False)  # as if uva_copy.cu had failed to build
    cache = OffloadCache(cfg, 3, DEV, torch.float32, max_len=T)
    assert cache.host[0].is_pinned()
    off = decode_logits(model, idx, prompt_lens, cache, graphed=graphed)
    for a, b in zip(off, twins):
        assert torch.equal(a, b)
    assert cache.stats.moved.sum() > 0


@pytest.mark.gpu
def test_generate_offload_with_no_cuda_toolkit(tmp_path):
    """CUDA_HOME pointing nowhere and an empty extension cache: the build fails with one warning and
    generate.py --offload still runs, graphed, on the Triton kernels."""
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "CUDA_HOME": str(tmp_path / "no-cuda"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
        "PATH": "/usr/bin:/bin",
    }
    r = subprocess.run(
        [sys.executable, "generate.py", "--offload", "--max-new-tokens", "40", "--quiet"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "did not build" in r.stderr and "hit rate" in r.stdout


def test_a_step_is_graphed_from_the_first_sub_block_to_the_capacity():
    """cache.graphable (fast.GraphedDecode records a step once, then replays it): not before some
    sequence has l_c tokens (the pooled caches' update takes another path), not at or past the
    preallocated length, never for a cache that grows; the same rule for the offloaded cache."""
    from config import Config
    from tests.conftest import small

    cfg = Config.from_preset("tiny", **small)
    static, growing = (
        KVCache(cfg, 2, "cpu", torch.float32, 100),
        KVCache(cfg, 2, "cpu", torch.float32),
    )
    off = OffloadCache(cfg, 2, "cpu", torch.float32, max_len=100)
    for cache in (static, off):
        assert [cache.graphable(p) for p in (cfg.l_c - 2, cfg.l_c - 1, 99, 100)] == [
            False,
            True,
            True,
            False,
        ]
    assert not any(growing.graphable(p) for p in (cfg.l_c, 50, 1000))


@pytest.mark.parametrize("attn", ["nosa", "infllmv2", "nosa-hh"])
def test_every_cache_buffer_is_listed_and_modelled(attn):
    """Every per-layer buffer of the offloaded cache is in its lists (OffloadCache.ROWS and SEQS,
    PooledState.BUFFERS: what split and rows slice), and the memory model counts them: the host
    store exactly, the GPU's within the small tables it leaves out."""
    from config import Config
    from nosa import PooledState
    from tests.conftest import small

    cfg = Config.from_preset("tiny", **{**small, "attn": attn})
    cache = OffloadCache(cfg, 3, "cpu", torch.float32, max_len=300)
    per_layer = lambda obj: {
        n for n, v in vars(obj).items() if isinstance(v, list) and v and torch.is_tensor(v[0])
    }
    assert per_layer(cache) == set(OffloadCache.ROWS + OffloadCache.SEQS)
    assert per_layer(cache.sub) == {
        n for n in PooledState.BUFFERS if getattr(cache.sub, n) is not None
    }
    tensors = [
        t for n in OffloadCache.ROWS + OffloadCache.SEQS if n != "host" for t in getattr(cache, n)
    ]
    tensors += [t for n in per_layer(cache.sub) for t in getattr(cache.sub, n)]
    # tail: a view
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    gpu, host = memory.cache_bytes(cfg, 3, 300, torch.float32)
    assert sum(t.numel() * t.element_size() for t in cache.host) == host
    assert 0.95 * gpu <= sum(storages.values()) <= 1.1 * gpu, (sum(storages.values()), gpu)
