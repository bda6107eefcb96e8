"""Loading released NOSA checkpoints in the Hugging Face Llama layout, from a small
random checkpoint written here in exactly that layout: sharded safetensors with an index."""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import checkpoint
import saving
from config import Config
from generate import generate
from kvcache import KVCache
from model import Transformer
from offload import OffloadCache
from prefill import prefill

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "rope_scaling": None,
    "torch_dtype": "bfloat16",
}
SMALL_NOSA = dict(B=8, l_c=4, s_c=2, n_sink=1, n_win=2, k=8, k_q=2)


def write_hf_checkpoint(path, hf_config=HF_CONFIG, drop=None, add=None, reshape=None):
    """A random NOSA model saved as Hugging Face would: 'model.'-prefixed names, lm_head without,
    two shards and model.safetensors.index.json, config.json, tokenizer.json, tokenizer_config.json."""
    os.makedirs(path, exist_ok=True)
    cfg = Config.from_hf(HF_CONFIG, **SMALL_NOSA)
    torch.manual_seed(1)
    model = Transformer(cfg)
    for m in model.modules():
        if hasattr(m, "A"):
            torch.nn.init.normal_(m.A)
    sd = {
        ("" if k.startswith("lm_head") else "model.") + k: v.to(torch.bfloat16)
        for k, v in model.state_dict().items()
    }
    if drop:
        sd.pop(drop)
    if add:
        sd[add] = torch.zeros(3)
    if reshape:
        sd[reshape] = torch.zeros(5, 5)
    names = sorted(sd)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for fname, keys in shards.items():
        save_file(
            {k: sd[k].contiguous() for k in keys},
            os.path.join(path, fname),
            metadata={"format": "pt"},
        )
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(
            {"metadata": {}, "weight_map": {k: fn for fn, ks in shards.items() for k in ks}}, f
        )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        ["def f(x):\n    return x + 1\n"] * 20,
        trainers.BpeTrainer(
            vocab_size=300,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}, f)
    return model, sd


def test_hf_checkpoint_loads_exactly(tmp_path):
    path = str(tmp_path / "nosa-hf")
    _, sd = write_hf_checkpoint(path)
    model, tok = checkpoint.load(path, **SMALL_NOSA)
    assert model.cfg.attn == "nosa" and model.cfg.H_kv == 2 and model.cfg.head_dim == 16
    got = model.state_dict()
    assert len(got) == len(sd)
    for name, t in sd.items():
        # every tensor arrived exactly
        assert torch.equal(got[name.removeprefix("model.")], t), name
    assert model.chat_template.startswith("{% for m in messages")
    assert tok.encode("def f(x):").ids


def test_hf_checkpoint_generates_same_logits_as_direct_model(tmp_path):
    path = str(tmp_path / "nosa-hf")
    direct, _ = write_hf_checkpoint(path)
    direct = direct.to(torch.bfloat16).float()  # the checkpoint is bf16
    loaded, _ = checkpoint.load(path, dtype=torch.float32, **SMALL_NOSA)
    idx = torch.randint(0, 300, (1, 200))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), direct(idx), rtol=0, atol=0)
        prompts = [idx[0, :50].tolist(), idx[0, 60:90].tolist()]  # a batch of two lengths
        want = generate(direct, prompts, 100)
        assert (
            generate(loaded, prompts, 100, cache=KVCache(loaded.cfg, 2, "cpu", torch.float32))
            == want
        )
        assert (
            generate(loaded, prompts, 100, cache=OffloadCache(loaded.cfg, 2, "cpu", torch.float32))
            == want
        )


@pytest.mark.parametrize(
    "kind, kw, msg",
    [
        ("missing", dict(drop="model.layers.1.self_attn.A"), "missing tensor layers.1.self_attn.A"),
        (
            "unexpected",
            dict(add="model.layers.0.self_attn.rotary_emb.inv_freq"),
            "unexpected tensor layers.0.self_attn.rotary_emb",
        ),
        ("shape", dict(reshape="model.norm.weight"), r"norm.weight has shape \(5, 5\)"),
        (
            "rope",
            dict(hf_config={**HF_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 8.0}}),
            "rope_type='yarn'",
        ),
        (
            "rope_new",
            dict(
                hf_config={**HF_CONFIG, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
            ),
            "'dynamic'",
        ),
        (
            "llama3_lacks",
            dict(hf_config={**HF_CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
            "lacks low_freq_factor",
        ),
        ("bias", dict(hf_config={**HF_CONFIG, "attention_bias": True}), "attention_bias=True"),
    ],
)
def test_bad_hf_checkpoints_are_named(tmp_path, kind, kw, msg):
    path = str(tmp_path / kind)
    write_hf_checkpoint(path, **{"hf_config": HF_CONFIG, **kw})
    with pytest.raises(ValueError, match=msg):
        checkpoint.load(path, **SMALL_NOSA)


def test_nosa_checkpoint_decodes_training_free_in_other_modes(tmp_path):
    path = str(tmp_path / "nosa-hf")
    write_hf_checkpoint(path)
    model, _ = checkpoint.load(path, **{**SMALL_NOSA, "attn": "infllmv2"})
    assert model.cfg.attn == "infllmv2" and not hasattr(model.layers[0].self_attn, "A")


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def test_hf_rope_layouts():
    """The RoPE base and scaling at the top level (older tools) or in rope_parameters (current ones)."""
    base = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    new = Config.from_hf(
        {**base, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    )
    old = Config.from_hf({**base, "rope_theta": 500000.0})
    assert (
        new.rope_theta == old.rope_theta == 500000.0
        and new.rope_scaling is old.rope_scaling is None
    )
    scaled = Config.from_hf({**base, "rope_parameters": {"rope_theta": 5e5, **LLAMA3}})
    assert (
        scaled.rope_scaling == {**LLAMA3, "original_max_position_embeddings": 256.0}
        and scaled.rope_theta == 5e5
    )
    assert Config.from_hf({**base, "rope_scaling": LLAMA3}).rope_scaling == scaled.rope_scaling
    assert Config.from_hf(base).rope_theta == 10000.0  # Hugging Face's default


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        LLAMA3,
        {**LLAMA3, "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0},
    ],
)
def test_scaled_rope_against_its_formula(scaling):
    """Each frequency and the rotation of random q at random positions against the formulas, written
    out one frequency at a time."""
    import math

    from config import Config
    from model import apply_rope, rope_frequencies, rope_tables

    cfg = Config.from_preset("tiny", head_dim=64, rope_theta=5e5, rope_scaling=scaling)
    got = rope_frequencies(cfg, "cpu")
    for i, f in enumerate(got.tolist()):
        base = 1.0 / 5e5 ** (2 * i / 64)
        if scaling is None:
            want = base
        elif scaling["rope_type"] == "linear":
            want = base / scaling["factor"]
        else:
            wavelen = 2 * math.pi / base
            old = scaling["original_max_position_embeddings"]
            lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
            if wavelen < old / hi:
                want = base
            elif wavelen > old / lo:
                want = base / scaling["factor"]
            else:
                s = (old / wavelen - lo) / (hi - lo)
                want = (1 - s) * base / scaling["factor"] + s * base
        assert math.isclose(f, want, rel_tol=1e-12), (i, f, want)
    if scaling is not None:
        assert not torch.allclose(
            got, rope_frequencies(Config.from_preset("tiny", head_dim=64, rope_theta=5e5), "cpu")
        )
    x, pos = torch.randn(2, 3, 5, 64, dtype=torch.float64), torch.randint(0, 100000, (2, 5))
    y = apply_rope(x, rope_tables(pos, got, torch.float64))
    for b, h, t in ((0, 0, 0), (1, 2, 4), (1, 1, 2)):
        for i in (0, 7, 31):
            a = pos[b, t].item() * got[i].item()
            x1, x2 = x[b, h, t, i].item(), x[b, h, t, i + 32].item()
            assert math.isclose(
                y[b, h, t, i].item(), x1 * math.cos(a) - x2 * math.sin(a), abs_tol=1e-9
            )
            assert math.isclose(
                y[b, h, t, i + 32].item(), x2 * math.cos(a) + x1 * math.sin(a), abs_tol=1e-9
            )


def test_hf_checkpoint_with_llama3_rope_decodes_like_its_parallel_forward(tmp_path):
    path = str(tmp_path / "llama3")
    write_hf_checkpoint(
        path,
        hf_config={
            **HF_CONFIG,
            "rope_scaling": None,
            "rope_parameters": {"rope_theta": 5e5, **LLAMA3},
        },
    )
    model, _ = checkpoint.load(path, dtype=torch.float64, **SMALL_NOSA)
    assert model.cfg.rope_scaling["rope_type"] == "llama3"
    idx = torch.randint(0, 300, (1, 150))
    with torch.no_grad():
        ref = model(idx)
        cache = KVCache(model.cfg, 1, "cpu", torch.float64)
        prefill(model, idx[:, :100], cache, 0)
        dec = torch.stack([model.decode(idx[:, t], cache)[0] for t in range(100, 150)])
    torch.testing.assert_close(dec[:-1], ref[0, 100:149], rtol=0, atol=1e-9)


def test_hf_end_of_sequence_ids(tmp_path):
    """eos_token_id from config.json and generation_config.json, one id or a list, all of them."""
    path = str(tmp_path / "eos")
    write_hf_checkpoint(path, hf_config={**HF_CONFIG, "eos_token_id": 2})
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [3, 7]}, f)
    model, _ = checkpoint.load(path, **SMALL_NOSA)
    assert model.eos_ids == {2, 3, 7}


def test_out_through_a_link_into_the_embedded_models_is_refused(tmp_path):
    """--out through a symbolic link that resolves inside checkpoints/ (the embedded models): refused
    like the direct path, for an existing checkpoint and for a new directory."""
    link = tmp_path / "link"
    link.symlink_to(os.path.join(checkpoint.ROOT, "checkpoints"))
    for out in (link / "tiny-nosa", link / "new"):
        with pytest.raises(ValueError, match="training never writes into"):
            saving.check_out(str(out))
    assert not os.path.exists(os.path.join(checkpoint.ROOT, "checkpoints", "new"))


def test_a_save_recovers_what_a_killed_save_left(tmp_path, capsys):
    """Killed between its renames, a save leaves the previous checkpoint at .DIR.replaced: load
    reads it there and moves nothing; the next save puts it back first, said in one line. Killed
    after them, it leaves DIR and .DIR.replaced: the next save removes the latter; killed while
    writing, .DIR.saving: removed too."""
    model = Transformer(Config.from_preset("tiny", n_layer=1, dim=32, hidden_dim=64))
    tok = checkpoint.byte_tokenizer()
    path = str(tmp_path / "run")
    tmp, old = saving.staging(path)
    saving.save(model, tok, path)
    os.rename(path, old)  # killed between the renames
    assert checkpoint.is_checkpoint(path) and checkpoint.load(path)
    assert os.path.isdir(old) and not os.path.exists(path)  # loading moved nothing
    saving.save(model, tok, path)
    assert "the checkpoint a killed save had moved aside" in capsys.readouterr().err
    assert not os.path.exists(old) and checkpoint.load(path)
    shutil.copytree(path, old)  # killed after the second rename: both are there
    shutil.copytree(path, tmp)  # and another killed while writing
    saving.save(model, tok, path)
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "removed" in err
    assert not os.path.exists(old) and not os.path.exists(tmp)
    checkpoint.load(path)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    """The serializer failing (here as safetensors does on a full disk): one line, the previous
    checkpoint intact and loadable, no temporary directory left."""
    model = Transformer(Config.from_preset("tiny", n_layer=1, dim=32, hidden_dim=64))
    tok = checkpoint.byte_tokenizer()
    path = str(tmp_path / "run")
    saving.save(model, tok, path)
    before = checkpoint.load(path)[0].state_dict()

    def full(*a, **kw):
        raise RuntimeError(
            "Error while serializing: IoError(Os { code: 28, kind: StorageFull })\nmore"
        )

    monkeypatch.setattr(saving, "save_file", full)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(OSError) as e:
        saving.save(model, tok, path)
    assert "\n" not in str(e.value) and "StorageFull" in str(e.value) and "intact" in str(e.value)
    after = checkpoint.load(path)[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not os.path.exists(saving.staging(path)[0])


@pytest.mark.parametrize(
    "file, content, msg",
    [
        ("generation_config.json", [1, 2], "generation_config.json: a JSON object is needed"),
        ("tokenizer_config.json", ["x"], "tokenizer_config.json: a JSON object is needed"),
        ("generation_config.json", {"eos_token_id": "2"}, "eos_token_id=['2']: give a token id"),
        ("generation_config.json", {"eos_token_id": [2, [3]]}, "eos_token_id=[2, [3]]"),
        ("tokenizer_config.json", {"chat_template": 7}, "chat_template must be a string"),
        ("tokenizer_config.json", {"bos_token": 5}, "bos_token must be a string"),
        ("config.json", {**HF_CONFIG, "num_attention_heads": 0}, "num_attention_heads=0"),
        ("model.safetensors.index.json", {"metadata": {}}, "no weight_map"),
        ("config.json", {**HF_CONFIG, "vocab_size": 100}, "tokenizer.json: 272 token ids, more"),
    ],
)
def test_every_side_file_of_a_checkpoint_is_checked(tmp_path, file, content, msg):
    """A side file of a Hugging Face checkpoint that holds the wrong kind of thing: one line naming
    the file and the field, before any weight is loaded (not an AttributeError, TypeError,
    ZeroDivisionError, KeyError or IndexError from deep inside)."""
    path = str(tmp_path / "ck")
    write_hf_checkpoint(path)
    with open(os.path.join(path, file), "w") as f:
        json.dump(content, f)
    with pytest.raises(ValueError, match=re.escape(msg)) as e:
        checkpoint.load(path, **SMALL_NOSA)
    assert "\n" not in str(e.value) and ".json" in str(e.value)
