"""LocalOptimizer as torch's optimizers are used: a group added after construction is named,
checked, clipped and stepped like the others, and state_dict() keeps the step count."""

import pytest
import torch

import muond


def test_a_group_added_later_is_clipped_and_checked_like_the_others():
    w = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = muond.LocalOptimizer([{"params": [("w", w)], "optimizer": "sgd", "lr": 1.0}], max_grad_norm=1.0)
    opt.add_param_group({"params": [b], "optimizer": "sgd", "lr": 1.0})
    assert opt._names == ["w", "p1"]

    w.grad, b.grad = torch.zeros(3), torch.tensor([300.0, 400.0])  # norm 500: clipped to 1
    opt.step()
    assert opt.last_info.applied
    assert opt.last_info.grad_norm == pytest.approx(500.0)
    assert torch.allclose(b.detach(), torch.tensor([-0.6, -0.8]))

    before = b.detach().clone()
    b.grad = torch.tensor([float("nan"), 1.0])
    opt.step()
    assert not opt.last_info.applied and "'p1'" in opt.last_info.skip_reason
    assert torch.equal(b.detach(), before)

    with pytest.raises(ValueError, match="parameter name 'w' is used twice"):
        opt.add_param_group({"params": [("w", torch.nn.Parameter(torch.zeros(1)))], "optimizer": "sgd"})
    with pytest.raises(ValueError, match="parameters 'p1' and 'again' are the same tensor"):
        opt.add_param_group({"params": [("again", b)], "optimizer": "sgd"})


def test_the_state_dict_keeps_the_step_count():
    w = torch.nn.Parameter(torch.ones(4, 4))
    opt = muond.LocalOptimizer([{"params": [("w", w)], "optimizer": "adamw"}])
    for _ in range(3):
        w.grad = torch.ones(4, 4)
        opt.step()
    saved = opt.state_dict()
    other = muond.LocalOptimizer([{"params": [("w", torch.nn.Parameter(torch.ones(4, 4)))],
                                   "optimizer": "adamw"}])
    other.load_state_dict(saved)
    assert other.last_step == 3


def test_a_sparse_gradient_is_refused_naming_the_parameter():
    w = torch.nn.Parameter(torch.zeros(4))
    opt = muond.LocalOptimizer([{"params": [("w", w)], "optimizer": "sgd", "lr": 0.1}])
    w.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="parameter 'w': sparse gradients are not supported"):
        opt.step()
    assert opt.last_step == 0 and torch.equal(w.detach(), torch.zeros(4))


def test_a_remote_optimizers_state_dict_loads_with_its_masters(endpoint):
    # Saved by RemoteOptimizer, loaded into LocalOptimizer (no daemon at hand): the masters become
    # the parameters, the momentum comes along, and both go on equally.
    torch.manual_seed(4)
    start = torch.randn(6, 4)
    remote_w = torch.nn.Parameter(start.clone())
    group = {"optimizer": "muon", "lr": 0.02}
    remote = muond.RemoteOptimizer([{"params": [("w", remote_w)], **group}], endpoint=endpoint)
    for step in range(2):
        remote_w.grad = torch.randn(6, 4)
        remote.step()
    saved = remote.state_dict()

    local_w = torch.nn.Parameter(start.clone())
    local = muond.LocalOptimizer([{"params": [("w", local_w)], **group}])
    local.load_state_dict(saved)
    assert torch.equal(local_w.detach(), remote_w.detach())
    assert "master" not in local.state[local_w]
    g = torch.randn(6, 4)
    remote_w.grad, local_w.grad = g.clone(), g.clone()
    remote.step()
    local.step()
    remote.close()
    assert torch.allclose(local_w.detach(), remote_w.detach(), rtol=1e-5, atol=1e-6)


def test_a_remote_state_dict_of_other_names_is_refused_and_numbered_names_load(endpoint):
    a = torch.nn.Parameter(torch.ones(3))
    remote = muond.RemoteOptimizer([{"params": [("a", a)], "optimizer": "sgd", "lr": 0.1}],
                                   endpoint=endpoint)
    a.grad = torch.ones(3)
    remote.step()
    saved = remote.state_dict()
    remote.close()
    other = muond.LocalOptimizer([{"params": [("b", torch.nn.Parameter(torch.ones(3)))],
                                   "optimizer": "sgd", "lr": 0.1}])
    with pytest.raises(ValueError, match="loading by position would swap their states"):
        other.load_state_dict(saved)
    unnamed = torch.nn.Parameter(torch.ones(3))
    local = muond.LocalOptimizer([{"params": [unnamed], "optimizer": "sgd", "lr": 0.1}])
    local.load_state_dict(saved)  # p0: loaded by position
    assert torch.equal(unnamed.detach(), a.detach()) and local.last_step == 1


def _side_by_side(endpoint, start, group, grads, **options):
    """Steps a RemoteOptimizer (the real daemon) and a LocalOptimizer from the same values with
    the same gradients; returns their (applied, skip_reason) per step and their final values."""
    remote_w = torch.nn.Parameter(start.clone())
    local_w = torch.nn.Parameter(start.clone())
    remote = muond.RemoteOptimizer([{"params": [("w", remote_w)], **group}], endpoint=endpoint, **options)
    local = muond.LocalOptimizer([{"params": [("w", local_w)], **group}], **options)
    said = []
    try:
        for g in grads:
            remote_w.grad, local_w.grad = g.clone(), g.clone()
            remote.step()
            local.step()
            said.append(((remote.last_info.applied, remote.last_info.skip_reason),
                         (local.last_info.applied, local.last_info.skip_reason)))
    finally:
        remote.close()
    return said, remote_w.detach(), local_w.detach(), local


# Each case: the group, the starting values, and gradients of which one is too large for the
# group's ranges (or the step's intermediate values) and one fits again.
_OVERFLOWS = {
    "sgd-master": ({"optimizer": "sgd", "lr": 100.0}, torch.ones(8), [torch.full((8,), 3e38), torch.ones(8)]),
    "adamw-square": ({"optimizer": "adamw", "lr": 1e-3}, torch.ones(8), [torch.full((8,), 2e19), torch.ones(8)]),
    "muon-momentum": ({"optimizer": "muon", "lr": 0.02}, torch.ones(4, 6),
                      [torch.full((4, 6), 3e38), torch.ones(4, 6)]),
    "muon-fp16-momentum": ({"optimizer": "muon", "lr": 0.02, "momentum_dtype": "fp16"}, torch.ones(4, 6),
                           [torch.full((4, 6), 3e6), torch.ones(4, 6)]),
    # The variants' own terms: NAMO's step size grows with the momentum over ε, AOL forms X·Xᵀ of
    # the unscaled input (2·n·u²), where plain Muon would go on.
    "muon-namo": ({"optimizer": "muon", "lr": 0.02, "moment2_method": "namo"}, torch.ones(4, 6),
                  [torch.full((4, 6), 1e30), torch.ones(4, 6)]),
    "muon-aol": ({"optimizer": "muon", "lr": 0.02, "ns_preconditioner": "aol"}, torch.ones(4, 6),
                 [torch.full((4, 6), 1e18), torch.ones(4, 6)]),
    "dion2-aol": ({"optimizer": "dion2", "lr": 0.02, "ns_preconditioner": "aol"}, torch.ones(4, 6),
                  [torch.full((4, 6), 1e18), torch.ones(4, 6)]),
    "lion-weights-near-the-limit": ({"optimizer": "lion", "lr": 1.0, "weight_decay": 0.0},
                                    torch.full((8,), 9.999995e35), [torch.ones(8), -torch.ones(8)]),
    "sgd-delayed-nesterov": ({"optimizer": "sgd", "lr": 10.0, "momentum": 0.9, "nesterov": True,
                              "nesterov_delay": 2},
                             torch.ones(8), [torch.full((8,), 3e37), torch.ones(8)]),
}


@pytest.mark.parametrize("case", sorted(_OVERFLOWS))
def test_a_step_beyond_the_fp32_range_is_skipped_as_the_daemon_skips_it(endpoint, case):
    # The daemon's finite-step guard (docs/algorithms.md, Finite steps): the same steps are
    # skipped with the same reason, nothing changes, and the steps after it go on alike.
    group, start, grads = _OVERFLOWS[case]
    said, remote_w, local_w, _ = _side_by_side(endpoint, start, group, grads)
    remote_said = [r for r, _ in said]
    assert [l for _, l in said] == remote_said
    assert any(not applied for applied, _ in remote_said), "the case must make the daemon skip a step"
    assert all(reason.startswith("the update could take 'w' ") for applied, reason in remote_said if not applied)
    assert torch.allclose(local_w, remote_w, rtol=1e-5, atol=1e-6)


def test_a_loose_bound_asks_for_the_exact_magnitudes_and_the_step_goes_on(endpoint):
    # 2²⁰ elements of 5e17: the gradient's norm (5.1e20) squared passes fp32's range in AdamW's
    # second moment, its largest element squared (2.5e35) does not. Both apply the step.
    start = torch.zeros(1 << 20)
    said, remote_w, local_w, _ = _side_by_side(endpoint, start, {"optimizer": "adamw", "lr": 1e-3},
                                               [torch.full((1 << 20,), 5e17)])
    assert said == [((True, ""), (True, ""))]
    assert torch.allclose(local_w, remote_w, rtol=1e-6, atol=0)


def test_a_skipped_step_backs_the_loss_scaler_off_and_a_changed_parameter_is_measured_again():
    w = torch.nn.Parameter(torch.ones(8))
    opt = muond.LocalOptimizer([{"params": [("w", w)], "optimizer": "sgd", "lr": 1.0}],
                               loss_scaler={"initial_scale": 2.0 ** 16, "hysteresis": 1})
    w.grad = torch.ones(8)
    opt.step()
    assert opt.last_info.applied and opt.loss_scale == 2.0 ** 16
    with torch.no_grad():
        w.fill_(9.99e35)  # changed in place outside the optimizer: its bound is measured again
    w.grad = torch.full((8,), 1e37)  # 1e37 / 2¹⁶ ≈ 1.5e32 more: fine
    opt.step()
    assert opt.last_info.applied
    w.grad = torch.full((8,), 3e38)  # 3e38 / 2¹⁶ ≈ 4.6e33 more, from 9.9915e35: beyond 1e36
    before = w.detach().clone()
    opt.step()
    assert not opt.last_info.applied and opt.last_info.skip_reason.startswith("the update could take 'w' ")
    assert torch.equal(w.detach(), before) and opt.loss_scale == 2.0 ** 15


@pytest.mark.parametrize("group, words", [
    # σ ← 5σ five times: 3125 times its start, beyond the 1000 the daemon accepts.
    ({"optimizer": "muon", "ns_coefficients": [(5.0, 0.0, 0.0)]},
     r"with 5 steps, ns_norm_safety 1 and matmul_precision fp32 .*; no ns_norm_safety up to 2 keeps them bounded"),
    # cans runs away from an input a bf16 rounding above its range.
    ({"optimizer": "muon", "ns_coefficients": "cans", "matmul_precision": "bf16"},
     r"with 5 steps, ns_norm_safety 1 and matmul_precision bf16 the iteration grows .* up to 0.0078125 .*; "
     r"ns_norm_safety 1.01 keeps them bounded"),
])
def test_a_schedule_that_grows_singular_values_is_refused_as_the_daemon_refuses_it(endpoint, group, words):
    with pytest.raises(muond.MuondError) as daemon:
        muond.RemoteOptimizer([{"params": [torch.nn.Parameter(torch.ones(4, 4))], **group}], endpoint=endpoint)
    with pytest.raises(ValueError, match="ns_coefficients: " + words) as local:
        muond.LocalOptimizer([{"params": [torch.nn.Parameter(torch.ones(4, 4))], **group}])
    assert str(local.value) in daemon.value.details
    safe = dict(group, ns_norm_safety=1.01)
    if group["ns_coefficients"] == "cans":  # the margin the refusal names is accepted by both
        muond.LocalOptimizer([{"params": [torch.nn.Parameter(torch.ones(4, 4))], **safe}])
        muond.RemoteOptimizer([{"params": [torch.nn.Parameter(torch.ones(4, 4))], **safe}], endpoint=endpoint).close()


def test_the_parameter_is_its_master_whatever_changed_it_and_whatever_its_dtype():
    # Changed through .data (which torch does not count): the guard reads the master every step.
    w = torch.nn.Parameter(torch.ones(4))
    opt = muond.LocalOptimizer([{"params": [("w", w)], "optimizer": "sgd", "lr": 1.0}])
    w.grad = torch.ones(4)
    opt.step()
    w.data.fill_(3.4e38)
    w.grad = torch.full((4,), -5e35)
    opt.step()
    assert not opt.last_info.applied and "(its master)" in opt.last_info.skip_reason
    assert torch.isfinite(w.detach()).all()

    # An fp16 model: its parameters hold the masters, so fp16's limit is theirs.
    h = torch.nn.Parameter(torch.full((4,), 1e4, dtype=torch.float16))
    opt = muond.LocalOptimizer([{"params": [("h", h)], "optimizer": "sgd", "lr": 1.0}])
    h.grad = torch.full((4,), -6e4, dtype=torch.float16)  # 1e4 + 6e4 is past fp16's 65504
    opt.step()
    assert not opt.last_info.applied and "that keeps fp16 finite" in opt.last_info.skip_reason
    assert torch.equal(h.detach(), torch.full((4,), 1e4, dtype=torch.float16))
    assert opt.state_dict()["state"] == {}  # a skipped first step leaves no state behind


def test_an_empty_parameter_steps_beside_the_others():
    e = torch.nn.Parameter(torch.zeros(0, 4))
    w = torch.nn.Parameter(torch.ones(4, 4))
    opt = muond.LocalOptimizer([{"params": [("e", e), ("w", w)], "optimizer": "muon", "lr": 0.02}])
    e.grad, w.grad = torch.zeros(0, 4), torch.ones(4, 4)
    opt.step()
    assert opt.last_info.applied


@pytest.mark.parametrize("group", [{"optimizer": "muon", "lr": 0.02},
                                   {"optimizer": "adamw", "lr": 0.01, "exp_avg_sq_dtype": "bf16"}],
                         ids=["muon", "adamw-bf16"])
def test_a_local_optimizers_state_dict_loads_into_a_remote_one(endpoint, group):
    """Trained in-process, then moved to a daemon: a RemoteOptimizer on the same parameters loads
    the LocalOptimizer's state dict (the parameters are the masters; the momentum, moments and step
    counts come along), and both go on equally. Started afresh instead, the remote one would not:
    its slots would begin at zero. A parameter the local optimizer never stepped keeps zeros."""
    torch.manual_seed(5)
    w = torch.nn.Parameter(torch.randn(6, 4))
    idle = torch.nn.Parameter(torch.randn(3, 4))
    local = muond.LocalOptimizer([{"params": [("w", w), ("idle", idle)], **group}])
    for _ in range(3):
        w.grad = torch.randn(6, 4)
        local.step()
    saved = local.state_dict()
    remote_w, remote_idle = torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(idle.detach().clone())
    fresh_w = torch.nn.Parameter(w.detach().clone())
    remote = muond.RemoteOptimizer([{"params": [("w", remote_w), ("idle", remote_idle)], **group}],
                                   endpoint=endpoint)
    fresh = muond.RemoteOptimizer([{"params": [("w", fresh_w), ("idle", torch.nn.Parameter(idle.detach().clone()))],
                                    **group}], endpoint=endpoint)
    remote.load_state_dict(saved)
    assert remote.last_step == 3
    loaded = remote.state_dict()["state"]
    assert loaded[0]["step"] == 3 and loaded[1]["step"] == 0
    assert all(torch.count_nonzero(t) == 0 for k, t in loaded[1].items() if k not in ("master", "step"))
    for _ in range(2):
        g = torch.randn(6, 4)
        w.grad, remote_w.grad, fresh_w.grad = g.clone(), g.clone(), g.clone()
        local.step()
        remote.step()
        fresh.step()
    assert remote.last_step == 5
    assert torch.allclose(remote_w.detach(), w.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(fresh_w.detach(), w.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(remote_idle.detach(), idle.detach())
    remote.close()
    fresh.close()


def test_a_local_state_dict_of_other_names_is_refused_by_a_remote_optimizer(endpoint):
    a = torch.nn.Parameter(torch.ones(3))
    local = muond.LocalOptimizer([{"params": [("a", a)], "optimizer": "sgd", "lr": 0.1}])
    a.grad = torch.ones(3)
    local.step()
    remote = muond.RemoteOptimizer([{"params": [("b", torch.nn.Parameter(torch.ones(3)))],
                                     "optimizer": "sgd", "lr": 0.1}], endpoint=endpoint)
    with pytest.raises(ValueError, match="loading by position would swap their states"):
        remote.load_state_dict(local.state_dict())
    assert remote.last_step == 0
    remote.close()
