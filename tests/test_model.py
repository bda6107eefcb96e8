"""The model: incremental decoding equals the parallel forward, and gradients are right."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attention
import config
import eviction
import nosa
from config import Config
from generate import Sampling, generate
from kvcache import KVCache
from prefill import prefill
from tests.conftest import decode_logits, make_model, small


@pytest.mark.parametrize("attn", config.MODES)
def test_decode_equals_parallel_fp64(attn):
    model = make_model(attn, torch.float64)
    T, prompt_lens = 330, [3, 50]
    idx = torch.randint(0, 97, (2, T))
    with torch.no_grad():
        ref = model(idx)
        dec = decode_logits(model, idx, prompt_lens)
    for i, P in enumerate(prompt_lens):
        n = dec[i].shape[0]
        torch.testing.assert_close(dec[i], ref[i, P - 1 : P - 1 + n], rtol=0, atol=1e-9)


def test_decode_equals_parallel_fp32_tiny_preset():
    model = make_model("nosa", torch.float32, B=16, l_c=8, s_c=4, n_win=4, k=16, k_q=4)
    idx = torch.randint(0, 97, (1, 600))
    with torch.no_grad():
        ref = model(idx)
        dec = decode_logits(model, idx, [40])[0]
    torch.testing.assert_close(dec, ref[0, 39:], rtol=1e-4, atol=1e-4)


def test_fused_weights_keep_hugging_face_names(tmp_path):
    """q, k, v (and gate, up) are one Linear each in the model; its state_dict splits them into
    Hugging Face's names and load_state_dict joins them: a checkpoint round-trips bit for bit, and a
    state dict of the separate weights gives the same model."""
    import checkpoint
    import saving

    model = make_model("nosa", torch.float64, vocab_size=256)  # the byte tokenizer's ids
    sd = model.state_dict()
    names = {n.split(".")[-2] for n in sd}
    assert {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} <= names
    assert not {"qkv_proj", "gate_up_proj"} & names
    other = make_model("nosa", torch.float64, vocab_size=256)
    other.load_state_dict(sd)
    idx = torch.randint(0, 97, (2, 120))
    with torch.no_grad():
        assert torch.equal(other(idx), model(idx))
        saving.save(model, checkpoint.byte_tokenizer(), str(tmp_path / "ck"))
        loaded, _ = checkpoint.load(str(tmp_path / "ck"))
        assert all(torch.equal(sd[k], v) for k, v in loaded.state_dict().items())


def test_compiled_model_decodes_alike_and_is_freed_when_dropped(monkeypatch):
    """fast.compile_model (torch.compile stood in for by the function itself on CPU): the same decode
    logits as the parallel forward, and no reference cycle: a dropped model frees its memory at
    once, not at the next garbage collection (a benchmark that builds one 8B model after another
    needs that)."""
    import gc
    import weakref

    import fast

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(fast, "COMPILED", {})
    model = make_model("nosa", torch.float64)
    idx = torch.randint(0, 97, (2, 200))
    with torch.no_grad():
        ref = model(idx)
        fast.compile_model(model, prefill=True)
        for i, (P, got) in enumerate(zip([3, 50], decode_logits(model, idx, [3, 50]))):
            torch.testing.assert_close(got, ref[i, P - 1 : P - 1 + got.shape[0]], rtol=0, atol=1e-9)
    gone = weakref.ref(model.layers[0])
    gc.disable()
    try:
        del model
        assert gone() is None
    finally:
        gc.enable()


def test_sparsity_is_active():
    """The parallel forward of a long sequence really selects only k of its blocks."""
    cfg = Config.from_preset("tiny", **small)
    T = 300
    q = torch.randn(1, cfg.H_q, T, cfg.head_dim)
    k, v = torch.randn(2, 1, cfg.H_kv, T, cfg.head_dim)
    _, mask = nosa.nosa_attention(q, k, v, torch.randn(1, cfg.H_kv, T), cfg)
    assert (mask.sum(-1) == torch.clamp(torch.arange(T) // cfg.B + 1, max=cfg.k)).all()


def test_sparse_attention_matches_explicit_loop():
    cfg = Config.from_preset("tiny", **small)
    Bz, T = 1, 40
    q = torch.randn(Bz, cfg.H_q, T, cfg.head_dim, dtype=torch.float64)
    k, v = torch.randn(2, Bz, cfg.H_kv, T, cfg.head_dim, dtype=torch.float64)
    bias = torch.randn(Bz, cfg.H_kv, T, dtype=torch.float64)
    mask = torch.rand(Bz, cfg.H_kv, T, 5) < 0.5
    mask[..., torch.arange(T), torch.arange(T) // cfg.B] = True  # own block
    o = attention.sparse_attention(q, k, v, bias, mask, torch.arange(T)[None], B=cfg.B)
    G = cfg.G
    for h in range(cfg.H_q):
        hk = h // G
        for t in range(0, T, 7):
            js = [j for j in range(t + 1) if mask[0, hk, t, j // cfg.B]]
            logit = torch.stack(
                [q[0, h, t] @ k[0, hk, j] / cfg.head_dim**0.5 + bias[0, hk, j] for j in js]
            )
            want = (torch.softmax(logit, 0)[:, None] * v[0, hk, js]).sum(0)
            torch.testing.assert_close(o[0, h, t], want)


def test_gradcheck_attention_and_eviction_head():
    """Analytic gradients match finite differences in float64 on tiny shapes: the attention with
    bias (dq, dk, dv, dc) and the eviction head (dA, dW_δ, dv)."""
    cfg = Config.from_preset("tiny", **{**small, "H_q": 4, "H_kv": 2, "head_dim": 4})
    T = 20
    mask = torch.rand(1, 2, T, 3) < 0.5
    mask[..., torch.arange(T), torch.arange(T) // cfg.B] = True
    pos = torch.arange(T)[None]
    args = [
        torch.randn(1, 4, T, 4),
        torch.randn(1, 2, T, 4),
        torch.randn(1, 2, T, 4),
        torch.randn(1, 2, T),
    ]
    args = [a.double().requires_grad_() for a in args]
    f = lambda q, k, v, c: attention.sparse_attention(q, k, v, c, mask, pos, B=cfg.B)
    assert torch.autograd.gradcheck(f, args)
    v = torch.randn(1, 2, T, 4, dtype=torch.float64, requires_grad=True)
    A = torch.randn(2, dtype=torch.float64, requires_grad=True)
    W = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(eviction.eviction_score, (v, A, W))


@pytest.mark.parametrize("attn", ["nosa", "dma", "nosa-hh"])
def test_model_gradients_reach_eviction_head(attn):
    model = make_model(attn, torch.float64)
    idx = torch.randint(0, 97, (1, 120))
    attn0 = model.layers[0].self_attn

    def loss_fn():
        logits = model(idx[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())

    loss_fn().backward()
    assert attn0.A.grad.abs().min() > 0 and attn0.delta.weight.grad.abs().max() > 0
    # finite differences in float64 for A (selection is piecewise constant: a tiny step keeps it)
    eps = 1e-6
    for h in range(2):
        with torch.no_grad():
            attn0.A[h] += eps
            up = loss_fn()
            attn0.A[h] -= 2 * eps
            down = loss_fn()
            attn0.A[h] += eps
        assert abs((up - down).item() / (2 * eps) - attn0.A.grad[h].item()) < 1e-6
    # with A = 0 (its initial value) W_δ gets no gradient yet, A does: that is how learning starts
    model.zero_grad()
    with torch.no_grad():
        attn0.A.zero_()
    loss_fn().backward()
    assert attn0.A.grad.abs().min() > 0 and attn0.delta.weight.grad.abs().max() == 0


def test_sampling():
    logits = torch.randn(4, 50)
    assert torch.equal(Sampling()(logits), logits.argmax(-1))
    assert torch.equal(Sampling(temperature=1.0, top_k=1)(logits), logits.argmax(-1))
    top3 = torch.topk(logits, 3).indices
    for _ in range(20):
        s = Sampling(temperature=2.0, top_k=3)(logits)
        assert (top3 == s[:, None]).any(-1).all()


def test_bad_generation_requests_raise():
    model = make_model("nosa", torch.float32, max_seq_len=64)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1] * 60], max_new_tokens=10)
    with pytest.raises(ValueError, match="at least one prompt"):
        generate(model, [], max_new_tokens=10)
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        generate(model, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, [[1, 2], []], max_new_tokens=3)


@settings(max_examples=12, deadline=None)
@given(
    attn=st.sampled_from(config.MODES),
    chunk=st.integers(1, 90),
    lens=st.lists(st.integers(1, 260), min_size=1, max_size=3),
)
def test_chunked_prefill_equals_parallel_fp64(attn, chunk, lens):
    """A prompt read `chunk` tokens at a time (chunks not aligned with blocks or sub-blocks), each
    chunk's queries selecting and attending over the earlier chunks' keys: the last position's logits
    are the parallel forward's, in every mode, for a ragged batch; and decoding after a chunked
    prefill equals decoding after a whole one (offloaded, too)."""
    from offload import OffloadCache

    torch.manual_seed(len(lens) * 1000 + chunk)
    model = make_model(attn, torch.float64)
    T = max(lens) + 20
    idx = torch.randint(0, 97, (len(lens), T))
    with torch.no_grad():
        ref = model(idx)
    for i, P in enumerate(lens):
        got = prefill(
            model, idx[i : i + 1, :P], KVCache(model.cfg, 1, "cpu", torch.float64), 0, chunk
        )
        torch.testing.assert_close(got, ref[i, P - 1], rtol=0, atol=1e-9)
    new = lambda: (
        OffloadCache(model.cfg, len(lens), "cpu", torch.float64, max_len=T)
        if model.cfg.sparse
        else KVCache(model.cfg, len(lens), "cpu", torch.float64)
    )
    for a, b in zip(
        decode_logits(model, idx, lens, new(), chunk=chunk), decode_logits(model, idx, lens, new())
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


@pytest.mark.parametrize("T, C", [(200, 48), (96, 48), (48, 48), (200, 256), (1, 8)])
def test_residual_stream_on_the_host_reads_what_the_pass_before_wrote(T, C, monkeypatch):
    """prefill.ResidualStream's host path in program order (its copies made synchronous, each fetch a
    copy): every pass reads what the pass before wrote, also where a pass is a single chunk, whose
    write comes after the point where a longer pass fetches the next pass's first chunk."""
    import contextlib

    import prefill as prefill_module

    class Stream:  # the copy and compute streams, synchronous
        def wait_event(self, event):
            pass

        def wait_stream(self, stream):
            pass

        def record_event(self):
            return None

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(
        prefill_module.ResidualStream,
        "fetch",
        lambda self, s: (self.x[:, s : s + self.C].clone(), None),
    )
    emb = torch.randn(1, T, 4)
    x = prefill_module.ResidualStream(
        T, 4, C, "cpu", torch.float32, False, first=lambda s: emb[:, s : s + C].clone()
    )
    x.copies = Stream()  # the host path
    want = emb
    for i in range(3):  # three layers: each doubles its input and adds its index
        for s, h in x.chunks(more=i < 2):
            x.write(s, 2 * h + i)
        want = 2 * want + i
    torch.testing.assert_close(x.last(), want[:, -1], rtol=0, atol=0)
    torch.testing.assert_close(x.x, want, rtol=0, atol=0)


def test_prefill_keeps_the_cache_and_the_lengths_of_other_rows():
    """Prefilling row 1 leaves row 0 as it was; both then decode as the parallel forward says."""
    model = make_model("nosa", torch.float64)
    idx = torch.randint(0, 97, (2, 200))
    with torch.no_grad():
        ref = model(idx)
    dec = decode_logits(model, idx, [150, 60], chunk=32)
    for i, P in enumerate([150, 60]):
        torch.testing.assert_close(
            dec[i], ref[i, P - 1 : P - 1 + dec[i].shape[0]], rtol=0, atol=1e-9
        )
