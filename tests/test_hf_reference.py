"""Our Llama against Hugging Face transformers' own, where transformers is installed (it is not a
dependency: CI skips this; the GPU machine has it). A random Llama saved by save_pretrained, as
current tools write it (RoPE in rope_parameters), loaded by checkpoint.load in full attention, must
give transformers' logits, with plain and llama3-scaled RoPE."""

import pytest
import torch

import checkpoint
from tests.test_checkpoint import write_hf_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ],
)
def test_logits_equal_transformers_llama(tmp_path, rope):
    write_hf_checkpoint(str(tmp_path / "tok"))  # for its tokenizer.json
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).float().eval()
    path = tmp_path / "llama"
    ref.save_pretrained(str(path))
    (path / "tokenizer.json").write_bytes((tmp_path / "tok" / "tokenizer.json").read_bytes())
    model, _ = checkpoint.load(str(path), dtype=torch.float32, attn="full")
    assert model.cfg.rope_theta == rope["rope_theta"]
    assert (model.cfg.rope_scaling or {}).get("rope_type", "default") == rope["rope_type"]
    idx = torch.randint(0, 300, (2, 700))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), ref(idx).logits, rtol=0, atol=2e-4)
