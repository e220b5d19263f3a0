"""Loss scaling against the real daemon: a static grad_scale is divided out before anything reads
the gradients; the daemon-side dynamic loss scaler (Megatron-Core's DynamicGradScaler) grows,
tolerates, backs off and survives a crash exactly as ``LocalOptimizer``'s; mismatched or bad
scales are refused with the field named."""

import math
import uuid

import pytest
import torch

import muond
from muond._stubs import pb
from helpers import TinyNet, clone_model, loss_of, rel_err


def groups(model):
    return muond.default_param_groups(model, muon={"weight_decay": 0.01})


def sgd(model):  # SGD's update is proportional to the gradient: a scale left in would show
    return [{"params": list(model.parameters()), "optimizer": "sgd", "lr": 0.05, "momentum": 0.9}]


@pytest.mark.parametrize("make_groups", [groups, sgd], ids=["muon-adamw", "sgd"])
def test_static_grad_scale_is_divided_out(endpoint, make_groups):
    """Gradients of a loss scaled by 2**12, stepped with grad_scale=2**12 and clipping, give the
    parameters of the unscaled run: the scale is a power of two, so dividing it out is exact."""
    plain, scaled = TinyNet(seed=31), TinyNet(seed=31)
    with muond.RemoteOptimizer(make_groups(plain), endpoint=endpoint, max_grad_norm=0.5) as a, \
            muond.RemoteOptimizer(make_groups(scaled), endpoint=endpoint, max_grad_norm=0.5) as b:
        for step in range(1, 5):
            loss_of(plain, step).backward()
            a.step()
            a.zero_grad()
            (loss_of(scaled, step) * 2.0 ** 12).backward()
            b.step(grad_scale=2.0 ** 12)
            b.zero_grad()
            # The reported norm is the unscaled gradients'.
            assert b.last_info.grad_norm == pytest.approx(a.last_info.grad_norm, rel=1e-6)
    # Scaling by 2^12 and back is exact in fp32 (no overflow or underflow here), so both sessions
    # compute the same values; 1e-6 would catch a scale applied twice or not at all.
    for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
        assert rel_err(p.detach(), q.detach()) < 1e-6, name


def _train_with_overflows(opt, model, steps, overflow_at):
    scales = []
    for step in steps:
        opt.scale_loss(loss_of(model, step)).backward()
        if step in overflow_at:  # an fp16 overflow: one gradient turned inf
            next(iter(model.parameters())).grad.view(-1)[0] = math.inf
        opt.step()
        opt.zero_grad()
        scales.append((opt.last_info.applied, opt.loss_scale))
    return scales


def test_dynamic_loss_scaler_matches_megatron_and_local(endpoint):
    scaler = {"initial_scale": 2.0 ** 16, "window": 3, "hysteresis": 2}
    model = TinyNet(seed=32)
    twin = clone_model(model)
    local = muond.LocalOptimizer(groups(twin), loss_scaler=scaler)
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint, loss_scaler=scaler) as opt:
        assert opt.loss_scale == 2.0 ** 16
        remote = _train_with_overflows(opt, model, range(1, 11), overflow_at={4, 6, 7})
    mine = _train_with_overflows(local, twin, range(1, 11), overflow_at={4, 6, 7})
    # Megatron-Core's DynamicGradScaler, step by step: three clean steps double the scale; the
    # first overflow is tolerated (hysteresis 2), the next ones halve it.
    s = 2.0 ** 16
    expected = [(True, s), (True, s), (True, 2 * s), (False, 2 * s), (True, 2 * s), (False, s),
                (False, s / 2), (True, s / 2), (True, s / 2), (True, s)]
    assert remote == expected
    assert mine == expected
    # LocalOptimizer's state dict carries its scaler like RemoteOptimizer's.
    saved = local.state_dict()
    assert saved["loss_scaler"] == {"scale": s, "growth_tracker": 0, "hysteresis_tracker": 2}
    again = muond.LocalOptimizer(groups(clone_model(twin)), loss_scaler=scaler)
    again.load_state_dict(saved)
    assert again.loss_scale == s
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):  # test_equivalence's bound
        assert rel_err(p.detach(), q.detach()) < 1e-4, name


def test_grad_scale_must_match_the_scaler_and_bad_scales_are_refused(endpoint):
    model = TinyNet(seed=33)
    with muond.RemoteOptimizer(groups(model), endpoint=endpoint,
                               loss_scaler={"initial_scale": 1024.0}) as opt:
        opt.scale_loss(loss_of(model, 1)).backward()
        with pytest.raises(muond.MuondError, match="header.grad_scale: 5 differs from the session loss scaler"):
            opt.step(grad_scale=5.0)
        opt.step(grad_scale=1024.0)  # the current scale is accepted
        assert opt.last_step == 1 and opt.last_info.applied
    with pytest.raises(ValueError, match="grad_scale must be finite, in"):
        muond.LocalOptimizer(groups(TinyNet(seed=34))).step(grad_scale=0.0)
    with pytest.raises(ValueError, match="loss_scaler.min_scale"):
        muond.RemoteOptimizer(groups(TinyNet(seed=35)), endpoint=endpoint,
                              loss_scaler={"initial_scale": 8.0, "min_scale": 16.0})
    with pytest.raises(ValueError, match="unknown option"):
        muond.LocalOptimizer(groups(TinyNet(seed=36)), loss_scaler={"scale": 8.0})
    # The daemon refuses what a client did not check, naming the field.
    spec = pb.SessionSpec(groups=[pb.ParameterGroup(name="g", options=pb.GroupOptions(
        optimizer=pb.OPTIMIZER_ADAMW))], parameters=[pb.ParameterSpec(name="w", shape=[4], group="g")],
        loss_scaler=pb.LossScaler(backoff_factor=1.5))
    conn = muond.Connection(endpoint)
    try:
        with pytest.raises(muond.MuondError, match="spec.loss_scaler.backoff_factor"):
            conn.create_session(f"bad-{uuid.uuid4().hex[:8]}", spec)
    finally:
        conn.close()


def test_loss_scaler_state_survives_a_crash_and_travels_in_the_state_dict(start_daemon, tmp_path):
    scaler = {"initial_scale": 2.0 ** 10, "window": 2, "hysteresis": 1}
    flags = ("--state-dir", tmp_path / "state", "--durability", "journal")
    daemon = start_daemon(*flags)
    session = f"scaler-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=37)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session,
                                loss_scaler=scaler)
    _train_with_overflows(opt, model, range(1, 4), overflow_at=set())
    assert opt.checkpoint() == 3
    _train_with_overflows(opt, model, range(4, 6), overflow_at={5})  # journaled only: backs off
    scale = opt.loss_scale
    saved = opt.state_dict()
    assert saved["muond"]["loss_scaler"]["scale"] == scale
    assert scale == 2.0 ** 11  # 2**10 → 2**11 (steps 1-2) → 2**12 (steps 3-4), halved at step 5
    opt.close(keep_session=True)
    daemon.kill()

    daemon = start_daemon(*flags, workdir=daemon.workdir)
    with muond.RemoteOptimizer(groups(TinyNet(seed=0)), endpoint=daemon.endpoint, session=session,
                               loss_scaler=scaler) as opt:
        assert opt.last_step == 5
        assert opt.loss_scale == scale  # the journal replayed the overflow over the checkpoint
        assert opt.state_dict()["muond"]["loss_scaler"] == saved["muond"]["loss_scaler"]
        saved["muond"]["loss_scaler"]["scale"] = 4.0
        opt.load_state_dict(saved)
        assert opt.loss_scale == 4.0
