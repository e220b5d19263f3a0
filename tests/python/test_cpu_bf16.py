"""``matmul_precision="bf16"`` on the CPU backend through the real daemon (docs/algorithms.md, Matmul
precision): where the CPU has bf16 dot products, a Muon step's update differs from the fp32 one by
bf16 rounding — more than fp32 rounding could, less than the Newton–Schulz bound of 15 units of bf16
roundoff (5 steps, 3 GEMMs each, u = 2⁻⁸) — and the daemon says once that bf16 GEMMs run; elsewhere
the update is the fp32 one bit for bit and the daemon logs the reason once. The test's output says
which path it exercised."""
import os

import pytest
import torch

import muond
from helpers import TinyNet, loss_of, rel_err

BF16_UNIT = 2.0 ** -8
BOUND = 5 * 3 * BF16_UNIT


def muon_updates(endpoint, precision):
    """The change one step makes to each Muon matrix of a fresh TinyNet."""
    model = TinyNet(seed=7)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    groups = muond.default_param_groups(model)
    groups[0].update(matmul_precision=precision)
    muon = {id(p) for p in groups[0]["params"]}
    opt = muond.RemoteOptimizer(groups, endpoint=endpoint)
    loss_of(model, 1).backward()
    opt.step()
    opt.close()
    return {name: p.detach() - before[name] for name, p in model.named_parameters() if id(p) in muon}


def test_bf16_muon_step_on_the_cpu(start_daemon, capsys):
    if os.environ.get("MUOND_TEST_BACKEND", "cpu") != "cpu":
        pytest.skip("the CPU backend's bf16 path; this run's daemon uses another backend")
    daemon = start_daemon("--log-level", "info", "--threads", "2")
    fp32 = muon_updates(daemon.endpoint, "fp32")
    bf16 = muon_updates(daemon.endpoint, "bf16")
    again = muon_updates(daemon.endpoint, "bf16")  # a second session: no second log line

    lines = [line for line in daemon.log_path.read_text().splitlines() if "matmul_precision bf16" in line]
    assert len(lines) == 1, lines
    exercised = "fp32 accumulation" in lines[0]
    assert exercised or "runs in fp32: " in lines[0], lines[0]
    assert fp32.keys() == bf16.keys() and len(fp32) >= 2
    for name in fp32:
        assert torch.equal(bf16[name], again[name]), name
        if exercised:
            assert 1e-4 < rel_err(bf16[name], fp32[name]) < BOUND, name
        else:
            assert torch.equal(bf16[name], fp32[name]), name
    with capsys.disabled():
        if exercised:
            print(f"\n[bf16] kernel exercised: {lines[0].split('accumulation')[-1].strip()}")
        else:
            print(f"\n[bf16] bf16 kernel NOT exercised, the fallback was tested: {lines[0]}")
