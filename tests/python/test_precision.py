"""Precision-aware state (the *_dtype group options) against the real daemon: 16-bit masters and
optimizer slots follow the pure-torch reference that computes in fp32 and rounds what it stores;
the state dict, SetState, checkpoints and the journal carry the 16-bit values unchanged; values an
fp16 tensor cannot hold are refused with the field named; the daemon's memory for the state is the
README's bytes per parameter; and a small model trained 200 steps with bf16 momentum ends within
2% of the fp32 run's loss."""

import math
import os
import uuid

import pytest
import torch
from torch import nn

import muond
from muond._stubs import pb
from helpers import (MAX_APART, SIXTEEN_BIT, Pair, TinyNet, assert_same_up_to_rounding, loss_of, rel_err,
                     remote_factory, rounding_disagreement)

# The daemon and the reference compute the same fp32 steps on the same 16-bit values and round what
# they store the same way (to nearest even), so they agree except where their fp32 arithmetic differs
# in the last bits (Newton–Schulz's GEMMs sum in another order) and a value near the midpoint of two
# 16-bit neighbours rounds apart. A 16-bit master is therefore compared in its own spacings
# (helpers.assert_same_up_to_rounding: each element within one spacing per step, few elements apart).
# An fp32 master beside 16-bit state moves by lr·update each step, and an update computed from state
# that is one 16-bit ulp apart in some elements is apart by at most about that ulp, relative: after
# `steps` steps the master is apart by at most steps · (16-bit unit roundoff) · (how far the steps
# moved it, relative to its norm), which FP32_MASTER_BOUND computes from the reference's own run.
# The same daemon against an unrounded fp32 reference puts most elements of a bf16 master apart
# (the guard below).
BF16 = dict(master_dtype="bf16", momentum_dtype="bf16")
BF16_ADAMW = dict(master_dtype="bf16", exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")


def run(pair: Pair, steps: int):
    for step in range(1, steps + 1):
        pair.step(step)
    errors = pair.errors()
    pair.opt.close()
    return errors


def master_dtypes(opt):
    """{parameter name: the 16-bit master dtype of its group, or None for fp32}."""
    return {name: (g.get("master_dtype") if g.get("master_dtype") in SIXTEEN_BIT else None)
            for g in opt.param_groups for name in g["param_names"]}


def state_dtype_unit_roundoff(options):
    """The unit roundoff of the narrowest 16-bit state in `options` (2^-8 bf16, 2^-11 fp16)."""
    dtypes = {v for k, v in options.items() if k.endswith("_dtype")}
    return 2.0 ** -8 if "bf16" in dtypes else 2.0 ** -11 if "fp16" in dtypes else 2.0 ** -24


def compare_with_reference(pair: Pair, steps: int, muon: dict, adamw: dict):
    """Runs `steps` steps and checks every parameter as the module comment says; returns the
    largest (ulps, fraction apart) of 16-bit masters and relative errors of fp32 ones."""
    travelled = {n: 0.0 for n in pair.ref_params}  # the sum of each step's move, relative to the norm
    largest_step = {n: 0.0 for n in pair.ref_params}  # the largest move of one element in one step
    for step in range(1, steps + 1):
        before = {n: p.detach().clone() for n, p in pair.ref_params.items()}
        pair.step(step)
        for n, p in pair.ref_params.items():
            travelled[n] += rel_err(p, before[n]) if before[n].norm() > 0 else 0.0
            largest_step[n] = max(largest_step[n], (p - before[n]).abs().max().item())
    dtypes = master_dtypes(pair.opt)
    kinds = {name: g["optimizer"] for g in pair.opt.param_groups for name in g["param_names"]}
    report = {}
    for name, p in pair.model.named_parameters():
        expected = pair.ref_params[name]
        if dtypes[name] is not None:
            report[name] = rounding_disagreement(p, expected, dtypes[name], largest_step[name])[:2]
            assert_same_up_to_rounding(p, expected, dtypes[name], steps, largest_step[name], name)
        else:
            u = state_dtype_unit_roundoff(muon if kinds[name] == "muon" else adamw)
            bound = FP32_MASTER_FACTOR * steps * u * travelled[name] + 2.0 ** -20
            report[name] = rel_err(p.detach(), expected)
            assert report[name] <= bound, (name, report[name], bound)
    pair.opt.close()
    return report


# An update apart by the 16-bit unit roundoff u (relative) moves the master apart by u times the
# step; 4 covers an update whose inputs are apart in several slots (momentum and a second moment)
# and Newton–Schulz's growth of a small input difference over its iterations.
FP32_MASTER_FACTOR = 4.0


@pytest.mark.parametrize("muon,adamw", [
    (BF16, BF16_ADAMW),
    (dict(momentum_dtype="fp16"), dict(exp_avg_dtype="fp16")),
    (dict(momentum_dtype="bf16", moment2_method="adamuon", exp_avg_sq_dtype="bf16"), dict(exp_avg_sq_dtype="bf16")),
    (dict(master_dtype="fp16", moment2_method="normuon", exp_avg_sq_dtype="fp16"), dict(master_dtype="fp16")),
], ids=["bf16-everything", "fp16-momenta", "adamuon-bf16", "normuon-fp16"])
def test_sixteen_bit_state_matches_the_reference(endpoint, muon, adamw):
    ref_muon = dict(muon)
    if "moment2_method" in muon:
        ref_muon["beta2"] = 0.95
    pair = Pair(remote_factory(endpoint, muon=muon, adamw=adamw), TinyNet(seed=81),
                ref_muon=ref_muon, ref_adamw=adamw)
    report = compare_with_reference(pair, 10, muon, adamw)
    print("16-bit masters (ulps, fraction apart), fp32 masters relative error, over 10 steps:", report)


def test_the_tolerance_sees_a_state_kept_in_fp32(endpoint):
    """Guards the test above: with bf16 state the daemon differs from an fp32 reference in most
    elements of every bf16 master, far more than MAX_APART, so matching the rounded reference means
    the state really is bf16."""
    pair = Pair(remote_factory(endpoint, muon=BF16, adamw=BF16_ADAMW), TinyNet(seed=81))
    run(pair, 10)
    for name, dtype in master_dtypes(pair.opt).items():
        assert dtype == "bf16", name
        _, apart, count = rounding_disagreement(dict(pair.model.named_parameters())[name],
                                                pair.ref_params[name].to(torch.bfloat16).float(), dtype)
        assert apart > 4 * MAX_APART * count, (name, apart, count)


def test_parameters_hold_the_rounded_masters_from_the_start(endpoint):
    """A bf16 master stores the uploaded values rounded; the trainer's parameters take those values
    when the session is created, not only after the first step. fp32 masters are left as they are."""
    model = TinyNet(seed=86)
    up, head = model.up.weight.detach().clone(), model.head.weight.detach().clone()
    groups = muond.default_param_groups(model, muon=dict(master_dtype="bf16"))
    assert any(model.head.weight is p for g in groups if g.get("optimizer") != "muon" for p in g["params"])
    with muond.RemoteOptimizer(groups, endpoint=endpoint):
        assert torch.equal(model.up.weight.detach(), up.to(torch.bfloat16).float())
        assert not torch.equal(model.up.weight.detach(), up)
        assert torch.equal(model.head.weight.detach(), head)  # an AdamW parameter, fp32 master


def test_state_dict_is_in_the_stored_dtypes_and_round_trips(endpoint):
    model = TinyNet(seed=82)
    groups = muond.default_param_groups(model, muon=BF16, adamw=dict(exp_avg_sq_dtype="fp16"))
    with muond.RemoteOptimizer(groups, endpoint=endpoint) as opt:
        for step in range(1, 4):
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
        saved = opt.state_dict()
        muon_entry = saved["state"][0]  # up.weight, the first Muon parameter
        assert muon_entry["master"].dtype == torch.bfloat16
        assert muon_entry["momentum"].dtype == torch.bfloat16
        adamw_index = len(opt.param_groups[0]["params"])
        adamw_entry = saved["state"][adamw_index]
        assert adamw_entry["master"].dtype == torch.float32
        assert adamw_entry["exp_avg"].dtype == torch.float32
        assert adamw_entry["exp_avg_sq"].dtype == torch.float16
        # The parameters the trainer holds are the bf16 masters, widened.
        assert torch.equal(model.up.weight.detach(), muon_entry["master"].float())
        opt.load_state_dict(saved)
        again = opt.state_dict()
        for i, entry in saved["state"].items():
            for slot, value in entry.items():
                if isinstance(value, torch.Tensor):
                    assert again["state"][i][slot].dtype == value.dtype
                    assert torch.equal(again["state"][i][slot], value), (i, slot)


def test_values_beyond_fp16_are_refused_with_the_field_named(endpoint):
    model = nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.weight[1, 2] = 1e5  # beyond fp16's largest finite value, 65504
    groups = [{"params": list(model.parameters()), "optimizer": "adamw", "master_dtype": "fp16"}]
    with pytest.raises(muond.MuondError) as refused:
        muond.RemoteOptimizer(groups, endpoint=endpoint)
    assert refused.value.code.name == "INVALID_ARGUMENT"
    assert "chunk.data" in str(refused.value) and "fp16" in str(refused.value)
    assert "65504" in str(refused.value)


def test_a_step_that_would_overflow_fp16_state_is_skipped(endpoint):
    """Adam's exp_avg_sq stored in fp16 holds (1−β2)·g²: a gradient of 1e4 would store 1e5, past
    fp16's 65504, so the step is skipped, naming the tensor, and nothing changes."""
    model = nn.Linear(4, 3, bias=False)
    groups = [{"params": list(model.parameters()), "optimizer": "adamw", "exp_avg_sq_dtype": "fp16"}]
    with muond.RemoteOptimizer(groups, endpoint=endpoint) as opt:
        before = model.weight.detach().clone()
        model.weight.grad = torch.full_like(model.weight, 0.5)
        model.weight.grad[0, 0] = 1e4
        opt.step()
        assert not opt.last_info.applied
        assert "exp_avg_sq" in opt.last_info.skip_reason and "fp16" in opt.last_info.skip_reason
        assert torch.equal(model.weight.detach(), before)
        model.weight.grad = torch.full_like(model.weight, 0.5)  # a gradient fp16 can square
        opt.step()
        assert opt.last_info.applied
        assert torch.isfinite(opt.state_dict()["state"][0]["exp_avg_sq"]).all()


def test_options_are_checked_and_named(endpoint):
    model = TinyNet(seed=83)
    with pytest.raises(ValueError, match="exp_avg_sq_dtype"):  # a muon group without a moment2_method
        muond.RemoteOptimizer(muond.default_param_groups(model, muon={"exp_avg_sq_dtype": "bf16"}),
                              endpoint=endpoint)
    with pytest.raises(ValueError, match="master_dtype"):
        muond.RemoteOptimizer(muond.default_param_groups(model, muon={"master_dtype": "fp8"}),
                              endpoint=endpoint)
    with pytest.raises(ValueError, match="exp_avg_dtype"):  # Muon keeps a momentum, not exp_avg
        muond.RemoteOptimizer(muond.default_param_groups(model, muon={"exp_avg_dtype": "bf16"}),
                              endpoint=endpoint)
    # torch's dtype names are accepted too (Megatron-Core's configuration takes torch dtypes).
    groups = muond.default_param_groups(model, muon={"momentum_dtype": torch.bfloat16})
    with muond.RemoteOptimizer(groups, endpoint=endpoint) as opt:
        assert opt.param_groups[0]["momentum_dtype"] == "bf16"


def test_daemon_refuses_a_muon_moment_format_without_a_moment(endpoint):
    """The daemon's own check, past the client's: the field is named in the error."""
    conn = muond.Connection(endpoint)
    try:
        spec = pb.SessionSpec()
        group = spec.groups.add(name="g")
        group.options.optimizer = pb.OPTIMIZER_MUON
        group.options.exp_avg_sq_dtype = "bf16"
        spec.parameters.add(name="w", shape=[4, 4], group="g")
        with pytest.raises(muond.MuondError) as refused:
            conn.create_session(f"p-{uuid.uuid4().hex[:8]}", spec)
        assert refused.value.code.name == "INVALID_ARGUMENT"
        assert "exp_avg_sq_dtype" in str(refused.value)
        group.options.ClearField("exp_avg_sq_dtype")
        group.options.momentum_dtype = "fp8"
        with pytest.raises(muond.MuondError) as refused:
            conn.create_session(f"p-{uuid.uuid4().hex[:8]}", spec)
        assert "momentum_dtype" in str(refused.value) and "bf16" in str(refused.value)
    finally:
        conn.close()


def test_sixteen_bit_state_survives_a_checkpoint_and_a_crash(start_daemon, tmp_path):
    """The checkpoint writes the 16-bit tensors as BF16 / F16, the journal replays over them, and
    the restored session goes on exactly as one that never stopped."""
    def groups(model):
        return muond.default_param_groups(model, muon=dict(master_dtype="bf16", momentum_dtype="fp16"),
                                          adamw=dict(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"))

    state_dir = tmp_path / "state"
    flags = ("--state-dir", state_dir, "--durability", "journal")
    daemon = start_daemon(*flags)
    session = f"precision-{uuid.uuid4().hex[:8]}"
    model, twin, ghost = TinyNet(seed=84), TinyNet(seed=84), TinyNet(seed=84)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, session=session)
    for step in range(1, 6):
        if step == 4:
            assert opt.checkpoint() == 3
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    opt.close(keep_session=True)
    daemon.kill()
    header = (state_dir / session).glob("checkpoint-*.safetensors")
    text = next(header).read_bytes()[8:4096].decode(errors="replace")
    assert '"BF16"' in text and '"F16"' in text and '"F32"' in text

    daemon = start_daemon(*flags, workdir=daemon.workdir)
    with muond.RemoteOptimizer(groups(twin), endpoint=daemon.endpoint, session=session) as opt:
        assert opt.last_step == 5
        restored = opt.state_dict()
        for i, entry in saved["state"].items():
            for slot, value in entry.items():
                if isinstance(value, torch.Tensor):
                    assert restored["state"][i][slot].dtype == value.dtype, (i, slot)
                    assert torch.equal(restored["state"][i][slot], value), (i, slot)
        for step in range(6, 8):
            loss_of(twin, step).backward()
            opt.step()
            opt.zero_grad()
        after = {n: p.detach().clone() for n, p in twin.named_parameters()}
    # The same 7 steps without a stop.
    with muond.RemoteOptimizer(groups(ghost), endpoint=daemon.endpoint) as opt:
        for step in range(1, 8):
            loss_of(ghost, step).backward()
            opt.step()
            opt.zero_grad()
    for name, p in ghost.named_parameters():
        assert torch.equal(p.detach(), after[name]), name


def _sessions_state_bytes(endpoint, session):
    conn = muond.Connection(endpoint)
    try:
        return next(s.state_bytes for s in conn.list_sessions() if s.session_id == session)
    finally:
        conn.close()


def test_daemon_memory_follows_the_bytes_per_parameter(start_daemon):
    """The README's bytes per parameter, measured: the backend memory a session's masters and slots
    take (muond_backend_memory_bytes) is 4 bytes per parameter for bf16 master and momentum (Muon),
    against 8 in fp32; the quota estimate adds the fp32 gradient."""
    from test_ops_metrics import metrics_address, sample, scrape

    daemon = start_daemon("--metrics-listen", "127.0.0.1:0")
    address = metrics_address(daemon.endpoint)
    rows, cols, count = 512, 256, 4
    used = {}
    for name, options in (("fp32", {}), ("bf16", BF16)):
        layers = nn.Sequential(*[nn.Linear(cols, rows, bias=False) for _ in range(count)])
        before = sample(scrape(address), "muond_backend_memory_bytes", state="in_use")
        session = f"memory-{name}-{uuid.uuid4().hex[:8]}"
        groups = [{"params": list(layers.parameters()), "optimizer": "muon", **options}]
        opt = muond.RemoteOptimizer(groups, endpoint=daemon.endpoint, session=session)
        used[name] = sample(scrape(address), "muond_backend_memory_bytes", state="in_use") - before
        estimate = _sessions_state_bytes(daemon.endpoint, session)
        opt.close()
        params = rows * cols * count
        per_parameter = used[name] / params
        print(f"{name}: {per_parameter} bytes per parameter in backend memory, estimate {estimate / params}")
        state = 8 if name == "fp32" else 4  # master + momentum
        # A backend with device memory (cuda) also holds the session's fp32 gradient set there from
        # the start (GradientPool::Preallocate); the CPU backend decodes into host tensors instead.
        gradients = 4 if os.environ.get("MUOND_TEST_BACKEND", "cpu") != "cpu" else 0
        assert per_parameter == state + gradients
        assert estimate == params * (state + 4)  # + the fp32 gradient, wherever it lives
        used[name] -= gradients * params
    assert used["bf16"] * 2 == used["fp32"]


class CharModel(nn.Module):
    """A tiny next-token model (embedding → two hidden layers → head) that learns a noisy rule."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(32, 32)
        self.hidden = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 32)

    def forward(self, x):
        return self.head(self.hidden(self.emb(x)))


def _train_200(endpoint, muon):
    model = CharModel()
    groups = muond.default_param_groups(model, muon=dict(lr=0.02, **muon), adamw=dict(lr=3e-3))
    gen = torch.Generator().manual_seed(9)
    losses = []
    with muond.RemoteOptimizer(groups, endpoint=endpoint) as opt:
        for _ in range(200):
            x = torch.randint(32, (64,), generator=gen)
            # A rule the model can learn, with a quarter of the labels random: the loss stays well
            # above zero (about 1.2 at best), so 2% of it is a real margin.
            noise = torch.randint(32, (64,), generator=gen)
            y = torch.where(torch.rand(64, generator=gen) < 0.75, (x * 7 + 3) % 32, noise)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return sum(losses[-20:]) / 20, losses[0]


def test_bf16_momentum_trains_within_two_percent_of_fp32(endpoint):
    fp32, first = _train_200(endpoint, {})
    bf16, _ = _train_200(endpoint, {"momentum_dtype": "bf16"})
    print(f"final loss over the last 20 of 200 steps: fp32 {fp32:.4f}, bf16 momentum {bf16:.4f} "
          f"(first step {first:.4f})")
    assert fp32 < 0.5 * first, "the model must learn for the comparison to mean anything"
    assert math.isfinite(bf16) and abs(bf16 - fp32) <= 0.02 * fp32


def test_local_optimizer_rounds_as_the_daemon(endpoint):
    """LocalOptimizer emulates 16-bit state (fp32 compute, round on store): it follows the daemon."""
    model, twin = TinyNet(seed=85), TinyNet(seed=85)
    muon, adamw = dict(BF16), dict(BF16_ADAMW)
    remote = muond.RemoteOptimizer(muond.default_param_groups(model, muon=muon, adamw=adamw), endpoint=endpoint)
    local = muond.LocalOptimizer(muond.default_param_groups(twin, muon=muon, adamw=adamw))
    largest_step = {n: 0.0 for n, _ in twin.named_parameters()}
    with remote:
        for step in range(1, 8):
            before = {n: q.detach().clone() for n, q in twin.named_parameters()}
            for m, opt in ((model, remote), (twin, local)):
                loss_of(m, step).backward()
                opt.step()
                opt.zero_grad()
            for n, q in twin.named_parameters():
                largest_step[n] = max(largest_step[n], (q.detach() - before[n]).abs().max().item())
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert_same_up_to_rounding(p, q, "bf16", 7, largest_step[name], name)  # bf16 masters everywhere
    assert local.state[twin.up.weight]["momentum"].dtype == torch.bfloat16


def test_local_optimizer_state_dict_keeps_the_stored_dtypes():
    """torch's load_state_dict casts state to the parameters' dtype; LocalOptimizer puts 16-bit
    slots back in their storage dtype, so a reloaded optimizer steps exactly as the saved one."""
    model, twin = TinyNet(seed=87), TinyNet(seed=87)
    make = lambda m: muond.LocalOptimizer(muond.default_param_groups(m, muon=BF16, adamw=BF16_ADAMW))
    first = make(model)
    for step in range(1, 3):
        loss_of(model, step).backward()
        first.step()
        first.zero_grad()
    twin.load_state_dict(model.state_dict())
    second = make(twin)
    second.load_state_dict(first.state_dict())
    assert second.state[twin.up.weight]["momentum"].dtype == torch.bfloat16
    assert second.state[twin.head.weight]["exp_avg_sq"].dtype == torch.bfloat16
    for m, opt in ((model, first), (twin, second)):
        loss_of(m, 3).backward()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
