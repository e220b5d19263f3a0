"""Dion2 (optimizer="dion2") on the daemon against its reference step written here as its own code
has it, LocalOptimizer against the daemon, and its momentum as state (state_dict, 16-bit storage).

Reference (facts read from the public code; the step below is written for these tests):
microsoft/dion at 00c2bc1, dion/dion2.py, dion2_update_megabatch_async with flatten=False on one
device: M ← M + G; the rows when rows ≤ cols, else the columns (select_dim); k = max(1,
⌈fraction·lines⌉) lines of largest L1 norm (torch.topk); their M lines ← ef_decay·M; O = NS of the
chosen lines (polar_express: X/(‖X‖·1.02 + ε), five tuples, bf16 there, fp32 on both sides here);
X ← X·(1 − lr·wd); X[chosen] −= lr·√(fan_out/fan_in)·O (adjust_lr "spectral_norm", the whole
matrix's shape). A 3-D stack chooses per matrix. dion's polar_express tuples are not muond's
`polar_express` set, so both sides get dion's as a custom list, with its 1.02 and ε = 1e-8.

Both sides compute in fp32 and sum in other orders, as in test_equivalence.py, whose bound (1e-4
relative after a few steps) is derived there. A wrong line choice, side, decay or scale is off by
far more."""

import math

import pytest
import torch

import muond
from test_muon_variants import assert_local_matches_daemon, rel_err

TOLERANCE = 1e-4
SHAPES = {"square": (16, 16), "tall": (24, 12), "wide": (12, 24), "experts": (3, 8, 12)}
DION_POLAR_EXPRESS = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
                      (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                      (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                      (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                      (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]


def polar_express(g):
    x = g.float()
    x = x / (x.norm() * 1.02 + 1e-8)
    tall = x.size(0) > x.size(1)
    for a, b, c in DION_POLAR_EXPRESS:
        if tall:
            m = x.T @ x
            x = a * x + x @ (b * m + c * m @ m)
        else:
            m = x @ x.T
            x = a * x + (b * m + c * m @ m) @ x
    return x


class Dion2Reference:
    def __init__(self, lr, fraction, ef_decay, weight_decay):
        self.lr, self.fraction, self.ef, self.wd = lr, fraction, ef_decay, weight_decay
        self.momenta = {}

    def step(self, name, w, g):
        m = self.momenta.setdefault(name, torch.zeros_like(g))
        m.add_(g)
        w.mul_(1 - self.lr * self.wd)
        stack = m if m.dim() == 3 else m.unsqueeze(0)
        weights = w if w.dim() == 3 else w.unsqueeze(0)
        rows, cols = stack.shape[-2:]
        select_rows = rows <= cols
        k = max(1, int(math.ceil(self.fraction * (rows if select_rows else cols))))
        for mm, ww in zip(stack.unbind(0), weights.unbind(0)):
            norms = mm.norm(p=1, dim=-1 if select_rows else -2)
            chosen = torch.topk(norms, k, sorted=False).indices
            lines = mm[chosen] if select_rows else mm[:, chosen]
            o = polar_express(lines)
            if select_rows:
                mm[chosen] = lines * self.ef
                ww[chosen] -= self.lr * math.sqrt(rows / cols) * o
            else:
                mm[:, chosen] = lines * self.ef
                ww[:, chosen] -= self.lr * math.sqrt(rows / cols) * o


def options(**extra):
    return dict({"optimizer": "dion2", "lr": 0.02, "weight_decay": 0.1, "dion2_fraction": 0.25,
                 "dion2_ef_decay": 0.9, "ns_coefficients": DION_POLAR_EXPRESS,
                 "ns_coefficients_after": "repeat_last", "ns_norm_safety": 1.02, "ns_eps": 1e-8}, **extra)


def test_daemon_and_local_match_the_reference(endpoint):
    gen = torch.Generator().manual_seed(3)
    start = {n: 0.1 * torch.randn(*s, generator=gen) for n, s in SHAPES.items()}
    remote_params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    local_params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    reference = {n: t.clone() for n, t in start.items()}
    opts = options()
    ref = Dion2Reference(opts["lr"], opts["dion2_fraction"], opts["dion2_ef_decay"], opts["weight_decay"])
    remote = muond.RemoteOptimizer([dict(opts, params=list(remote_params.items()))], endpoint=endpoint)
    local = muond.LocalOptimizer([dict(opts, params=list(local_params.items()))])
    for _ in range(6):
        for name, shape in SHAPES.items():
            g = torch.randn(*shape, generator=gen)
            remote_params[name].grad, local_params[name].grad = g.clone(), g.clone()
            ref.step(name, reference[name], g)
        remote.step()
        local.step()
    momenta = {i: s["momentum"] for i, s in remote.state_dict()["state"].items()}
    remote.close()
    for i, name in enumerate(SHAPES):
        ours = remote_params[name].detach()
        assert rel_err(ours, reference[name]) < TOLERANCE, (name, rel_err(ours, reference[name]))
        assert rel_err(local_params[name].detach(), ours) < TOLERANCE, name
        assert rel_err(momenta[i], ref.momenta[name]) < TOLERANCE, name
        moved = rel_err(start[name], reference[name])
        assert moved > 100 * TOLERANCE, f"{name} hardly moved ({moved}): the check would not tell"


@pytest.mark.parametrize("extra", [{"dion2_select": "cols", "dion2_fraction": 0.5},
                                   {"dion2_select": "rows", "momentum_dtype": "bf16",
                                    "weight_decay_mode": "independent", "weight_decay": 0.01},
                                   {"ns_preconditioner": "aol", "scale_mode": "spectral",
                                    "extra_scale_factor": 0.2},
                                   {"dion2_select": "cols", "dion2_fraction": 0.5, "ns_preconditioner": "aol"}])
def test_local_matches_the_daemon(endpoint, extra):
    """Forced sides, 16-bit momentum, independent decay, AOL Newton–Schulz, a conv filter
    (flattened to (out, rest), as Muon's); half the columns of a 12×24 matrix are a square block,
    which AOL scales by its own rows, not the stored lines'."""
    assert_local_matches_daemon(endpoint, {"optimizer": "dion2", "lr": 0.02, **extra},
                                dict(SHAPES, conv=(8, 3, 3, 3)), 4, torch.Generator().manual_seed(4))


def test_only_the_chosen_lines_move_without_decay(endpoint):
    """With no weight decay, a step changes exactly ⌈fraction·rows⌉ rows of a wide matrix: those
    of the largest L1 norm."""
    gen = torch.Generator().manual_seed(6)
    w = torch.nn.Parameter(torch.randn(8, 16, generator=gen))
    start = w.detach().clone()
    opt = muond.RemoteOptimizer([{"params": [w], "optimizer": "dion2", "weight_decay": 0.0,
                                  "dion2_fraction": 0.25}], endpoint=endpoint)
    g = torch.randn(8, 16, generator=gen)
    g[5] *= 10
    g[2] *= 5
    w.grad = g.clone()
    opt.step()
    opt.close()
    moved = [i for i in range(8) if not torch.equal(w.detach()[i], start[i])]
    assert moved == [2, 5]


def test_refusals_name_the_option(endpoint):
    w = torch.nn.Parameter(torch.zeros(8, 8))
    with pytest.raises(ValueError, match="weight_decay_mode cautious does not apply to dion2"):
        muond.RemoteOptimizer([{"params": [w], "optimizer": "dion2", "weight_decay_mode": "cautious"}],
                              endpoint=endpoint)
    with pytest.raises(ValueError, match="option 'momentum' does not apply to optimizer 'dion2'"):
        muond.RemoteOptimizer([{"params": [w], "optimizer": "dion2", "momentum": 0.9}], endpoint=endpoint)
    with pytest.raises((ValueError, muond.MuondError), match=r"dion2_fraction must be in \(0, 1\], got 0"):
        muond.RemoteOptimizer([{"params": [w], "optimizer": "dion2", "dion2_fraction": 0.0}],
                              endpoint=endpoint)
    with pytest.raises(ValueError, match="Dion2 needs matrices"):
        muond.RemoteOptimizer([{"params": [torch.nn.Parameter(torch.zeros(8))], "optimizer": "dion2"}],
                              endpoint=endpoint)


def test_over_two_daemons_as_on_one(start_daemon):
    """A Dion2 group and a NAMO-D group whose parameters are placed over two daemons step
    bit-identically to one daemon (each daemon holds whole parameters), and their state_dict
    holds the same momenta and second moments."""
    gen = torch.Generator().manual_seed(8)
    shapes = {"a": (16, 24), "b": (24, 16), "c": (3, 8, 12), "d": (12, 12)}
    start = {n: 0.1 * torch.randn(*s, generator=gen) for n, s in shapes.items()}
    grads = [{n: torch.randn(*s, generator=gen) for n, s in shapes.items()} for _ in range(4)]

    def run(endpoints):
        params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
        opt = muond.RemoteOptimizer(
            [{"name": "dion2", "optimizer": "dion2", "params": [("a", params["a"]), ("b", params["b"])]},
             {"name": "namo_d", "moment2_method": "namo_d", "params": [("c", params["c"]), ("d", params["d"])]}],
            endpoints=endpoints)
        for step in grads:
            for n, p in params.items():
                p.grad = step[n].clone()
            opt.step()
        state = opt.state_dict()["state"]
        opt.close()
        return params, state

    one, one_state = run([start_daemon().endpoint])
    two, two_state = run([start_daemon().endpoint, start_daemon().endpoint])
    for n in shapes:
        assert torch.equal(one[n].detach(), two[n].detach()), n
    for i, slots in one_state.items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, two_state[i][slot]), (i, slot)
