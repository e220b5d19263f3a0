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
