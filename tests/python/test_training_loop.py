"""RemoteOptimizer in an ordinary torch training loop: closures, lr schedulers, per-step
overrides, parameters without gradients, zero_grad, replayed and skipped steps, clipping."""

import pytest
import torch

import muond
from helpers import Pair, TinyNet, clone_model, loss_of, params_of, rel_err, remote_factory


def test_step_returns_the_closure_loss(endpoint):
    model = TinyNet(seed=10)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint) as opt:
        def closure():
            opt.zero_grad()
            loss = loss_of(model, 1)
            loss.backward()
            return loss
        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.item() > 0
        assert opt.step() is None  # no closure: None, as torch optimizers return
        assert opt.last_step == 2
        assert opt.last_info.applied and opt.last_info.grad_norm > 0


def test_lr_scheduler_changes_the_update(endpoint):
    factors = [1.0, 0.5, 0.0, 2.0, 0.25, 1.0]
    make = remote_factory(endpoint)
    pair = Pair(make, TinyNet(seed=11))
    scheduler = torch.optim.lr_scheduler.LambdaLR(pair.opt, lambda s: factors[min(s, 5)])
    seen = []
    for step in range(1, 7):
        seen.append([g["lr"] for g in pair.opt.param_groups])
        before = params_of(pair.model)
        pair.step(step, sync_lr=True)
        scheduler.step()
        if factors[step - 1] == 0.0:  # lr 0 on every group: nothing may move
            for name, p in pair.model.named_parameters():
                assert torch.equal(p.detach(), before[name]), name
    assert seen[2] == [0.0, 0.0] and seen[3] == [0.04, 0.002]
    errors = pair.errors()
    pair.opt.close()
    assert max(errors.values()) < 1e-4, errors  # test_equivalence's derivation


def test_lr_schedule_gives_a_different_trajectory_than_constant_lr(endpoint):
    finals = []
    for decay in (False, True):
        model = TinyNet(seed=12)
        with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint) as opt:
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            for step in range(1, 5):
                loss_of(model, step).backward()
                opt.step()
                opt.zero_grad()
                if decay:
                    scheduler.step()
        finals.append(model.up.weight.detach().clone())
    assert rel_err(finals[1], finals[0]) > 1e-3


def test_changed_momentum_and_weight_decay_are_sent(endpoint):
    pair = Pair(remote_factory(endpoint, muon={"weight_decay": 0.01}), TinyNet(seed=13),
                ref_muon={"weight_decay": 0.01})
    for step in range(1, 7):
        if step == 4:
            for group, ref_group in zip(pair.opt.param_groups, pair.ref.groups):
                if group["optimizer"] == "muon":
                    group["momentum"] = ref_group["momentum"] = 0.8
                    group["weight_decay"] = ref_group["weight_decay"] = 0.2
        pair.step(step)
    errors = pair.errors()
    pair.opt.close()
    assert max(errors.values()) < 1e-4, errors


def test_parameters_without_gradient_are_left_out(endpoint):
    model = TinyNet(seed=14)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint) as opt:
        loss_of(model, 1).backward()
        model.head.weight.grad = None
        head_before = model.head.weight.detach().clone()
        up_before = model.up.weight.detach().clone()
        opt.step()
        assert torch.equal(model.head.weight.detach(), head_before)
        assert not torch.equal(model.up.weight.detach(), up_before)
        state = opt.state_dict()
        index = opt.param_groups[0]["param_names"] + opt.param_groups[1]["param_names"]
        assert state["state"][index.index("head.weight")]["step"] == 0
        assert state["state"][index.index("up.weight")]["step"] == 1


def test_zero_grad(endpoint):
    model = TinyNet(seed=15)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint) as opt:
        loss_of(model, 1).backward()
        opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())


def test_plain_parameter_list_and_named_parameters(endpoint):
    model = torch.nn.Linear(6, 5, bias=False)
    with muond.RemoteOptimizer(model.parameters(), endpoint=endpoint) as opt:
        assert opt.param_groups[0]["param_names"] == ["p0"]
        assert opt.param_groups[0]["optimizer"] == "muon"
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
    with muond.RemoteOptimizer(model.named_parameters(), endpoint=endpoint) as opt:
        assert opt.param_groups[0]["param_names"] == ["weight"]


def test_bf16_model_gets_fp32_masters_rounded(endpoint):
    model = TinyNet(seed=16).to(torch.bfloat16)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                               wire_dtype="bf16") as opt:
        model(torch.arange(8)).float().sum().backward()
        opt.step()
        masters = opt.state_dict()["state"]
        names = [n for g in opt.param_groups for n in g["param_names"]]
        for i, name in enumerate(names):
            param = dict(model.named_parameters())[name]
            assert param.dtype == torch.bfloat16
            assert torch.equal(param.detach(), masters[i]["master"].to(torch.bfloat16)), name


def test_resent_step_is_replayed_not_applied_twice(endpoint):
    # What a retry after a lost answer looks like: the same step number again.
    model = TinyNet(seed=17)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint) as opt:
        loss_of(model, 1).backward()
        opt.step()
        after_one = params_of(model)
        opt.last_step = 0
        opt.step()  # same gradients, same step number
        assert opt.last_info.replayed and opt.last_step == 1
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), after_one[name]), name


def test_non_finite_gradient_skips_the_step(endpoint):
    model = TinyNet(seed=18)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint) as opt:
        loss_of(model, 1).backward()
        model.up.weight.grad[0, 0] = float("nan")
        before = params_of(model)
        opt.step()
        info = opt.last_info
        assert not info.applied and info.skip_reason and opt.last_step == 1
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), before[name]), name
        opt.zero_grad()
        loss_of(model, 2).backward()
        opt.step()  # the counter advanced: step 2 is next, and it applies
        assert opt.last_info.applied and opt.last_step == 2


def test_max_grad_norm_clips_like_torch(endpoint):
    max_norm = 0.05
    pair = Pair(remote_factory(endpoint, max_grad_norm=max_norm), TinyNet(seed=19))
    for step in range(1, 6):
        loss = loss_of(pair.model, step)
        loss.backward()
        grads = [p.grad for p in pair.model.parameters()]
        total = torch.norm(torch.stack([g.norm() for g in grads])).item()
        clipped = {id(pair.ref_params[n]): p.grad.clone() * min(1.0, max_norm / (total + 1e-6))
                   for n, p in pair.model.named_parameters()}
        pair.opt.step()
        pair.ref.step(clipped)
        pair.opt.zero_grad()
        assert pair.opt.last_info.grad_norm == pytest.approx(total, rel=1e-5)
        assert total > max_norm  # the clip really engaged
    errors = pair.errors()
    pair.opt.close()
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize("shards", [1, 2])
def test_log_num_zeros_in_grad_counts_exact_zeros(endpoint, start_daemon, shards):
    """log_num_zeros_in_grad: the answer counts gradient elements that are exactly 0 (+0 and -0),
    over every shard, as LocalOptimizer counts them; None when not asked."""
    endpoints = [endpoint] + [start_daemon().endpoint for _ in range(shards - 1)]
    model = TinyNet(seed=61)
    twin = clone_model(model)
    kwargs = dict(endpoints=endpoints) if shards > 1 else dict(endpoint=endpoint)
    with muond.RemoteOptimizer(muond.default_param_groups(model), log_num_zeros_in_grad=True, **kwargs) as opt:
        local = muond.LocalOptimizer(muond.default_param_groups(twin), log_num_zeros_in_grad=True)
        for step in (1, 2):
            for m, o in ((model, opt), (twin, local)):
                loss_of(m, step).backward()
                grads = [p.grad for p in m.parameters()]
                grads[0].view(-1)[:5] = 0.0
                grads[0].view(-1)[5] = -0.0
                grads[-1].view(-1)[0] = 1e-40  # a denormal is not zero
                o.step()
            expected = sum(int((p.grad == 0).sum()) for p in model.parameters())
            assert expected >= 6
            assert opt.last_info.num_zeros_in_grad == expected
            assert local.last_info.num_zeros_in_grad == expected
            opt.zero_grad()
            local.zero_grad()
    plain_model = TinyNet(seed=62)
    with muond.RemoteOptimizer(muond.default_param_groups(plain_model), endpoint=endpoint) as plain:
        loss_of(plain_model, 1).backward()
        plain.step()
        assert plain.last_info.num_zeros_in_grad is None
