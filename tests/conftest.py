import os
import sysconfig

import pytest
import torch

# Triton kernels run in the interpreter on machines without a GPU (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the cores shared by the processes of `pytest -n N` (pytest-xdist): N processes of all the cores'
# threads each would fight over them
THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(THREADS)

import fast  # noqa: E402 (after TRITON_INTERPRET)
from config import Config  # noqa: E402
from kvcache import KVCache  # noqa: E402
from model import Transformer  # noqa: E402
from prefill import prefill  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped where CUDA is not."""
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs a GPU"))


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # generate.cli runs on one thread on CPU; the other tests do not


# k*B = 64 tokens: sequences of 300+ tokens cross many block boundaries with sparsity active
small = dict(
    n_layer=2,
    dim=64,
    H_q=4,
    H_kv=2,
    head_dim=16,
    hidden_dim=96,
    vocab_size=97,
    B=8,
    l_c=4,
    s_c=2,
    n_sink=1,
    n_win=2,
    k=8,
    k_q=2,
)


def processes_env(n):
    """The environment of a test that starts n processes: where fewer than n GPUs are visible they
    run on CPUs (gloo), so that no test starts a process on a GPU the machine lacks."""
    env = dict(os.environ)
    if torch.cuda.device_count() < n:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def make_model(attn, dtype, **kw):
    cfg = Config.from_preset("tiny", attn=attn, **{**small, **kw})
    model = Transformer(cfg).to(dtype)
    for m in model.modules():  # A = 0 at init would make the bias vanish; give it a real value
        if hasattr(m, "A"):
            torch.nn.init.normal_(m.A, std=1.0)
    return model


def decode_logits(
    model, idx, prompt_lens, cache=None, graphed=False, micro_batches=1, chunk=None, in_turns=False
):
    """Prefill each sequence's prompt, then decode the rest of idx one token per step (through
    fast.GraphedDecode if graphed, in micro-batches (in turns) if asked; the prompts `chunk` tokens at a time);
    returns the logits at every position from
    the last prompt token on, per sequence. The cache defaults to a growing KVCache on idx's device."""
    cache = cache or KVCache(
        model.cfg, len(prompt_lens), idx.device, model.embed_tokens.weight.dtype
    )
    out = [[] for _ in prompt_lens]
    with torch.no_grad():
        for i, P in enumerate(prompt_lens):
            out[i].append(prefill(model, idx[i : i + 1, :P], cache, i, chunk))
        decode = fast.GraphedDecode(model, cache, micro_batches, in_turns)
        decode = decode if graphed else decode.step
        for s in range(idx.shape[1] - max(prompt_lens)):
            logits = decode(torch.stack([idx[i, P + s] for i, P in enumerate(prompt_lens)]))
            for i in range(len(prompt_lens)):
                out[i].append(logits[i])
    return [torch.stack(o) for o in out]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few standard-library modules as a small corpus (test_train, test_data)."""
    d = tmp_path_factory.mktemp("corpus")
    for name in (
        "argparse.py",
        "textwrap.py",
        "shlex.py",
        "fnmatch.py",
        "glob.py",
        "string.py",
        "bisect.py",
    ):
        with open(os.path.join(sysconfig.get_paths()["stdlib"], name)) as f:
            (d / name).write_text(f.read())
    return str(d)
