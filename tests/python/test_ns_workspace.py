"""Newton–Schulz's bounded workspace (--ns-workspace-bytes) and ns_algorithm="auto", against the
real daemon: a session that cannot step within the bound is refused when it is created, naming the
flag and the parameter; batches cut to fit give the unbounded results bit for bit (each matrix is
computed on its own on the CPU backend); the workspace held is in the metrics and within the bound;
"auto" gives, per shape, exactly the variant its cost rule picks."""

import os
import uuid

import grpc
import pytest
import torch
from torch import nn

import muond
from muond.local import prefer_gram
from test_ops_metrics import metrics_address, sample, scrape

CPU_ONLY = pytest.mark.skipif(os.environ.get("MUOND_TEST_BACKEND", "cpu") != "cpu",
                              reason="bit-identical batching and the CPU's cost rule are the CPU backend's")

# Four 32×32 matrices (one batch when unbounded) and two 16×48. One 32×32 matrix alone needs
# NewtonSchulz's 2·32² + 2·32² floats (16 KiB); the group, one matrix per batch, as much plus, for
# NorMuon, a copy of a 16×48 (768 floats), or for auto, Gram's two 16² matrices (512 floats). Four
# 32×32 at once need 5·4·32² floats with the gather buffer.
SHAPES = [(32, 32)] * 4 + [(16, 48)] * 2
ONE_MATRIX_BYTES = 4 * 4 * 32 * 32
LEAST_BYTES = ONE_MATRIX_BYTES + 4 * 768


def _model(shapes=SHAPES):
    torch.manual_seed(3)
    return nn.Sequential(*[nn.Linear(cols, rows, bias=False) for rows, cols in shapes])


def _train(endpoint, options=None, shapes=SHAPES, steps=3):
    model = _model(shapes)
    groups = [{"params": list(model.parameters()), "optimizer": "muon", **(options or {})}]
    opt = muond.RemoteOptimizer(groups, endpoint=endpoint, session=f"ns-{uuid.uuid4().hex[:8]}")
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        opt.step()
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


def test_a_session_that_cannot_step_within_the_bound_is_refused_naming_it(start_daemon):
    daemon = start_daemon("--ns-workspace-bytes", str(ONE_MATRIX_BYTES - 4))
    model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 16, bias=False))
    with pytest.raises(muond.MuondError) as refused:
        muond.RemoteOptimizer([{"params": list(model.parameters()), "optimizer": "muon"}], endpoint=daemon.endpoint,
                              session="too-large")
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = refused.value.details
    # p0, the 32×32 matrix (p1, 16×32, needs less), named with the flag and the bytes.
    assert "--ns-workspace-bytes" in message and "parameter 'p0' of shape [32, 32]" in message, message
    assert f"needs {ONE_MATRIX_BYTES} bytes" in message, message
    # Element-wise groups need no workspace, whatever their size.
    opt = muond.RemoteOptimizer([{"params": list(model.parameters()), "optimizer": "adamw"}],
                                endpoint=daemon.endpoint, session="adamw-fits")
    opt.close()


@CPU_ONLY
def test_batches_cut_to_the_bound_give_the_unbounded_results_bit_for_bit(start_daemon):
    unbounded = start_daemon("--ns-workspace-bytes", "0")
    bounded = start_daemon("--ns-workspace-bytes", str(LEAST_BYTES), "--metrics-listen", "127.0.0.1:0")
    for options in ({}, {"ns_algorithm": "auto"}, {"moment2_method": "normuon"}):
        expected = _train(unbounded.endpoint, options)
        got = _train(bounded.endpoint, options)
        for e, g in zip(expected, got):
            assert torch.equal(e, g), options
    text = scrape(metrics_address(bounded.endpoint))
    held = sample(text, "muond_newton_schulz_workspace_bytes", state="held")
    assert 0 < held <= LEAST_BYTES
    assert sample(text, "muond_newton_schulz_workspace_bytes", state="limit") == LEAST_BYTES


@CPU_ONLY
def test_auto_is_the_variant_its_rule_picks_bit_for_bit(daemon):
    gram_shapes, standard_shapes = [(16, 64), (64, 16)], [(32, 40), (24, 24)]
    simple = [(3.4445, -4.7750, 2.0315)]
    assert all(prefer_gram(r, c, simple, "cycle", 5, ()) for r, c in gram_shapes)
    assert not any(prefer_gram(r, c, simple, "cycle", 5, ()) for r, c in standard_shapes)
    for shapes, variant in ((gram_shapes, "gram"), (standard_shapes, "standard")):
        auto = _train(daemon.endpoint, {"ns_algorithm": "auto"}, shapes)
        chosen = _train(daemon.endpoint, {"ns_algorithm": variant}, shapes)
        assert all(torch.equal(a, c) for a, c in zip(auto, chosen)), variant
    # The two variants differ on the Gram shapes, so the comparison above tells them apart.
    gram = _train(daemon.endpoint, {"ns_algorithm": "gram"}, gram_shapes)
    standard = _train(daemon.endpoint, {"ns_algorithm": "standard"}, gram_shapes)
    assert not all(torch.equal(g, s) for g, s in zip(gram, standard))


def _train_local(options, shapes):
    model = _model(shapes)
    local = muond.LocalOptimizer([{"params": list(model.parameters()), "optimizer": "muon", **options}])
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        local.step()
    return [p.detach().clone() for p in model.parameters()]


def test_local_optimizer_picks_per_shape_as_the_daemon_does():
    """LocalOptimizer's "auto" runs its own Gram or standard path on the shapes the daemon's CPU
    rule gives to each: the same computation, so the same bits."""
    for shapes, variant in (([(16, 64), (64, 16)], "gram"), ([(32, 40), (24, 24)], "standard")):
        auto = _train_local({"ns_algorithm": "auto"}, shapes)
        chosen = _train_local({"ns_algorithm": variant}, shapes)
        assert all(torch.equal(a, c) for a, c in zip(auto, chosen)), variant


def _wide_muon_spec():
    # One Muon matrix of 2048×20480: one matrix alone needs 2·2048·20480 + 2·2048² floats of
    # Newton–Schulz workspace, about 369 MB, more than the default bound of 256 MiB.
    from muond._stubs import pb
    spec = pb.SessionSpec()
    group = spec.groups.add(name="matrices")
    group.options.optimizer = pb.OPTIMIZER_MUON
    spec.parameters.add(name="wide", shape=[2048, 20480], group="matrices")
    return spec


def test_the_default_bound_is_soft_and_an_explicit_one_hard(start_daemon):
    from muond.client import Connection
    for flags, refused in (((), False), (("--ns-workspace-bytes", "256MiB"), True)):
        conn = Connection(start_daemon(*flags).endpoint)
        try:
            if refused:
                with pytest.raises(muond.MuondError) as err:
                    conn.create_session("wide", _wide_muon_spec())
                assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "parameter 'wide' of shape [2048, 20480]" in err.value.details
            else:
                conn.create_session("wide", _wide_muon_spec())  # batches cut to one matrix, then past the bound
                conn.close_session("wide")
        finally:
            conn.close()
