"""
FSDP2 training, applied from outside the model (as tp.py applies tensor parallelism to decoding):
train.py --fsdp under torchrun shards each block's weights, gradients and optimizer state over the
processes with torch.distributed.fsdp.fully_shard, as torchtitan does. A checkpoint is saved whole,
in the format of any run (gathered), and a resumed run takes its shards of it again (to_shards).
"""

import torch

from model import Transformer


def fully_shard_blocks(model, device):
    """FSDP2: each block a unit, then the rest; on GPUs the blocks compute in bf16 and reduce
    gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if device.type == "cuda" else None
    kw = dict(mp_policy=mp) if mp else {}
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def like(opt, pairs):
    """An optimizer of opt's kind with opt's groups over other parameters (pairs: each of opt's ->
    its counterpart), its state empty."""
    groups = [{**g, "params": [pairs[p] for p in g["params"]]} for g in opt.param_groups]
    return type(opt)([{**g, "fused": False} if "fused" in g else g for g in groups])


def gathered(model, opt):
    """An FSDP2 model's weights and optimizer state gathered whole on the CPU, in every process (a
    collective): a plain model and its optimizer, saved as any run's are."""
    model.reshard()  # the optimizer's shards (the root stays unsharded after a forward)
    whole = lambda t: t.full_tensor().cpu() if hasattr(t, "full_tensor") else t.cpu()
    plain = Transformer(model.cfg)
    plain.load_state_dict({n: whole(p) for n, p in model.named_parameters()})
    for name in ("eos_ids", "chat_template", "special_tokens"):
        if hasattr(model, name):
            setattr(plain, name, getattr(model, name))
    pairs = dict(zip(model.parameters(), plain.parameters()))
    plain_opt = like(opt, pairs)
    for p, q in pairs.items():
        if p in opt.state:
            plain_opt.state[q] = {k: whole(v) for k, v in opt.state[p].items()}
    return plain, plain_opt


def to_shards(model, opt, plain, opt_state):
    """The twin of gathered: a plain model's weights and a saved state of its optimizer (opt's
    groups, whole) into each process's shards of the FSDP2 model and its optimizer opt."""
    from torch.distributed.tensor import distribute_tensor

    pairs = dict(zip(model.parameters(), plain.parameters()))
    plain_opt = like(opt, pairs)
    plain_opt.load_state_dict(opt_state)
    shard = lambda t, p: distribute_tensor(t.to(p.device), p.device_mesh, p.placements)
    with torch.no_grad():
        for p, q in pairs.items():
            p.copy_(shard(q, p))
            if q in plain_opt.state:
                st = plain_opt.state[q]
                opt.state[p] = {k: shard(v, p) if v.dim() else v.clone() for k, v in st.items()}
