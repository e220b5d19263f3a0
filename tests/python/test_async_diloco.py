"""Asynchronous DiLoCo (``muond.DiLoCo(..., sync_mode="async")``) against the real daemon: each
worker's pseudo-gradient is applied on arrival as the next global step, by delayed Nesterov (Liu et
al., arXiv 2401.09135) with the session's staleness scaling. Three workers, each its own rank of one
session, are driven from one thread in a pinned arrival order, and must equal, bit for bit, a
pure-torch reference of the same rule written here. Also: a push more than ``max_staleness``
behind is dropped and its worker takes the session's parameters; what asynchronous DiLoCo refuses,
naming the argument or option."""

import uuid

import pytest
import torch
import torch.nn.functional as F

import muond

from helpers import TinyNet, assert_bitwise, batch

SEED = 71
SIZES = (8, 16, 24)             # worker r's batch size
SYNC_EVERY = (2, 5, 3)          # worker r's inner steps between two of its pushes
INNER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
# The outer SGD asynchronous DiLoCo takes by default: DiLoCo's lr, and momentum 0.5 where
# synchronous DiLoCo has 0.9 (docs/diloco.md, Asynchronous outer steps, Outer momentum).
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.5
# The order in which the workers push: worker 1 (the slowest) pushes on bases 3 and 4 global steps
# old, worker 0 (the fastest) on bases 0 to 2 old.
ORDER = (0, 2, 0, 1, 0, 2, 0, 0, 1, 2, 0)


def backward(model, inner, rank: int, t: int) -> None:
    """Worker ``rank``'s gradients of its inner step ``t``, on its own data."""
    inner.zero_grad()
    x, y = batch(200 * rank + t, size=SIZES[rank])
    F.cross_entropy(model(x), y).backward()


def staleness_factor(scaling, s: int) -> float:
    if scaling is None:
        return 1.0
    kind, a = scaling
    assert kind == "polynomial"
    return (1.0 + s) ** -a


def heloco(g, m, opts, seen):
    """HeLoCo's correction (docs/algorithms.md, SGD, HeLoCo) of pseudo-gradient ``g`` against the
    momentum ``m`` before it: norms and cosine in fp64, the result a·g + b·m with fp32 factors;
    ``seen`` counts the cases taken."""
    g64, m64 = g.double().flatten(), m.double().flatten()
    gn, mn = g64.norm().item(), m64.norm().item()
    if gn == 0 or mn == 0:
        seen["kept"] += 1
        return g
    c = torch.dot(g64, m64).item() / (gn * mn)
    keep = opts["heloco_keep_cosine"]
    if c >= keep:
        seen["kept"] += 1
        return g
    conf = gn / (gn + opts["heloco_kappa"] * mn + 1e-12)
    if c < 0:
        seen["shrunk"] += 1
        beta = min(opts["heloco_shrink"] * -c * conf, opts["heloco_shrink_max"])
        a, b = 1.0, -beta * c * gn / mn
    else:
        seen["reoriented"] += 1
        lam = min(opts["heloco_reorient"] * (keep - c) * conf, 1.0)
        u = ((1 - lam) ** 2 + lam ** 2 + 2 * lam * (1 - lam) * c) ** 0.5
        a, b = (1 - lam) / u, lam * gn / (mn * u)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return g * f32(a) + m * f32(b)


class DelayedNesterov:
    """The reference rule (docs/algorithms.md, SGD, delayed Nesterov), one arrival at a time, N =
    ``delay``, c = ``activation``, β the momentum, η the push's lr (the group's times its staleness
    factor), t the arrivals before this one:
        D ← D + g
        (t + 1) mod N = 0:  m ← β·m + D/N;  W ← W − η(1 − cN + c)β·m − (η/N)·g;  D ← 0
        otherwise:          W ← W − ηcβ·m − (η/N)·g
    every product rounded to fp32 before the sum it enters (each factor an fp32 number)."""

    def __init__(self, delay: int, activation: float, heloco_options=None):
        self.delay, self.activation, self.t = delay, activation, 0
        self.m, self.sums = {}, {}
        self.heloco = heloco_options  # with HeLoCo: each g corrected against m first
        self.seen = {"kept": 0, "reoriented": 0, "shrunk": 0}

    def __call__(self, weights, grads, lr: float) -> None:
        n, c, beta = self.delay, self.activation, OUTER_MOMENTUM
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
        boundary = (self.t + 1) % n == 0
        for name, g in grads.items():
            m = self.m.setdefault(name, torch.zeros_like(g))
            d = self.sums.setdefault(name, torch.zeros_like(g))
            if self.heloco is not None:
                g = heloco(g, m, self.heloco, self.seen)
            d = d + g
            w = weights[name]
            if boundary:
                m = d * f32(1.0 / n) + m * f32(beta)
                w = w + m * f32(-lr * (1.0 - c * n + c) * beta)
            elif c != 0:
                w = w + m * f32(-lr * c * beta)
            w = w + g * f32(-lr / n)
            self.m[name] = m
            self.sums[name] = torch.zeros_like(g) if boundary else d
            weights[name] = w
        self.t += 1


def reference(order, delay, activation, scaling, max_staleness=None, heloco_options=None):
    """Pure-torch asynchronous DiLoCo over ``order``: returns each worker's local parameters, the
    global parameters, and the pushes dropped as too stale (rank, staleness); with
    ``heloco_options``, also the count of each HeLoCo case."""
    init = TinyNet(seed=SEED)
    weights = {n: p.detach().clone() for n, p in init.named_parameters()}
    outer = DelayedNesterov(delay, activation, heloco_options)
    models, inners, bases, base_weights, steps = [], [], [], [], []
    for r in range(3):
        model = TinyNet(seed=SEED)
        models.append(model)
        inners.append(torch.optim.AdamW(model.parameters(), **INNER))
        bases.append(0)
        base_weights.append({n: w.clone() for n, w in weights.items()})
        steps.append(0)
    global_step, dropped = 0, []
    for r in order:
        model = models[r]
        for _ in range(SYNC_EVERY[r]):
            steps[r] += 1
            backward(model, inners[r], r, steps[r])
            inners[r].step()
        staleness = global_step - bases[r]
        if max_staleness is not None and staleness > max_staleness:
            dropped.append((r, staleness))
        else:
            grads = {n: base_weights[r][n] - p.detach() for n, p in model.named_parameters()}
            outer(weights, grads, OUTER_LR * staleness_factor(scaling, staleness))
            global_step += 1
        bases[r] = global_step
        base_weights[r] = {n: w.clone() for n, w in weights.items()}
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])
    locals_ = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]
    if heloco_options is not None:
        return locals_, weights, dropped, outer.seen
    return locals_, weights, dropped


def run(endpoint, order, delay=None, activation=0.0, scaling=None, max_staleness=8, after=None,
        outer_options=None, **options):
    """The same run through muond: three DiLoCo workers of one asynchronous session;
    ``after(i)`` runs after the i-th push (from 1)."""
    session = f"async-diloco-{uuid.uuid4().hex[:12]}"
    outer = dict(outer_options or {})
    if activation:
        outer["momentum_activation"] = activation
    if delay is not None:
        outer["nesterov_delay"] = delay
    async_options = dict(max_staleness=max_staleness, **options)
    if scaling is not None:
        async_options["staleness_scaling"] = scaling
    workers = []
    for r in range(3):
        model = TinyNet(seed=SEED)
        inner = torch.optim.AdamW(model.parameters(), **INNER)
        workers.append((model, muond.DiLoCo(model, inner, sync_every=SYNC_EVERY[r], outer=outer,
                                           endpoint=endpoint, session=session, world_size=3,
                                           rank=r, sync_mode="async", **async_options)))
    steps = [0, 0, 0]
    infos = []
    for i, r in enumerate(order, 1):
        model, diloco = workers[r]
        for _ in range(SYNC_EVERY[r]):
            steps[r] += 1
            backward(model, diloco.inner, r, steps[r])
            diloco.step(tokens=SIZES[r])  # the inner step, and the push after the last
        infos.append(diloco.last_info)
        if after is not None:
            after(i)
    result = ([{n: p.detach().clone() for n, p in m.named_parameters()} for m, _ in workers],
              {n: g.clone() for n, g in workers[0][1].global_parameters().items()}, infos,
              [d.remote.param_groups for _, d in workers])
    for _, diloco in workers:
        diloco.close()
    return result


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("delay,activation,scaling", [
    (None, 0.0, None),                  # N = the number of workers (3), c = 0
    (2, 0.25, ("polynomial", 0.5)),     # momentum activation and a staleness correction
])
def test_pushes_in_a_pinned_order_equal_the_delayed_nesterov_reference(endpoint, delay, activation,
                                                                      scaling):
    locals_, globals_, infos, groups = run(endpoint, ORDER, delay, activation, scaling)
    want_locals, want_globals, dropped = reference(ORDER, 3 if delay is None else delay,
                                                   activation, scaling)
    assert dropped == []
    assert groups[0][0]["nesterov_delay"] == (3 if delay is None else delay)
    # Every push was applied as the next global step, at the staleness the order gives it.
    assert [i.global_step for i in infos] == list(range(1, len(ORDER) + 1))
    stalenesses = [i.staleness for i in infos]
    assert stalenesses == [0, 1, 1, 3, 1, 3, 1, 0, 4, 3, 2]
    assert_bitwise(globals_, want_globals, "global parameters")
    for r in range(3):
        assert_bitwise(locals_[r], want_locals[r], f"worker {r}'s parameters")


def test_heloco_corrects_the_pushes_as_the_reference_does(endpoint):
    """HeLoCo on the outer SGD (docs/algorithms.md, SGD, HeLoCo): each pseudo-gradient is corrected
    against the outer momentum before delayed Nesterov takes it. The pinned order against the
    reference, which counts the cases: the pushes after the first momentum update are reoriented or
    shrunk, so the run differs from the uncorrected one, and the answers count the cases as the
    reference takes them. Not bit for bit: the daemon sums the norms
    and the dot product in element order, torch in its own, so a factor can differ in its last fp32
    bit; the tolerance is a few fp32 ulps of the weights (all of order 1)."""
    opts = dict(heloco=True, heloco_keep_cosine=0.9, heloco_shrink=1.0, heloco_shrink_max=1.0,
                heloco_reorient=1.0, heloco_kappa=1.0)
    locals_, globals_, infos, groups = run(endpoint, ORDER, outer_options=opts)
    want_locals, want_globals, dropped, seen = reference(ORDER, 3, 0.0, None, heloco_options=opts)
    _, plain_globals, _ = reference(ORDER, 3, 0.0, None)
    assert dropped == [] and groups[0][0]["heloco"] is True
    assert seen["reoriented"] + seen["shrunk"] > 0, seen
    # Each push's answer counts its parameters in each case, as the reference took them.
    counted = {"kept": 0, "reoriented": 0, "shrunk": 0}
    for info in infos:
        for group in info.groups.values():
            for case in counted:
                counted[case] += getattr(group.heloco, case)
    assert counted == seen
    assert any(not torch.equal(want_globals[n], plain_globals[n]) for n in want_globals)
    for name, want in want_globals.items():
        torch.testing.assert_close(globals_[name], want, rtol=0, atol=1e-6)
    for r in range(3):
        for name, want in want_locals[r].items():
            torch.testing.assert_close(locals_[r][name], want, rtol=0, atol=1e-6)


def test_a_push_too_stale_is_dropped_and_its_worker_takes_the_session_parameters(endpoint):
    """max_staleness 2: the pushes of workers 1 and 2 that are 3 or more global steps behind are
    dropped (nothing applied, the delayed Nesterov count unchanged); each such worker drops its
    local progress, takes the session's latest parameters and goes on from them."""
    locals_, globals_, infos, _ = run(endpoint, ORDER, max_staleness=2)
    want_locals, want_globals, dropped = reference(ORDER, 3, 0.0, None, max_staleness=2)
    assert dropped and all(s > 2 for _, s in dropped)
    stale = [(ORDER[i], info.staleness) for i, info in enumerate(infos) if info.stale]
    assert stale == dropped
    assert all(not info.applied for info in infos if info.stale)
    assert_bitwise(globals_, want_globals, "global parameters")
    for r in range(3):
        assert_bitwise(locals_[r], want_locals[r], f"worker {r}'s parameters")


def test_asynchronous_outer_sgd_defaults_to_momentum_one_half(endpoint):
    """Asynchronously an outer SGD group's momentum defaults to 0.5 (0.9 in lock-step), with
    nesterov_delay the number of workers; a momentum the caller gives is kept."""
    assert muond.diloco.ASYNC_OUTER_MOMENTUM == OUTER_MOMENTUM
    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters())
    common = dict(sync_every=4, endpoint=endpoint, world_size=2, rank=0)
    for outer, sync_mode, want in ((None, "async", (0.7, 0.5, True, 2)),
                                   ("sgd", "async", (0.7, 0.5, True, 2)),
                                   ({"lr": 0.4}, "async", (0.4, 0.5, True, 2)),
                                   ({"momentum": 0.9, "nesterov_delay": 3}, "async", (0.7, 0.9, True, 3)),
                                   (None, "lockstep", (0.7, 0.9, True, 1))):
        options = {"max_staleness": 4} if sync_mode == "async" else {}
        with muond.DiLoCo(model, inner, outer=outer, sync_mode=sync_mode,
                          session=f"defaults-{uuid.uuid4().hex[:8]}", **common, **options) as diloco:
            (group,) = diloco.remote.param_groups
            got = (group["lr"], group["momentum"], group["nesterov"], group.get("nesterov_delay", 1))
            assert (group["optimizer"], *got) == ("sgd", *want), (outer, sync_mode)


def test_what_asynchronous_diloco_refuses_is_named(endpoint):
    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters())
    common = dict(sync_every=4, endpoint=endpoint, sync_mode="async", max_staleness=4)
    with pytest.raises(ValueError, match="fragments: asynchronous DiLoCo syncs every parameter"):
        muond.DiLoCo(model, inner, fragments=2, world_size=2, rank=0, **common)
    with pytest.raises(ValueError, match="world_size: asynchronous DiLoCo needs the number of "
                                         "workers"):
        muond.DiLoCo(model, inner, **common)
    for outer, words in (({"nesterov_delay": 3, "momentum_activation": 0.5},
                          "momentum_activation must be at most 1/nesterov_delay"),
                         ({"nesterov_delay": 2, "weight_decay": 0.1},
                          "nesterov_delay > 1 takes none"),
                         ({"nesterov_delay": 2, "nesterov": False},
                          "nesterov_delay > 1 needs nesterov"),
                         ({"nesterov_delay": 0}, "nesterov_delay")):
        with pytest.raises((ValueError, muond.MuondError), match=words):
            muond.DiLoCo(model, inner, outer=outer, world_size=2, rank=0,
                         session=f"refused-{uuid.uuid4().hex[:8]}", **common)
    with muond.DiLoCo(model, inner, world_size=1, rank=0, **common) as diloco:
        state = diloco.state_dict()
        with pytest.raises(ValueError, match="load_state_dict: an asynchronous DiLoCo worker"):
            diloco.load_state_dict(state)


def test_pushes_through_a_crash_and_a_restart_equal_the_reference(start_daemon, tmp_path):
    """The daemon is killed after push 4 (its journal has the pushes, the delayed-Nesterov buffer
    among the state) and stopped cleanly after push 8 (a checkpoint); the workers' next pushes
    ride over each restart. Nothing is lost or applied twice: the run equals the reference."""
    flags = ("--state-dir", tmp_path / "state", "--durability", "journal")
    daemon = start_daemon(*flags)

    def restart(i):
        nonlocal daemon
        if i not in (4, 8):
            return
        if i == 4:
            daemon.kill()
        else:
            assert daemon.stop() == 0
        daemon = start_daemon(*flags, listen=daemon.endpoint, workdir=daemon.workdir)
        # The restarted daemon holds the session at push i, from its journal or its checkpoint.
        conn = muond.Connection(daemon.endpoint)
        try:
            recovered.append([(s.session_id.startswith("async-diloco-"), s.last_step)
                              for s in conn.list_sessions()])
        finally:
            conn.close()

    recovered = []
    locals_, globals_, infos, _ = run(daemon.endpoint, ORDER, after=restart, max_step_attempts=30,
                                      retry_backoff=0.05)
    want_locals, want_globals, _ = reference(ORDER, 3, 0.0, None)
    assert [i.global_step for i in infos] == list(range(1, len(ORDER) + 1))
    assert recovered == [[(True, 4)], [(True, 8)]]
    assert_bitwise(globals_, want_globals, "global parameters")
    for r in range(3):
        assert_bitwise(locals_[r], want_locals[r], f"worker {r}'s parameters")

