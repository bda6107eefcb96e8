"""Compiles while serving: a compile inside a turn is a gap between tokens of a second or more, so
the prefill kernels do not specialize on lengths, and bench arrivals counts what was compiled."""

import inspect

import torch
import triton

import common
from bench.arrivals import compiles

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def launched_variants(run):
    """The Triton kernel variants run() launches that were not launched before in this process: on a
    GPU the JIT cache's misses (bench arrivals' count); in the interpreter each launch keyed as a
    GPU's cache would key it (an integer argument 1, divisible by 16 or neither, unless
    do_not_specialize; constexprs and launch options by value; tensors by dtype)."""
    if DEV == "cuda":
        with compiles() as compiled:
            run()
        return [c for c in compiled if c.startswith("triton")]
    from triton.runtime.interpreter import InterpretedFunction

    def key(fn, args, kw, fixed):
        params = inspect.signature(fn.fn).parameters
        out = [fn.fn.__name__]
        for name, v in (dict(zip(params, args)) | kw).items():
            if name not in params or "constexpr" in str(params[name].annotation):
                out.append((name, v))  # a launch option (num_warps) or a constexpr
            elif isinstance(v, int) and not isinstance(v, bool) and name not in fixed:
                out.append((name, 1 if v == 1 else v % 16 == 0))
            elif isinstance(v, torch.Tensor):
                out.append((name, v.dtype))
        return tuple(out)

    seen = launched_variants.seen = getattr(launched_variants, "seen", set())
    new, plain = [], InterpretedFunction.run

    def run_keyed(self, *args, grid, warmup, **kw):
        k = key(self, args, kw, set(self.kwargs.get("do_not_specialize") or ()))
        if k not in seen:
            seen.add(k)
            new.append(k[0])
        return plain(self, *args, grid=grid, warmup=warmup, **kw)

    InterpretedFunction.run = run_keyed
    try:
        run()
    finally:
        InterpretedFunction.run = plain
    return new


def test_a_prompt_of_a_new_length_compiles_nothing_new():
    """Serving meets prompts of every length: after one prefill in chunks, prompts of other lengths
    (divisible by 16 or not, their block counts too, the same power-of-two tile counts) launch no
    kernel variant the first did not, so no compile stalls a decode step beside them."""
    from kvcache import KVCache
    from prefill import prefill
    from tests.conftest import make_model, small

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    kw = dict(small, n_layer=1, B=16, l_c=8, s_c=4, n_win=1, k=4)
    model = make_model("nosa", dtype, **kw).to(DEV)
    idx = torch.randint(0, 97, (1, 256), device=DEV)

    def fill(T):
        cache = KVCache(model.cfg, 1, DEV, dtype)
        return lambda: prefill(model, idx[:, :T], cache, 0, 64)

    with torch.no_grad(), common.kernels(True):
        launched_variants(fill(256))  # the first prompt compiles (here, or in a test before)
        for T in (250, 240, 209, 200):  # T, the last chunk and the block count in every class
            assert launched_variants(fill(T)) == [], T


def test_compiles_counts_what_was_compiled_inside_it_and_restores_tritons_hook():
    """bench arrivals' count of compiles while serving (a compile in a turn is a long gap): a
    torch.compile graph made inside the block counts once (a second call reuses it), a Triton
    specialization as its JIT cache calls the hook; a hook set before is called on and restored."""
    seen, runtime = [], triton.knobs.runtime
    before = runtime.jit_cache_hook
    mine = runtime.jit_cache_hook = lambda *a, **kw: seen.append(kw["repr"])
    try:
        f = torch.compile(lambda a: a * 2 + 1, backend="eager")
        with compiles() as compiled:
            f(torch.randn(3))
            f(torch.randn(3))
            assert (
                runtime.jit_cache_hook(repr="k[num_warps=4](n: i32)") is None
            )  # as Triton calls it
        assert compiled == ["triton k[num_warps=4](n: i32)", "torch.compile graph"]
        assert seen == ["k[num_warps=4](n: i32)"] and runtime.jit_cache_hook is mine
    finally:
        runtime.jit_cache_hook = before
