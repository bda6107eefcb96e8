"""
Tensor parallelism over KV heads, applied from outside the model (as fast.py applies speed): each of
`world` processes keeps H_kv / world KV heads with their G query heads each, its slice of every
projection and of the MLP, and its own decode cache of those heads (offloaded: its own host store
and its own UVA gather, over its own PCIe link). Selection is per KV head, so a rank selects, moves
and attends exactly what one process does for those heads; the layers' outputs are summed over the
ranks, one all-reduce after the attention's output projection and one after the MLP, as in
Megatron-LM and gpt-fast. The eviction head reads every KV head's values (c = A ⊙ softplus(W_δ ·
concat_h v)): each rank multiplies its heads' part of W_δ and one all-reduce of H_kv numbers a token
sums them.

Run with torchrun (`torchrun --nproc_per_node=2 generate.py --offload ...`):
common.start_processes starts the process group (NCCL on GPUs, gloo on CPUs), and shard(model)
cuts the model of every process the same way; each rank then samples the same tokens from the same logits.
"""

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import fp32


def check(cfg, world):
    """One line where the shape does not divide over `world` ranks."""
    if cfg.H_kv % world:
        raise ValueError(
            f"tensor parallelism splits the KV heads: {world} processes cannot share H_kv="
            f"{cfg.H_kv} (give --nproc_per_node a divisor of {cfg.H_kv})"
        )
    if cfg.hidden_dim % world:
        raise ValueError(
            f"tensor parallelism splits the MLP: hidden_dim={cfg.hidden_dim} is not a multiple "
            f"of {world} processes"
        )


def shard(model, rank, world, group=None):
    """Cut `model` in place to rank's share of `world`: its KV heads (and their query heads), its
    slice of the MLP, and an all-reduce after each attention and MLP output. Returns the model, whose
    cfg now has the rank's head counts (the decode caches made from it keep only its heads)."""
    cfg = model.cfg
    check(cfg, world)
    d, h = cfg.head_dim, cfg.H_kv // world
    kv = torch.arange(
        rank * h * d, (rank + 1) * h * d
    )  # the rank's rows of K, V (and columns of W_δ)
    q = torch.arange(rank * h * cfg.G * d, (rank + 1) * h * cfg.G * d)
    f = cfg.hidden_dim // world
    mlp = torch.arange(rank * f, (rank + 1) * f)
    local = replace(cfg, H_q=cfg.H_q // world, H_kv=h, hidden_dim=f)  # validated again
    model.cfg = local
    heads = slice(rank * h, (rank + 1) * h)
    for block in model.layers:
        attn, ff = block.self_attn, block.mlp
        W = attn.qkv_proj.weight.data  # rows: q (H_q d), k (H_kv d), v (H_kv d)
        Hq, Hk = cfg.H_q * d, cfg.H_kv * d
        keep(attn.qkv_proj, torch.cat([W[q], W[Hq + kv], W[Hq + Hk + kv]]))
        keep(attn.o_proj, attn.o_proj.weight.data[:, q])
        attn.cfg = local
        if cfg.eviction_head:
            keep(attn.delta, attn.delta.weight.data[:, kv])  # every head's row, the rank's columns
            attn.eviction = eviction_part(attn, heads, group)
        W = ff.gate_up_proj.weight.data  # rows: gate (hidden), up (hidden)
        keep(ff.gate_up_proj, torch.cat([W[mlp], W[cfg.hidden_dim + mlp]]))
        keep(ff.down_proj, ff.down_proj.weight.data[:, mlp])
        for m in (attn.o_proj, ff.down_proj):
            m.register_forward_hook(lambda m, args, out: all_reduce(out, group))
    return model


def keep(linear, weight):
    """linear's weight replaced by its slice (a copy: the whole one is freed)."""
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=linear.weight.requires_grad)
    linear.out_features, linear.in_features = weight.shape


def all_reduce(x, group):
    dist.all_reduce(x, group=group)
    return x


def eviction_part(attn, heads, group):
    """The eviction score of the rank's KV heads, from its part of W_δ · concat_h v (summed over
    the ranks: the twin of eviction.eviction_score)."""

    def eviction(v):  # v (Bz, h, T, d): the rank's heads -> c (Bz, h, T)
        Bz, h, T, d = v.shape
        x = v.transpose(1, 2).reshape(Bz, T, h * d)
        z = fp32(x) @ fp32(attn.delta.weight).t()  # (Bz, T, H_kv): this rank's share of the sum
        dist.all_reduce(z, group=group)
        return (fp32(attn.A[heads]) * F.softplus(z[..., heads])).transpose(1, 2)

    return eviction


def gather_stats(stats):
    """An offloaded cache's counters (offload.Stats) of every rank, joined on each: the summary then
    counts every KV head, as one process's would. Nothing outside torchrun."""
    if not dist.is_initialized():
        return
    for name, dim in (("needed", 1), ("moved", 1), ("cold", 1), ("stepped", 1), ("row_max", 0)):
        t = getattr(stats, name)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        setattr(stats, name, torch.cat(parts, dim))
