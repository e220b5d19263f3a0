"""QK-clip (MuonClip) from the Python client, against the real daemon.

The reference is the formula of docs/algorithms.md, QK-clip, written here in fp64: after the
update, every head h of a pair whose max logit S_h exceeds τ has its query rows multiplied by γ^α
and its key rows by γ^(1−α), γ = τ/S_h; τ and α come from the query's group. With lr 0 the Muon
update changes nothing, so a step's answer is the clip alone.
"""

import math

import grpc
import pytest
import torch

import muond

H = 4  # heads of every pair below


def reference_clip(query, key, max_logits, tau, alpha):
    """The QK-clip of docs/algorithms.md in fp64; returns new (query, key)."""
    q, k = query.detach().double().clone(), key.detach().double().clone()
    for weight, exponent in ((q, alpha), (k, 1 - alpha)):
        rows = weight.shape[0] // len(max_logits)
        for h, s in enumerate(max_logits):
            if math.isfinite(s) and s > tau and s > 0:
                weight[h * rows:(h + 1) * rows] *= (tau / s) ** exponent
    return q, k


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def attention_params(seed=0):
    """Two pairs: (wq0, wk0) with head dims 3 and 2, (wq1, wk1) with head dim 2; width 8."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"wq0": (H * 3, 8), "wk0": (H * 2, 8), "wq1": (H * 2, 8), "wk1": (H * 2, 8)}
    return {n: torch.randn(*s, generator=gen).requires_grad_() for n, s in shapes.items()}


def groups_of(params, lr):
    # wq0's group sets τ and α; its key wk0 sits in a group with the defaults (τ 100, α 0.5), so
    # pair 0 shows that the query's group decides. Pair 1 uses the defaults.
    return [{"name": "q0", "params": [("wq0", params["wq0"])], "lr": lr,
             "qk_clip_threshold": 10.0, "qk_clip_alpha": 0.3},
            {"name": "rest", "params": [(n, params[n]) for n in ("wk0", "wq1", "wk1")],
             "lr": lr}]


def pairs_of(params):
    return [(params["wq0"], params["wk0"], H), (params["wq1"], params["wk1"], H)]


def set_grads(params, step, nan=False):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen)
    if nan:
        params["wk1"].grad[0, 0] = float("nan")


# S_h per pair: pair 0 (τ 10): heads 1 and 3 above, head 2 exactly at τ (untouched), head 0 below;
# pair 1 (τ 100): head 2 above, a non-finite and a negative logit (both untouched).
LOGITS0 = [5.0, 40.0, 10.0, 12.5]
LOGITS1 = [50.0, float("inf"), 400.0, -300.0]


def test_lr0_step_is_the_clip_of_design_md(endpoint):
    params = attention_params()
    before = {n: p.detach().clone() for n, p in params.items()}
    set_grads(params, 1)
    with muond.RemoteOptimizer(groups_of(params, lr=0.0), endpoint=endpoint,
                               qk_clip=pairs_of(params)) as opt:
        opt.step(qk_logits={params["wq0"]: torch.tensor(LOGITS0), params["wq1"]: LOGITS1})
        assert opt.last_info.applied
        got = {n: p.detach().clone() for n, p in params.items()}

    q0, k0 = reference_clip(before["wq0"], before["wk0"], LOGITS0, tau=10.0, alpha=0.3)
    q1, k1 = reference_clip(before["wq1"], before["wk1"], LOGITS1, tau=100.0, alpha=0.5)
    for name, want in (("wq0", q0), ("wk0", k0), ("wq1", q1), ("wk1", k1)):
        # One fp32 scaling per element by a factor computed with pow: ≤ 2 fp32 roundings, ≲ 1.2e-7
        # relative; a wrong exponent (alpha against 1 − alpha) is off by percents.
        err = rel_err(got[name], want)
        assert err < 1e-6, (name, err)

    # Heads at or below τ, or with unusable logits, are untouched bit for bit.
    for name, untouched in (("wq0", (0, 2)), ("wk0", (0, 2)), ("wq1", (0, 1, 3)),
                            ("wk1", (0, 1, 3))):
        rows = params[name].shape[0] // H
        for h in untouched:
            assert torch.equal(got[name][h * rows:(h + 1) * rows],
                               before[name][h * rows:(h + 1) * rows]), (name, h)
    # α = 0.3 from the query's group: query rows of head 1 scaled by (1/4)^0.3, key rows by
    # (1/4)^0.7 — not the key group's α 0.5.
    ratio_q = (got["wq0"][3:6] / before["wq0"][3:6]).double()
    ratio_k = (got["wk0"][2:4] / before["wk0"][2:4]).double()
    assert torch.allclose(ratio_q, torch.full_like(ratio_q, 0.25 ** 0.3), rtol=1e-6)
    assert torch.allclose(ratio_k, torch.full_like(ratio_k, 0.25 ** 0.7), rtol=1e-6)


def test_normal_steps_match_local_optimizer(endpoint):
    remote_params, local_params = attention_params(seed=1), attention_params(seed=1)
    remote = muond.RemoteOptimizer(groups_of(remote_params, lr=0.02), endpoint=endpoint,
                                   qk_clip=pairs_of(remote_params))
    local = muond.LocalOptimizer(groups_of(local_params, lr=0.02),
                                 qk_clip=pairs_of(local_params))
    try:
        for step, (l0, l1) in enumerate([(LOGITS0, LOGITS1), ([11.0, 9.0, 30.0, 1.0], None),
                                         ([1.0] * H, [150.0, 99.0, 100.0, 1e4])], start=1):
            for opt, params in ((remote, remote_params), (local, local_params)):
                set_grads(params, step)
                logits = {params["wq0"]: l0}
                if l1 is not None:
                    logits["wq1"] = l1  # by name works too
                opt.step(qk_logits=logits)
        assert remote.last_info.applied
        for name in remote_params:  # fp32 in another order; see test_equivalence's derivation
            err = rel_err(remote_params[name], local_params[name])
            assert err < 1e-5, (name, err)
    finally:
        remote.close()


def test_local_optimizer_lr0_step_is_the_clip():
    params = attention_params(seed=2)
    before = {n: p.detach().clone() for n, p in params.items()}
    set_grads(params, 1)
    opt = muond.LocalOptimizer(groups_of(params, lr=0.0), qk_clip=pairs_of(params))
    opt.step(qk_logits={params["wq0"]: LOGITS0})
    q0, k0 = reference_clip(before["wq0"], before["wk0"], LOGITS0, tau=10.0, alpha=0.3)
    assert rel_err(params["wq0"], q0) < 1e-6 and rel_err(params["wk0"], k0) < 1e-6
    assert torch.equal(params["wq1"].detach(), before["wq1"])  # no logits: not clipped


def test_pair_whose_rows_do_not_split_into_heads_is_refused(endpoint):
    params = attention_params()
    with pytest.raises(muond.MuondError) as info:
        muond.RemoteOptimizer(groups_of(params, lr=0.0), endpoint=endpoint,
                              qk_clip=[(params["wq0"], params["wk0"], 5)])  # 12 rows, 5 heads
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.qk_clip[0].num_heads" in info.value.details, info.value.details
    with pytest.raises(ValueError, match=r"qk_clip\[0\].num_heads"):
        muond.LocalOptimizer(groups_of(params, lr=0.0),
                             qk_clip=[(params["wq0"], params["wk0"], 5)])


def test_a_skipped_step_does_not_clip(endpoint):
    params = attention_params()
    set_grads(params, 1, nan=True)
    before = {n: p.detach().clone() for n, p in params.items()}
    with muond.RemoteOptimizer(groups_of(params, lr=0.0), endpoint=endpoint,
                               qk_clip=pairs_of(params)) as opt:
        opt.step(qk_logits={params["wq0"]: LOGITS0, params["wq1"]: LOGITS1})
        assert not opt.last_info.applied
        assert "non-finite" in opt.last_info.skip_reason
        for name, p in params.items():
            assert torch.equal(p.detach(), before[name]), name
        # The next step, with finite gradients, does clip.
        set_grads(params, 2)
        opt.step(qk_logits={params["wq0"]: LOGITS0})
        assert opt.last_info.applied and opt.last_step == 2
        assert not torch.equal(params["wq0"].detach(), before["wq0"])


def test_bad_logits_are_refused_before_anything_is_sent(endpoint):
    params = attention_params()
    stranger = torch.zeros(H, 8, requires_grad=True)
    with muond.RemoteOptimizer(groups_of(params, lr=0.0), endpoint=endpoint,
                               qk_clip=pairs_of(params)) as opt:
        for logits, message in (
                ({stranger: [1.0] * H}, "not a parameter of this optimizer"),
                ({params["wk0"]: [1.0] * H}, "'wk0' is not the query of a qk_clip pair"),
                ({"nope": [1.0] * H}, "no parameter named 'nope'"),
                ({params["wq0"]: [50.0] * (H - 1)}, r"expected 4 values \(one per head\), got 3"),
                ({params["wq0"]: torch.ones(H, 1)}, "1-D tensor"),
                ({params["wq0"]: [50.0] * H, "wq0": [50.0] * H}, "given twice")):
            with pytest.raises(ValueError, match=message):
                opt.step(qk_logits=logits)
        assert opt.last_step == 0  # nothing reached the daemon
        opt.step()  # a step without logits clips nothing
        assert opt.last_step == 1
    for name, p in params.items():
        assert torch.equal(p.detach(), attention_params()[name].detach()), name


def test_bad_pairs_are_refused_at_construction():
    params = attention_params()
    stranger = torch.zeros(H, 8, requires_grad=True)
    # Found before connecting: no daemon is needed at this endpoint.
    for qk_clip, error, message in (
            ([(stranger, params["wk0"], H)], ValueError, r"qk_clip\[0\].query: .* not a param"),
            ([(params["wq0"], "nope", H)], ValueError, r"qk_clip\[0\].key: no parameter"),
            ([(params["wq0"], params["wk0"], 2.5)], TypeError, r"qk_clip\[0\].num_heads"),
            ((params["wq0"], params["wk0"], H), TypeError, "wrap a single pair in a list")):
        for make in (muond.LocalOptimizer,
                     lambda g, **kw: muond.RemoteOptimizer(g, endpoint="127.0.0.1:1", **kw)):
            with pytest.raises(error, match=message):
                make(groups_of(params, lr=0.0), qk_clip=qk_clip)


def test_closure_may_fill_in_the_logits(endpoint):
    params = attention_params()
    before = {n: p.detach().clone() for n, p in params.items()}
    logits = {}

    def closure():
        set_grads(params, 1)
        logits[params["wq0"]] = LOGITS0  # as a forward pass that records its max logits would
        return 1.5

    with muond.RemoteOptimizer(groups_of(params, lr=0.0), endpoint=endpoint,
                               qk_clip=pairs_of(params)) as opt:
        assert opt.step(closure, qk_logits=logits) == 1.5
    q0, _ = reference_clip(before["wq0"], before["wk0"], LOGITS0, tau=10.0, alpha=0.3)
    assert rel_err(params["wq0"], q0) < 1e-6


def test_pairs_are_part_of_the_session_spec(endpoint):
    params = attention_params()
    session = "qk-clip-attach"
    first = muond.RemoteOptimizer(groups_of(params, lr=0.0), endpoint=endpoint, session=session,
                                  qk_clip=pairs_of(params))
    try:
        first.close(keep_session=True)
        with pytest.raises(muond.MuondError) as info:
            muond.RemoteOptimizer(groups_of(params, lr=0.0), endpoint=endpoint, session=session)
        assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
        again = muond.RemoteOptimizer(groups_of(params, lr=0.0), endpoint=endpoint,
                                      session=session, qk_clip=pairs_of(params))
        assert again.attached
        again.close()
    except BaseException:
        conn = muond.Connection(endpoint)  # leave no session behind on the shared daemon
        try:
            conn.close_session(session)
        except muond.MuondError:
            pass
        finally:
            conn.close()
        raise


def test_mla_clips_nope_and_rope_parts_as_kimi_k2(endpoint):
    """Multi-head latent attention (Kimi K2's MuonClip Algorithm 1): per clipped head, q_nope and
    k_nope are scaled by √γ (α 0.5), q_rope by γ, v rows and every unclipped head not at all."""
    dn, dr, dv = 3, 2, 4
    gen = torch.Generator().manual_seed(7)
    params = {"wq": torch.randn(H * (dn + dr), 8, generator=gen).requires_grad_(),
              "wkv": torch.randn(H * (dn + dv), 8, generator=gen).requires_grad_()}
    before = {n: p.detach().clone().double() for n, p in params.items()}
    layout = {"qk_nope_head_dim": dn, "qk_rope_head_dim": dr, "v_head_dim": dv}
    logits = [5.0, 400.0, 100.0, 250.0]  # τ 100: heads 1 and 3 clipped
    twin = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    for p in list(params.values()) + list(twin.values()):
        p.grad = torch.zeros_like(p)
    groups = [{"params": [(n, p)], "lr": 0.0} for n, p in params.items()]
    with muond.RemoteOptimizer(groups, endpoint=endpoint,
                               qk_clip=[(params["wq"], params["wkv"], H, layout)]) as opt:
        opt.step(qk_logits={params["wq"]: logits})
    local = muond.LocalOptimizer([{"params": [(n, p)], "lr": 0.0} for n, p in twin.items()],
                                 qk_clip=[("wq", "wkv", H, layout)])
    local.step(qk_logits={"wq": logits})

    want_q, want_k = before["wq"].clone(), before["wkv"].clone()
    for h, s in enumerate(logits):
        if s <= 100.0:
            continue
        gamma = 100.0 / s
        q0, k0 = h * (dn + dr), h * (dn + dv)
        want_q[q0:q0 + dn] *= math.sqrt(gamma)       # q_nope
        want_q[q0 + dn:q0 + dn + dr] *= gamma        # q_rope
        want_k[k0:k0 + dn] *= math.sqrt(gamma)       # k_nope; v rows untouched
    for name, want in (("wq", want_q), ("wkv", want_k)):
        assert rel_err(params[name].detach(), want) < 1e-6, name
        assert rel_err(twin[name].detach(), want) < 1e-6, name
    # v rows of a clipped head, and unclipped heads, are untouched bit for bit.
    k1 = 1 * (dn + dv)
    assert torch.equal(params["wkv"].detach()[k1 + dn:k1 + dn + dv], before["wkv"][k1 + dn:k1 + dn + dv].float())
    assert torch.equal(params["wq"].detach()[:dn + dr], before["wq"][:dn + dr].float())


def test_mla_layout_that_does_not_fit_is_refused(endpoint):
    gen = torch.Generator().manual_seed(8)
    wq = torch.randn(H * 5, 8, generator=gen).requires_grad_()
    wkv = torch.randn(H * 6, 8, generator=gen).requires_grad_()  # 6 rows a head, not 3 + 4
    layout = {"qk_nope_head_dim": 3, "qk_rope_head_dim": 2, "v_head_dim": 4}
    with pytest.raises(muond.MuondError, match=r"qk_clip\[0\]\.mla: 'wkv' has 24 rows \(4 heads of 6\); the MLA layout"):
        muond.RemoteOptimizer([{"params": [("wq", wq), ("wkv", wkv)]}], endpoint=endpoint,
                              qk_clip=[(wq, wkv, H, layout)])
    with pytest.raises(ValueError, match=r"qk_clip\[0\]\.mla: 'wkv' has 24 rows \(4 heads of 6\); the MLA layout"):
        muond.LocalOptimizer([{"params": [("wq", wq), ("wkv", wkv)]}], qk_clip=[(wq, wkv, H, layout)])
    with pytest.raises(ValueError, match="qk_nope_head_dim must be >= 1"):
        muond.LocalOptimizer([{"params": [("wq", wq), ("wkv", wkv)]}],
                             qk_clip=[(wq, wkv, H, {"qk_nope_head_dim": 0})])


def test_bf16_masters_are_clipped_then_rounded(endpoint):
    """QK-clip on 16-bit masters scales them in fp32 and rounds the result as it stores it: the
    answer is the reference clip of the stored (rounded) weights, rounded to bf16 again."""
    params = attention_params(seed=3)
    set_grads(params, 1)
    groups = groups_of(params, lr=0.0)
    for group in groups:
        group["master_dtype"] = "bf16"
    with muond.RemoteOptimizer(groups, endpoint=endpoint, qk_clip=pairs_of(params)) as opt:
        stored = {n: p.detach().clone() for n, p in params.items()}  # the masters as uploaded
        assert all(torch.equal(t, t.to(torch.bfloat16).float()) for t in stored.values())
        opt.step(qk_logits={params["wq0"]: LOGITS0})
        assert opt.last_info.applied
    q0, k0 = reference_clip(stored["wq0"], stored["wk0"], LOGITS0, tau=10.0, alpha=0.3)
    for name, want in (("wq0", q0), ("wk0", k0)):
        got = params[name].detach()
        assert torch.equal(got, got.to(torch.bfloat16).float()), name  # stored in bf16
        # One bf16 rounding of the fp32 clip (the reference's pow is fp64, the daemon's scale fp32).
        assert (got - want.to(torch.bfloat16).float()).abs().max() <= 2 ** -7 * want.abs().max(), name
    assert torch.equal(params["wq1"].detach(), stored["wq1"])  # no logits: not clipped


def test_two_ranks_clip_by_the_largest_logit_either_saw(endpoint):
    # Each rank's max logits are over its own tokens; MuonClip wants the maximum over the batch.
    # Two ranks with different logits (one giving pair 1 alone) equal one rank giving, per head,
    # the larger finite value: pair 0 from both, pair 1 from rank 1 only.
    import threading
    rank_logits = [{"wq0": [5.0, 40.0, 10.0, 12.5]},
                   {"wq0": [30.0, 20.0, float("inf"), 8.0], "wq1": [50.0, 400.0, 1.0, -3.0]}]
    merged = {"wq0": [30.0, 40.0, 10.0, 12.5], "wq1": [50.0, 400.0, 1.0, -3.0]}

    def run(world, logits_of_rank, session):
        results, errors = [None] * world, []

        def rank_main(rank):
            try:
                params = attention_params()
                set_grads(params, 1)
                with muond.RemoteOptimizer(groups_of(params, lr=0.0), endpoint=endpoint,
                                           session=session, world_size=world, rank=rank,
                                           qk_clip=pairs_of(params)) as opt:
                    opt.step(qk_logits={params[q]: v for q, v in logits_of_rank[rank].items()})
                results[rank] = {n: p.detach().clone() for n, p in params.items()}
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        return results

    two = run(2, rank_logits, "qk-two-ranks")
    one = run(1, [merged], "qk-one-rank")
    for name in ("wq0", "wk0", "wq1", "wk1"):
        assert torch.equal(two[0][name], one[0][name]), name
        assert torch.equal(two[1][name], one[0][name]), name
    assert not torch.equal(one[0]["wq1"], attention_params()["wq1"]), "pair 1 was clipped"
