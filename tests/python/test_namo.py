"""NAMO and NAMO-D (moment2_method namo, namo_d) on the daemon, against each method's reference step
written here as its own code has it, and LocalOptimizer against the daemon.

References (facts read from the public code; the steps below are written for these tests):
- NAMO: NVIDIA-NeMo/Emerging-Optimizers at 033065f, emerging_optimizers/orthogonalized_optimizers/
  adaptive_muon.py, AdaptiveMuon with moment2_method="namo": decoupled decay W ← W·(1 − lr·wd) first;
  buf.lerp_(g, 1 − μ); Nesterov M̃ = g.lerp(buf, μ); O = NS(M̃); one scalar v per parameter,
  v.lerp_(‖g‖², 1 − β2); α = ‖M̃‖/(√v + ε), no bias correction; W ← W − lr·scale·α·O. 2-D only
  there: here each matrix muond orthogonalizes (an expert, a flattened filter) is one such matrix.
- NAMO-D: the authors' code, minxin-zhg/namo at 9fa2762, src/namo.py, class NAMO_D: V (one per
  column) ← μ2·V + (1 − μ2)·‖g_col‖²; buf.lerp_(g, 1 − μ); Nesterov M̃; O = NS(M̃);
  base = lr·√(1 − μ2ᵗ)/(1 − μᵗ); d_j = ‖M̃_col j‖·rsqrt(V_j + ε), clamped to [c·mean, mean/c];
  W_col j −= min(d_j·base·0.2·√max(m, n), 1)·O_col j. Its Newton–Schulz runs in bf16 (fp32 on both
  sides here). Its decay is per column, W_col *= 1 − wd·min(d_j·base, 1); muond's is its weight
  decay modes' (docs/algorithms.md, NAMO and NAMO-D), so the comparison runs without decay and the
  decay is checked against LocalOptimizer. Its scale takes the first two dimensions of a 4-D filter;
  muond's takes the flattened shape, as for every Muon variant, and so does the reference here.

Both sides compute in fp32 and sum in other orders, as in test_equivalence.py, whose bound (1e-4
relative after a few steps) is derived there; the step sizes add one rounded sum per line and one
product per element. A missing bias correction, a wrong line or clamp is off by far more (ε, 1e-8
against V, is not seen here)."""

import math

import pytest
import torch

import muond
from test_muon_variants import SHAPES, assert_local_matches_daemon, keller_ns, rel_err

TOLERANCE = 1e-4


def matrices(t):
    if t.dim() == 3:
        return [t[e] for e in range(t.size(0))]
    return [t.reshape(t.size(0), -1)]


class NamoReference:
    """Emerging-Optimizers' NAMO (method "namo") or the authors' NAMO-D ("namo_d"), matrix by matrix."""

    def __init__(self, method, lr, momentum, beta2, eps, weight_decay, clamp=0.75):
        self.method, self.lr, self.mu, self.beta2, self.eps = method, lr, momentum, beta2, eps
        self.wd, self.clamp = weight_decay, clamp
        self.state = {}

    def step(self, name, w, g):
        buf, v, t = self.state.setdefault(name, (torch.zeros_like(g), [], [0]))
        t[0] += 1
        if self.method == "namo":
            w.mul_(1 - self.lr * self.wd)
        buf.lerp_(g, 1 - self.mu)
        m_all = g.lerp(buf, self.mu)
        for i, (wm, gm, mm) in enumerate(zip(matrices(w), matrices(g), matrices(m_all))):
            rows, cols = mm.shape
            o = keller_ns(mm)
            if len(v) <= i:
                v.append(torch.zeros(1 if self.method == "namo" else cols))
            if self.method == "namo":
                v[i].lerp_(torch.linalg.vector_norm(gm).square().reshape(1), 1 - self.beta2)
                alpha = torch.linalg.vector_norm(mm) / (v[i].sqrt() + self.eps)
                wm.add_(o * alpha * (0.2 * math.sqrt(max(rows, cols))), alpha=-self.lr)
                continue
            nc = torch.linalg.vector_norm(gm, dim=0)
            v[i].mul_(self.beta2).addcmul_(nc, nc, value=1 - self.beta2)
            base = self.lr * math.sqrt(1 - self.beta2 ** t[0]) / (1 - self.mu ** t[0] + 1e-12)
            d = torch.linalg.vector_norm(mm, dim=0) * torch.rsqrt(v[i] + self.eps)
            mean = d.mean()
            d = torch.clamp(d, min=mean * self.clamp, max=mean / self.clamp)
            step = (d * base * (0.2 * math.sqrt(max(rows, cols)))).clamp(max=1.0)
            wm.sub_(o * step[None, :])


def options(method, weight_decay):
    out = {"moment2_method": method, "lr": 0.02, "momentum": 0.9, "beta2": 0.95, "eps": 1e-8,
           "weight_decay": weight_decay, "scale_mode": "spectral", "extra_scale_factor": 0.2}
    if method == "namo_d":
        out["namo_clamp"] = 0.75
    return out


def run(method, weight_decay, endpoint, steps=6, seed=5):
    gen = torch.Generator().manual_seed(seed)
    start = {n: 0.1 * torch.randn(*s, generator=gen) for n, s in SHAPES.items()}
    remote_params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    local_params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    reference = {n: t.clone() for n, t in start.items()}
    opts = options(method, weight_decay)
    ref = NamoReference(method, opts["lr"], opts["momentum"], opts["beta2"], opts["eps"], weight_decay)
    remote = muond.RemoteOptimizer([dict(opts, params=list(remote_params.items()))], endpoint=endpoint)
    local = muond.LocalOptimizer([dict(opts, params=list(local_params.items()))])
    for _ in range(steps):
        for name, shape in SHAPES.items():
            # Gradients of different sizes per step, so that v and ‖M̃‖ part ways.
            g = torch.randn(*shape, generator=gen) * float(torch.rand(1, generator=gen) * 3 + 0.1)
            remote_params[name].grad, local_params[name].grad = g.clone(), g.clone()
            ref.step(name, reference[name], g)
        remote.step()
        local.step()
    state = remote.state_dict()["state"]
    remote.close()
    return start, remote_params, local_params, reference, state


@pytest.mark.parametrize("method,weight_decay", [("namo", 0.1), ("namo_d", 0.0)])
def test_daemon_and_local_match_the_reference(endpoint, method, weight_decay):
    start, remote_params, local_params, reference, state = run(method, weight_decay, endpoint)
    for name in SHAPES:
        ours = remote_params[name].detach()
        assert rel_err(ours, reference[name]) < TOLERANCE, (name, rel_err(ours, reference[name]))
        assert rel_err(local_params[name].detach(), ours) < TOLERANCE, name
        moved = rel_err(start[name], reference[name])
        assert moved > 100 * TOLERANCE, f"{name} hardly moved ({moved}): the check would not tell"
    # The second moment: one value per matrix (NAMO) or per column of each (NAMO-D), flat.
    shapes = [tuple(state[i]["moment2"].shape) for i in range(len(SHAPES))]
    per_matrix = {"square": 1, "tall": 1, "wide": 1, "experts": 3, "conv": 1}
    cols = {"square": 16, "tall": 12, "wide": 24, "experts": 3 * 12, "conv": 27}
    want = per_matrix if method == "namo" else cols
    assert shapes == [(want[n],) for n in SHAPES]


def test_namo_d_decay_matches_local(endpoint):
    """NAMO-D with decoupled decay: muond's decay, the same on the daemon and LocalOptimizer."""
    start, remote_params, local_params, _, _ = run("namo_d", 0.1, endpoint, steps=4, seed=7)
    for name in SHAPES:
        ours = remote_params[name].detach()
        assert rel_err(local_params[name].detach(), ours) < TOLERANCE, name
        assert rel_err(start[name], ours) > 100 * TOLERANCE


def test_the_step_sizes_change_the_update(endpoint):
    """NAMO, NAMO-D, unclamped NAMO-D and plain Muon make different updates (so a step size that
    were ignored would fail above)."""
    gen = torch.Generator().manual_seed(9)
    start = 0.1 * torch.randn(12, 24, generator=gen)
    grads = [torch.randn(12, 24, generator=gen) for _ in range(2)]
    # Columns whose gradients change size from one step to the next: ‖M̃_col‖/√V_col then differs
    # between columns, so NAMO-D's scales differ and the clamp binds.
    grads[0][:, :6] *= 10
    grads[1][:, 6:12] *= 10
    results = {}
    for key, extra in {"plain": {}, "namo": {"moment2_method": "namo"},
                       "namo_d": {"moment2_method": "namo_d"},
                       "unclamped": {"moment2_method": "namo_d", "namo_clamp": 0.0}}.items():
        p = torch.nn.Parameter(start.clone())
        opt = muond.RemoteOptimizer([dict(extra, params=[("w", p)])], endpoint=endpoint)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        opt.close()
        results[key] = p.detach().clone()
    keys = list(results)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert rel_err(results[a] - start, results[b] - start) > 1e-3, (a, b)


def test_refusals_name_the_option(endpoint):
    w = torch.nn.Parameter(torch.zeros(8, 8))
    with pytest.raises(ValueError, match="weight_decay_mode l2 cannot be combined with moment2_method namo"):
        muond.RemoteOptimizer([{"params": [w], "moment2_method": "namo", "weight_decay_mode": "l2"}],
                              endpoint=endpoint)
    with pytest.raises((ValueError, muond.MuondError), match=r"namo_clamp must be in \[0, 1\], got 1.5"):
        muond.RemoteOptimizer([{"params": [w], "moment2_method": "namo_d", "namo_clamp": 1.5}],
                              endpoint=endpoint)
    with pytest.raises(ValueError, match="option 'namo_clamp' applies to a muon group only with a moment2_method"):
        muond.RemoteOptimizer([{"params": [w], "namo_clamp": 0.5}], endpoint=endpoint)
    # The daemon's own refusal, for a client that skips the Python checks.
    conn = muond.Connection(endpoint)
    spec = muond._stubs.pb.SessionSpec()
    group = spec.groups.add(name="g")
    group.options.moment2_method = "namo_d"
    group.options.weight_decay_mode = "l2"
    spec.parameters.add(name="w", shape=[8, 8], group="g")
    with pytest.raises(muond.MuondError, match=r"spec\.groups\[0\]\.options\.weight_decay_mode l2 cannot"):
        conn.create_session("namo-refused", spec)


@pytest.mark.parametrize("method,extra", [
    ("namo", {"exp_avg_sq_dtype": "bf16", "ns_algorithm": "gram", "ns_coefficients": "gram_polar_express"}),
    ("namo_d", {"momentum_normalization": "rowcol", "post_normalization": "row_col",
                "scale_mode": "unit_rms_norm", "weight_decay_mode": "independent", "weight_decay": 0.01}),
    ("namo_d", {"num_heads": 2, "momentum_style": "sum", "nesterov": False, "weight_decay_mode": "cautious",
                "weight_decay": 0.1}),
])
def test_compositions_match_local(endpoint, method, extra):
    """NAMO with a 16-bit second moment and the Gram iteration; NAMO-D with MuonEq, Muon+, another
    scale and decay mode; NAMO-D per head with sum momentum and cautious decay: the daemon and
    LocalOptimizer agree (each composes as docs/algorithms.md, NAMO and NAMO-D, says)."""
    shapes = {"wide": (12, 24), "tall": (24, 12), "experts": (2, 8, 12)}
    if extra.get("num_heads"):
        del shapes["experts"]
    # A bf16 second moment rounds V (2⁻⁸ relative) on both sides alike; the step sizes then differ
    # by the fp32 sums' order only.
    assert_local_matches_daemon(endpoint, dict({"moment2_method": method, "lr": 0.02}, **extra), shapes, 4,
                                torch.Generator().manual_seed(12), scaled=True)
