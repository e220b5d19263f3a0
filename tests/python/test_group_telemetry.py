"""Per-group telemetry and health warnings from Python (docs/algorithms.md, Telemetry;
docs/operations.md, Warnings): ``last_info.groups[name]`` after every step, consistent with the
model's own parameters; each warning reproduced against the real daemon — in the answer, as a JSON
log event of its kind and in muond_health_warnings_total — and none in a healthy run; the options
checked before anything is sent."""

import json
import math
import re
import urllib.request

import pytest
import torch

import muond
from helpers import TinyNet, loss_of

KINDS = ("clip_stall", "momentum_below_eps", "parameter_stale", "residual_high")


def groups(model, **muon_options):
    made = muond.default_param_groups(model)
    made[0].update(name="matrices", **muon_options)
    made[1].update(name="vectors")
    return made


def warnings_counted(endpoint):
    conn = muond.Connection(endpoint)
    try:
        address = conn.server_info().metrics_address
    finally:
        conn.close()
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts = dict(re.findall(r'^muond_health_warnings_total\{kind="(\w+)"\} (\S+)$', text, re.M))
    return {kind: float(counts.get(kind, 0)) for kind in KINDS}


def events(daemon):
    return [json.loads(line) for line in daemon.log_path.read_text().splitlines()
            if line.startswith("{") and json.loads(line).get("event") in KINDS]


@pytest.fixture
def daemon(start_daemon):
    return start_daemon("--log-format", "json", "--metrics-listen", "127.0.0.1:0")


def test_every_step_reports_each_group(endpoint):
    model = TinyNet(seed=3)
    made = groups(model)
    matrices = list(made[0]["params"])
    opt = muond.RemoteOptimizer(made, endpoint=endpoint)
    for step in range(1, 4):
        before = [p.detach().clone() for p in matrices]
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
        info = opt.last_info.groups
        assert set(info) == {"matrices", "vectors"}
        for name, group in info.items():
            assert group.grad_norm == opt.last_info.group_clips[name].grad_norm
            assert group.clip_coefficient == 1.0
            assert group.update_rms > 0 and group.update_ratio > 0, name
            assert group.stale_parameters == 0 and group.warnings == ()
        m = info["matrices"]
        # The matrices moved by update_rms·√n, and relative to their norm before by update_ratio
        # (fp32 parameters: the model holds the masters' values; fp32 differences, fp64 sums).
        delta = sum(float((p.detach().double() - b.double()).pow(2).sum()) for p, b in zip(matrices, before))
        norm = sum(float(b.double().pow(2).sum()) for b in before)
        count = sum(p.numel() for p in matrices)
        assert math.isclose(m.update_rms, math.sqrt(delta / count), rel_tol=1e-5)
        assert math.isclose(m.update_ratio, math.sqrt(delta / norm), rel_tol=1e-5)
        assert m.momentum_norm > 0 and m.smallest_momentum_norm <= m.momentum_norm
        assert 0 < m.orthogonality_residual < 0.8 and m.residual_parameter
        assert info["vectors"].momentum_norm is None and info["vectors"].orthogonality_residual is None
    opt.close()


def test_a_healthy_run_raises_nothing(daemon):
    model = TinyNet(seed=4)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, max_grad_norm=10.0)
    for step in range(1, 13):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
        assert all(g.warnings == () for g in opt.last_info.groups.values()), step
    opt.close()
    assert warnings_counted(daemon.endpoint) == {kind: 0.0 for kind in KINDS}
    assert events(daemon) == []


def test_a_huge_global_norm_stalls_the_muon_group(daemon):
    """Megatron-LM#5394: the embedding's gradient, 1e12 times too large, dominates the global norm;
    clip_scope global multiplies the Muon group's gradients by ~1e-12."""
    model = TinyNet(seed=5)
    opt = muond.RemoteOptimizer(groups(model, warn_clip_steps=3), endpoint=daemon.endpoint, max_grad_norm=1.0)
    raised = []
    for step in range(1, 6):
        loss_of(model, step).backward()
        model.emb.weight.grad.mul_(1e12)
        opt.step()
        opt.zero_grad()
        m = opt.last_info.groups["matrices"]
        assert m.clip_coefficient < 1e-9
        raised.append(m.warnings)
    opt.close()
    assert raised[0] == ("momentum_below_eps", "residual_high")
    assert raised[2] == ("clip_stall",)
    assert raised[1] == raised[3] == raised[4] == ()
    counted = warnings_counted(daemon.endpoint)
    assert (counted["clip_stall"], counted["momentum_below_eps"], counted["residual_high"]) == (1, 1, 1)
    logged = [(e["event"], e["step"], e["level"]) for e in events(daemon)]
    assert ("clip_stall", 3, "warning") in logged and ("momentum_below_eps", 1, "warning") in logged
    assert all("matrices" in e["message"] for e in events(daemon))


def test_a_parameter_without_gradients(daemon):
    model = TinyNet(seed=6)
    made = groups(model)
    made[1]["warn_stale_steps"] = 2
    opt = muond.RemoteOptimizer(made, endpoint=daemon.endpoint)
    stale = []
    for step in range(1, 5):
        loss_of(model, step).backward()
        model.norm.bias.grad = None  # torch's "no gradient": the daemon leaves it as it is
        opt.step()
        opt.zero_grad()
        v = opt.last_info.groups["vectors"]
        stale.append((v.stale_parameters, v.warnings))
    opt.close()
    assert stale == [(0, ()), (1, ("parameter_stale",)), (1, ()), (1, ())]
    assert warnings_counted(daemon.endpoint)["parameter_stale"] == 1
    assert any("norm.bias" in e["message"] for e in events(daemon) if e["event"] == "parameter_stale")


def test_a_residual_above_its_bound(daemon):
    model = TinyNet(seed=8)
    opt = muond.RemoteOptimizer(groups(model, warn_residual_above=1e-3), endpoint=daemon.endpoint)
    loss_of(model, 1).backward()
    opt.step()
    assert opt.last_info.groups["matrices"].warnings == ("residual_high",)
    opt.close()
    assert warnings_counted(daemon.endpoint)["residual_high"] == 1


def test_telemetry_off_and_bad_options(endpoint):
    model = TinyNet(seed=9)
    opt = muond.RemoteOptimizer(groups(model, telemetry=False), endpoint=endpoint)
    loss_of(model, 1).backward()
    opt.step()
    m = opt.last_info.groups["matrices"]
    assert m.update_rms is None and m.orthogonality_residual is None and m.momentum_norm > 0
    assert opt.last_info.groups["vectors"].update_rms > 0
    opt.close()
    with pytest.raises(ValueError, match="does not apply"):
        muond.RemoteOptimizer([{"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": False,
                                "warn_clip_below": 0.1}], endpoint=endpoint)
    with pytest.raises(muond.MuondError, match="warn_clip_steps must be in"):
        muond.RemoteOptimizer(groups(TinyNet(seed=9), warn_clip_steps=0), endpoint=endpoint)


@pytest.mark.ops
def test_muondctl_sessions_show_prints_the_last_steps_groups(daemon):
    from test_ops_muondctl import ctl, ctl_json

    model = TinyNet(seed=10)
    opt = muond.RemoteOptimizer(groups(model, warn_residual_above=1e-3), endpoint=daemon.endpoint,
                                session="shown")
    e = ("--endpoint", daemon.endpoint)
    assert ctl_json(*e, "sessions", "show", "shown")["telemetry"] == {"step": 0, "groups": []}
    for step in (1, 2):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    telemetry = ctl_json(*e, "sessions", "show", "shown")["telemetry"]
    assert telemetry["step"] == 2
    shown = {g["group"]: g for g in telemetry["groups"]}
    for name, info in opt.last_info.groups.items():
        for field in ("grad_norm", "clip_coefficient", "update_rms", "update_ratio", "momentum_norm",
                      "orthogonality_residual", "stale_parameters"):
            assert shown[name][field] == getattr(info, field), (name, field)
        assert tuple(shown[name]["warnings"]) == info.warnings
    code, out, _ = ctl(*e, "sessions", "show", "shown")
    assert code == 0 and "telemetry     of step 2" in out and "matrices" in out.split("telemetry")[1]
    opt.close()
