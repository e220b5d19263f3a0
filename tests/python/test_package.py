"""Pieces of the package that need no daemon: wire encoding, option resolution and its proto
mapping, default parameter groups, the in-process optimizer, the generated stubs."""

import importlib.util
import re

import pytest
import torch
from torch import nn

import muond
from muond import options, wire
from muond._stubs import pb
from helpers import TinyNet, loss_of, rel_err
from reference import MUON_DEFAULTS, Reference


# -- wire ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_encode_and_assemble_round_trip_in_chunks(dtype):
    t = torch.randn(37, 11)
    chunks = list(wire.encode("w", t, dtype, max_chunk_bytes=64))
    itemsize = 4 if dtype == "fp32" else 2
    assert len(chunks) == -(-t.numel() * itemsize // 64)
    assert [c.offset for c in chunks] == [i * 64 // itemsize for i in range(len(chunks))]
    assert list(chunks[0].shape) == [37, 11] and not chunks[1].shape
    into = wire.ChunkAssembler({"w": t.numel()})
    into.add_all(chunks)
    out = into.tensors()[("w", "")].view(37, 11)
    expected = {"fp32": t, "bf16": t.to(torch.bfloat16).float(),
                "fp16": t.to(torch.float16).float()}[dtype]
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_chunk_count_matches_encode(dtype):
    for numel in (0, 1, 15, 16, 17, 100, 1000):
        for max_chunk_bytes in (1, 3, 32, 64, 1 << 20):
            t = torch.ones(numel)
            chunks = list(wire.encode("w", t, dtype, max_chunk_bytes=max_chunk_bytes))
            assert wire.chunk_count(numel, dtype, max_chunk_bytes) == len(chunks), \
                (numel, max_chunk_bytes)


def test_assembler_rejects_gaps_and_partial_tensors():
    chunks = list(wire.encode("w", torch.ones(100), "fp32", max_chunk_bytes=40))
    into = wire.ChunkAssembler({"w": 100})
    with pytest.raises(ValueError, match="offset"):
        into.add(chunks[1])
    into.add(chunks[0])
    with pytest.raises(ValueError, match="arrived with 10 of 100"):
        into.tensors()


def test_dtype_names():
    assert wire.dtype_name(torch.bfloat16) == "bf16" and wire.dtype_name("float32") == "fp32"
    with pytest.raises(ValueError):
        wire.dtype_name("int8")


# -- options -------------------------------------------------------------------------------------

def test_defaults_follow_the_option_table():
    w = torch.zeros(3, 3)
    muon = options.resolve_group({"params": [w]}, {})
    assert (muon["optimizer"], muon["lr"], muon["momentum"], muon["nesterov"]) == \
        ("muon", 0.02, 0.95, True)
    assert (muon["ns_steps"], muon["ns_coefficients"], muon["scale_mode"],
            muon["weight_decay_mode"], muon["momentum_style"]) == \
        (5, "simple", "shape_scaling", "decoupled", "ema")
    adamw = options.resolve_group({"params": [w], "use_muon": False}, {})
    assert (adamw["optimizer"], adamw["lr"], adamw["weight_decay"], adamw["betas"],
            adamw["eps"]) == ("adamw", 1e-3, 0.01, (0.9, 0.999), 1e-8)
    lion = options.resolve_group({"params": [w], "optimizer": "lion"}, {})
    assert (lion["lr"], lion["betas"], lion["weight_decay"]) == (1e-4, (0.9, 0.99), 0.0)
    sgd = options.resolve_group({"params": [w], "optimizer": "SGD"}, {})
    assert (sgd["lr"], sgd["momentum"], sgd["nesterov"]) == (1e-2, 0.0, False)


def test_constructor_defaults_apply_where_they_fit():
    w = torch.zeros(3, 3)
    defaults = {"lr": 0.5, "momentum": 0.8, "betas": (0.7, 0.9)}
    muon = options.resolve_group({"params": [w]}, defaults)
    adamw = options.resolve_group({"params": [w], "optimizer": "adamw", "lr": 0.1}, defaults)
    assert (muon["lr"], muon["momentum"]) == (0.5, 0.8) and "betas" not in muon
    assert (adamw["lr"], adamw["betas"]) == (0.1, (0.7, 0.9)) and "momentum" not in adamw


def test_group_options_proto_names_every_option():
    group = options.resolve_group(
        {"params": [], "ns_steps": 3, "momentum_style": "sum", "ns_coefficients": "quintic",
         "scale_mode": "spectral", "extra_scale_factor": 0.2, "weight_decay_mode": "l2",
         "ns_eps": 1e-6, "ns_norm_safety": 1.01, "matmul_precision": "fp32",
         "qk_clip_threshold": 50.0, "qk_clip_alpha": 0.3, "nesterov": False}, {})
    msg = options.group_options_proto(group)
    assert msg.optimizer == pb.OPTIMIZER_MUON
    assert (msg.ns_steps, msg.momentum_style, msg.ns_coefficients, msg.scale_mode) == \
        (3, "sum", "quintic", "spectral")
    assert (msg.extra_scale_factor, msg.weight_decay_mode, msg.ns_eps, msg.ns_norm_safety) == \
        (0.2, "l2", 1e-6, 1.01)
    assert (msg.matmul_precision, msg.qk_clip_threshold, msg.qk_clip_alpha) == ("fp32", 50.0, 0.3)
    assert msg.HasField("nesterov") and not msg.nesterov and not msg.HasField("ns_coefficients_after")
    custom = options.group_options_proto(options.resolve_group(
        {"params": [], "ns_coefficients": [(1, 2, 3), (4, 5, 6)],
         "ns_coefficients_after": "repeat_last"}, {}))
    assert [(c.a, c.b, c.c) for c in custom.ns_custom_coefficients] == [(1, 2, 3), (4, 5, 6)]
    assert custom.ns_coefficients_after == "repeat_last" and not custom.HasField("ns_coefficients")
    adamw = options.group_options_proto(options.resolve_group(
        {"params": [], "optimizer": "adamw", "betas": (0.8, 0.9), "eps": 1e-6}, {}))
    assert (adamw.beta1, adamw.beta2, adamw.eps) == (0.8, 0.9, 1e-6)
    assert not adamw.HasField("momentum") and not adamw.HasField("ns_steps")


# -- default_param_groups ------------------------------------------------------------------------

class Gpt(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.wte = nn.Embedding(50, 16)
        self.attn = nn.MultiheadAttention(16, 2)
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.conv = nn.Conv2d(3, 8, 3)
        self.gain = nn.Parameter(torch.ones(()))
        self.ln = nn.LayerNorm(16)
        self.proj_out = nn.Linear(16, 50, bias=False)  # untied LM head under a non-standard name
        if tied:
            self.proj_out.weight = self.wte.weight
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


@pytest.mark.parametrize("tied", [False, True])
def test_default_param_groups_routes_by_role(tied):
    model = Gpt(tied)
    muon, adamw = muond.default_param_groups(model, muon={"lr": 0.03}, adamw={"lr": 3e-4})
    assert muon["optimizer"] == "muon" and muon["lr"] == 0.03
    assert adamw["optimizer"] == "adamw" and adamw["lr"] == 3e-4
    assert set(muon["param_names"]) == {"attn.in_proj_weight", "attn.out_proj.weight",
                                        "mlp.0.weight", "mlp.2.weight", "conv.weight"}
    expected_adamw = {"wte.weight", "attn.in_proj_bias", "attn.out_proj.bias", "mlp.0.bias",
                      "mlp.2.bias", "conv.bias", "gain", "ln.weight", "ln.bias"}
    if not tied:
        expected_adamw.add("proj_out.weight")
    assert set(adamw["param_names"]) == expected_adamw
    assert len(muon["params"]) == len(muon["param_names"])


def test_default_param_groups_head_override_and_names():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    muon, adamw = muond.default_param_groups(model, head=["2"])
    assert muon["param_names"] == ["0.weight"]
    assert adamw["param_names"] == ["0.bias", "2.weight", "2.bias"]
    (only,) = muond.default_param_groups(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                                         head=[], adamw={"lr": 1.0})[:1]
    assert only["optimizer"] == "muon"
    with pytest.raises(ValueError, match="no module named"):
        muond.default_param_groups(model, head=["lm_head"])


# -- LocalOptimizer ------------------------------------------------------------------------------

def test_local_adamw_and_sgd_match_torch():
    for kind, torch_cls, kwargs in (
            ("adamw", torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6,
                                              weight_decay=0.1)),
            ("sgd", torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True,
                                          weight_decay=0.01))):
        a, b = TinyNet(seed=40), TinyNet(seed=40)
        mine = muond.LocalOptimizer(a.parameters(), optimizer=kind, **kwargs)
        theirs = torch_cls(b.parameters(), **kwargs)
        for step in range(1, 8):
            for model, opt in ((a, mine), (b, theirs)):
                loss_of(model, step).backward()
                opt.step()
                opt.zero_grad()
        # Element-wise fp32 math in another order (torch's fused ops against the daemon's loop): each
        # step's update is off by a few fp32 ulps (≲ 4·2^-24 relative) and moves a parameter by
        # lr·update ≪ |p|, so 7 steps stay orders of magnitude below 1e-5; a wrong coefficient (bias
        # correction, decay) shows at 1e-3 or more.
        for p, q in zip(a.parameters(), b.parameters()):
            assert rel_err(p.detach(), q.detach()) < 1e-5, kind


def test_local_max_grad_norm_clips_like_torch():
    a, b = TinyNet(seed=43), TinyNet(seed=43)
    mine = muond.LocalOptimizer(a.parameters(), optimizer="sgd", lr=0.1, momentum=0.9,
                                max_grad_norm=0.05)
    theirs = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, 6):
        loss_of(a, step).backward()
        mine.step()
        mine.zero_grad()
        loss_of(b, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
        theirs.step()
        theirs.zero_grad()
        assert mine.last_info.applied and mine.last_info.step == step
        # torch sums squares pairwise in fp32 (≤ (log2 n + 2)·2^-24 ≈ 1e-6 relative for n ≈ 5k), the
        # daemon in fp64: the norms agree to ≤ 1e-6; 1e-5 leaves a 10× margin.
        assert abs(mine.last_info.grad_norm - norm.item()) < 1e-5 * norm.item()
        assert mine.last_info.grad_norm > 0.05  # so every step was clipped
    for p, q in zip(a.parameters(), b.parameters()):
        assert rel_err(p.detach(), q.detach()) < 1e-5
    with pytest.raises(ValueError, match="max_grad_norm"):
        muond.LocalOptimizer(a.parameters(), max_grad_norm=0.0)


def test_local_skips_a_step_with_a_non_finite_gradient():
    model = TinyNet(seed=44)
    opt = muond.LocalOptimizer(muond.default_param_groups(model))
    loss_of(model, 1).backward()
    opt.step()
    opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
             for n, p in model.named_parameters()}
    steps = {n: opt.state[p]["step"] for n, p in model.named_parameters()}
    loss_of(model, 2).backward()
    model.down.weight.grad.view(-1)[5] = float("inf")
    opt.step()
    assert not opt.last_info.applied and opt.last_step == 2
    assert opt.last_info.skip_reason == "non-finite gradient in 'down.weight'"
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
        assert opt.state[p]["step"] == steps[n], n
        for k, v in state[n].items():
            assert torch.equal(opt.state[p][k], v), (n, k)
    opt.zero_grad()
    loss_of(model, 3).backward()
    opt.step()
    assert opt.last_info.applied and opt.last_info.step == 3
    assert not torch.equal(model.down.weight.detach(), params["down.weight"])


def test_local_muon_matches_reference():
    model = TinyNet(seed=41)
    ref_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = muond.default_param_groups(model, muon={"weight_decay": 0.1},
                                        adamw={"weight_decay": 0.0})
    opt = muond.LocalOptimizer(groups)
    ref = Reference([
        {"kind": "muon", "params": [ref_params[n] for n in groups[0]["param_names"]],
         **dict(MUON_DEFAULTS, weight_decay=0.1)},
        {"kind": "adamw", "params": [ref_params[n] for n in groups[1]["param_names"]],
         "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}])
    for step in range(1, 11):
        loss_of(model, step).backward()
        grads = {id(ref_params[n]): p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        ref.step(grads)
        opt.zero_grad()
    for n, p in model.named_parameters():  # the element-wise bound above, over 10 steps
        assert rel_err(p.detach(), ref_params[n]) < 1e-5, n


def test_newton_schulz_orthogonalizes():
    from muond.local import newton_schulz
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    o = newton_schulz(g, 5, options.COEFFICIENT_SETS["simple"], "cycle", 1e-7, 1.0)
    s = torch.linalg.svdvals(o)
    assert o.shape == g.shape and 0.6 < s.min() and s.max() < 1.2  # Jordan's band [0.68, 1.13]


# -- ConnectionOptions ---------------------------------------------------------------------------

def test_connection_options_gather_the_connection_keywords():
    from dataclasses import FrozenInstanceError
    conn, rest = muond.ConnectionOptions.from_arguments(
        None, "h:1", {"timeout": 3.0, "transport": "grpc", "lr": 0.1, "chunk_bytes": 64})
    assert conn == muond.ConnectionOptions(endpoint="h:1", timeout=3.0, transport="grpc",
                                           chunk_bytes=64)
    assert rest == {"lr": 0.1}
    given = muond.ConnectionOptions(endpoint="h:2", max_step_attempts=2)
    assert muond.ConnectionOptions.from_arguments(given, None, {"lr": 0.1}) == (given, {"lr": 0.1})
    with pytest.raises(FrozenInstanceError):
        given.timeout = 1.0
    assert (given.endpoint_list(), given.step_attempts()) == (["h:2"], 2)
    assert muond.ConnectionOptions(transport="shm").transport_name() == "shm"
    with pytest.raises(ValueError, match="'pigeon' is not one of auto, cuda_ipc, nccl, shm, grpc"):
        muond.ConnectionOptions(transport="pigeon").transport_name()
    with pytest.raises(ValueError, match="max_step_attempts must be at least 1"):
        muond.ConnectionOptions(max_step_attempts=0).step_attempts()


def test_a_connection_option_given_twice_is_a_type_error_naming_it():
    model = nn.Linear(4, 4)
    conn = muond.ConnectionOptions(endpoint="127.0.0.1:1", connect_timeout=0.1)
    for keywords, field in (({"timeout": 5.0}, "timeout"), ({"transport": "grpc"}, "transport"),
                            ({"endpoint": "127.0.0.1:2"}, "endpoint")):
        with pytest.raises(TypeError, match=f"'{field}' was given both as an argument and in "
                                            f"connection="):
            muond.RemoteOptimizer(model.parameters(), connection=conn, **keywords)
    with pytest.raises(TypeError, match="'endpoint' was given both"):
        muond.RemoteOptimizer(model.parameters(), "127.0.0.1:2", connection=conn)
    with pytest.raises(TypeError, match="connection: a muond.ConnectionOptions"):
        muond.RemoteOptimizer(model.parameters(), connection={"endpoint": "127.0.0.1:1"})


# -- generated stubs -----------------------------------------------------------------------------

def test_generated_stubs_import_as_a_subpackage(tmp_path):
    from conftest import REPO_ROOT
    spec = importlib.util.spec_from_file_location("muond_codegen",
                                                  REPO_ROOT / "python" / "muond" / "_codegen.py")
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    target = codegen.generate(REPO_ROOT / "proto", tmp_path)
    files = {"muond_pb2.py", "session_spec_pb2.py", "step_pb2.py", "device_transport_pb2.py",
             "error_details_pb2.py", "muond_pb2_grpc.py"}
    assert {p.name for p in target.iterdir()} >= files | {"__init__.py", "group_options.json"}
    for name in files:  # every module imports its siblings relatively
        assert not re.search(r"^(from|import) muond\.v1", (target / name).read_text(), re.MULTILINE), name
    assert "from . import muond_pb2" in (target / "muond_pb2_grpc.py").read_text()
    assert "from .step_pb2 import *" in (target / "muond_pb2.py").read_text()
    assert "muond._proto" in muond._stubs.pb.__name__
    # The public imports make every message of the API a name of muond_pb2.
    for message in ("SessionSpec", "StepHeader", "StepSharedRequest", "ErrorInfo", "ServerInfo"):
        assert hasattr(muond._stubs.pb, message), message
