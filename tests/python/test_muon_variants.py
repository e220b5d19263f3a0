"""MuonEq (momentum_normalization), Muon+ (post_normalization), Turbo-Muon (ns_preconditioner aol)
and per-head Newton–Schulz (num_heads) on the daemon, against each method's reference step written
here as its own code has it, and LocalOptimizer against the daemon.

References (facts read from the public code; the steps below are written for these tests):
- MuonEq: MaeChd/muon-eq at 99b6c8b, llm-opt-baseline-npu/llama2_pretrain/optimizers/muon_variants/
  muoneq.py, class MuonEq: buf ← μ·buf + g; Nesterov u = g + μ·buf; per normalize_mode the row
  and/or column scales (Σ u² + 1e-8)^(-1/2), both taken from the same u (rowcol); Newton–Schulz
  (Keller Jordan's tuple, 5 steps, X/(‖X‖_F + 1e-7), transposed when tall); W ← W·(1 − lr·wd) −
  lr·0.2·√max(m, n)·O. The reference runs Newton–Schulz in bf16; here it is fp32 on both sides.
- Muon+: the same repository's muon_variants/muon_plus.py (as K1seki221/MuonPlus), class MuonPlus:
  the same momentum and Newton–Schulz, then apply_post_polar_norm: each row and/or column divided by
  √(Σ u² + 1e-7) (its norm_eps argument is not used there), one after the other; W ← W·(1 − lr·wd)
  − lr·√(m/n)·O (rms_scaling: fan_out over fan_in, no max).

Both sides compute in fp32 and sum in other orders, as in test_equivalence.py, whose bound (1e-4
relative after a few steps) is derived there; the normalizations add one rounded sum and product
per line. A wrong orientation, order, eps placement or scale is off by a percent or more."""

import math

import pytest
import torch

import muond

TOLERANCE = 1e-4
SIMPLE = (3.4445, -4.7750, 2.0315)
SHAPES = {"square": (16, 16), "tall": (24, 12), "wide": (12, 24), "experts": (3, 8, 12),
          "conv": (8, 3, 3, 3)}


def keller_ns(g, steps=5):
    a, b, c = SIMPLE
    x = g.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if tall else x


def aol_ns(g, steps=4):
    """Turbo-Muon (thib-s/flash-newton-schulz, gradient-exploration/ns_variants/flash_ns.py at
    1aa1f31, newton_schulz_triton_aol), in fp32 rather than its bf16, with the aol tuples: wide X;
    A = X·Xᵀ; s = rsqrt(clamp_min(Σ|A|, 1e-7)) per row; X ← X·s; A ← A·s_i·s_j; the first iteration
    with that A."""
    tuples = muond.option_facts.COEFFICIENT_SETS["aol"]
    x = g.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    a_mat = x @ x.T
    s = torch.rsqrt(torch.clamp_min(a_mat.abs().sum(dim=-1), min=1e-7))
    x = x * s.unsqueeze(-1)
    a_mat = a_mat * s.unsqueeze(-1) * s.unsqueeze(-2)
    for t in range(steps):
        a, b, c = tuples[t % len(tuples)]
        if t > 0:
            a_mat = x @ x.T
        x = a * x + (b * a_mat + c * a_mat @ a_mat) @ x
    return x.T if tall else x


def muoneq_normalize(u, mode):
    sq = u.square()
    row = (sq.sum(dim=1) + 1e-8).rsqrt()
    col = (sq.sum(dim=0) + 1e-8).rsqrt()
    if mode == "row":
        return u * row[:, None]
    if mode == "col":
        return u * col[None, :]
    out = u * row[:, None]
    out.mul_(col[None, :])
    return out


def post_polar_norm(u, mode):
    order = {"row": ("row",), "col": ("col",), "row_col": ("row", "col"), "muon_plus": ("row", "col"),
             "col_row": ("col", "row")}[mode]
    for line in order:
        dim = -1 if line == "row" else -2
        u = u / torch.sqrt((u * u).sum(dim=dim, keepdim=True) + 1e-7)
    return u


class ReferenceStep:
    """One reference optimizer for 2-D matrices; a 3-D stack is its experts one by one and a 4-D
    filter is viewed as (out, rest), as the references' own reshape does."""

    def __init__(self, method, mode, lr, momentum, weight_decay):
        self.method, self.mode = method, mode
        self.lr, self.mu, self.wd = lr, momentum, weight_decay
        self.buffers = {}

    def matrices(self, t):
        if t.dim() == 3:
            return [t[e] for e in range(t.size(0))]
        return [t.reshape(t.size(0), -1)]

    def step(self, name, w, g):
        buf = self.buffers.setdefault(name, torch.zeros_like(g))
        buf.mul_(self.mu).add_(g)
        u = g.add(buf, alpha=self.mu)
        w.mul_(1 - self.lr * self.wd)
        for wm, um in zip(self.matrices(w), self.matrices(u)):
            rows, cols = um.shape
            if self.method == "muoneq":
                o = keller_ns(muoneq_normalize(um, self.mode))
                ratio = 0.2 * math.sqrt(max(rows, cols))
            elif self.method == "turbo":
                o = aol_ns(um)
                ratio = 0.2 * math.sqrt(max(rows, cols))
            else:
                o = post_polar_norm(keller_ns(um), self.mode)
                ratio = math.sqrt(rows / cols)
            wm.add_(o, alpha=-self.lr * ratio)


def daemon_options(method, mode):
    common = {"momentum_style": "sum", "nesterov": True, "lr": 0.02, "momentum": 0.9,
              "weight_decay": 0.1}
    if method == "muoneq":
        return dict(common, momentum_normalization=mode, scale_mode="spectral", extra_scale_factor=0.2)
    if method == "turbo":  # the aol set and 4 steps are ns_preconditioner aol's defaults
        return dict(common, ns_preconditioner="aol", scale_mode="spectral", extra_scale_factor=0.2)
    return dict(common, post_normalization=mode, scale_mode="unit_rms_norm")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_local_matches_daemon(endpoint, options, shapes, steps, gen, scaled=False):
    """Steps one group of ``options`` over parameters of ``shapes`` on the daemon and in
    LocalOptimizer with the same gradients (each scaled by a random factor when ``scaled``), then
    asserts the two agree within TOLERANCE and that every parameter moved well beyond it."""
    start = {n: 0.1 * torch.randn(*s, generator=gen) for n, s in shapes.items()}
    remote_params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    local_params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    remote = muond.RemoteOptimizer([dict(options, params=list(remote_params.items()))], endpoint=endpoint)
    local = muond.LocalOptimizer([dict(options, params=list(local_params.items()))])
    for _ in range(steps):
        for name, shape in shapes.items():
            g = torch.randn(*shape, generator=gen)
            if scaled:
                g = g * float(torch.rand(1, generator=gen) * 3 + 0.1)
            remote_params[name].grad, local_params[name].grad = g.clone(), g.clone()
        remote.step()
        local.step()
    remote.close()
    for name in shapes:
        ours = remote_params[name].detach()
        assert rel_err(local_params[name].detach(), ours) < TOLERANCE, name
        assert rel_err(start[name], ours) > 100 * TOLERANCE, name


@pytest.mark.parametrize("method,mode", [("muoneq", "row"), ("muoneq", "col"), ("muoneq", "rowcol"),
                                         ("muon_plus", "muon_plus"), ("muon_plus", "row"),
                                         ("muon_plus", "col"), ("muon_plus", "col_row"),
                                         ("turbo", "aol")])
def test_daemon_and_local_match_the_reference(endpoint, method, mode):
    gen = torch.Generator().manual_seed(5)
    start = {n: 0.1 * torch.randn(*s, generator=gen) for n, s in SHAPES.items()}
    remote_params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    local_params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    reference = {n: t.clone() for n, t in start.items()}
    options = daemon_options(method, mode)
    ref = ReferenceStep(method, mode, options["lr"], options["momentum"], options["weight_decay"])

    def groups(params):
        return [dict(options, params=list(params.items()))]

    remote = muond.RemoteOptimizer(groups(remote_params), endpoint=endpoint)
    local = muond.LocalOptimizer(groups(local_params))
    for _ in range(6):
        for name, shape in SHAPES.items():
            g = torch.randn(*shape, generator=gen)
            remote_params[name].grad, local_params[name].grad = g.clone(), g.clone()
            ref.step(name, reference[name], g)
        remote.step()
        local.step()
    remote.close()
    for name in SHAPES:
        ours = remote_params[name].detach()
        assert rel_err(ours, reference[name]) < TOLERANCE, (name, rel_err(ours, reference[name]))
        assert rel_err(local_params[name].detach(), ours) < TOLERANCE, name
        moved = rel_err(start[name], reference[name])
        assert moved > 100 * TOLERANCE, f"{name} hardly moved ({moved}): the check would not tell"


@pytest.mark.parametrize("dim", [0, 1], ids=["row-blocks", "column-blocks"])
def test_turbo_on_square_tensor_parallel_blocks_scales_each_blocks_own_rows(endpoint, dim):
    """AOL's scales depend on the orientation: each square block of a tensor-parallel weight
    (8×16 in two 8×8 column blocks, or 16×8 in two row blocks) is the reference's AOL step on that
    block as the parameter has it, though a column block is stored transposed."""
    gen = torch.Generator().manual_seed(11)
    shape = (8, 16) if dim == 1 else (16, 8)
    options = dict(daemon_options("turbo", "aol"), tp_blocks=2, tp_block_dim=dim)
    start = 0.1 * torch.randn(*shape, generator=gen)
    remote_w, local_w = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    reference = start.clone()
    ref = ReferenceStep("turbo", "aol", options["lr"], options["momentum"], options["weight_decay"])
    remote = muond.RemoteOptimizer([dict(options, params=[("w", remote_w)])], endpoint=endpoint)
    local = muond.LocalOptimizer([dict(options, params=[("w", local_w)])])
    for _ in range(3):
        g = torch.randn(*shape, generator=gen)
        remote_w.grad, local_w.grad = g.clone(), g.clone()
        for k, (w_block, g_block) in enumerate(zip(torch.chunk(reference, 2, dim=dim), torch.chunk(g, 2, dim=dim))):
            ref.step(f"block{k}", w_block, g_block.contiguous())
        remote.step()
        local.step()
    remote.close()
    assert rel_err(remote_w.detach(), reference) < TOLERANCE, rel_err(remote_w.detach(), reference)
    assert rel_err(local_w.detach(), reference) < TOLERANCE, rel_err(local_w.detach(), reference)
    assert rel_err(start, reference) > 100 * TOLERANCE


def test_the_normalizations_change_the_update(endpoint):
    """Each mode makes a different update from plain Muon's and from the others (so a mode that
    were ignored would fail above)."""
    gen = torch.Generator().manual_seed(9)
    start, g = 0.1 * torch.randn(12, 24, generator=gen), torch.randn(12, 24, generator=gen)
    results = {}
    for key, options in {"plain": {}, "row": {"momentum_normalization": "row"},
                         "col": {"momentum_normalization": "col"},
                         "rowcol": {"momentum_normalization": "rowcol"},
                         "muon_plus": {"post_normalization": "muon_plus"},
                         "col_row": {"post_normalization": "col_row"},
                         "aol": {"ns_preconditioner": "aol"}}.items():
        p = torch.nn.Parameter(start.clone())
        opt = muond.RemoteOptimizer([dict(options, params=[("w", p)])], endpoint=endpoint)
        p.grad = g.clone()
        opt.step()
        opt.close()
        results[key] = p.detach().clone()
    keys = list(results)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert rel_err(results[a], results[b]) > 1e-3, (a, b)


def test_refusals_name_the_option(endpoint):
    w = torch.nn.Parameter(torch.zeros(8, 8))
    with pytest.raises(ValueError, match="momentum_normalization must be one of none, row, col, rowcol"):
        muond.RemoteOptimizer([{"params": [w], "momentum_normalization": "diag"}], endpoint=endpoint)
    with pytest.raises(ValueError, match="post_normalization applies without moment2_method normuon"):
        muond.RemoteOptimizer([{"params": [w], "post_normalization": "muon_plus",
                                "moment2_method": "normuon"}], endpoint=endpoint)
    with pytest.raises(ValueError, match="option 'post_normalization' does not apply to optimizer 'adamw'"):
        muond.RemoteOptimizer([{"params": [w], "optimizer": "adamw", "post_normalization": "row"}],
                              endpoint=endpoint)
    # The daemon's own refusal, for a client that skips the Python checks.
    conn = muond.Connection(endpoint)
    spec = muond._stubs.pb.SessionSpec()
    group = spec.groups.add(name="g")
    group.options.post_normalization = "row"
    group.options.moment2_method = "normuon"
    spec.parameters.add(name="w", shape=[8, 8], group="g")
    with pytest.raises(muond.MuondError, match=r"spec\.groups\[0\]\.options\.post_normalization applies"):
        conn.create_session("variants-refused", spec)


@pytest.mark.parametrize("layout", ["plain", "qkv"])
def test_per_head_newton_schulz_is_a_muon_per_head(endpoint, layout):
    """num_heads (dion's per-head Newton–Schulz, microsoft/dion megabatch_base.py at 01287d7:
    rows cut into num_heads equal blocks, each orthogonalized and scaled on its own shape) on the
    daemon equals a session whose heads are parameters of their own; LocalOptimizer agrees. With a
    fused QKV weight (2 query groups of 2 query heads of 4 rows, k and v one head each) the query
    heads' size cuts q, k and v."""
    gen = torch.Generator().manual_seed(11)
    if layout == "plain":
        shape, extra, head = (16, 12), {"num_heads": 4}, 4
    else:
        shape, head = (32, 12), 4
        extra = {"num_heads": 4, "qkv_split": (8, 4, 4), "num_query_groups": 2}
    start = 0.1 * torch.randn(*shape, generator=gen)
    whole = torch.nn.Parameter(start.clone())
    local_whole = torch.nn.Parameter(start.clone())
    heads = [torch.nn.Parameter(part.clone()) for part in start.split(head)]
    options = {"lr": 0.02, "weight_decay": 0.1, "moment2_method": "normuon", "beta2": 0.9}
    by_head = muond.RemoteOptimizer([dict(options, params=[(f"h{i}", h) for i, h in enumerate(heads)])],
                                    endpoint=endpoint)
    cut = muond.RemoteOptimizer([dict(options, params=[("w", whole)], **extra)], endpoint=endpoint)
    local = muond.LocalOptimizer([dict(options, params=[("w", local_whole)], **extra)])
    for _ in range(5):
        g = torch.randn(*shape, generator=gen)
        whole.grad, local_whole.grad = g.clone(), g.clone()
        for h, part in zip(heads, g.split(head)):
            h.grad = part.clone()
        for opt in (by_head, cut, local):
            opt.step()
    moment2 = cut.state_dict()["state"][0]["moment2"]
    by_head.close()
    cut.close()
    joined = torch.cat([h.detach() for h in heads])
    assert rel_err(whole.detach(), joined) < TOLERANCE
    assert rel_err(local_whole.detach(), whole.detach()) < TOLERANCE
    # NorMuon: one value per line along each head's longer side, flat.
    assert moment2.shape == (shape[0] // head * max(head, shape[1]),)
    assert rel_err(whole.detach(), start) > 100 * TOLERANCE


def test_num_heads_refusals(endpoint):
    w = torch.nn.Parameter(torch.zeros(10, 8))
    with pytest.raises(ValueError, match="num_heads 4 does not divide the 10 rows"):
        muond.RemoteOptimizer([{"params": [w], "num_heads": 4}], endpoint=endpoint)
    experts = torch.nn.Parameter(torch.zeros(2, 8, 8))
    with pytest.raises(ValueError, match="num_heads needs 2-D parameters"):
        muond.RemoteOptimizer([{"params": [experts], "num_heads": 2}], endpoint=endpoint)
    conn = muond.Connection(endpoint)
    spec = muond._stubs.pb.SessionSpec()
    group = spec.groups.add(name="g")
    group.options.num_heads = 0
    spec.parameters.add(name="w", shape=[8, 8], group="g")
    with pytest.raises(muond.MuondError, match=r"spec\.groups\[0\]\.options\.num_heads must be >= 1, got 0"):
        conn.create_session("heads-refused", spec)
