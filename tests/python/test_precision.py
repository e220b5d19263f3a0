"""Precision-aware state (the *_dtype group options) against the real daemon: 16-bit masters and
optimizer slots follow the pure-torch reference that computes in fp32 and rounds what it stores;
the state dict, SetState, checkpoints and the journal carry the 16-bit values unchanged; values an
fp16 tensor cannot hold are refused with the field named; the daemon's memory for the state is the
README's bytes per parameter; and a small model trained 200 steps with bf16 momentum ends within
2% of the fp32 run's loss."""

import math
import uuid

import pytest
import torch
from torch import nn

import muond
from muond._stubs import pb
from helpers import Pair, TinyNet, loss_of, rel_err, remote_factory

# The daemon and the reference compute the same fp32 steps on the same 16-bit values and round what
# they store the same way (to nearest even), so they agree except where their fp32 arithmetic differs
# in the last bits (Newton–Schulz's GEMMs sum in another order) and a value near the midpoint of two
# 16-bit neighbours rounds apart, by one 16-bit ulp. Measured over 10 steps: 0 for bf16 everywhere,
# up to 3e-5 relative (Frobenius) with fp16 state or a second moment. The same daemon run against
# an unrounded fp32 reference is off by 3e-3 to 7e-3 (the guard below).
TOLERANCE = 2e-4
BF16 = dict(master_dtype="bf16", momentum_dtype="bf16")
BF16_ADAMW = dict(master_dtype="bf16", exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")


def run(pair: Pair, steps: int):
    for step in range(1, steps + 1):
        pair.step(step)
    errors = pair.errors()
    pair.opt.close()
    return errors


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
    errors = run(pair, 10)
    print("max relative error over 10 steps:", max(errors.values()), errors)
    assert max(errors.values()) < TOLERANCE, errors


def test_the_tolerance_sees_a_state_kept_in_fp32(endpoint):
    """Guards the test above: with bf16 state the daemon differs from an fp32 reference by far more
    than the tolerance, so matching the rounded reference means the state really is bf16."""
    pair = Pair(remote_factory(endpoint, muon=BF16, adamw=BF16_ADAMW), TinyNet(seed=81))
    errors = run(pair, 10)
    assert max(errors.values()) > 10 * TOLERANCE, errors


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
        expected = 8 if name == "fp32" else 4  # master + momentum
        assert per_parameter == expected
        assert estimate == params * (expected + 4)  # + the fp32 gradient
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
    with remote:
        for step in range(1, 8):
            for m, opt in ((model, remote), (twin, local)):
                loss_of(m, step).backward()
                opt.step()
                opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert rel_err(p.detach(), q.detach()) < TOLERANCE, name
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
