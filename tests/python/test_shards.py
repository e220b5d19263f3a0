"""A session spread over several real daemons (``RemoteOptimizer(endpoints=[...])``).

Sharded training must be the one-daemon training — bit for bit on the CPU backend, within SAME_BOUND
on the CUDA backend (see there): the same parameters, optimizer state, gradient norms and skips
after every step — with Muon and AdamW groups, global clipping, a
non-finite step, QK-clip, a learning-rate scheduler and two data-parallel ranks — and it must stay so when a shard is killed
with SIGKILL (journal mode) and restarted, even between its prepare and its commit. A different
endpoint list for an existing session, and shards restored to different steps, are refused.
"""

import os
import uuid

import grpc
import pytest
import torch

import muond
from muond import placement
from muond._stubs import pb

from helpers import run_ranks

HEADS = 2

# How closely sharded training follows one daemon's, per backend. The CPU backend computes each
# matrix's Newton–Schulz products alone whatever else is in the batch, so the shards' results are
# bit-identical (None: compared with torch.equal / ==). The CUDA backend multiplies a batch of
# same-shaped matrices in one cuBLAS strided-batched GEMM, and cuBLAS may choose another algorithm
# (another order of the k ≤ 48 products of each dot product) for another batch count: one daemon
# batches wq, wk and wv together, a shard may hold one of them alone. Each fp32 GEMM then differs
# by at most 2·k·2⁻²⁴ ≈ 6e-6 of Σ|a||b|, and a Newton–Schulz call is 15 GEMMs (5 iterations of 3):
# about 1e-4 of an update's norm. The iteration's slope (≤ 3.45 at 0 for the default
# coefficients) can grow the difference along a small singular direction, but such directions
# carry little of the update's norm, and the 30 steps of lr ≤ 0.05 scale what remains; 1e-3 of
# each tensor's norm is that estimate with headroom, not a worst case. What follows the
# parameters (gradients, their norms, AdamW's moments) inherits the difference. The bound is
# relative in the Frobenius norm, per tensor; step numbers, skips and their reasons stay exact,
# and a session compared with itself on the same daemons (the state_dict round trip) stays
# bit-identical on every backend.
BACKEND = os.environ.get("MUOND_TEST_BACKEND", "cpu")
SAME_BOUND = None if BACKEND == "cpu" else 1e-3


def assert_close(value, other, what):
    """``value`` equals ``other`` on the CPU backend; on others, within SAME_BOUND relative."""
    if SAME_BOUND is None:
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), f"{what} differs"
        else:
            assert value == other, what
        return
    if isinstance(value, torch.Tensor):
        scale = max(value.double().norm().item(), 1e-12)
        assert (value.double() - other.double()).norm().item() <= SAME_BOUND * scale, f"{what} differs"
    elif isinstance(value, float):
        assert abs(value - other) <= SAME_BOUND * max(abs(value), 1e-12), what
    else:
        assert value == other, what


class AttentionNet(torch.nn.Module):
    """Embedding, one attention layer with a QK-clip pair, an MLP: Muon matrices and AdamW
    vectors and embedding."""

    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def param(*shape, scale):
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) * scale)

        self.emb = param(32, 16, scale=1.0)
        self.wq = param(16, 16, scale=0.6)
        self.wk = param(16, 16, scale=0.6)
        self.wv = param(16, 16, scale=0.3)
        self.w1 = param(48, 16, scale=0.3)
        self.b1 = param(48, scale=0.0)
        self.w2 = param(16, 48, scale=0.3)

    def forward(self, tokens):
        x = self.emb[tokens]                                   # (B, T, 16)
        b, t, d = x.shape
        q = (x @ self.wq.T).view(b, t, HEADS, d // HEADS).transpose(1, 2)
        k = (x @ self.wk.T).view(b, t, HEADS, d // HEADS).transpose(1, 2)
        v = (x @ self.wv.T).view(b, t, HEADS, d // HEADS).transpose(1, 2)
        logits = q @ k.transpose(-1, -2) / (d // HEADS) ** 0.5   # (B, H, T, T)
        y = (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        h = torch.relu(y @ self.w1.T + self.b1) @ self.w2.T
        loss = ((h - x.detach()) ** 2).mean()
        return loss, logits.detach().amax(dim=(0, 2, 3))


def groups(model):
    muon = [(n, getattr(model, n)) for n in ("wq", "wk", "wv", "w1", "w2")]
    adamw = [(n, getattr(model, n)) for n in ("emb", "b1")]
    return [{"name": "muon", "params": muon, "optimizer": "muon", "lr": 0.05,
             "weight_decay": 0.01, "qk_clip_threshold": 1.5},
            {"name": "adamw", "params": adamw, "optimizer": "adamw", "lr": 0.01}]


def sharded(model, **kwargs):
    """A RemoteOptimizer of the model's groups naming its QK-clip pair, whose query reads the muon
    group's qk_clip_threshold."""
    return muond.RemoteOptimizer(groups(model), qk_clip=[(model.wq, model.wk, HEADS)], **kwargs)


def batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 32, (4, 6), generator=gen)


NAN_STEP = 7


def one_step(model, opt, step, rank):
    opt.zero_grad()
    loss, max_logits = model(batch(step, rank))
    loss.backward()
    if step == NAN_STEP and rank == 0:
        model.w2.grad[3, 5] = float("nan")
    opt.step(qk_logits={model.wq: max_logits})
    return opt.last_info


def train(endpoints, steps, world_size=1, session=None, scheduled=False, **kwargs):
    """Trains one model per rank (threads) for ``steps`` (with a learning-rate scheduler when
    ``scheduled``); returns rank 0's model, its state_dict and the step infos."""
    session = session or f"shards-{uuid.uuid4().hex[:8]}"
    models = [AttentionNet(seed=3) for _ in range(world_size)]
    infos, errors = [], []

    def rank_loop(rank):
        model = models[rank]
        try:
            opt = muond.RemoteOptimizer(groups(model), endpoints=endpoints, session=session,
                                        world_size=world_size, rank=rank, max_grad_norm=0.5,
                                        qk_clip=[(model.wq, model.wk, HEADS)], **kwargs)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
            try:
                for step in steps:
                    info = one_step(model, opt, step, rank)
                    if scheduled:
                        schedule.step()
                    if rank == 0:
                        infos.append(info)
                if rank == 0:
                    infos.append(opt.state_dict())
            finally:
                opt.close(keep_session=False)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    run_ranks(rank_loop, world_size, errors)
    return models[0], infos.pop(), infos


def assert_same_state(a, b):
    assert a["muond"]["last_step"] == b["muond"]["last_step"]
    assert a["state"].keys() == b["state"].keys()
    for i, slots in a["state"].items():
        assert slots.keys() == b["state"][i].keys()
        for slot, value in slots.items():
            assert_close(value, b["state"][i][slot], f"parameter {i} slot {slot}")


def assert_same_infos(a, b):
    assert [(i.step, i.applied, i.skip_reason) for i in a] == [(i.step, i.applied, i.skip_reason) for i in b]
    for x, y in zip(a[:NAN_STEP - 1], b[:NAN_STEP - 1]):
        assert_close(x.grad_norm, y.grad_norm, f"grad_norm of step {x.step}")


def assert_ends_as_expected(model, opt, infos, expected_model, expected_state, expected_infos):
    """Closes ``opt`` and checks the run against one daemon's: step answers, state, parameters."""
    state = opt.state_dict()
    opt.close()
    assert_same_infos(infos, expected_infos)
    assert_same_state(state, expected_state)
    for (name, p), (_, q) in zip(model.named_parameters(), expected_model.named_parameters()):
        assert_close(p.detach(), q.detach(), name)


@pytest.fixture
def three(start_daemon):
    return [start_daemon() for _ in range(3)]


def test_placement_balances_cost_and_keeps_pairs_together():
    tensors = [placement.Tensor((768, 768), True), placement.Tensor((3072, 768), True),
               placement.Tensor((768, 3072), True), placement.Tensor((768,), False),
               placement.Tensor((768, 768), True), placement.Tensor((50257, 768), False)]
    plan = placement.place(tensors, 3, together=[(0, 4)])
    assert plan.shard_of[0] == plan.shard_of[4]
    # Longest first onto the least loaded: the two 3072x768 matrices (cost 3072*768^2 each)
    # take daemons 0 and 1, then the pair (2 * 768^3) daemon 2, which stays the least loaded for
    # the embedding (4 * 50257 * 768 bytes) and the vector. The C++ client's test
    # (tests/integration/sharded_session_test.cc) expects the same.
    assert plan.shard_of == (2, 0, 1, 2, 2, 2)
    assert plan == placement.place(tensors, 3, together=[(0, 4)])  # deterministic
    assert sorted(set(plan.shard_of)) == [0, 1, 2]
    assert plan.imbalance == max(plan.loads) / (sum(plan.loads) / 3)
    one = placement.place(tensors, 1)
    assert set(one.shard_of) == {0} and one.imbalance == 1.0
    with pytest.raises(ValueError, match="endpoints"):
        placement.place(tensors, 0)


def test_three_daemons_train_bit_identical_to_one(three, start_daemon):
    steps = range(1, 31)
    single_model, single_state, single_infos = train([start_daemon().endpoint], steps, world_size=2,
                                                     scheduled=True)
    model, state, infos = train([d.endpoint for d in three], steps, world_size=2, scheduled=True)
    assert not infos[NAN_STEP - 1].applied
    assert infos[NAN_STEP - 1].skip_reason == "non-finite gradient in 'w2'"
    assert any(i.grad_norm > 0.5 for i in infos)  # clipping was active
    assert_same_infos(infos, single_infos)
    assert_same_state(state, single_state)
    for (name, p), (_, q) in zip(model.named_parameters(), single_model.named_parameters()):
        assert_close(p.detach(), q.detach(), name)


def test_every_daemon_holds_whole_parameters_of_the_placement(three):
    model = AttentionNet(seed=3)
    endpoints = [d.endpoint for d in three]
    with muond.RemoteOptimizer(groups(model), endpoints=endpoints,
                               qk_clip=[(model.wq, model.wk, HEADS)]) as opt:
        held = []
        for k, daemon in enumerate(opt._sessions):
            sessions = daemon.conn.list_sessions()
            assert [s.session_id for s in sessions] == [opt.session_id]
            held.append(set(daemon.names))
        assert set().union(*held) == {n for n, _ in model.named_parameters()}
        assert sum(len(h) for h in held) == len(list(model.parameters()))
        assert any("wq" in h and "wk" in h for h in held)  # the QK-clip pair together
        assert opt.placement.imbalance >= 1.0


def test_a_shard_killed_between_prepare_and_commit_resumes_bit_identical(start_daemon, tmp_path):
    expected_model, expected_state, expected_infos = train([start_daemon().endpoint], range(1, 21))
    daemons = [start_daemon("--state-dir", tmp_path / f"state-{k}", "--durability", "journal",
                            workdir=tmp_path / f"d{k}") for k in range(3)]
    endpoints = [d.endpoint for d in daemons]
    session = f"killed-{uuid.uuid4().hex[:8]}"
    model = AttentionNet(seed=3)
    opt = muond.RemoteOptimizer(groups(model), endpoints=endpoints, session=session,
                                max_grad_norm=0.5, qk_clip=[(model.wq, model.wk, HEADS)],
                                retry_backoff=0.05, max_step_attempts=6)
    infos = [one_step(model, opt, step, 0) for step in range(1, 8)]

    def restart(k):
        old = daemons[k]
        old.kill()
        daemons[k] = start_daemon("--state-dir", tmp_path / f"state-{k}", "--durability", "journal",
                                  listen=old.endpoint, workdir=old.workdir)

    # SIGKILL between steps: the journal holds every acknowledged step.
    restart(1)
    infos += [one_step(model, opt, step, 0) for step in range(8, 12)]

    # SIGKILL of shard 2 after it prepared step 12 and before its commit: the restarted daemon
    # holds no prepared step, the commit is refused, and the client prepares again on every
    # shard (shards 0 and 1 answer with the decision they applied).
    shard = opt._sessions[2]
    real_step = shard.step
    killed = []

    def kill_before_first_commit(header, grads, *rest):
        if header.phase == pb.STEP_PHASE_COMMIT and not killed:
            killed.append(header.step)
            restart(2)
        return real_step(header, grads, *rest)

    shard.step = kill_before_first_commit
    infos.append(one_step(model, opt, 12, 0))
    assert killed == [12] and opt.last_info.attempts == 2
    shard.step = real_step
    infos += [one_step(model, opt, step, 0) for step in range(13, 16)]
    opt.close(keep_session=True)

    # A new trainer attaches to the three shards and goes on.
    model = AttentionNet(seed=99)
    opt = muond.RemoteOptimizer(groups(model), endpoints=endpoints, session=session,
                                max_grad_norm=0.5, qk_clip=[(model.wq, model.wk, HEADS)])
    assert opt.attached and opt.last_step == 15
    infos += [one_step(model, opt, step, 0) for step in range(16, 21)]
    assert_ends_as_expected(model, opt, infos, expected_model, expected_state, expected_infos)


class Stopped(Exception):
    """The trainer's end, as its process dying there would be."""


def stopping_at_commit(real_step):
    """A shard's step that stops the trainer when it comes to the commit (the prepare goes through)."""
    def step(header, grads, *rest):
        if header.phase == pb.STEP_PHASE_COMMIT:
            raise Stopped()
        return real_step(header, grads, *rest)
    return step


def test_a_step_its_trainer_left_between_commits_is_finished_by_the_next_attach(three, start_daemon):
    """A trainer that stops after shard 0 committed step 6 and before the others did leaves the
    shards at steps 6, 5, 5 with 6 prepared on shards 1 and 2: the next trainer's attach commits it
    there with shard 0's decision, and training goes on as on one daemon."""
    expected_model, expected_state, expected_infos = train([start_daemon().endpoint], range(1, 11))
    endpoints = [d.endpoint for d in three]
    session = f"cut-off-{uuid.uuid4().hex[:8]}"
    model = AttentionNet(seed=3)
    opt = muond.RemoteOptimizer(groups(model), endpoints=endpoints, session=session,
                                max_grad_norm=0.5, qk_clip=[(model.wq, model.wk, HEADS)])
    infos = [one_step(model, opt, step, 0) for step in range(1, 6)]

    for k in (1, 2):
        opt._sessions[k].step = stopping_at_commit(opt._sessions[k].step)
    with pytest.raises(Stopped):
        one_step(model, opt, 6, 0)
    opt.close(keep_session=True)
    steps = []
    for endpoint in endpoints:
        conn = muond.Connection(endpoint)
        steps += [s.last_step for s in conn.list_sessions() if s.session_id == session]
        conn.close()
    assert steps == [6, 5, 5]

    model = AttentionNet(seed=99)
    opt = muond.RemoteOptimizer(groups(model), endpoints=endpoints, session=session,
                                max_grad_norm=0.5, qk_clip=[(model.wq, model.wk, HEADS)])
    assert opt.attached and opt.last_step == 6
    infos.append(expected_infos[5])  # step 6's answer never reached the stopped trainer
    infos += [one_step(model, opt, step, 0) for step in range(7, 11)]
    assert_ends_as_expected(model, opt, infos, expected_model, expected_state, expected_infos)


def test_a_step_cut_off_in_its_commit_is_sent_again_with_its_own_gradients(three, start_daemon,
                                                                            caplog):
    """Shard 0 commits step 6; every try of the commit on shards 1 and 2 fails before it is sent,
    so step() raises with step 6 applied on shard 0 only. The trainer's next step() (another
    batch) sends step 6 again with the gradients and options it was first sent with: shard 0
    answers with the decision it applied and the others commit that decision with the gradients it
    was computed from, as one daemon answers a resend of a step it applied. Training goes on as on
    one daemon, bit for bit; the next batch's gradients were not used."""
    import logging  # noqa: PLC0415

    expected_model, expected_state, expected_infos = train([start_daemon().endpoint], range(1, 11))
    model = AttentionNet(seed=3)
    opt = sharded(model, endpoints=[d.endpoint for d in three], max_grad_norm=0.5,
                  retry_backoff=0.01)
    infos = [one_step(model, opt, step, 0) for step in range(1, 6)]
    refused = []

    def unreachable_at_commit(real_step):
        def step(header, grads, *rest):
            if header.phase == pb.STEP_PHASE_COMMIT and header.step == 6:
                refused.append(header.step)
                raise muond.MuondError(grpc.StatusCode.UNAVAILABLE, "injected: unreachable", "Step")
            return real_step(header, grads, *rest)
        return step

    real_steps = [opt._sessions[k].step for k in (1, 2)]
    for k in (1, 2):
        opt._sessions[k].step = unreachable_at_commit(opt._sessions[k].step)
    with pytest.raises(muond.MuondError) as failed:
        one_step(model, opt, 6, 0)
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert refused == [6] * 2 * opt.max_step_attempts  # every try's commit, on shards 1 and 2
    for k, real_step in zip((1, 2), real_steps):
        opt._sessions[k].step = real_step
    steps = []
    for endpoint in opt.endpoints:
        conn = muond.Connection(endpoint)
        steps += [s.last_step for s in conn.list_sessions() if s.session_id == opt.session_id]
        conn.close()
    assert steps == [6, 5, 5]
    with pytest.raises(muond.MuondError) as split:  # the shards' state is of no one step yet
        opt.state_dict()
    assert split.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "step 6 was cut off in its commit" in split.value.details
    assert "the next step() sends it again" in split.value.details
    for needs_one_step in (opt.state_digest, opt.checkpoint):  # checkpoint: before any shard writes
        with pytest.raises(muond.MuondError) as split:
            needs_one_step()
        assert split.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "step 6 was cut off in its commit" in split.value.details

    with caplog.at_level(logging.WARNING, logger="muond"):
        infos.append(one_step(model, opt, 106, 0))  # another batch: not what step 6 applies
    assert opt.last_step == 6 and opt.last_info.attempts == 1
    assert "step 6 failed once some shards may have applied it" in caplog.text
    infos += [one_step(model, opt, step, 0) for step in range(7, 11)]
    assert_ends_as_expected(model, opt, infos, expected_model, expected_state, expected_infos)


def test_a_rank_whose_prepare_went_out_sends_its_step_again_with_its_own_gradients(start_daemon):
    """Two ranks over two daemons. Every answer to rank 1's prepares of step 2 on shard 1 is lost,
    so its step() raises while rank 0 commits the step, with rank 1's gradients, which a shard
    holds from its prepare and rank 0's commit applies. Had a shard not committed yet, a new
    prepare from rank 1 would have replaced them there: so rank 1 keeps the step as soon as its
    prepare went out, and its next step() (another batch) sends the same gradients again. The run
    ends bit for bit like two ranks on one daemon."""
    steps = range(1, 7)
    expected_model, expected_state, expected_infos = train([start_daemon().endpoint], steps,
                                                           world_size=2)
    endpoints = [start_daemon().endpoint, start_daemon().endpoint]
    session = f"prepared-{uuid.uuid4().hex[:8]}"
    models = [AttentionNet(seed=3) for _ in range(2)]
    sent, infos, errors, kept = [], [], [], []

    def rank_loop(rank):
        model = models[rank]
        try:
            opt = sharded(model, endpoints=endpoints, session=session, world_size=2, rank=rank,
                          max_grad_norm=0.5, retry_backoff=0.01)
            if rank == 1:
                shards = opt._sessions
                real = [shards[0].step, shards[1].step]

                def recorded(header, grads, *rest):  # shard 0: what rank 1 prepares for step 2
                    if header.phase == pb.STEP_PHASE_PREPARE and header.step == 2:
                        sent.append([g.detach().clone() for _, g in grads])
                    return real[0](header, grads, *rest)

                def answer_lost(header, grads, *rest):  # shard 1: its answers, while step() is 1st
                    answer = real[1](header, grads, *rest)
                    if header.phase == pb.STEP_PHASE_PREPARE and header.step == 2 and not kept:
                        raise muond.MuondError(grpc.StatusCode.UNAVAILABLE, "injected", "Step")
                    return answer

                shards[0].step, shards[1].step = recorded, answer_lost
            for step in steps:
                if rank == 1 and step == 2:
                    with pytest.raises(muond.MuondError):
                        one_step(model, opt, 2, rank)
                    kept.append(opt.cut_off_step)
                    one_step(model, opt, 102, rank)  # another batch: step 2 sent again as it was
                    continue
                info = one_step(model, opt, step, rank)
                if rank == 0:
                    infos.append(info)
            if rank == 0:
                infos.append(opt.state_dict())
            opt.close(keep_session=rank == 1)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    run_ranks(rank_loop, 2, errors)
    assert kept == [2]
    assert len(sent) >= 2
    for resent in sent[1:]:
        for a, b in zip(resent, sent[0]):
            assert torch.equal(a, b), "a prepare of step 2 carried other gradients"
    state = infos.pop()
    assert_same_infos(infos, expected_infos)
    assert_same_state(state, expected_state)
    for model in models:
        for (name, p), (_, q) in zip(model.named_parameters(), expected_model.named_parameters()):
            assert_close(p.detach(), q.detach(), name)


def test_wrong_endpoint_order_or_count_is_refused(three, start_daemon):
    endpoints = [d.endpoint for d in three]
    model = AttentionNet(seed=3)
    session = f"order-{uuid.uuid4().hex[:8]}"
    with sharded(model, endpoints=endpoints, session=session) as opt:
        one_step_plain(model, opt)
        for wrong in ([endpoints[1], endpoints[0], endpoints[2]], endpoints[:2],
                      endpoints + [start_daemon().endpoint]):
            with pytest.raises(muond.MuondError) as err:
                sharded(AttentionNet(seed=3), endpoints=wrong, session=session)
            assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
            assert "spec.shard.endpoints" in err.value.details
            assert "give the endpoints in the order the session was created with" in err.value.details
        # One endpoint sends no placement: refused all the same, with the session's endpoints.
        with pytest.raises(muond.MuondError) as err:
            sharded(AttentionNet(seed=3), endpoint=endpoints[0], session=session)
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert f"spec.shard: the session is shard 0 of a session placed on 3 daemons [{', '.join(endpoints)}]" \
            in err.value.details
        assert "give the endpoints in the order the session was created with" in err.value.details
        one_step_plain(model, opt)  # the session is untouched
        assert opt.last_step == 2
    with pytest.raises(ValueError, match=r"endpoints\[1\]: .* listed twice"):
        muond.RemoteOptimizer(groups(model), endpoints=[endpoints[0], endpoints[0]])
    with pytest.raises(ValueError, match="one or the other"):
        muond.RemoteOptimizer(groups(model), endpoint=endpoints[0], endpoints=endpoints)


def session_ids(endpoint):
    conn = muond.Connection(endpoint)
    try:
        return {s.session_id for s in conn.list_sessions()}
    finally:
        conn.close()


def test_a_refused_sharded_attach_rolls_back_what_it_created(three):
    a, b, c = (d.endpoint for d in three)
    session = f"orphans-{uuid.uuid4().hex[:8]}"
    # b holds an unsharded session of that id, and a already holds another session.
    model, other, again = AttentionNet(seed=4), AttentionNet(seed=5), AttentionNet(seed=4)
    with muond.RemoteOptimizer(groups(model), endpoint=b, session=session,
                               qk_clip=[(model.wq, model.wk, HEADS)]) as plain, \
            muond.RemoteOptimizer(groups(other), endpoint=a, session="kept",
                                  qk_clip=[(other.wq, other.wk, HEADS)]) as kept:
        one_step_plain(model, plain)
        with pytest.raises(muond.MuondError) as err:
            muond.RemoteOptimizer(groups(again), endpoints=[a, b, c], session=session,
                                  qk_clip=[(again.wq, again.wk, HEADS)])
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        # a and c keep nothing of the refused attach (it counted against --max-sessions and the
        # quotas); b's session and a's other session are untouched.
        assert session not in session_ids(a)
        assert session not in session_ids(c)
        assert session_ids(b) == {session}
        assert "kept" in session_ids(a)
        one_step_plain(model, plain)
        assert plain.last_step == 2
        assert kept.last_step == 0


def test_a_new_sharded_session_without_pairs_refuses_qk_clip_options(three):
    """Each daemon sees only its own shard's QK-clip pairs and the whole session's count of them
    (spec.shard.qk_clip_pairs), so every shard refuses what an unsharded daemon would: QK-clip's
    threshold in a session that names no pair. Nothing is created; with the pair named, the same
    id is created afresh."""
    endpoints = [d.endpoint for d in three]
    model = AttentionNet(seed=6)
    session = f"no-pairs-{uuid.uuid4().hex[:8]}"
    with pytest.raises(muond.MuondError) as err:
        muond.RemoteOptimizer(groups(model), endpoints=endpoints, session=session)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details == (f"shard 0 ({endpoints[0]}): spec.groups[0].options.qk_clip_threshold: only "
                                 "QK-clip reads it, and this session names no QK-clip pair (spec.qk_clip); name "
                                 "the query and key weights or leave qk_clip_threshold at its default 100")
    assert all(session not in session_ids(endpoint) for endpoint in endpoints)
    with sharded(model, endpoints=endpoints, session=session) as opt:
        assert not opt.attached


def one_step_plain(model, opt):
    opt.zero_grad()
    loss, _ = model(batch(opt.last_step + 1, 0))
    loss.backward()
    opt.step()


def test_a_shard_restored_to_an_older_checkpoint_is_named(start_daemon, tmp_path):
    daemons = [start_daemon("--state-dir", tmp_path / f"state-{k}", workdir=tmp_path / f"d{k}")
               for k in range(3)]
    endpoints = [d.endpoint for d in daemons]
    model = AttentionNet(seed=3)
    session = f"behind-{uuid.uuid4().hex[:8]}"
    opt = sharded(model, endpoints=endpoints, session=session)
    for _ in range(3):
        one_step_plain(model, opt)
    assert opt.checkpoint() == 3  # every shard at step 3
    for _ in range(2):
        one_step_plain(model, opt)
    old = daemons[1]
    old.kill()  # snapshot mode: steps 4 and 5 are lost on shard 1
    start_daemon("--state-dir", tmp_path / "state-1", listen=old.endpoint, workdir=old.workdir)
    # The trainer stepping on is refused naming the shard behind, not its step number alone.
    with pytest.raises(muond.MuondError) as err:
        one_step_plain(model, opt)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"shard 1 ({endpoints[1]}) at step 3, the others at step 5" in err.value.details
    opt.close(keep_session=True)
    with pytest.raises(muond.MuondError) as err:
        sharded(AttentionNet(seed=3), endpoints=endpoints, session=session)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"shard 1 ({endpoints[1]}) at step 3, the others at step 5" in err.value.details


def test_state_dict_round_trips_across_shards(three):
    endpoints = [d.endpoint for d in three]
    model = AttentionNet(seed=3)
    with sharded(model, endpoints=endpoints) as opt:
        for _ in range(3):
            one_step_plain(model, opt)
        saved = opt.state_dict()
        for _ in range(2):
            one_step_plain(model, opt)
        after_5 = [p.detach().clone() for p in model.parameters()]
        opt.load_state_dict(saved)
        assert opt.last_step == 3
        assert_same_state(opt.state_dict(), saved)
        for _ in range(2):
            one_step_plain(model, opt)
        for p, q in zip(model.parameters(), after_5):
            assert torch.equal(p, q)


def test_an_attach_that_finishes_a_cut_off_step_resumes_that_steps_values(three):
    """The shards behind answered the attach with the step before (its overrides); the attach
    finishes the cut-off step there and takes the values of the step every shard is at."""
    endpoints = [d.endpoint for d in three]
    session = f"cut-off-lr-{uuid.uuid4().hex[:8]}"
    model = AttentionNet(seed=5)
    opt = muond.RemoteOptimizer(groups(model), endpoints=endpoints, session=session,
                                qk_clip=[(model.wq, model.wk, HEADS)])
    lrs = {step: [g["lr"] * (1 - 0.1 * step) for g in opt.param_groups] for step in range(1, 4)}

    def scheduled(step):
        for group, lr in zip(opt.param_groups, lrs[step]):
            group["lr"] = lr
        one_step(model, opt, step, 0)

    for step in (1, 2):
        scheduled(step)

    for k in (1, 2):
        opt._sessions[k].step = stopping_at_commit(opt._sessions[k].step)
    with pytest.raises(Stopped):
        scheduled(3)
    opt.close(keep_session=True)

    model = AttentionNet(seed=6)
    opt = muond.RemoteOptimizer(groups(model), endpoints=endpoints, session=session,
                                qk_clip=[(model.wq, model.wk, HEADS)])
    assert opt.attached and opt.last_step == 3
    assert [g["lr"] for g in opt.param_groups] == lrs[3], "step 3's, not the step before"
    opt.close()


def test_a_checkpoint_with_a_shard_that_lost_the_session_is_refused_with_its_reason(three):
    """Before any shard writes a checkpoint, checkpoint() asks each shard's step; a shard that no
    longer holds the session leaves that to its own checkpoint call, which the daemon refuses
    with its machine-readable reason (SESSION_NOT_FOUND), as on one daemon."""
    model = AttentionNet(seed=3)
    opt = sharded(model, endpoints=[d.endpoint for d in three])
    one_step(model, opt, 1, 0)
    conn = muond.Connection(three[0].endpoint)
    conn.close_session(opt.session_id)
    conn.close()
    with pytest.raises(muond.MuondError) as lost:
        opt.checkpoint()
    assert lost.value.code == grpc.StatusCode.NOT_FOUND
    assert lost.value.reason == muond.errors.SESSION_NOT_FOUND
