"""Clipping group by group (clip_scope) from Python: the daemon's report of every group's norm and
coefficient in ``last_info.group_clips``, LocalOptimizer clipping the same way (its norms and
coefficients equal the daemon's up to the order of their fp64 sums, checked to 1e-6 relative: a
reordering moves them by ~1e-15, a wrong scope by far more), and the early refusals naming the
option."""

import pytest

import muond
from helpers import TinyNet, loss_of, rel_err


def groups(model, muon_scope=None, adamw_scope=None, muon_limit=None):
    made = muond.default_param_groups(model)
    made[0].update(name="matrices", clip_scope=muon_scope)
    made[1].update(name="vectors", clip_scope=adamw_scope)
    if muon_limit is not None:
        made[0]["max_grad_norm"] = muon_limit
    return made


@pytest.mark.parametrize("muon_scope, adamw_scope, muon_limit", [
    (None, None, None),        # today's global clipping
    ("none", None, None),      # Muon's groups neither counted nor clipped
    ("group", "none", 0.05),   # Muon by its own norm and limit
    ("group", "group", None),  # each group by its own norm against the step's limit
])
def test_daemon_and_local_optimizer_clip_each_group_alike(endpoint, muon_scope, adamw_scope, muon_limit):
    remote_model, local_model = TinyNet(seed=21), TinyNet(seed=21)
    remote = muond.RemoteOptimizer(groups(remote_model, muon_scope, adamw_scope, muon_limit),
                                   endpoint=endpoint, max_grad_norm=0.02)
    local = muond.LocalOptimizer(groups(local_model, muon_scope, adamw_scope, muon_limit), max_grad_norm=0.02)
    for step in range(1, 6):
        for model, opt in ((remote_model, remote), (local_model, local)):
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
        daemon, mine = remote.last_info.group_clips, local.last_info.group_clips
        assert set(daemon) == set(mine) == {"matrices", "vectors"}
        for name in daemon:
            assert rel_err_scalar(daemon[name].grad_norm, mine[name].grad_norm) < 1e-6, name
            assert rel_err_scalar(daemon[name].coefficient, mine[name].coefficient) < 1e-6, name
            # StepInfo.groups: the same clipping; LocalOptimizer measures no telemetry.
            group = local.last_info.groups[name]
            assert (group.grad_norm, group.clip_coefficient) == tuple(mine[name])
            assert group.update_rms is None and group.warnings == ()
        scopes = {"matrices": muon_scope or "global", "vectors": adamw_scope or "global"}
        for name, scope in scopes.items():
            clip = daemon[name]
            if scope == "none":
                assert clip.coefficient == 1.0
            elif scope == "global":
                assert clip.coefficient == min(1.0, 0.02 / (remote.last_info.grad_norm + 1e-6))
            else:
                limit = muon_limit if name == "matrices" and muon_limit else 0.02
                assert clip.coefficient == min(1.0, limit / (clip.grad_norm + 1e-6))
    remote.close()
    errors = {n: rel_err(p.detach(), dict(local_model.named_parameters())[n].detach())
              for n, p in remote_model.named_parameters()}
    assert max(errors.values()) < 1e-3, errors


def rel_err_scalar(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


@pytest.mark.parametrize("options, message", [
    ({"clip_scope": "sideways"}, "clip_scope must be one of global, group, none"),
    ({"max_grad_norm": 1.0}, "max_grad_norm applies with clip_scope 'group' only"),
    ({"clip_scope": "group", "max_grad_norm": -1.0}, "max_grad_norm must be > 0"),
])
def test_bad_clip_options_are_refused_before_anything_is_sent(endpoint, options, message):
    model = TinyNet(seed=22)
    made = muond.default_param_groups(model)
    made[0].update(options)
    with pytest.raises(ValueError, match=message):
        muond.RemoteOptimizer(made, endpoint=endpoint)
    with pytest.raises(ValueError, match=message):
        muond.LocalOptimizer(made)
