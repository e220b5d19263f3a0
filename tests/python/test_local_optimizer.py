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
