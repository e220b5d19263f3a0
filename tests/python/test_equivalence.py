"""The daemon's Muon and AdamW against the pure-torch reference of docs/algorithms.md, on identical
gradients from a small model: parameters must agree to a relative error below 1e-4."""

import pytest
import torch

import muond
from muond import options as opts
from muond._stubs import pb
from muond.local import newton_schulz
from helpers import Pair, TinyNet, clone_model, loss_of, rel_err, remote_factory
from reference import ADAMW_DEFAULTS, MUON_DEFAULTS, POLAR_EXPRESS, QUINTIC, SIMPLE, Reference

# Both sides compute every step in fp32 but sum in other orders (OpenBLAS's kernel against torch's),
# so their updates differ by the rounding of those sums: a GEMM of inner size k is off by at most
# about k·2^-24 relative, and Newton–Schulz's 5 iterations of 3 GEMMs with k ≤ 48 (TinyNet's widest)
# give an update off by ≲ 15·48·2^-24 ≈ 4.3e-5 relative, about doubled by the iterations' growth of
# a small input difference. The master moves by that update times lr each step, so its relative
# error is at most that 9e-5 times how far it moved relative to its norm; over these runs (≤ 20
# steps) that distance stays below 1, which bounds the error by 1e-4. An update computed wrongly
# (a coefficient, a scale, a missed step) is off by far more: a percent or more.
TOLERANCE = 1e-4


def run(pair: Pair, steps: int):
    for step in range(1, steps + 1):
        pair.step(step)
    errors = pair.errors()
    pair.opt.close()
    return errors


def test_defaults_match_reference_over_20_steps(endpoint):
    # Muon: fp32 Newton–Schulz, simple coefficients, 5 steps, ema momentum with Nesterov,
    # shape scaling, decoupled weight decay. AdamW: torch semantics.
    pair = Pair(remote_factory(endpoint, muon={"weight_decay": 0.05}),
                TinyNet(seed=1), ref_muon={"weight_decay": 0.05})
    assert [g["optimizer"] for g in pair.opt.param_groups] == ["muon", "adamw"]
    assert pair.opt.param_groups[0]["param_names"] == ["up.weight", "down.weight"]
    errors = run(pair, 20)
    print("max relative error over 20 steps:", max(errors.values()), errors)
    assert max(errors.values()) < TOLERANCE, errors


def test_parameters_moved(endpoint):
    model = TinyNet(seed=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pair = Pair(remote_factory(endpoint), model)
    run(pair, 3)
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), f"{name} was not updated"


def test_bf16_wire_matches_reference_on_rounded_gradients(endpoint):
    pair = Pair(remote_factory(endpoint, wire_dtype="bf16"), TinyNet(seed=3),
                round_grads_to=torch.bfloat16)
    errors = run(pair, 20)
    print("bf16 wire, max relative error:", max(errors.values()))
    assert max(errors.values()) < TOLERANCE, errors


def test_bf16_gradients_differ_from_fp32():
    # Guards the test above: bf16 rounding is visible, so matching the rounded reference means
    # the daemon really received bf16.
    g = torch.randn(1000)
    assert (g.to(torch.bfloat16).float() - g).abs().max() > 1e-4


MUON_VARIANTS = [
    ({"momentum_style": "sum", "nesterov": False, "momentum": 0.9},
     {"momentum_style": "sum", "nesterov": False, "momentum": 0.9}),
    ({"momentum_style": "sum", "nesterov": True}, {"momentum_style": "sum", "nesterov": True}),
    ({"ns_coefficients": "quintic"}, {"coefficients": QUINTIC}),
    ({"ns_coefficients": "polar_express", "ns_steps": 10},
     {"coefficients": POLAR_EXPRESS, "after": "repeat_last", "ns_steps": 10}),
    ({"ns_coefficients": [(3.0, -3.2, 1.2), (3.4445, -4.775, 2.0315)], "ns_steps": 5,
      "ns_coefficients_after": "repeat_last"},
     {"coefficients": [(3.0, -3.2, 1.2), (3.4445, -4.775, 2.0315)], "after": "repeat_last"}),
    ({"ns_coefficients": (3.4445, -4.775, 2.0315), "ns_steps": 3},
     {"coefficients": [(3.4445, -4.775, 2.0315)], "ns_steps": 3}),
    ({"scale_mode": "spectral", "extra_scale_factor": 0.2, "weight_decay": 0.01,
      "weight_decay_mode": "independent"},
     {"scale_mode": "spectral", "extra_scale_factor": 0.2, "weight_decay": 0.01,
      "weight_decay_mode": "independent"}),
    ({"scale_mode": "unit_rms_norm", "weight_decay": 0.05, "weight_decay_mode": "l2",
      "ns_eps": 1e-6, "ns_norm_safety": 1.02},
     {"scale_mode": "unit_rms_norm", "weight_decay": 0.05, "weight_decay_mode": "l2",
      "ns_eps": 1e-6, "ns_norm_safety": 1.02}),
    ({"ns_coefficients": "deepseekv4", "ns_steps": 10},
     {"coefficients": [SIMPLE[0]] * 8 + [(2.0, -1.5, 0.5)] * 2, "after": "repeat_last", "ns_steps": 10}),
    ({"ns_coefficients": "cubic5"},
     {"coefficients": [(3.3656576, -3.3420992, 0.0), (2.5744352, -1.4957376, 0.0),
                       (2.5368962, -1.4312570, 0.0), (2.4418906, -1.2764040, 0.0),
                       (2.2230472, -0.9630650, 0.0)], "after": "repeat_last"}),
    # Gram Newton–Schulz computes the standard iteration's map: the reference is the standard one.
    ({"ns_algorithm": "gram"}, {}),
    ({"ns_algorithm": "gram", "ns_coefficients": "gram_polar_express"},
     {"coefficients": [(a / 1.05, b / 1.05 ** 3, c / 1.05 ** 5) for a, b, c in (
         (8.28721201814563, -23.595886519098837, 17.300387312530933),
         (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
         (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
         (3.3184196573706015, -2.488488024314874, 0.51004894012372),
         (2.300652019954817, -1.6689039845747493, 0.4188073119525673))], "after": "repeat_last"}),
]


@pytest.mark.parametrize("options,reference", MUON_VARIANTS,
                         ids=["sum", "sum-nesterov", "quintic", "polar_express", "custom",
                              "torch-style-tuple", "spectral-independent", "unit_rms-l2", "deepseekv4",
                              "cubic5", "gram", "gram-polar-express"])
def test_muon_options_map_through(endpoint, options, reference):
    pair = Pair(remote_factory(endpoint, muon=dict(options, lr=0.05)), TinyNet(seed=4),
                ref_muon=dict(reference, lr=0.05))
    errors = run(pair, 6)
    assert max(errors.values()) < TOLERANCE, errors


ADAPTIVE_VARIANTS = [
    {"moment2_method": "adamuon", "beta2": 0.9, "eps": 1e-8},
    {"moment2_method": "normuon", "beta2": 0.9, "eps": 1e-10},
    {"moment2_method": "normuon", "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.5,
     "weight_decay_mode": "cautious", "scale_mode": "spectral", "extra_scale_factor": 0.2},
    {"weight_decay": 0.5, "weight_decay_mode": "cautious"},
]


@pytest.mark.parametrize("options", ADAPTIVE_VARIANTS,
                         ids=["adamuon", "normuon", "normuon-cautious-spectral", "cautious"])
def test_adaptive_muon_and_cautious_decay_match_the_reference(endpoint, options):
    """Adaptive Muon (Megatron-Core's adamuon, modded-nanogpt's NorMuon) and cautious weight decay
    against the pure-torch reference, and LocalOptimizer against the daemon, over 8 steps."""
    lr = 0.01 if options.get("moment2_method") == "adamuon" else 0.05
    pair = Pair(remote_factory(endpoint, muon=dict(options, lr=lr)), TinyNet(seed=21),
                ref_muon=dict(options, lr=lr))
    local_model = clone_model(pair.model)
    local = muond.LocalOptimizer(muond.default_param_groups(local_model, muon=dict(options, lr=lr)))
    for step in range(1, 9):
        pair.step(step)
        loss_of(local_model, step).backward()
        local.step()
        local.zero_grad()
    errors = pair.errors()
    state = pair.opt.state_dict()["state"]
    pair.opt.close()
    assert max(errors.values()) < TOLERANCE, errors
    for (name, p), q in zip(pair.model.named_parameters(), local_model.parameters()):
        assert rel_err(p.detach(), q.detach()) < TOLERANCE, name
    if "moment2_method" in options:
        for i, p in enumerate(local.param_groups[0]["params"]):
            mine = local.state[p]["moment2"]
            assert state[i]["moment2"].shape == mine.shape
            assert rel_err(state[i]["moment2"], mine) < 1e-3


@pytest.mark.parametrize("coefficients", ["simple", "gram_polar_express"])
def test_local_gram_newton_schulz_matches_the_standard_map(coefficients):
    """LocalOptimizer's Gram path (with the set's restart) against its standard path."""
    tuples, after = opts.COEFFICIENT_SETS[coefficients], opts.COEFFICIENTS_AFTER[coefficients]
    g = torch.Generator().manual_seed(3)
    for shape in ((24, 64), (64, 24), (3, 16, 40)):
        u = torch.randn(*shape, generator=g)
        standard = newton_schulz(u, 5, tuples, after, 1e-7, 1.0)
        gram = newton_schulz(u, 5, tuples, after, 1e-7, 1.0,
                             gram_restarts=opts.GRAM_RESTARTS.get(coefficients, ()))
        assert (gram - standard).abs().max() < 1e-4, shape


def test_adaptive_muon_refusals(endpoint):
    model = TinyNet(seed=22)
    with pytest.raises(ValueError, match="'beta2' applies to a muon group only with a moment2_method"):
        muond.RemoteOptimizer(muond.default_param_groups(model, muon={"beta2": 0.9}), endpoint=endpoint)
    with pytest.raises(ValueError, match="option 'moment2_method' does not apply to optimizer 'adamw'"):
        muond.RemoteOptimizer(muond.default_param_groups(model, adamw={"moment2_method": "adamuon"}),
                              endpoint=endpoint)
    with pytest.raises(ValueError, match="weight_decay_mode cautious applies to muon only"):
        muond.RemoteOptimizer(muond.default_param_groups(model, adamw={"weight_decay_mode": "cautious"}),
                              endpoint=endpoint)
    with pytest.raises(ValueError, match="moment2_method must be one of"):
        muond.RemoteOptimizer(muond.default_param_groups(model, muon={"moment2_method": "adam"}),
                              endpoint=endpoint)
    # AdamW's eps given to the constructor does not leak into a Muon group without a second moment.
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, eps=1e-6) as opt:
        assert opt.param_groups[1]["eps"] == 1e-6


def test_adamw_options_map_through(endpoint):
    adamw = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    pair = Pair(remote_factory(endpoint, adamw=adamw), TinyNet(seed=5), ref_adamw=adamw)
    errors = run(pair, 8)
    assert max(errors.values()) < TOLERANCE, errors


def test_adam_with_coupled_l2_matches_the_reference_and_torch_adam(endpoint):
    """weight_decay_mode l2 on an AdamW group: Adam with coupled L2 (Megatron-Core's
    decoupled_weight_decay=False), against the fp64-free reference and against torch.optim.Adam."""
    adam = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "weight_decay_mode": "l2"}
    pair = Pair(remote_factory(endpoint, adamw=adam), TinyNet(seed=15), ref_adamw=adam)
    errors = run(pair, 8)
    assert max(errors.values()) < TOLERANCE, errors

    model = TinyNet(seed=16)
    twin = clone_model(model)
    groups = [dict(params=list(model.parameters()), optimizer="adamw", **adam)]
    with muond.RemoteOptimizer(groups, endpoint=endpoint) as opt:
        torch_adam = torch.optim.Adam(twin.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                                      weight_decay=0.1)
        for step in range(1, 6):
            for m, o in ((model, opt), (twin, torch_adam)):
                loss_of(m, step).backward()
                o.step()
                o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert rel_err(p.detach(), q.detach()) < TOLERANCE, name


def test_cubic5_takes_exactly_five_steps(endpoint):
    model = TinyNet(seed=18)
    with pytest.raises(ValueError, match="ns_steps must be 5 with ns_coefficients cubic5"):
        muond.RemoteOptimizer(muond.default_param_groups(model, muon={"ns_coefficients": "cubic5",
                                                                       "ns_steps": 6}), endpoint=endpoint)
    # The daemon refuses it too, naming the field, when a client skips the check.
    spec = pb.SessionSpec(groups=[pb.ParameterGroup(name="g", options=pb.GroupOptions(
        optimizer=pb.OPTIMIZER_MUON, ns_coefficients="cubic5", ns_steps=6))],
        parameters=[pb.ParameterSpec(name="w", shape=[4, 8], group="g")])
    conn = muond.Connection(endpoint)
    try:
        with pytest.raises(muond.MuondError, match="ns_steps must be 5 with ns_coefficients cubic5") as refused:
            conn.create_session("cubic5-six-steps", spec)
        assert "spec.groups[0].options" in str(refused.value)
    finally:
        conn.close()


def test_adamw_refuses_independent_decay(endpoint):
    model = TinyNet(seed=17)
    with pytest.raises(ValueError, match="weight_decay_mode independent applies to muon only"):
        muond.RemoteOptimizer([dict(params=list(model.parameters()), optimizer="adamw",
                                    weight_decay_mode="independent")], endpoint=endpoint)


def test_muon_with_aux_adam_style_groups(endpoint):
    # Keller Jordan's MuonWithAuxAdam group layout, keys and all.
    model = TinyNet(seed=6)
    hidden = [model.up.weight, model.down.weight]
    others = [p for n, p in model.named_parameters() if n not in ("up.weight", "down.weight")]
    groups = [dict(params=hidden, use_muon=True, lr=0.02, momentum=0.95, weight_decay=0.0),
              dict(params=others, use_muon=False, lr=3e-4, betas=(0.9, 0.95), eps=1e-10,
                   weight_decay=0.0)]
    with muond.RemoteOptimizer(groups, endpoint=endpoint) as opt:
        assert [g["optimizer"] for g in opt.param_groups] == ["muon", "adamw"]
        assert opt.param_groups[1]["betas"] == (0.9, 0.95)
        model(torch.arange(8)).sum().backward()
        opt.step()
        assert opt.last_step == 1


def test_local_optimizer_matches_daemon(endpoint):
    # The example's --compare-local baseline is the same optimizer as the daemon's.
    remote_model, local_model = TinyNet(seed=7), TinyNet(seed=7)
    make = lambda m: muond.default_param_groups(m, muon={"weight_decay": 0.02})  # noqa: E731
    remote = muond.RemoteOptimizer(make(remote_model), endpoint=endpoint)
    local = muond.LocalOptimizer(make(local_model))
    for step in range(1, 21):
        for model, opt in ((remote_model, remote), (local_model, local)):
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
    remote.close()
    errors = {n: rel_err(p.detach(), dict(local_model.named_parameters())[n].detach())
              for n, p in remote_model.named_parameters()}
    assert max(errors.values()) < 1e-3, errors


def test_local_optimizer_clips_and_skips_like_the_daemon(endpoint):
    remote_model, local_model = TinyNet(seed=9), TinyNet(seed=9)
    make = lambda m: muond.default_param_groups(m)  # noqa: E731
    remote = muond.RemoteOptimizer(make(remote_model), endpoint=endpoint, max_grad_norm=0.2)
    local = muond.LocalOptimizer(make(local_model), max_grad_norm=0.2)
    for step in range(1, 9):
        for model, opt in ((remote_model, remote), (local_model, local)):
            loss_of(model, step).backward()
            if step == 4:
                model.up.weight.grad.view(-1)[3] = float("nan")
            opt.step()
            opt.zero_grad()
        assert remote.last_info.applied == local.last_info.applied == (step != 4)
        assert remote.last_info.skip_reason == local.last_info.skip_reason
        if step != 4:
            assert abs(remote.last_info.grad_norm - local.last_info.grad_norm) < 1e-4 * remote.last_info.grad_norm
    remote.close()
    errors = {n: rel_err(p.detach(), dict(local_model.named_parameters())[n].detach())
              for n, p in remote_model.named_parameters()}
    assert max(errors.values()) < 1e-3, errors


def test_sgd_group_matches_torch_sgd(endpoint):
    model = TinyNet(seed=8)
    twin = TinyNet(seed=8)
    opt = muond.RemoteOptimizer(model.parameters(), endpoint=endpoint, optimizer="sgd", lr=0.1,
                                momentum=0.9, nesterov=True, weight_decay=0.01)
    ref = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                          weight_decay=0.01)
    for step in range(1, 9):
        for m, o in ((model, opt), (twin, ref)):
            loss_of(m, step).backward()
            o.step()
            o.zero_grad()
    opt.close()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert rel_err(p.detach(), q.detach()) < TOLERANCE, name


def test_local_sgd_with_heloco_matches_the_daemon(endpoint):
    """LocalOptimizer's HeLoCo (docs/algorithms.md, SGD, HeLoCo) against the daemon's, with a keep
    threshold high enough that gradients are reoriented or shrunk, not all kept: without the
    correction the same run ends elsewhere."""
    options = dict(optimizer="sgd", lr=0.1, momentum=0.9, nesterov=True, heloco=True,
                   heloco_keep_cosine=0.95)
    remote_model, local_model, plain_model = TinyNet(seed=8), TinyNet(seed=8), TinyNet(seed=8)
    remote = muond.RemoteOptimizer(remote_model.parameters(), endpoint=endpoint, **options)
    local = muond.LocalOptimizer([{"params": list(local_model.parameters()), **options}])
    plain = muond.LocalOptimizer([{"params": list(plain_model.parameters()), "heloco": False,
                                   **{k: v for k, v in options.items() if not k.startswith("heloco")}}])
    for step in range(1, 9):
        for model, opt in ((remote_model, remote), (local_model, local), (plain_model, plain)):
            loss_of(model, step).backward()
            opt.step()
            opt.zero_grad()
    remote.close()
    locals_ = dict(local_model.named_parameters())
    plains = dict(plain_model.named_parameters())
    for name, p in remote_model.named_parameters():
        assert rel_err(p.detach(), locals_[name].detach()) < TOLERANCE, name
    assert max(rel_err(locals_[n].detach(), plains[n].detach()) for n in locals_) > 100 * TOLERANCE


def test_heloco_keeps_the_gradient_against_a_momentum_decayed_to_subnormals(endpoint):
    """A parameter without gradients for many steps: its momentum decays to subnormals (0.5¹³⁵ is
    about 2e-41), which have no usable direction. HeLoCo keeps the next gradient there, on the
    daemon and in LocalOptimizer alike, and the step stays finite (docs/algorithms.md, SGD,
    HeLoCo), where scaling the momentum to the gradient's size would overflow fp32."""
    options = dict(optimizer="sgd", lr=0.1, momentum=0.5, heloco=True)
    start = torch.tensor([1.0, 2.0, 3.0, 4.0])
    remote_w, local_w = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    remote = muond.RemoteOptimizer([{"params": [remote_w], **options}], endpoint=endpoint)
    local = muond.LocalOptimizer([{"params": [local_w], **options}])
    gradients = [torch.tensor([1.0, 0.0, 0.0, 0.0])] + [torch.zeros(4)] * 135
    gradients.append(torch.tensor([0.0, 1.0, 0.0, 0.0]))  # orthogonal to the momentum's last direction
    for g in gradients:
        for w, opt in ((remote_w, remote), (local_w, local)):
            w.grad = g.clone()
            opt.step()
    counts = next(iter(remote.last_info.groups.values())).heloco
    remote.close()
    assert torch.isfinite(remote_w.detach()).all(), remote_w
    assert torch.equal(remote_w.detach(), local_w.detach())
    assert (counts.kept, counts.reoriented, counts.shrunk) == (1, 0, 0)


def test_a_step_with_momentum_0_in_a_heloco_group_is_refused_naming_momentum(endpoint):
    """Momentum 0 for one step (a scheduler's override) would leave the buffer as it is and HeLoCo
    turning gradients toward it: refused by the daemon naming `momentum`, with nothing changed (the
    same step with the momentum back goes through), and by LocalOptimizer before any change."""
    options = dict(optimizer="sgd", lr=0.1, momentum=0.9, heloco=True)
    remote_w, local_w = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    remote = muond.RemoteOptimizer([{"params": [remote_w], **options}], endpoint=endpoint)
    local = muond.LocalOptimizer([{"params": [local_w], **options}])
    for w, opt in ((remote_w, remote), (local_w, local)):
        w.grad = torch.tensor([1.0, 0.0, 0.0, 0.0])
        opt.step()
        opt.param_groups[0]["momentum"] = 0.0
        w.grad = torch.tensor([0.0, 1.0, 0.0, 0.0])
        before = w.detach().clone()
        with pytest.raises((muond.MuondError, ValueError), match="momentum: heloco needs momentum > 0"):
            opt.step()
        assert torch.equal(w.detach(), before)
        opt.param_groups[0]["momentum"] = 0.9
        opt.step()
    assert remote.last_step == local.last_step == 2
    remote.close()
    assert rel_err(remote_w.detach(), local_w.detach()) < TOLERANCE  # norms summed in another order


def test_lion_group_matches_design(endpoint):
    model = TinyNet(seed=9)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    exp_avg = {n: torch.zeros_like(p) for n, p in params.items()}
    lr, wd, (b1, b2) = 1e-3, 0.1, (0.9, 0.99)
    opt = muond.RemoteOptimizer(model.named_parameters(), endpoint=endpoint, optimizer="lion",
                                lr=lr, weight_decay=wd, betas=(b1, b2))
    for step in range(1, 6):
        loss_of(model, step).backward()
        for n, p in model.named_parameters():
            g = p.grad.detach()
            u = torch.sign(b1 * exp_avg[n] + (1 - b1) * g)
            params[n] = params[n] * (1 - lr * wd) - lr * u
            exp_avg[n] = b2 * exp_avg[n] + (1 - b2) * g
        opt.step()
        opt.zero_grad()
    opt.close()
    for n, p in model.named_parameters():
        assert rel_err(p.detach(), params[n]) < TOLERANCE, n


@pytest.mark.parametrize("split,query_groups", [((8, 4, 4), 2), ((16, 16, 16), 1)])
def test_fused_qkv_experts_and_conv_match_local(endpoint, split, query_groups):
    # The other shapes of docs/algorithms.md, Shapes: fused QKV orthogonalized block by block,
    # 3-D experts one by one, 4-D and 5-D convolution filters as (out, the rest). LocalOptimizer is checked
    # against the reference for matrices above; here it stands in for the reference.
    gen = torch.Generator().manual_seed(60)
    rows = sum(split) * query_groups
    shapes = {"qkv": (rows, 16), "experts": (3, 8, 12), "conv": (8, 3, 3, 3), "conv3d": (8, 4, 3, 3, 3)}
    remote_params = {n: torch.nn.Parameter(0.1 * torch.randn(*s, generator=gen))
                     for n, s in shapes.items()}
    local_params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in remote_params.items()}

    def groups(params):
        return [{"params": [("qkv", params["qkv"])], "qkv_split": split,
                 "num_query_groups": query_groups},
                {"params": [("experts", params["experts"]), ("conv", params["conv"]),
                            ("conv3d", params["conv3d"])]}]

    remote = muond.RemoteOptimizer(groups(remote_params), endpoint=endpoint)
    local = muond.LocalOptimizer(groups(local_params))
    for _ in range(4):
        for name, shape in shapes.items():
            g = torch.randn(*shape, generator=gen)
            remote_params[name].grad, local_params[name].grad = g.clone(), g.clone()
        remote.step()
        local.step()
    remote.close()
    for name in shapes:
        assert rel_err(remote_params[name].detach(), local_params[name].detach()) < TOLERANCE, name


@pytest.mark.parametrize("dim", [0, 1], ids=["row-blocks", "column-blocks"])
def test_tp_blockwise_muon_is_a_muon_per_block(endpoint, dim):
    """tp_blocks (Megatron-Core's muon_tp_mode = blockwise): each tensor-parallel shard is
    orthogonalized and scaled on its own shape. Momentum is element-wise, so the reference is the
    plain reference run on every block as a parameter of its own; LocalOptimizer agrees too."""
    model = TinyNet(seed=41)
    twin = clone_model(model)
    ref_params = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    muon = {"tp_blocks": 2, "tp_block_dim": dim, "lr": 0.05}
    opt = muond.RemoteOptimizer(muond.default_param_groups(model, muon=muon), endpoint=endpoint)
    local = muond.LocalOptimizer(muond.default_param_groups(twin, muon=muon))
    muon_names, adamw_names = (g["param_names"] for g in opt.param_groups)
    blocks = {n: torch.chunk(ref_params[n], 2, dim=dim) for n in muon_names}
    ref = Reference([
        {"kind": "muon", "params": [b for n in muon_names for b in blocks[n]], **dict(MUON_DEFAULTS, lr=0.05)},
        {"kind": "adamw", "params": [ref_params[n] for n in adamw_names], **ADAMW_DEFAULTS}])
    for step in range(1, 7):
        for m, o in ((model, opt), (twin, local)):
            loss_of(m, step).backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.detach().clone()
            if name in blocks:
                for block, g_block in zip(blocks[name], torch.chunk(g, 2, dim=dim)):
                    grads[id(block)] = g_block.contiguous()
            else:
                grads[id(ref_params[name])] = g
        opt.step()
        local.step()
        ref.step(grads)
        opt.zero_grad()
        local.zero_grad()
    opt.close()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert rel_err(p.detach(), ref_params[name]) < TOLERANCE, name
        assert rel_err(p.detach(), q.detach()) < TOLERANCE, name
    # Blocks that do not divide the dimension are refused before anything is sent, and by the
    # daemon naming the parameter when a client does not check.
    with pytest.raises(ValueError, match="tp_blocks 5 does not divide"):
        muond.RemoteOptimizer(muond.default_param_groups(TinyNet(seed=42), muon={"tp_blocks": 5}),
                              endpoint=endpoint)
    spec = pb.SessionSpec(groups=[pb.ParameterGroup(name="g", options=pb.GroupOptions(optimizer=pb.OPTIMIZER_MUON))],
                          parameters=[pb.ParameterSpec(name="w", shape=[6, 8], group="g", tp_blocks=4,
                                                       tp_block_dim=0)])
    conn = muond.Connection(endpoint)
    try:
        with pytest.raises(muond.MuondError, match=r"spec.parameters\[0\].tp_blocks: tp_blocks 4 does not divide"):
            conn.create_session("tp-refused", spec)
    finally:
        conn.close()
