"""Health warnings you can trust (docs/operations.md, Warnings), through the real daemon.

Healthy runs raise no warning at all: the demo's transformer (examples/train_gpt.py) at its
defaults, at batch size 1, with zero-initialized output projections (modded-nanogpt's), with bf16
matmuls, with Dion2 for its matrices, and under every named coefficient set at its own step count; and the other examples (the
C++ MLP, DDP, ranks that hold parts, DiLoCo) at their defaults. And each warning still fires
within a few steps on its fault: Newton–Schulz made a no-op (custom coefficients (1, 0, 0)) on
full-rank gradients, a momentum that falls under ns_eps, a parameter that never gets a gradient, and
clipping that keeps a Muon group's gradients under 1% for warn_clip_steps steps; Dion2's first two
on its chosen lines.
"""

import os
import sys

import pytest
import torch

import muond
from conftest import REPO_ROOT

# The health checks read the step the daemon computes, whichever transport carried its gradient.
pytestmark = pytest.mark.once

sys.path.insert(0, str(REPO_ROOT / "examples"))
import train_gpt as demo  # noqa: E402

STEPS = 30  # the demo printed its 8 false warnings within 30 steps


def train_demo(endpoint, steps=STEPS, batch_size=None, zero_projections=False, **muon_options):
    """The demo's transformer at its defaults (but `batch_size` and `muon_options`) trained for
    `steps` steps through the daemon; every warning raised, as (step, group, kind), and the largest
    orthogonality residual of each Muon group."""
    argv = ["--corpus-chars", "60000"] + (["--batch-size", str(batch_size)] if batch_size else [])
    args = demo.parse_args(argv)
    torch.manual_seed(args.seed)
    data = demo.CharData(demo.Grammar(args.seed).text(args.corpus_chars), args.seed, args.context)
    model = demo.GPT(data.vocab_size, args.context, args.d_model, args.n_layer, args.n_head)
    if zero_projections:
        for block in model.blocks:
            torch.nn.init.zeros_(block.proj.weight)
            torch.nn.init.zeros_(block.fc_proj.weight)
    groups = demo.param_groups(model, args)
    for group in groups:
        if group.get("optimizer") == "muon":
            group.update(muon_options)
            if group["optimizer"] == "dion2":
                del group["momentum"]  # Dion2's momentum sums the gradients, as the demo's own option does
    raised, residuals = [], {}
    batches = data.batches(args.batch_size)
    with muond.RemoteOptimizer(groups, endpoint=endpoint) as opt:
        for step in range(1, steps + 1):
            x, y = next(batches)
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for name, info in opt.last_info.groups.items():
                raised += [(step, name, kind) for kind in info.warnings]
                if info.orthogonality_residual is not None:
                    residuals[name] = max(residuals.get(name, 0.0), info.orthogonality_residual)
    return raised, residuals


@pytest.mark.parametrize("variant", [
    {},
    {"batch_size": 1},
    {"zero_projections": True},
    {"matmul_precision": "bf16"},
    {"optimizer": "dion2"},
], ids=["defaults", "batch-1", "zero-projections", "bf16-matmul", "dion2"])
@pytest.mark.slow
def test_the_demo_raises_no_warning(endpoint, variant):
    raised, residuals = train_demo(endpoint, **variant)
    print(f"{variant}: largest residual by group {residuals}")
    assert raised == [], raised
    assert residuals, "no residual was measured"


# Each named set at its own step count: the ns_steps its tuples are made for.
OWN_STEPS = {"simple": 5, "quintic": 5, "polar_express": 8, "cans": 5, "aol": 4, "deepseekv4": 10,
             "cubic5": 5, "gram_polar_express": 5}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OWN_STEPS))
def test_every_coefficient_set_at_its_own_step_count_raises_no_warning(endpoint, name):
    options = {"ns_coefficients": name, "ns_steps": OWN_STEPS[name]}
    if name == "gram_polar_express":
        options["ns_algorithm"] = "gram"
    raised, residuals = train_demo(endpoint, steps=20, batch_size=4, **options)
    print(f"{name}: largest residual by group {residuals}")
    assert raised == [], raised


# -- each warning on its fault ------------------------------------------------------------------

class Square(torch.nn.Module):
    """One 64×64 Muon matrix and a bias (AdamW)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.w = torch.nn.Parameter(torch.randn(64, 64) * 0.05)
        self.b = torch.nn.Parameter(torch.zeros(64))


def step_with(opt, model, step, w_scale=1.0, b_grad=True):
    gen = torch.Generator().manual_seed(step)
    model.w.grad = torch.randn(64, 64, generator=gen) * w_scale  # full rank
    model.b.grad = torch.randn(64, generator=gen) if b_grad else None
    opt.step()
    return {name: info.warnings for name, info in opt.last_info.groups.items()}


def fault_run(endpoint, steps, muon=None, adamw=None, **kwargs):
    model = Square()
    groups = [{"params": [model.w], "param_names": ["w"], "optimizer": "muon", **(muon or {})},
              {"params": [model.b], "param_names": ["b"], "optimizer": "adamw", **(adamw or {})}]
    with muond.RemoteOptimizer(groups, endpoint=endpoint) as opt:
        return [step_with(opt, model, step, **kwargs) for step in range(1, steps + 1)], opt.last_info


def test_newton_schulz_made_a_no_op_raises_residual_high(endpoint):
    warnings, info = fault_run(endpoint, 3, muon={"ns_coefficients": [(1.0, 0.0, 0.0)]})
    assert warnings[0]["g0"] == ("residual_high",), warnings
    print(f"no-op residual {info.groups['g0'].orthogonality_residual:.3f}")
    assert info.groups["g0"].orthogonality_residual > 0.9


def test_a_momentum_under_eps_raises_momentum_below_eps(endpoint):
    # Gradients of 1e-14 an element: a momentum norm of ~1e-12, so Newton–Schulz's input is ~1e-5
    # (‖U‖/(‖U‖ + ns_eps 1e-7)), far under the ~1e-3 that the default 5 steps lift to half.
    warnings, info = fault_run(endpoint, 5, w_scale=1e-14)
    assert "momentum_below_eps" in warnings[0]["g0"], warnings
    assert all("momentum_below_eps" not in w["g0"] for w in warnings[1:]), "raised once while it lasts"
    assert 0 < info.groups["g0"].smallest_momentum_norm < 1e-10


@pytest.mark.parametrize("muon,w_scale", [({}, 1e-10), ({"ns_preconditioner": "aol"}, 1e-6)],
                         ids=["frobenius", "aol"])
def test_a_momentum_under_eps_that_the_iteration_still_lifts_is_not_a_fault(endpoint, muon, w_scale):
    # A momentum norm of ~1e-8 (under ns_eps 1e-7: Newton–Schulz's input ~0.1), or with AOL of
    # ~1e-4 (its square under ns_eps: an input of ~0.4): the iteration lifts either well above
    # half, so the update did not shrink and nothing is raised (it was, before the bound came from
    # the iteration: a false alarm on healthy Turbo-Muon runs, whose early momenta are this small).
    warnings, info = fault_run(endpoint, 3, muon=muon, w_scale=w_scale)
    assert info.groups["g0"].smallest_momentum_norm < (1e-7 if not muon else 3e-4)
    assert all("momentum_below_eps" not in w["g0"] for w in warnings), warnings


def test_dion2_newton_schulz_made_a_no_op_or_a_momentum_under_eps_is_warned_about(endpoint):
    # Dion2 orthogonalizes each matrix's chosen lines (16 of 64 here): the same two faults there.
    warnings, info = fault_run(endpoint, 3, muon={"optimizer": "dion2", "ns_coefficients": [(1.0, 0.0, 0.0)]})
    assert warnings[0]["g0"] == ("residual_high",), warnings
    assert info.groups["g0"].orthogonality_residual > 0.9
    assert info.groups["g0"].residual_parameter == "w"
    warnings, info = fault_run(endpoint, 5, muon={"optimizer": "dion2"}, w_scale=1e-14)
    assert "momentum_below_eps" in warnings[0]["g0"], warnings
    assert all("momentum_below_eps" not in w["g0"] for w in warnings[1:]), "raised once while it lasts"
    assert 0 < info.groups["g0"].smallest_momentum_norm < 1e-10


def test_a_zero_momentum_at_the_start_is_not_a_fault(endpoint):
    # Exactly zero gradients (a zero-initialized layer's inputs): nothing fell under eps.
    warnings, info = fault_run(endpoint, 3, w_scale=0.0)
    assert all(w["g0"] == () for w in warnings), warnings
    assert info.groups["g0"].smallest_momentum_norm == 0


def test_a_momentum_decaying_on_zero_gradients_is_not_a_fault(endpoint):
    # An expert no token reaches: one step with a gradient, then all-zero gradients. With momentum
    # 0.5 its momentum halves each step, from ~30 to under ns_eps within 40 steps; nothing was
    # scaled down, so nothing is raised (nor is the residual of an update that rightly fades).
    model = Square()
    groups = [{"params": [model.w], "param_names": ["w"], "optimizer": "muon", "momentum": 0.5}]
    raised = []
    with muond.RemoteOptimizer(groups, endpoint=endpoint) as opt:
        for step in range(1, 46):
            model.w.grad = torch.randn(64, 64) if step == 1 else torch.zeros(64, 64)
            opt.step()
            raised.append(opt.last_info.groups["g0"].warnings)
        smallest = opt.last_info.groups["g0"].smallest_momentum_norm
    assert 0 < smallest < 1e-7, f"the momentum did not fall under ns_eps: {smallest}"
    assert all(w == () for w in raised), raised


def test_a_momentum_under_eps_with_aol_raises_momentum_below_eps(endpoint):
    # Turbo-Muon's AOL floors U·Uᵀ's row sums (of the order of ‖U‖²) at ns_eps: a momentum norm of
    # ~1e-7 makes its input ~‖U‖/√ns_eps ≈ 4e-4, under the ~4e-3 its 4 steps lift to half.
    warnings, info = fault_run(endpoint, 3, muon={"ns_preconditioner": "aol"}, w_scale=1e-9)
    norm = info.groups["g0"].smallest_momentum_norm
    assert 0 < norm < 1e-6, norm
    assert "momentum_below_eps" in warnings[0]["g0"], warnings
    assert all("momentum_below_eps" not in w["g0"] for w in warnings[1:]), "raised once while it lasts"


def test_a_parameter_that_never_gets_a_gradient_raises_parameter_stale(endpoint):
    warnings, _ = fault_run(endpoint, 4, adamw={"warn_stale_steps": 3}, b_grad=False)
    assert [w["g1"] for w in warnings] == [(), (), ("parameter_stale",), ()], warnings


def test_clipping_under_one_percent_raises_clip_stall(endpoint):
    # The bias's gradient is huge beside w's: the global norm clips w's to under 1%.
    model = Square()
    groups = [{"params": [model.w], "param_names": ["w"], "optimizer": "muon", "warn_clip_steps": 3},
              {"params": [model.b], "param_names": ["b"], "optimizer": "adamw"}]
    with muond.RemoteOptimizer(groups, endpoint=endpoint, max_grad_norm=1.0) as opt:
        raised = []
        for step in range(1, 5):
            model.w.grad = torch.randn(64, 64) * 1e-3
            model.b.grad = torch.full((64,), 1e3)
            opt.step()
            raised.append(opt.last_info.groups["g0"].warnings)
    assert raised == [(), (), ("clip_stall",), ()], raised


# -- the demo's terminal --------------------------------------------------------------------------

@pytest.mark.slow
def test_the_log_summary_the_demo_prints(start_daemon):
    # scripts/demo.sh writes the daemon's log (--log-format json) to a file and prints this summary
    # at the end: nothing for a healthy run, each kind with its first message for a faulty one.
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import log_summary  # noqa: PLC0415

    daemon = start_daemon("--log-level", "info", "--log-format", "json")
    raised, _ = train_demo(daemon.endpoint, steps=10, batch_size=4)
    assert raised == []
    daemon.stop()
    assert log_summary.summarize(str(daemon.log_path)).endswith("no warnings, no errors")

    faulty = start_daemon("--log-level", "info", "--log-format", "json")
    fault_run(faulty.endpoint, 3, muon={"ns_coefficients": [(1.0, 0.0, 0.0)]})
    faulty.stop()
    summary = log_summary.summarize(str(faulty.log_path))
    assert "1 warning or error" in summary and "warning residual_high x1" in summary, summary
    assert "orthogonality residual" in summary


@pytest.mark.slow
def test_the_examples_at_their_defaults_raise_no_warning(start_daemon):
    # examples/* as scripts/demo.sh and their READMEs run them (fewer steps where the default is
    # long): the C++ MLP, DDP ranks, ranks that hold parts (and HSDP replicas of them), DiLoCo
    # workers. The daemon's log, JSON, must hold no warning at all.
    import subprocess  # noqa: PLC0415
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import log_summary  # noqa: PLC0415
    from conftest import _daemon_binary  # noqa: PLC0415

    daemon = start_daemon("--log-level", "info", "--log-format", "json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    mlp = _daemon_binary().parent / "mlp_trainer"
    assert mlp.is_file(), f"{mlp} is missing: scripts/build.sh builds the examples"
    runs = [[str(mlp), "--endpoint", daemon.endpoint, "--steps", "150"]]
    for script, extra in (("train_ddp.py", ["--ranks", "2", "--steps", "40"]),
                          ("train_sharded.py", ["--ranks", "2", "--steps", "40"]),
                          ("train_sharded.py", ["--ranks", "4", "--replicas", "2", "--steps", "40"]),
                          ("train_diloco.py", ["--steps", "60"])):
        runs.append([sys.executable, str(REPO_ROOT / "examples" / script), "--endpoint", daemon.endpoint, *extra])
    for command in runs:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    daemon.stop()
    summary = log_summary.summarize(str(daemon.log_path))
    assert summary.endswith("no warnings, no errors"), summary
