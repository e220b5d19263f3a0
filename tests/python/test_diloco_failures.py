"""muond.DiLoCo when things go wrong, against the real daemon: a sync the daemon applied whose
answer was lost (its retry is a replay: nothing counts twice and the worker keeps pace), a sync that
failed in flight, a diverged worker, and the arguments and state dicts it refuses, naming them,
before anything is sent or changed."""

import copy
import threading

import grpc
import pytest
import torch

import muond
from muond import quantize
from muond._stubs import pb

from diloco_helpers import INNER, SEED, SIZES, end_session, inner_step, session_name
from helpers import TinyNet, assert_bitwise


def lose_every_answer_of(diloco, step, sent=None):
    """Makes every try of ``diloco``'s first sync of session step ``step`` lose its answer once the
    daemon has applied it (UNAVAILABLE, as a broken connection would); the list of the tries lost.
    ``sent``, a dict, gets copies of the gradients (Δ + e) the first try sent, by name."""
    attempts = diloco.remote.max_step_attempts
    lossy = diloco.remote._sessions[0]  # pylint: disable=protected-access
    real_step, lost = lossy.step, []

    def answer_lost(header, grads, *args, **kwargs):
        answer = real_step(header, grads, *args, **kwargs)
        if header.step == step and len(lost) < attempts:
            if not lost and sent is not None:
                sent.update((name, g.detach().clone()) for name, g in grads)
            lost.append(header.step)
            raise muond.MuondError(grpc.StatusCode.UNAVAILABLE, "injected: answer lost", "Step")
        return answer

    lossy.step = answer_lost
    return lost


def assert_feedback_is_the_rounding_of(diloco, feedback, sent, wire_dtype):
    """``feedback`` (a copy of ``diloco``'s error feedback, by parameter index) of the parameters in
    ``sent`` is what ``wire_dtype`` rounds away of them, bit for bit (and there is one for each)."""
    feedback = {diloco.names[i]: e for i, e in feedback.items()}
    assert sent and set(sent) <= set(feedback)
    assert_bitwise({name: feedback[name] for name in sent},
                   {name: g - quantize.round_trip(g, wire_dtype).view_as(g) for name, g in sent.items()},
                   "the error feedback after the replay")


@pytest.mark.parametrize("overlap_steps,wire_dtype", [(0, "fp32"), (1, "fp32"), (0, "int8")])
def test_a_sync_applied_before_its_answer_was_lost_is_not_sent_twice(start_daemon, overlap_steps,
                                                                     wire_dtype):
    """Two workers, H = 4, F = 2: the daemon applies session step 3 (after inner step 6), and
    worker 1's every try of it loses the answer. Its next sync (after inner step 8) sends step 3
    again, which the daemon answers as a replay: the first try's Δ and weight were applied, so the
    tokens counted again go back to those since the first try, and the worker sends step 4 at once,
    as the other worker did there: both end at the same session step, every step's weight the
    tokens each worker trained on since it last sent that fragment. With τ = 1 the failure and the
    replay are seen at the merges, one inner step after the sends: worker 1 sends step 4 after inner
    step 9, its Δ of fragment 1 five inner steps' worth (weight 5·s1) and its next one three. With a
    quantized wire the error feedback after the replay is what the applied first try rounded away,
    not the retry's rounding, which was not applied."""
    daemon = start_daemon("--straggler-timeout", "60")
    session = session_name()
    workers = []
    for rank in range(2):
        model = TinyNet(seed=SEED)
        inner = torch.optim.AdamW(model.parameters(), **INNER)
        workers.append((model, inner, muond.DiLoCo(
            model, inner, sync_every=4, fragments=2, overlap_steps=overlap_steps,
            wire_dtype=wire_dtype, endpoint=daemon.endpoint, session=session, world_size=2,
            rank=rank, transport="grpc", retry_backoff=0.01)))
    attempts = workers[1][2].remote.max_step_attempts
    first_try = {}
    lost = lose_every_answer_of(workers[1][2], 3, first_try)
    merges, errors, after_replay = [[], []], [[], []], {}

    def train(rank):
        model, inner, diloco = workers[rank]
        for t in range(1, 13 + overlap_steps):  # the last sync (after inner step 12) merged too
            inner_step(model, inner, rank, t)
            try:
                diloco.step(tokens=SIZES[rank])
            except muond.MuondError as err:
                errors[rank].append((t, err.code))
                continue
            if diloco.last_merged is not None:
                info = diloco.last_info
                merges[rank].append((t, info.step, info.total_weight, info.replayed))
            if rank == 1 and t == 8 and overlap_steps == 0:  # step 3 replayed, step 4 (fragment 1) sent
                after_replay.update(feedback=copy.deepcopy(diloco._feedback))  # pylint: disable=protected-access

    threads = [threading.Thread(target=train, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tau = overlap_steps
    assert lost == [3] * attempts
    assert errors == [[], [(6 + tau, grpc.StatusCode.UNAVAILABLE)]]
    s0, s1 = SIZES[0], SIZES[1]
    weights = [2 * (s0 + s1)] + [4 * (s0 + s1)] * 5
    if tau:
        weights[3], weights[5] = 4 * s0 + 5 * s1, 4 * s0 + 3 * s1
    assert merges[0] == [(2 * k + tau, k, weights[k - 1], False) for k in range(1, 7)]
    # After inner step 8 (+ τ) worker 1 got step 3's replay, then step 4's answer.
    assert merges[1] == [(2 * k + tau, k, weights[k - 1], False) for k in (1, 2, 4, 5, 6)]
    for _, _, diloco in workers:
        assert diloco.remote.last_step == 6
    assert_bitwise(workers[0][2].global_parameters(), workers[1][2].global_parameters(),
                   "the workers' global parameters")
    if wire_dtype != "fp32":
        assert_feedback_is_the_rounding_of(workers[1][2], after_replay["feedback"], first_try, wire_dtype)
    for _, _, diloco in workers:
        diloco.close(keep_session=True)
    end_session(daemon.endpoint, session)


def test_a_quantized_retry_answered_after_the_session_moved_on_sends_no_feedback_twice(endpoint):
    """int8 syncs, quorum of 1 without grace, one fragment, sync_every 2, in one thread. Worker 1's
    sync of session step 1 is applied alone and leaves error feedback e (its rounding). Its sync of
    step 2 (Δ + e) is applied alone too, and every try's answer is lost. Worker 0 is answered late
    for steps 1 and 2 and then applies step 3 alone. Worker 1's next sync sends step 2 again, which
    the daemon answers after step 3: included (the first try was applied), replayed. Worker 1 takes
    the session's parameters whole, and e, applied in step 2, is not sent again: the feedback is
    what step 2's first try rounded away, as after a replay in lock-step."""
    session, runs = session_name(), []
    for r in range(2):
        model = TinyNet(seed=SEED)
        inner = torch.optim.AdamW(model.parameters(), **INNER)
        runs.append((model, inner, muond.DiLoCo(
            model, inner, sync_every=2, wire_dtype="int8", endpoint=endpoint, session=session,
            world_size=2, rank=r, sync_mode="quorum", min_ranks=1, grace_seconds=0,
            transport="grpc", retry_backoff=0.01)))
    worker = runs[1][2]
    attempts = worker.remote.max_step_attempts
    first_try = {}
    lost = lose_every_answer_of(worker, 2, first_try)

    def sync(r, t):
        model, inner, diloco = runs[r]
        for k in (t - 1, t):
            inner_step(model, inner, r, k)
            diloco.step(tokens=SIZES[r])
        return diloco.last_info

    try:
        assert sync(1, 2).included and worker._feedback  # pylint: disable=protected-access
        assert not sync(0, 2).included
        with pytest.raises(muond.MuondError):
            sync(1, 4)
        assert lost == [2] * attempts
        late = sync(0, 4)
        assert (late.step, late.included) == (2, False)
        taken = sync(0, 6)
        assert (taken.step, taken.contributors, taken.included) == (3, (0,), True)
        replay = sync(1, 6)
        assert (replay.step, replay.included, replay.replayed) == (3, True, True)
        assert_bitwise({n: p.detach() for n, p in runs[1][0].named_parameters()},
                       runs[0][2].global_parameters(), "the worker's parameters after the replay")
        assert_feedback_is_the_rounding_of(worker, worker._feedback, first_try, "int8")  # pylint: disable=protected-access
    finally:
        for _, _, diloco in runs:
            diloco.close(keep_session=True)
        end_session(endpoint, session)


@pytest.mark.parametrize("overlap_steps", [0, 1])
def test_a_sync_cut_off_between_the_shards_commits_is_resent_as_it_was(start_daemon,
                                                                       overlap_steps):
    """A sharded outer session over two daemons, H = 2: every try of session step 2 fails at
    shard 1, once its commit is sent (shard 0 committed the step) in one run, at its prepare
    (nothing committed anywhere) in the other. The next sync sends step 2 again with the failed
    try's Δ and weight, so shard 1 commits the gradients shard 0 applied: both runs end with the
    same global parameters, bit for bit, and the tokens since the first try count toward the next
    sync. Without the resend the cut-off run's shards would apply two different pseudo-gradients
    under one decision."""
    daemons = [start_daemon(), start_daemon()]
    endpoints = [d.endpoint for d in daemons]

    def run(phase):
        model = TinyNet(seed=SEED)
        inner = torch.optim.AdamW(model.parameters(), **INNER)
        session = session_name()
        diloco = muond.DiLoCo(model, inner, sync_every=2, overlap_steps=overlap_steps,
                              endpoints=endpoints, session=session, transport="grpc",
                              retry_backoff=0.01)
        shard = diloco.remote._sessions[1]  # pylint: disable=protected-access
        real_step, failing, prepared = shard.step, [True], []

        def unreachable(header, grads, *args, **kwargs):
            if header.phase == phase and header.step == 2 and failing[0]:
                raise muond.MuondError(grpc.StatusCode.UNAVAILABLE, "injected", "Step")
            if header.phase == pb.STEP_PHASE_PREPARE and header.step == 2:
                prepared.append((header.weight, [g.detach().clone() for _, g in grads]))
            return real_step(header, grads, *args, **kwargs)

        shard.step = unreachable
        merges, errors = [], []
        for t in range(1, 9 + overlap_steps):
            inner_step(model, inner, 0, t)
            try:
                diloco.step(tokens=SIZES[0])
            except muond.MuondError as err:
                errors.append((t, err.code))
                failing[0] = False  # the next sync's step 2 goes through
                if phase == pb.STEP_PHASE_COMMIT:  # the shards are at two steps until the resend
                    with pytest.raises(muond.MuondError, match="outer step 2 was cut off"):
                        diloco.state_dict()
                continue
            if diloco.last_merged is not None:
                merges.append((t, diloco.last_info.step, diloco.last_info.total_weight))
        assert errors == [(4 + overlap_steps, grpc.StatusCode.UNAVAILABLE)]
        assert diloco.remote.last_step == 3
        # Every prepare of step 2 that reached shard 1 (each try of the first sync when its
        # commit failed, then the resend) carried the same weight and Δ.
        assert len(prepared) == (diloco.remote.max_step_attempts + 1
                                 if phase == pb.STEP_PHASE_COMMIT else 1)
        for weight, deltas in prepared[1:]:
            assert weight == prepared[0][0]
            for a, b in zip(deltas, prepared[0][1]):
                assert torch.equal(a, b), "a resent Δ differs from the first try's"
        globals_ = {name: t.clone() for name, t in diloco.global_parameters().items()}
        diloco.close(keep_session=False)
        return globals_, merges

    cut_off, cut_merges = run(pb.STEP_PHASE_COMMIT)
    not_sent, plain_merges = run(pb.STEP_PHASE_PREPARE)
    tau, s0 = overlap_steps, SIZES[0]
    # Step 3 weighs the tokens since step 2's first try: those the resend left out and its own.
    expected = [(2 + tau, 1, 2 * s0), (6 + tau, 2, 2 * s0), (8 + tau, 3, 4 * s0)]
    assert cut_merges == plain_merges == expected
    assert_bitwise(cut_off, not_sent, "the global parameters")


def test_a_failed_overlapped_sync_raises_at_its_merge_and_its_tokens_count_again(endpoint,
                                                                                   caplog):
    """overlap_steps 1 against the real daemon, the sync's RemoteOptimizer.step made to fail
    before anything is sent: the error comes at the merge, one inner step later; the fragment's
    tokens count again, so the next sync sends them with those since, as the session's step 1.
    A sync that fails while in flight at close() is logged, not lost."""
    import logging  # noqa: PLC0415

    def failing(*args, **kwargs):
        raise RuntimeError("injected: the sync did not go out")

    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    with caplog.at_level(logging.WARNING, logger="muond"):
        with muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint, overlap_steps=1) as diloco:
            real_step = diloco.remote.step
            diloco.remote.step = failing
            for t in (1, 2):
                inner_step(model, inner, 0, t)
                diloco.step(tokens=SIZES[0])
            assert diloco.sync_in_flight == 0
            inner_step(model, inner, 0, 3)
            with pytest.raises(RuntimeError, match="injected"):
                diloco.step(tokens=SIZES[0])
            assert (diloco.sync_in_flight, diloco.inner_steps) == (None, 3)
            assert diloco._since_sync == [3.0 * SIZES[0]]  # pylint: disable=protected-access
            diloco.remote.step = real_step
            for t in (4, 5):  # sent after 4, merged after 5
                inner_step(model, inner, 0, t)
                diloco.step(tokens=SIZES[0])
            assert (diloco.last_merged, diloco.last_info.step) == (0, 1)
            assert diloco.last_info.total_weight == 4.0 * SIZES[0]
            assert_bitwise({n: p.detach() for n, p in model.named_parameters()},
                           diloco.global_parameters(), "the merged parameters")
            diloco.remote.step = failing
            inner_step(model, inner, 0, 6)
            diloco.step(tokens=SIZES[0])  # sent after 6, failing in its thread
            assert diloco.sync_in_flight == 0
            diloco.remote.step = real_step  # close() ends the session
    assert "the sync of fragment 0 in flight at close failed: injected" in caplog.text


def test_state_dict_refuses_another_step(endpoint):
    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    with muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint) as diloco:
        state = diloco.state_dict()
        for t in (1, 2):
            inner_step(model, inner, 0, t)
            diloco.step()
        assert diloco.remote.last_step == 1
        with pytest.raises(ValueError, match="outer step 0.*at step 1"):
            diloco.load_state_dict(state)
        with pytest.raises(ValueError, match="not a DiLoCo state dict"):
            diloco.load_state_dict(inner.state_dict())
        # Another worker's state, or one missing a part, is refused before anything changes.
        now = diloco.state_dict()
        inner_before = copy.deepcopy(inner.state_dict())
        other_rank = {**now, "diloco": {**now["diloco"], "rank": 1, "world_size": 2}}
        no_local = {key: value for key, value in now.items() if key != "local"}
        short = {**now, "diloco": {**now["diloco"], "tokens_since_sync": []}}
        wrong_shape = {**now, "global": {**now["global"], "up.weight": torch.zeros(3)}}
        for bad, pattern in ((other_rank, "rank: the state dict is of a worker with rank 1"),
                             (no_local, "local: the state dict has no 'local' section"),
                             (short, "tokens_since_sync: the state dict needs one count"),
                             (wrong_shape, "global\\['up.weight'\\]: the state dict needs a tensor")):
            with pytest.raises(ValueError, match=pattern):
                diloco.load_state_dict(bad)
        after = inner.state_dict()["state"]
        for index, slots in inner_before["state"].items():
            for slot, value in slots.items():
                assert torch.equal(after[index][slot], value), (index, slot)


def test_bad_arguments_are_refused_naming_them(endpoint):
    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters())
    for kwargs, pattern in [
            (dict(sync_every=0), "sync_every: must be at least 1"),
            (dict(sync_every=4, fragments=0), "fragments: must be in \\[1, 8\\]"),
            (dict(sync_every=9, fragments=9), "fragments: must be in \\[1, 8\\]"),
            (dict(sync_every=6, fragments=4), "fragments: sync_every \\(6\\) must be a multiple"),
            (dict(sync_every=4, outer="adam"), "outer: unknown outer optimizer"),
            (dict(sync_every=4, outer={"lr": -1}), "outer: group 0: lr must be in"),
            (dict(sync_every=4, outer={"momentum": 1.5}), "outer: group 0: momentum must be in"),
            (dict(sync_every=4, sync_mode="sideways"), "sync_mode: DiLoCo syncs in"),
            (dict(sync_every=4, outer=[{"params": [model.up.weight]}]), "outer: the parameters"),
            (dict(sync_every=4, outer=[{"params": ["up.weight", "up.weight"]}]),
             "outer: parameter 'up.weight'"),
            (dict(sync_every=4, outer=[{"params": [torch.zeros(2)]}]),
             "outer: group 0 holds a tensor"),
            (dict(sync_every=4, fragments=2, overlap_steps=2),
             "overlap_steps: must be in \\[0, 1\\] \\(below sync_every / fragments = 2"),
            (dict(sync_every=4, overlap_steps=-1), "overlap_steps: must be in \\[0, 3\\]"),
            (dict(sync_every=4, merge_alpha=1.5), "merge_alpha: must be in \\[0, 1\\], got 1.5"),
            (dict(sync_every=4, overlap_steps=1, sync_mode="async", world_size=1),
             "overlap_steps: not with sync_mode='async'")]:
        with pytest.raises(ValueError, match=pattern):
            muond.DiLoCo(model, inner, endpoint=endpoint, **kwargs)
    for outer, pattern in ((5, "outer: 'sgd', 'muon', a dict"),
                           ([{"params": 5}], "outer: group 0's 'params' must be")):
        with pytest.raises(TypeError, match=pattern):
            muond.DiLoCo(model, inner, sync_every=4, endpoint=endpoint, outer=outer)
    with pytest.raises(TypeError, match="sync_every: must be an integer"):
        muond.DiLoCo(model, inner, sync_every=2.5, endpoint=endpoint)
    with pytest.raises(TypeError, match="merge_alpha: must be a number"):
        muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint, merge_alpha="half")
    # A delayed update would let each sync read the answer and the globals of the one before.
    for kwargs in (dict(delay=1), dict(timing=muond.TimingOptions(delay=1))):
        with pytest.raises(ValueError, match="delay: DiLoCo takes no delayed update"):
            muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint, **kwargs)
    with muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint) as diloco:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        inner_step(model, inner, 0, 1)
        for tokens, error in ((-1, ValueError), (float("nan"), ValueError), ("8", TypeError)):
            with pytest.raises(error, match="tokens: must be"):
                diloco.step(tokens=tokens)
        assert diloco.inner_steps == 0  # refused before the inner step ran
        assert_bitwise({n: p.detach() for n, p in model.named_parameters()}, before, "parameters")
        diloco.step(tokens=0)
        inner_step(model, inner, 0, 2)
        with pytest.raises(ValueError, match="tokens: no tokens counted since fragment 0"):
            diloco.step(tokens=0)  # a sync of weight 0: refused before the inner step
        assert (diloco.inner_steps, diloco.remote.last_step) == (1, 0)
        diloco.step(tokens=3)
        assert (diloco.inner_steps, diloco.remote.last_step) == (2, 1)
        assert diloco.last_info.total_weight == 3.0


def test_a_diverged_worker_raises_before_sending_its_pseudo_gradient(endpoint):
    """A NaN in the local parameters (here: one poisoned inner step, whose AdamW moments stay NaN)
    would make the daemon skip the outer step for every worker, at every sync from then on. The
    worker raises, naming the parameter and sending nothing; the session is where it was."""
    model = TinyNet(seed=SEED)
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    with muond.DiLoCo(model, inner, sync_every=2, endpoint=endpoint) as diloco:
        inner_step(model, inner, 0, 1)
        diloco.step()
        inner_step(model, inner, 0, 2)
        model.up.weight.grad.fill_(float("nan"))  # the inner step of the sync poisons up.weight
        with pytest.raises(RuntimeError, match="the pseudo-gradient of 'up.weight' is not finite"):
            diloco.step()
        assert diloco.remote.last_step == 0
        assert all(torch.isfinite(g).all() for g in diloco.global_parameters().values())


def test_a_worker_with_other_fragments_is_refused_at_attach(endpoint):
    """Workers split the parameters by their own F; one whose F differs from the session's would
    send other fragments at each session step and stall the others. The session carries F as a
    label (``diloco.fragments``) and the daemon refuses the attach, naming it; the label beside a
    user's own is kept, and a user cannot set DiLoCo's."""
    session = session_name()
    models = [TinyNet(seed=SEED) for _ in range(3)]
    inners = [torch.optim.AdamW(m.parameters(), **INNER) for m in models]
    first = muond.DiLoCo(models[0], inners[0], sync_every=4, fragments=2, endpoint=endpoint,
                         session=session, world_size=2, rank=0, labels={"run": "r1"})
    try:
        assert first.remote.labels == {"run": "r1", "diloco.fragments": "2"}
        with pytest.raises(muond.MuondError) as refused:
            muond.DiLoCo(models[1], inners[1], sync_every=4, fragments=1, endpoint=endpoint,
                         session=session, world_size=2, rank=1, labels={"run": "r1"})
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert "spec.labels['diloco.fragments']: the session's is '2', this request's '1'" in (
            refused.value.details)
        # The caller's labels in ranks= (and return_dtype in wire=) this time: the option objects
        # take DiLoCo's own world_size, rank and wire_dtype; the same labels, so it attaches.
        second = muond.DiLoCo(models[2], inners[2], sync_every=4, fragments=2, endpoint=endpoint,
                              session=session, world_size=2, rank=1,
                              ranks=muond.RankOptions(labels={"run": "r1"}),
                              wire=muond.WireOptions(return_dtype="fp32"))
        assert (second.remote.world_size, second.remote.rank) == (2, 1)
        assert second.remote.attached and second.remote.labels == first.remote.labels
        second.close(keep_session=True)
    finally:
        first.close(keep_session=True)
        end_session(endpoint, session)
    with pytest.raises(ValueError, match="labels: 'diloco.fragments' is DiLoCo's own"):
        muond.DiLoCo(models[0], inners[0], sync_every=2, endpoint=endpoint,
                     labels={"diloco.fragments": "1"})
    with pytest.raises(ValueError, match="labels: at most 15 with DiLoCo, which adds 'diloco.fragments'"):
        muond.DiLoCo(models[0], inners[0], sync_every=2, endpoint=endpoint,
                     labels={f"k{i}": "v" for i in range(16)})
    for world_size, error, message in ((0, ValueError, "world_size: must be at least 1, got 0"),
                                       ("abc", TypeError, "world_size: must be an integer, got 'abc'")):
        with pytest.raises(error, match=message):
            muond.DiLoCo(models[0], inners[0], sync_every=2, endpoint=endpoint, sync_mode="async",
                         world_size=world_size)
    with pytest.raises(TypeError, match="ranks.rank: give rank to DiLoCo itself"):
        muond.DiLoCo(models[0], inners[0], sync_every=2, endpoint=endpoint, ranks=muond.RankOptions(rank=0))
    with pytest.raises(TypeError, match="wire.wire_dtype: give wire_dtype to DiLoCo itself"):
        muond.DiLoCo(models[0], inners[0], sync_every=2, endpoint=endpoint,
                     wire=muond.WireOptions(wire_dtype="bf16"))
