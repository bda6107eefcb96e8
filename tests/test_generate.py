"""The main job of the README: generate.py on the embedded model, with and without offload."""
import os
import sysconfig

import pytest
import torch

import checkpoint
import generate


def test_embedded_model_knows_python():
    """The committed checkpoint loads and predicts standard-library code well (a random model's
    loss would be ln(4096) = 8.3)."""
    model, tok = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT, dtype=torch.float32)
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py")) as f:
        ids = torch.tensor([tok.encode(f.read()).ids[:1024]])
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:])
    assert loss < 4.0  # measured 3.39 (validation loss over held-out files: 2.46)


@pytest.mark.parametrize("offload", [False, True])
def test_generate_main(offload, capsys):
    out = generate.main(max_new_tokens=40, batch=2, temperature=0.0, offload=offload, device="cpu", quiet=True)
    assert len(out) == 2 and len(out[0]) == 40 and out[0] == out[1]  # greedy: both sequences agree
    printed = capsys.readouterr().out
    assert "tokens/sec:" in printed
    assert ("hit rate:" in printed) == offload


def test_generate_main_ragged_prompts(capsys):
    """Different prompts in one batch: each sequence continues its own prompt, offloaded or not."""
    prompts = ["import os\n", "def add(a, b):\n    return a + b\n\n\nclass Point:"]
    a = generate.main(prompt=prompts, max_new_tokens=30, temperature=0.0, offload=True, device="cpu", quiet=True)
    b = [generate.main(prompt=p, max_new_tokens=30, temperature=0.0, device="cpu", quiet=True)[0] for p in prompts]
    assert a == b
    assert "prompts of 3-" in capsys.readouterr().out


def test_greedy_offload_matches_resident():
    a = generate.main(max_new_tokens=300, temperature=0.0, offload=False, device="cpu", quiet=True)
    b = generate.main(max_new_tokens=300, temperature=0.0, offload=True, device="cpu", quiet=True)
    assert a == b


def test_missing_checkpoint_is_one_clear_error():
    with pytest.raises(FileNotFoundError, match="no checkpoint directory at"):
        generate.main(checkpoint_dir="/nonexistent/ckpt", max_new_tokens=5, device="cpu")


@pytest.mark.parametrize("argv, msg", [
    (["--batch", "0"], "--batch 0: must be at least 1"),
    (["--batch", "-1"], "--batch -1"),
    (["--temperature", "-1"], "--temperature -1.0"),
    (["--top-k", "-1"], "--top-k -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["--prompt-file", "BINARY"], "not UTF-8 text"),
    (["--prompt-file", "/nonexistent/prompt.py"], "--prompt-file /nonexistent/prompt.py: No such file"),
    (["--checkpoint", "/nonexistent/ckpt"], "no checkpoint directory at '/nonexistent/ckpt'"),
    (["--max-new-tokens", "5000"], "exceeds max_seq_len"),
] + ([(["--device", "cuda"], "sees no CUDA device")] if not torch.cuda.is_available() else []))
def test_generate_flags_fail_in_one_line(argv, msg, capsys, tmp_path):
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(SystemExit) as e:
        generate.cli([str(binary) if a == "BINARY" else a for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and msg in err, err


def test_chat_prompt_uses_the_template():
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert generate.chat_prompt(template, "hi", {"bos_token": "<s>"}) == "<s><|user|>hi<|end|><|assistant|>"
    with pytest.raises(ValueError, match="chat template fails"):
        generate.chat_prompt("{{ raise_exception('only system roles') }}", "hi", {})


def test_single_prompt_streams_its_text(capsys):
    out = generate.main(prompt="def parse(", max_new_tokens=30, temperature=0.0, device="cpu")
    printed = capsys.readouterr().out
    model, tok = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT, dtype=torch.float32)
    assert printed.startswith("def parse(" + tok.decode(out[0]) + "\n---\n")
    assert model.eos_ids == {tok.token_to_id(checkpoint.EOT)}  # this format ends where a document ends


def test_cpu_generation_runs_on_one_thread(monkeypatch):
    """Decoding on a CPU is a chain of small ops: more threads only spin against competing processes."""
    torch.set_num_threads(2)
    seen = []
    monkeypatch.setattr(generate, "main", lambda *a, **k: seen.append(torch.get_num_threads()))
    generate.cli(["--device", "cpu", "--max-new-tokens", "1"])
    assert seen == [1]


def test_profile_trace_marks_the_parts_of_a_step(tmp_path):
    import json
    trace = tmp_path / "trace.json"
    generate.main(max_new_tokens=5, offload=True, device="cpu", quiet=True, profile=str(trace))
    names = {e.get("name") for e in json.load(open(trace))["traceEvents"]}
    assert {"selection", "transfer", "attention"} <= names


def test_without_the_embedded_model_a_random_one_runs(monkeypatch, capsys):
    monkeypatch.setattr(generate.os.path, "isdir", lambda p: False)  # as if checkpoints/ were missing
    out = generate.main(max_new_tokens=5, offload=True, device="cpu", quiet=True)
    assert len(out[0]) == 5 and "randomly initialised" in capsys.readouterr().out
