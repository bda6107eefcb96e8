"""
Attention with a per-token additive bias over a selection of KV blocks, in torch: the definition
each kernel is tested against.

    o_t = Σ_{j in Γ(t), j <= t} softmax_j(q_t·k_j/√d + bias_j) v_j        (docs/METHOD.md §3)

Notation: Bz batch, H_q / H_kv query / KV heads, G = H_q / H_kv, T queries, S keys, d head dim,
B block size, k selected blocks per (query, KV head); R = Bz·H_kv rows (sequence, KV head).

  sparse_attention   any T queries over a block mask (training, a prefill's chunk, a decode step
                     against a resident cache: sparse_decode)
  full_attention     every causal key (the `full` mode)
  slot_attention     one query per sequence over the GPU slot pool of offload.py
  dense_decode       one query per sequence over a whole cache (the full-attention baseline)

The bias is added after the 1/√d scale; softmax and its statistics are in fp32 (fp64 stays fp64).
Kernels: attention_kernels.py (T queries: forward and backward, over the selection as tiles of
neighbouring queries), decode_kernels.py (one query per sequence, split over its blocks).
"""

import math

import torch
import torch.nn.functional as F

import attention_kernels
import decode_kernels
from common import fp32, use_kernels


@torch.amp.autocast("cuda", enabled=False)  # scores, bias and softmax stay in fp32 under autocast
def attend(q, k, v, logit_add):
    """softmax(q·k/√d + logit_add) v for G query heads per KV head, in fp32 (or fp64).

    q: (Bz, H_kv, G, T, d); k, v: (Bz, H_kv, S, d); logit_add: (Bz, H_kv, T, S), the bias where a
    key may be attended and -inf where not. Returns (Bz, H_kv, G, T, d)."""
    d = q.shape[-1]
    s = fp32(q) * (1.0 / math.sqrt(d)) @ fp32(k)[:, :, None].transpose(-1, -2)  # (.., G, T, S)
    p = torch.softmax(s + logit_add[:, :, None], dim=-1)
    return p @ fp32(v)[:, :, None]


def sparse_attention(q, k, v, bias, block_mask, q_pos, *, B):
    """q: (Bz, H_q, T, d) at positions q_pos (Bz, T); k, v: (Bz, H_kv, S, d) keys at positions
    0..S-1; bias: (Bz, H_kv, S) or None; block_mask: (Bz, H_kv, T, nb), or None for every causal
    key. Returns (Bz, H_q, T, d). Kernel: attention_kernels.sparse_attention (Γ(t) as tiles)."""
    Bz, H_q, T, d = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    j = torch.arange(S, device=q.device)
    allowed = (j <= q_pos[..., None])[:, None]  # (Bz, 1, T, S) causal
    if block_mask is not None:
        allowed = allowed & block_mask[..., j // B]  # (Bz, H_kv, T, S)
    zero = torch.zeros((), device=q.device, dtype=fp32(q).dtype)
    bias = fp32(bias)[:, :, None, :] if bias is not None else zero
    logit_add = torch.where(allowed, bias, float("-inf"))  # (Bz, H_kv, T, S)
    o = attend(q.view(Bz, H_kv, H_q // H_kv, T, d), k, v, logit_add)  # (Bz, H_kv, G, T, d)
    return o.reshape(Bz, H_q, T, d).to(q.dtype)


def full_attention(q, k, v, q_pos):
    """Every causal key, no bias: the queries at q_pos (Bz, T) are the last T of the S positions (a
    whole sequence, or a prefill's chunk). Kernel: torch's flash attention
    (attention_kernels.causal_sdpa)."""
    if use_kernels(q):
        return attention_kernels.causal_sdpa(q, k, v)
    return sparse_attention(q, k, v, None, None, q_pos, B=1)


def sparse_decode(q, k, v, bias, block_mask, pos, *, cfg):
    """sparse_attention for one query per sequence against a resident cache (kvcache.KVCache):
    q (Bz, H_q, 1, d) at positions pos (Bz,), at most k selected blocks per row.
    Kernel: decode_kernels.sparse_decode."""
    if use_kernels(q, cfg):
        return decode_kernels.sparse_decode(q, k, v, bias, block_mask, pos, B=cfg.B, k_sel=cfg.k)
    return sparse_attention(q, k, v, bias, block_mask, pos[:, None], B=cfg.B)


def slot_attention(q, pool, slot_block, bias, pos, cfg):
    """Decode over the slot pool: q (Bz, H_q, 1, d); pool (R, k+1, 2, B, d), slot k the tail block
    (the one being written); slot_block (R, k) the block in each slot, -1 free; bias (Bz, H_kv, S)
    per token or None; pos (Bz,). Every resident block is selected (offload.set_difference freed
    the rest), so the keys are the k slots and the tail up to pos.
    Kernel: decode_kernels.slot_attention."""
    if use_kernels(q, cfg):
        return decode_kernels.slot_attention(q, pool, slot_block, bias, pos, cfg.B)
    Bz, H_q, _, d = q.shape
    keys, vals, tok = pool_tokens(pool, slot_block, pos, cfg.B)
    H = keys.shape[1]
    valid = (tok >= 0) & (tok <= pos[:, None, None])
    logit_add = torch.zeros((), device=q.device, dtype=fp32(q).dtype)
    if bias is not None:  # (Bz, H, (k+1) B)
        logit_add = fp32(bias).gather(2, tok.clamp(0, bias.shape[2] - 1))
    logit_add = torch.where(valid, logit_add, float("-inf"))[:, :, None]  # (Bz, H, 1, (k+1) B)
    o = attend(q.view(Bz, H, H_q // H, 1, d), keys, vals, logit_add)  # (Bz, H, G, 1, d)
    return o.reshape(Bz, H_q, 1, d).to(q.dtype)


def pool_tokens(pool, slot_block, pos, B):
    """The slot pool read as tokens, as the decode kernel reads it: pool (R, k+1, 2, B, d), slot k
    the tail (the block of pos), slot_block (R, k) the block in each slot (-1 free), pos (Bz,) ->
    keys, values (Bz, H_kv, (k+1) B, d) and their positions (Bz, H_kv, (k+1) B), -1 where the slot
    is free."""
    R, k1, _, _, d = pool.shape
    Bz = pos.shape[0]
    H = R // Bz
    blk = torch.cat([slot_block, (pos // B).repeat_interleave(H)[:, None]], 1).view(Bz, H, k1)
    tok = blk[..., None] * B + torch.arange(B, device=pool.device)  # (Bz, H, k+1, B)
    tok = torch.where(blk[..., None] >= 0, tok, -1).view(Bz, H, -1)
    kv = pool.view(Bz, H, k1, 2, B, d)
    return kv[:, :, :, 0].reshape(Bz, H, -1, d), kv[:, :, :, 1].reshape(Bz, H, -1, d), tok


def dense_decode(q, k, v, pos, cfg):
    """Full attention for one query per sequence: q (Bz, H_q, 1, d) at positions pos (Bz,); k, v
    (Bz, H_kv, S, d), keys past a sequence's position ignored. The G query heads of a KV head are
    G rows of one SDPA call, so K and V are read once; no host sync (the mask is made on the
    device). Kernel: decode_kernels.dense_decode."""
    if use_kernels(q, cfg):
        return decode_kernels.dense_decode(q, k, v, pos)
    Bz, H_q, _, d = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    mask = (torch.arange(S, device=q.device) <= pos[:, None])[:, None, None]  # (Bz, 1, 1, S)
    o = F.scaled_dot_product_attention(q.reshape(Bz, H_kv, H_q // H_kv, d), k, v, attn_mask=mask)
    return o.reshape(Bz, H_q, 1, d)
