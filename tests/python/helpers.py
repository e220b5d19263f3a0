"""Shared pieces of the SDK tests: a tiny model with every kind of parameter the Muon/AdamW
split cares about, seeded batches, and a harness that trains the daemon and the pure-torch
reference side by side on identical gradients."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import muond
from reference import ADAMW_DEFAULTS, MUON_DEFAULTS, Reference

VOCAB = 40


class TinyNet(nn.Module):
    """Embedding → tall matrix → norm → wide matrix → head (about 5k parameters)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, 16)
        self.up = nn.Linear(16, 48)      # weight 48×16: tall, transposed inside Newton–Schulz
        self.norm = nn.LayerNorm(48)
        self.down = nn.Linear(48, 24)    # weight 24×48: wide
        self.head = nn.Linear(24, VOCAB, bias=False)

    def forward(self, idx):
        x = self.norm(F.gelu(self.up(self.emb(idx))))
        return self.head(torch.tanh(self.down(x)))


def batch(step: int, size: int = 32):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(VOCAB, (size,), generator=gen)
    y = torch.randint(VOCAB, (size,), generator=gen)
    return x, y


def loss_of(model, step: int):
    x, y = batch(step)
    return F.cross_entropy(model(x), y)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class Pair:
    """A model driven by a muond optimizer, and fp32 copies of its parameters driven by the
    reference with the same gradients (rounded to bf16 first when the wire is bf16)."""

    def __init__(self, optimizer_factory, model: nn.Module, ref_muon=None, ref_adamw=None,
                 round_grads_to=None):
        self.model = model
        self.ref_params = {n: p.detach().clone().float() for n, p in model.named_parameters()}
        self.opt = optimizer_factory(model)
        groups = []
        for g in self.opt.param_groups:
            kind = g["optimizer"]
            options = dict(MUON_DEFAULTS if kind == "muon" else ADAMW_DEFAULTS)
            options.update((ref_muon if kind == "muon" else ref_adamw) or {})
            groups.append({"kind": kind, "params": [self.ref_params[n] for n in g["param_names"]],
                           **options})
        self.ref = Reference(groups)
        self.round_grads_to = round_grads_to

    def step(self, step: int, sync_lr: bool = False):
        loss = loss_of(self.model, step)
        loss.backward()
        grads = {}
        for name, p in self.model.named_parameters():
            g = p.grad.detach().clone()
            if self.round_grads_to is not None:
                g = g.to(self.round_grads_to).float()
            grads[id(self.ref_params[name])] = g
        if sync_lr:  # the reference follows the lr the torch scheduler set on each group
            for ref_group, group in zip(self.ref.groups, self.opt.param_groups):
                ref_group["lr"] = group["lr"]
        self.opt.step()
        self.ref.step(grads)
        self.opt.zero_grad()
        return loss.item()

    def errors(self):
        return {n: rel_err(p.detach(), self.ref_params[n])
                for n, p in self.model.named_parameters()}


def remote_factory(endpoint, **kwargs):
    muon = kwargs.pop("muon", None)
    adamw = kwargs.pop("adamw", None)

    def make(model):
        groups = muond.default_param_groups(model, muon=muon, adamw=adamw)
        return muond.RemoteOptimizer(groups, endpoint=endpoint, **kwargs)
    return make


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def clone_model(model):
    return copy.deepcopy(model)
