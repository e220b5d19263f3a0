"""Shared pieces of the SDK tests: a tiny model with every kind of parameter the Muon/AdamW
split cares about, seeded batches, and a harness that trains the daemon and the pure-torch
reference side by side on identical gradients."""

import copy
import math
import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

import muond
from reference import ADAMW_DEFAULTS, MUON_DEFAULTS, Reference

# scripts/gpu-check.sh sets MUOND_REQUIRE_GPU=1 on the GPU machine: there a test that needs a GPU
# runs (and fails) instead of being skipped when torch sees none, so a broken GPU path cannot pass
# as "skipped".
GPU_REQUIRED = os.environ.get("MUOND_REQUIRE_GPU") == "1"


def no_gpu() -> bool:
    """Whether a GPU test should skip: torch sees no CUDA device and no GPU is required."""
    return not torch.cuda.is_available() and not GPU_REQUIRED

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


SIXTEEN_BIT = {"bf16": torch.bfloat16, "fp16": torch.float16}
_SIGNIFICAND_BITS = {"bf16": 8, "fp16": 11}
_SMALLEST_NORMAL = {"bf16": 2.0 ** -126, "fp16": 2.0 ** -14}

# Two runs that compute the same fp32 steps on the same 16-bit values, but whose fp32 arithmetic
# differs in the last bits (GEMMs and reductions summed in another order: another BLAS kernel,
# another library), store the same 16-bit value except where the fp32 result lies within that
# difference of a midpoint between two 16-bit neighbours; there they store the neighbours, one ulp
# apart. An fp32 difference δ·|x| (δ ≲ k·2^-24 for sums of k terms) against the 16-bit spacing
# (≥ 2^-8·|x| for bf16, 2^-11 for fp16) makes that happen to a fraction of about 2δ/spacing of the
# elements per step: ≲ 2·64·2^-16 = 0.2% for bf16 with k = 64 (TinyNet's widest sum); 10 steps
# make 2%, and MAX_APART = 5% leaves room for a disagreement spreading through the next step's
# Newton–Schulz; a small tensor may have MAX_APART_SPARE more (48 elements × 10 steps × 0.2% is
# about one). Each step can add to an element's distance one ulp of its own rounding plus the
# difference of the updates, which are computed from inputs one 16-bit unit roundoff apart and so
# differ by at most about one 16-bit spacing of the update's size: after `steps` steps, an element
# is within `steps` spacings of max(|value|, the largest step any element took). A state kept in
# fp32 instead, or rounded another way, puts most elements apart (test_precision's guard).
MAX_APART = 0.05
MAX_APART_SPARE = 2


def sixteen_bit_spacing(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """The distance from |x| to the next larger value of the 16-bit `dtype`, element-wise."""
    magnitude = x.detach().double().abs().clamp_min(_SMALLEST_NORMAL[dtype])
    _, exponent = torch.frexp(magnitude)  # magnitude = m·2^exponent, 0.5 ≤ m < 1
    return torch.pow(2.0, (exponent - _SIGNIFICAND_BITS[dtype]).double())


def rounding_disagreement(a: torch.Tensor, b: torch.Tensor, dtype: str, floor: float = 0.0):
    """(largest distance in 16-bit spacings of max(|b|, floor), elements apart, elements) of two
    tensors of 16-bit values."""
    diff = (a.detach().double() - b.detach().double()).abs()
    spacing = sixteen_bit_spacing(b.detach().double().abs().clamp_min(floor), dtype)
    return (diff / spacing).max().item(), int((diff > 0).sum().item()), diff.numel()


def assert_same_up_to_rounding(a: torch.Tensor, b: torch.Tensor, dtype: str, steps: int, floor: float = 0.0,
                               what: str = ""):
    """a and b agree as two runs of `steps` 16-bit steps can (see MAX_APART); `floor` is the largest
    step an element took."""
    worst, apart, count = rounding_disagreement(a, b, dtype, floor)
    allowed = math.ceil(MAX_APART * count) + MAX_APART_SPARE
    assert worst <= steps and apart <= allowed, (
        f"{what}: {apart} of {count} elements apart (at most {allowed}), up to {worst:.2f} {dtype} spacings "
        f"(at most {steps})")


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


def assert_bitwise(got, want, what):
    """Each tensor of ``got`` equals ``want``'s of the same name bit for bit; the message names the
    first that does not, how many elements differ and by how much."""
    for name, value in want.items():
        assert torch.equal(got[name], value), (
            f"{what}: {name} differs in {(got[name] != value).sum().item()} of {value.numel()} "
            f"elements, by up to {(got[name] - value).abs().max().item():.3e}")


def run_ranks(rank_loop, world_size, errors):
    """``rank_loop(rank)`` in a thread per rank; then the first error a rank appended to
    ``errors``, raised."""
    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
