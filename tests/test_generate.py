"""The main job of the README: generate.py on the embedded model, with and without offload."""

import os
import sysconfig

import pytest
import torch

import checkpoint
import console
import fast
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
    out = generate.main(
        max_new_tokens=40, batch=2, temperature=0.0, offload=offload, device="cpu", quiet=True
    )
    assert len(out) == 2 and len(out[0]) == 40 and out[0] == out[1]  # greedy: both sequences agree
    printed = capsys.readouterr().out
    assert "tokens/sec:" in printed
    assert ("hit rate:" in printed) == offload


def test_generate_main_ragged_prompts(capsys):
    """Different prompts in one batch: each sequence continues its own prompt, offloaded or not."""
    prompts = ["import os\n", "def add(a, b):\n    return a + b\n\n\nclass Point:"]
    a = generate.main(
        prompt=prompts, max_new_tokens=30, temperature=0.0, offload=True, device="cpu", quiet=True
    )
    b = [
        generate.main(prompt=p, max_new_tokens=30, temperature=0.0, device="cpu", quiet=True)[0]
        for p in prompts
    ]
    assert a == b
    assert "prompts of 3-" in capsys.readouterr().out


@pytest.mark.slow
def test_greedy_offload_matches_resident():
    a = generate.main(max_new_tokens=300, temperature=0.0, offload=False, device="cpu", quiet=True)
    b = generate.main(max_new_tokens=300, temperature=0.0, offload=True, device="cpu", quiet=True)
    assert a == b


def test_missing_checkpoint_is_one_clear_error():
    with pytest.raises(FileNotFoundError, match="no checkpoint directory at"):
        generate.main(checkpoint="/nonexistent/ckpt", max_new_tokens=5, device="cpu")


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--batch", "0"], "--batch 0: must be at least 1"),
        (["--batch", "-1"], "--batch -1"),
        (["--temperature", "-1"], "--temperature -1.0"),
        (["--temperature", "inf"], "--temperature inf: give a finite number"),
        (["--temperature", "nan"], "--temperature nan: give a finite number"),
        (["--gpu-budget", "nan"], "--gpu-budget nan: give a finite number"),
        (["--host-budget", "inf"], "--host-budget inf: give a finite number"),
        (["--gpu-budget", "0"], "--gpu-budget 0.0: must be at least"),
        (["--host-budget", "0"], "--host-budget 0.0: must be at least"),
        (["--chunk", "0"], "--chunk 0: must be at least 1"),
        (["--prompt-len", "0"], "--prompt-len 0: must be at least 1"),
        (["--seed", "-1"], "--seed -1: give a whole number"),
        (["--top-k", "-1"], "--top-k -1"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0"),
        (["--prompt-file", "BINARY"], "not UTF-8 text"),
        (
            ["--prompt-file", "/nonexistent/prompt.py"],
            "--prompt-file /nonexistent/prompt.py: No such file",
        ),
        (["--checkpoint", "/nonexistent/ckpt"], "no checkpoint directory at '/nonexistent/ckpt'"),
        (["--max-new-tokens", "5000"], "exceeds max_seq_len"),
    ]
    + ([(["--device", "cuda"], "sees no CUDA device")] if not torch.cuda.is_available() else []),
)
def test_generate_flags_fail_in_one_line(argv, msg, capsys, tmp_path):
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(SystemExit) as e:
        generate.cli([str(binary) if a == "BINARY" else a for a in argv])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and msg in err
    ), err


def test_chat_prompt_uses_the_template():
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert (
        console.chat_prompt(template, "hi", {"bos_token": "<s>"})
        == "<s><|user|>hi<|end|><|assistant|>"
    )
    with pytest.raises(ValueError, match="chat template fails"):
        console.chat_prompt("{{ raise_exception('only system roles') }}", "hi", {})


def test_single_prompt_streams_its_text(capsys):
    out = generate.main(prompt="def parse(", max_new_tokens=30, temperature=0.0, device="cpu")
    printed = capsys.readouterr().out
    model, tok = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT, dtype=torch.float32)
    assert printed.startswith("def parse(" + tok.decode(out[0]) + "\n---\n")
    # this format ends where a document ends
    assert model.eos_ids == {tok.token_to_id(checkpoint.EOT)}


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
    # as if checkpoints/ were missing
    monkeypatch.setattr(generate.os.path, "isdir", lambda p: False)
    out = generate.main(max_new_tokens=5, offload=True, device="cpu", quiet=True)
    assert len(out[0]) == 5 and "randomly initialised" in capsys.readouterr().out


def test_memory_plan_picks_the_chunk_and_says_what_fits():
    """The memory model (memory.plan_memory) at the 8b shape, 128K prompts, 24 GiB: a batch that fits
    gets the largest chunk that fits, and one sequence more is refused with the batch that does."""
    import memory
    from config import Config

    cfg = Config.from_preset("paper-8b")
    weights, P, budget = 15.66e9, 131072, 24 * 2**30
    with pytest.raises(MemoryError, match=r"at most \d+ sequences fit") as e:
        memory.plan_memory(cfg, weights, 40, P, P + 1024, torch.bfloat16, gpu_budget=budget)
    n = int(str(e.value).split("at most ")[1].split()[0])
    pl = memory.plan_memory(cfg, weights, n, P, P + 1024, torch.bfloat16, gpu_budget=budget)
    chunk, on_host = pl.chunk, pl.on_host
    assert (pl.batch, pl.P, pl.max_len, pl.gpu, pl.weights) == (n, P, P + 1024, budget, weights)
    # the benchmark's batch, with a prefill beside it
    assert chunk in memory.PREFILL_CHUNKS and n >= 28
    # bounded by the chunk, not T x vocab
    assert memory.prefill_bytes(cfg, P, chunk, torch.bfloat16, on_host) < 3e9
    with pytest.raises(MemoryError, match="at most"):
        memory.plan_memory(cfg, weights, n + 1, P, P + 1024, torch.bfloat16, gpu_budget=budget)
    with pytest.raises(MemoryError, match="host KV store needs .* at most 1 sequences"):
        memory.plan_memory(
            cfg,
            weights,
            2,
            P,
            P,
            torch.bfloat16,
            host_budget=memory.cache_bytes(cfg, 1, P, torch.bfloat16)[1],
        )
    small = memory.prefill_bytes(cfg, P, 512, torch.bfloat16)
    assert small < memory.prefill_bytes(cfg, P, 4096, torch.bfloat16)  # smaller chunks, less memory


def test_a_host_store_that_leaves_too_little_is_one_line_of_warning(monkeypatch, capsys):
    """A host KV store that leaves the process and the OS less than memory.HOST_LEFT of what the OS reports
    available (the pinned store cannot be paged out) is one line of warning with the numbers, before the
    run; a store that leaves more, or a machine that does not say, none."""
    import memory

    monkeypatch.setattr(memory, "mem_available", lambda: 124 * 2**30)
    w = memory.host_warning(119 * 2**30)
    assert "leaves 5.00 GiB" in w and "\n" not in w
    assert memory.host_warning(100 * 2**30) is None
    monkeypatch.setattr(memory, "mem_available", lambda: 2**30)  # a machine with 1 GiB available
    generate.main(random="tiny", max_new_tokens=3, batch=2, offload=True, device="cpu", quiet=True)
    err = capsys.readouterr().err
    assert err.count("warning: the host KV store takes") == 1 and "smaller --host-budget" in err, (
        err
    )
    monkeypatch.setattr(memory, "mem_available", lambda: None)
    assert memory.host_warning(119 * 2**30) is None


def test_a_gpu_budget_too_small_is_one_line(capsys):
    with pytest.raises(SystemExit):
        generate.cli(
            ["--device", "cpu", "--random", "tiny", "--offload", "--gpu-budget", "0.001", "--quiet"]
        )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not fit" in err and "not even one sequence fits" in err, (
        err
    )


def test_random_model_with_a_long_prompt_in_chunks(capsys):
    """--random PRESET and --prompt-len: a prompt cycled to 1000 tokens, prefilled in chunks of 96
    (not a multiple of the block), offloaded; the prefill line reports it."""
    out = generate.main(
        random="tiny",
        prompt_len=1000,
        chunk=96,
        max_new_tokens=8,
        offload=True,
        device="cpu",
        quiet=True,
        batch=2,
    )
    assert [len(o) for o in out] == [8, 8]
    printed = capsys.readouterr().out
    assert (
        "prefill: 2000 tokens" in printed
        and "chunks of 96" in printed
        and "prompts of 1000-1000" in printed
    )


@pytest.mark.gpu
@torch.no_grad()  # as generate runs
def test_prefill_and_decode_stay_within_the_memory_model():
    """The peak of a chunked prefill beyond the weights and the cache (its residual stream on the GPU,
    or in host memory) is within memory.prefill_bytes, and not far below it; a graphed decode step's
    is within memory.decode_bytes."""
    import memory
    import offload
    from config import Config
    from model import random_model
    from prefill import prefill

    cfg = Config.from_preset("paper", n_layer=2, vocab_size=32000)
    model = fast.compile_model(random_model(cfg, "cuda", torch.bfloat16), prefill=True)
    P, C = 16384, 2048
    cache = offload.OffloadCache(cfg, 2, "cuda", torch.bfloat16, max_len=P + 64)
    idx = torch.randint(0, 32000, (1, P), device="cuda")
    prefill(model, idx[:, :256], cache, 1, C)  # compile and warm up first
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for on_host in (False, True):
        torch.cuda.reset_peak_memory_stats()
        prefill(model, idx, cache, 0, C, stream_on_host=on_host)
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - base
        model_bytes = memory.prefill_bytes(cfg, P, C, torch.bfloat16, on_host)
        print(
            f"prefill, stream on host {on_host}: {used / 2**20:.0f} MiB measured, "
            f"{model_bytes / 2**20:.0f} MiB modelled"
        )
        assert used <= model_bytes and used >= model_bytes / 4, on_host
    step = fast.GraphedDecode(model, cache, 1)
    tok = torch.zeros(2, dtype=torch.long, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(4):
        tok = step(tok).argmax(-1)
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - base
    assert used <= memory.decode_bytes(cfg, 2, P + 64, torch.bfloat16), used


def test_same_behaviour_from_any_directory(tmp_path, monkeypatch, capsys):
    """A relative --checkpoint is the working directory's where it exists there, else the
    repository's (where train.py writes out/); an unwritable --profile (under a file) fails
    before any work."""
    monkeypatch.chdir(tmp_path)
    out = generate.main(
        checkpoint=os.path.join("checkpoints", "tiny-nosa"),
        max_new_tokens=3,
        device="cpu",
        quiet=True,
    )
    assert len(out[0]) == 3
    with pytest.raises(SystemExit):
        (tmp_path / "a-file").write_text("x")
        generate.cli(["--device", "cpu", "--profile", str(tmp_path / "a-file" / "t.json")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--profile" in err and "cannot write in" in err


def test_a_random_model_too_large_for_the_machine_is_one_line(monkeypatch, capsys):
    """--random paper-8b where its weights do not fit the memory there is: one line that says how
    much they take and what is free, before anything is allocated."""
    import memory

    monkeypatch.setattr(memory, "mem_available", lambda: 2**30)  # a CPU with 1 GiB free
    with pytest.raises(SystemExit):
        generate.cli(["--device", "cpu", "--random", "paper-8b", "--quiet"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GiB of weights" in err and "1.00 GiB is free" in err, err


def test_a_cut_prompt_is_shown_as_the_model_read_it(capsys):
    """--prompt-len N: the text printed before each sample is the N tokens the model read, not the
    whole prompt."""
    out = generate.main(
        prompt="def parse(args):\n    return args\n",
        prompt_len=3,
        batch=2,
        max_new_tokens=2,
        temperature=0.0,
        device="cpu",
    )
    printed = capsys.readouterr().out
    model, tok = checkpoint.load(checkpoint.DEFAULT_CHECKPOINT, dtype=torch.float32)
    first3 = tok.decode(tok.encode("def parse(args):\n    return args\n").ids[:3])
    assert (
        f"--- sample 0 ---\n{first3}{tok.decode(out[0])}\n" in printed
        and "return args" not in printed
    )
