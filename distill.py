"""
Teaching the eviction head from the model's own dense attention (docs/METHOD.md §8), applied from
outside the model, as fsdp.py shards it: a forward hook on every attention layer recomputes the
layer's q, k and v without gradient, takes the dense attention of a few sampled queries as the
teacher (eviction.attention_by_block), and adds the distillation loss of the layer's c
(eviction.distillation_loss), whose gradient reaches A and W_δ alone.

train.py uses it twice:
  --head-warmup N   the run's first N steps teach the head alone (the rest of the model frozen:
                    its forward runs without gradient), before the language-model loss
  --head-distill λ  after them, λ times this loss beside the language-model loss, so that what
                    the bias learns does not undo the ranking

Why A starts at TAU, not 0: E = A ⊙ pool(softplus(W_δ v)), so at A = 0 every block scores alike
and W_δ gets no gradient from any loss. A small positive A ranks blocks by pool(softplus(W_δ v))
at once, and keeps the bias c, which the dense model never saw, within a fraction of a logit.
"""

import numpy as np
import torch
import torch.distributed as dist

import eviction

TAU = 0.1  # the student's temperature: E / TAU. The bias c is as wide as E, so E's range of a few
# nats at the optimum is a few tenths of a logit in c
N_QUERIES = 256  # queries a step whose attention teaches, shared by the batch's sequences


def head_parameters(model):
    return [p for layer in model.layers for p in (layer.self_attn.A, layer.self_attn.delta.weight)]


def start_head(model):
    """Before the first warm-up step: A = TAU where it is 0 (a fresh head), so that W_δ learns."""
    with torch.no_grad():
        for layer in model.layers:
            A = layer.self_attn.A
            A.copy_(torch.where(A == 0, torch.full_like(A, TAU), A))


def average_gradients(model, world):
    """The head's gradients averaged over the processes: a warm-up step's forward runs outside the
    DistributedDataParallel wrapper (no gradient through the model), so it does not reduce them."""
    if world > 1:
        for p in head_parameters(model):
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


class Teacher:
    """The distillation loss of every attention layer, collected by forward hooks while `queries`
    are set (a training step's forward); evaluation and generation pass untouched."""

    def __init__(self, model, n_queries=N_QUERIES, tau=TAU, target="mass"):
        self.cfg, self.n, self.tau = model.cfg, n_queries, tau
        self.v = target == "output"  # the teacher: each block's attention mass, or its output's
        self.t, self.losses = None, []
        for layer in model.layers:
            layer.self_attn.register_forward_hook(self.hook)

    def queries(self, T, seed, step, rank, device):
        """The positions that teach this step: n_queries of those whose selection is sparse
        (t >= k·B), drawn from (seed, step, rank) alone, so a resumed run draws the same."""
        lo = self.cfg.k * self.cfg.B
        if T <= lo:
            raise ValueError(
                f"--seq-len {T}: the head learns where the selection is sparse, past k·B = {lo} "
                f"tokens; give a longer --seq-len"
            )
        rng = np.random.default_rng([seed, step, rank, 7])
        t = np.sort(rng.choice(np.arange(lo, T), min(self.n, T - lo), replace=False))
        self.t = torch.from_numpy(t).to(device)

    def hook(self, attn, args, out):
        if self.t is None:
            return
        x, rope = args[0], args[1]
        with torch.no_grad():
            q, k, v, _ = attn.qkvc(x, rope)
            mass = eviction.attention_by_block(
                q[:, :, self.t], k, self.t, self.cfg, v=v if self.v else None
            )
        with torch.enable_grad():  # also inside a warm-up step's forward, which has none
            c = attn.eviction(v)
            self.losses.append(eviction.distillation_loss(c, mass, self.t, self.cfg, self.tau))

    def loss(self):
        """The mean over the layers of this step's losses; the hooks stop until the next queries."""
        out = torch.stack(self.losses).mean()
        self.t, self.losses = None, []
        return out
