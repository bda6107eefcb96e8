"""Cost of one block step of the forward kernel by rows per tile (64 / 128) and warps, and of its K/V loads alone
(random block lists, K and V of S keys; `python -m bench.step_cost 32768 131072` on a GPU)."""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from common import tma_descriptor  # noqa: E402


@triton.jit
def _rows(Q, KD, VD, IDX, O, n, scale2, D: tl.constexpr, B: tl.constexpr, R: tl.constexpr):
    p_id = tl.program_id(0)
    r, offs_d = tl.arange(0, R), tl.arange(0, D)
    q = tl.load(Q + (p_id * R + r[:, None]) * D + offs_d[None, :])
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, D], tl.float32)
    for i in range(n):
        blk = tl.load(IDX + p_id * n + i)
        kb = KD.load([blk * B, 0])
        vb = VD.load([blk * B, 0])
        s = tl.dot(q, tl.trans(kb)) * scale2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
    tl.store(O + (p_id * R + r[:, None]) * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))


@triton.jit
def _loads(Q, KD, VD, IDX, O, n, scale2, D: tl.constexpr, B: tl.constexpr, R: tl.constexpr):
    p_id = tl.program_id(0)
    acc = tl.zeros([B, D], tl.float32)
    for i in range(n):
        blk = tl.load(IDX + p_id * n + i)
        kb = KD.load([blk * B, 0])
        vb = VD.load([blk * B, 0])
        acc += kb.to(tl.float32) + vb.to(tl.float32)
    r, offs_d = tl.arange(0, B), tl.arange(0, D)
    tl.store(O + (p_id * R + r[:, None]) * D + offs_d[None, :], acc.to(O.dtype.element_ty))


def main(S, progs=16384, n=64, D=128, B=64):
    from triton.testing import do_bench
    torch.manual_seed(0)
    k, v = (torch.randn(S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kd, vd = (tma_descriptor(x, (B, D)) for x in (k, v))
    idx = torch.randint(0, S // B, (progs, n), device="cuda", dtype=torch.int32)
    scale2 = 1 / (D ** 0.5 * 0.6931471805599453)
    base = None
    for name, kern, R, w, st in (("64 rows w4 s3", _rows, 64, 4, 3), ("128 rows w8 s3", _rows, 128, 8, 3),
                                 ("128 rows w8 s2", _rows, 128, 8, 2), ("128 rows w4 s2", _rows, 128, 4, 2),
                                 ("loads w4 s3", _loads, 64, 4, 3)):
        q = torch.randn(progs * R, D, device="cuda", dtype=torch.bfloat16)
        o = torch.empty_like(q)
        call = lambda: kern[(progs,)](q, kd, vd, idx, o, n, scale2, D=D, B=B, R=R, num_warps=w, num_stages=st)
        try:
            call()
            t = min(do_bench(call, rep=200) for _ in range(3))
        except Exception as e:
            print(name, "FAILED", str(e)[-200:])
            continue
        ns = t * 1e6 / (progs * n / 132)
        base = base or ns
        tf = progs * n * R * B * D * 4 / t / 1e9
        print(f"S={S} {name}: {ns:.0f} ns a step a SM ({ns / base:.2f}x the 64-row step), {tf:.0f} TFLOP/s, "
              f"{progs * n * 2 * B * D * 2 / t / 1e9:.1f} TB/s of K/V", flush=True)


if __name__ == "__main__":
    for S in map(int, sys.argv[1:]):
        main(S)
