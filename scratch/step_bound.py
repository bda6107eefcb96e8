"""Cost of one block step: the 64-row step of the forward kernel (4 queries x 16 heads, rows x keys)
against a transposed 16-column step (one query's 16 heads as the N side: K q^T, keys x heads), on the
same random block lists. Is a tile's single-query block cheaper taken transposed?"""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")  # run from the repository root: python scratch/step_bound.py
from common import tma_descriptor  # noqa: E402


@triton.jit
def _rows64(Q, KD, VD, IDX, O, n, scale2, D: tl.constexpr, B: tl.constexpr, R: tl.constexpr):
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
def _cols(Q, KD, VD, IDX, O, n, scale2, D: tl.constexpr, B: tl.constexpr, R: tl.constexpr):
    p_id = tl.program_id(0)
    r, offs_d = tl.arange(0, R), tl.arange(0, D)
    q = tl.load(Q + (p_id * R + r[:, None]) * D + offs_d[None, :])  # (R, D), R = 16 heads of one query
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    accT = tl.zeros([D, R], tl.float32)
    for i in range(n):
        blk = tl.load(IDX + p_id * n + i)
        kb = KD.load([blk * B, 0])
        vb = VD.load([blk * B, 0])
        sT = tl.dot(kb, tl.trans(q)) * scale2  # (B, R)
        m_new = tl.maximum(m_i, tl.max(sT, 0))
        pT = tl.exp2(sT - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(pT, 0)
        accT = accT * alpha[None, :] + tl.dot(tl.trans(vb), pT.to(vb.dtype))  # (D, B) x (B, R)
        m_i = m_new
    o = tl.trans(accT / l_i[None, :])
    tl.store(O + (p_id * R + r[:, None]) * D + offs_d[None, :], o.to(O.dtype.element_ty))


def main(dev="cuda", S=131072, progs=16384, n=64, D=128, B=64):
    torch.manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    k, v = (torch.randn(S, D, device=dev, dtype=dt) for _ in range(2))
    kd, vd = (tma_descriptor(x, (B, D)) for x in (k, v))
    idx = torch.randint(0, S // B, (progs, n), device=dev, dtype=torch.int32)
    scale2 = 1 / (D ** 0.5 * 0.6931471805599453)
    res = {}
    for name, kern, R in (("64 rows", _rows64, 64), ("16 cols", _cols, 16)):
        q = torch.randn(progs * R, D, device=dev, dtype=dt)
        o = torch.empty_like(q)
        call = lambda: kern[(progs,)](q, kd, vd, idx, o, n, scale2, D=D, B=B, R=R, num_warps=4, num_stages=3)
        call()
        # check against torch on the first programs
        ref = []
        for p in range(2):
            kk = torch.cat([k[b * B:(b + 1) * B] for b in idx[p].tolist()]).float()
            vv = torch.cat([v[b * B:(b + 1) * B] for b in idx[p].tolist()]).float()
            ref.append(torch.softmax(q[p * R:(p + 1) * R].float() @ kk.T / D ** 0.5, -1) @ vv)
        err = (o[:2 * R].float() - torch.cat(ref)).abs().max().item()
        if dev == "cuda":
            from triton.testing import do_bench
            t = min(do_bench(call, rep=200) for _ in range(3))
            res[name] = t
            print(f"{name}: {t:.3f} ms for {progs} x {n} steps, {t * 1e6 / (progs * n / 132):.0f} ns a step a SM, "
                  f"max err {err:.1e}", flush=True)
        else:
            print(name, "max err", err)
    if dev == "cuda":
        print(f"16-col step / 64-row step: {res['16 cols'] / res['64 rows']:.2f}")


if __name__ == "__main__":
    for S in (32768, 131072):
        print("S =", S)
        main("cuda", S=S)
