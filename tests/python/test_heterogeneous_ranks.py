"""Ranks that differ, from Python, against the real daemon with one process per rank: weighted
averages (``step(weight=)``) equal one rank sending Σ w·g / Σ w bit for bit; quorum sessions
(``sync_mode="quorum"``) go on without a late, absent or killed rank, which is told
(``last_info.included``), gets the session's parameters and continues; a killed rank restarted as a
new process attaches and rejoins; nothing is lost or applied twice, through daemon restarts too
(journal and clean). Bad weights and sync options are refused naming the argument.

Each rank is a spawned process driven over a pipe, so the test decides who sends which step when.
Arrival order is pinned by waiting for the daemon's debug line "session <id>: step <k> has <n> of
<N> ranks; rank <r> waits", or for the answers themselves, never by sleeping. Quorum sessions use a
grace of 0 where a step must go without a rank, and one no busy machine exhausts where a rank must
arrive within it.
"""

import dataclasses
import io
import math
import re
import time
import traceback
import uuid
from pathlib import Path

import grpc
import pytest
import torch

import muond
from muond import ranks as ranks_module
from muond import options, session_spec, shard_step
from muond.naming import named_groups
from muond._stubs import pb
from muond.step_info import rank_report

from helpers import TinyNet, params_of
from processes import rank_context

SEED = 61
WORLD = 3
WAIT = 300  # seconds: a bound on waiting for an event, never an expected duration
LONG_GRACE = 600.0  # a grace no busy machine exhausts
DEBUG_FLAGS = ("--log-level", "debug", "--straggler-timeout", "900")


# -- gradients and the reference -------------------------------------------------------------------

def shapes():
    return {n: tuple(p.shape) for n, p in TinyNet(seed=SEED).named_parameters()}


def grads_of(rank: int, step: int):
    """Rank ``rank``'s gradients of step ``step`` (any process computes the same ones)."""
    gen = torch.Generator().manual_seed(10_000 + 100 * rank + step)
    return {n: torch.randn(shape, generator=gen) for n, shape in shapes().items()}


def weighted_mean(parts):
    """Σ w·g / Σ w per parameter over ``parts`` [(weight, grads)] in rank order, in fp64, rounded
    once to fp32: the daemon's rule."""
    total = 0.0
    for weight, _ in parts:
        total += weight
    mean = {}
    for name in parts[0][1]:
        acc = torch.zeros(parts[0][1][name].shape, dtype=torch.float64)
        for weight, grads in parts:
            acc += weight * grads[name].double()
        mean[name] = (acc / total).float()
    return mean


def one_rank(endpoint, steps):
    """The parameters a one-rank session reaches from the ranks' initial ones by stepping the
    gradients ``steps`` (in order)."""
    model = TinyNet(seed=SEED)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                               world_size=1, rank=0) as opt:
        for grads in steps:
            for name, p in model.named_parameters():
                p.grad = grads[name].clone()
            opt.step()
            assert opt.last_info.applied and opt.last_info.included
    return params_of(model)


def assert_params(actual, expected, what):
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{what}: {name} differs"


# -- one process per rank --------------------------------------------------------------------------

def _packed(tensors) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def _rank_main(rank, endpoint, session, options, pipe):
    """A rank's process: makes its RemoteOptimizer, then runs the parent's commands — ("step",
    step, weight): its gradients of ``step`` (which labels the data, not the step number it
    sends); ("resend", step, weight): the same, numbered as the last step (a retry whose answer
    was lost); ("close",) — answering each with what the optimizer saw."""
    torch.set_num_threads(1)
    try:
        model = TinyNet(seed=SEED)
        opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                    session=session, world_size=WORLD, rank=rank, **options)
        pipe.send(("ready", {"attached": opt.attached, "last_step": opt.last_step,
                             "params": _packed(params_of(model))}))
        while True:
            try:
                command, *args = pipe.recv()
            except EOFError:
                return
            if command == "close":
                opt.close()
                pipe.send(("closed", {}))
                return
            step, weight = args
            if command == "resend":
                opt.last_step -= 1
            for name, p in model.named_parameters():
                p.grad = grads_of(rank, step)[name]
            opt.step(weight=weight)
            pipe.send(("stepped", {"info": dataclasses.asdict(opt.last_info),
                                   "last_step": opt.last_step,
                                   "params": _packed(params_of(model))}))
    except BaseException:  # noqa: BLE001 - the parent reports it
        pipe.send(("error", traceback.format_exc()))


class Rank:
    """The parent's handle of one rank process."""

    def __init__(self, rank, endpoint, session, **options):
        context = rank_context()
        self.rank = rank
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=_rank_main, daemon=True,
                                       args=(rank, endpoint, session, options, theirs))
        self.process.start()
        theirs.close()
        self.ready = self._answer("ready")
        self.ready["params"] = torch.load(io.BytesIO(self.ready["params"]))

    def _answer(self, expected):
        if not self.pipe.poll(WAIT):
            raise AssertionError(f"rank {self.rank} did not answer within {WAIT} s")
        kind, body = self.pipe.recv()
        if kind == "error":
            raise AssertionError(f"rank {self.rank} failed:\n{body}")
        assert kind == expected, (kind, expected)
        return body

    def start_step(self, step, weight=None, command="step"):
        self.pipe.send((command, step, weight))

    def answer(self):
        """The answer of the step started last: (StepInfo fields, last_step, parameters)."""
        body = self._answer("stepped")
        return body["info"], body["last_step"], torch.load(io.BytesIO(body["params"]))

    def step(self, step, weight=None):
        self.start_step(step, weight)
        return self.answer()

    def resend(self, step, weight=None):
        self.start_step(step, weight, command="resend")
        return self.answer()

    def kill(self):
        """SIGKILL: the process ends at once, without closing anything."""
        self.process.kill()
        self.process.join()

    def close(self):
        if self.process.is_alive():
            self.pipe.send(("close",))
            self._answer("closed")
        self.process.join(WAIT)


@pytest.fixture
def rank_processes():
    """``start(rank, endpoint, session, **options)`` starts a rank process (after the ones started
    before it are ready); every one still alive is closed after the test, rank 0 last."""
    started = []

    def start(rank, endpoint, session, **options):
        process = Rank(rank, endpoint, session, **options)
        started.append(process)
        return process

    yield start
    for process in sorted(started, key=lambda p: p.rank == 0):
        try:
            process.close()
        except (AssertionError, OSError):
            process.kill()


def log_size(daemon) -> int:
    return daemon.log_path.stat().st_size


def wait_for_log(daemon, text, since):
    """Returns once the daemon's log has ``text`` after byte ``since``."""
    deadline = time.monotonic() + WAIT
    while True:
        with open(daemon.log_path, "rb") as log:
            log.seek(since)
            if text in log.read().decode(errors="replace"):
                return
        assert daemon.alive(), f"the daemon died:\n{daemon.log_tail()}"
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in the daemon's log within {WAIT} s:\n"
                                 f"{daemon.log_tail()}")
        time.sleep(0.01)


def send_and_wait(daemon, session, rank, step, arrived, data_step=None, weight=None):
    """``rank`` sends ``step`` (its gradients of ``data_step``, default ``step``); returns once the
    daemon says it waits with ``arrived`` ranks there."""
    since = log_size(daemon)
    rank.start_step(step if data_step is None else data_step, weight)
    wait_for_log(daemon, f"session {session}: step {step} has {arrived} of {WORLD} ranks; "
                         f"rank {rank.rank} waits", since)


def fresh_session(name):
    return f"{name}-{uuid.uuid4().hex[:8]}"


def quorum(min_ranks=2, grace_seconds=0.0):
    return {"sync_mode": "quorum", "min_ranks": min_ranks, "grace_seconds": grace_seconds}


# -- weighted averages ---------------------------------------------------------------------------

@pytest.mark.slow
def test_weighted_ranks_equal_one_rank_sending_the_weighted_mean(endpoint, rank_processes):
    session = fresh_session("weighted")
    ranks = [rank_processes(r, endpoint, session) for r in range(WORLD)]
    applied = []
    for step, weights in ((1, (1.0, 2.5, 4.0)), (2, (3.0, 0.5, 1.0))):
        for rank, weight in zip(ranks, weights):
            rank.start_step(step, weight)
        answers = [rank.answer() for rank in ranks]
        for info, last_step, _ in answers:
            assert info["applied"] and info["included"] and not info["replayed"]
            assert info["contributors"] == (0, 1, 2)
            assert info["total_weight"] == sum(weights)
            assert info["step"] == last_step == step
        applied.append(weighted_mean([(w, grads_of(r, step)) for r, w in enumerate(weights)]))
        expected = one_rank(endpoint, applied)
        for r, (_, _, params) in enumerate(answers):
            assert_params(params, expected, f"rank {r} after step {step}")


# -- quorum ----------------------------------------------------------------------------------------

def quorum_step(daemon, session, step, first, second, weights=(1.0, 1.0), late=None):
    """Step ``step`` of a quorum session with Q = 2 and grace 0: ``first`` sends and waits, then
    ``second`` completes the quorum; then ``late`` (if given) sends the step after it was taken.
    Checks the answers; returns the gradients the step applied and the parameters each rank holds
    after it, by rank."""
    send_and_wait(daemon, session, first, step, 1, weight=weights[0])
    answers = {second.rank: second.step(step, weight=weights[1]), first.rank: first.answer()}
    used = sorted(answers)
    for info, last_step, _ in answers.values():
        assert info["applied"] and info["included"] and not info["replayed"]
        assert info["contributors"] == tuple(used) and info["total_weight"] == sum(weights)
        assert info["step"] == last_step == step
    if late is not None:
        answers[late.rank] = late.step(step)
        info, last_step, _ = answers[late.rank]
        # Not used: answered with the parameters after the step, which it continues from.
        assert not info["included"] and info["replayed"] and info["contributors"] == tuple(used)
        assert info["step"] == last_step == step
    by_rank = dict(zip((first.rank, second.rank), weights))
    mean = weighted_mean([(by_rank[r], grads_of(r, step)) for r in used])
    return mean, {rank: params for rank, (_, _, params) in answers.items()}


def assert_all(params_by_rank, expected, what):
    for rank, params in params_by_rank.items():
        assert_params(params, expected, f"rank {rank} {what}")


@pytest.mark.slow
def test_quorum_goes_on_without_a_late_rank_and_a_killed_rank_rejoins(start_daemon, endpoint,
                                                                       rank_processes):
    daemon = start_daemon(*DEBUG_FLAGS)
    session = fresh_session("quorum")
    ranks = [rank_processes(r, daemon.endpoint, session, **quorum()) for r in range(WORLD)]
    applied = []

    # Step 1: ranks 0 and 1 (weights 3 and 1); rank 2's comes late: not used, and it gets the
    # parameters after step 1. Step 2: rank 2's next step counts; rank 1 is the late one now.
    for step, first, second, weights, late in ((1, 0, 1, (3.0, 1.0), 2), (2, 2, 0, (1.0, 1.0), 1)):
        mean, params = quorum_step(daemon, session, step, ranks[first], ranks[second], weights,
                                   late=ranks[late])
        applied.append(mean)
        assert_all(params, one_rank(endpoint, applied), f"after step {step}")

    # Rank 2 is killed (SIGKILL); steps 3 and 4 go on with ranks 0 and 1.
    ranks[2].kill()
    for step in (3, 4):
        applied.append(quorum_step(daemon, session, step, ranks[0], ranks[1])[0])

    # A new process for rank 2 attaches at the session's step with its parameters and rejoins.
    ranks[2] = rank_processes(2, daemon.endpoint, session, **quorum())
    assert ranks[2].ready["attached"] and ranks[2].ready["last_step"] == 4
    assert_params(ranks[2].ready["params"], one_rank(endpoint, applied), "restarted rank 2")
    mean, params = quorum_step(daemon, session, 5, ranks[2], ranks[1], late=ranks[0])
    applied.append(mean)
    assert_all(params, one_rank(endpoint, applied), "after step 5")

    # Rank 2 is killed while its step 6 waits: the gradients the daemon received stay in the
    # step, which rank 0 completes; the restarted rank 2 attaches after it, and rank 1 is late.
    send_and_wait(daemon, session, ranks[2], 6, 1)
    ranks[2].kill()
    info, _, params0 = ranks[0].step(6)
    assert info["contributors"] == (0, 2) and info["included"]
    applied.append(weighted_mean([(1.0, grads_of(0, 6)), (1.0, grads_of(2, 6))]))
    ranks[2] = rank_processes(2, daemon.endpoint, session, **quorum())
    assert ranks[2].ready["last_step"] == 6
    info, last_step, params1 = ranks[1].step(6)
    assert not info["included"] and last_step == 6

    # Every step was applied once, with exactly the gradients of the ranks it names.
    assert_all({0: params0, 1: params1, 2: ranks[2].ready["params"]}, one_rank(endpoint, applied),
               "after step 6")


@pytest.mark.slow
def test_quorum_rank_arriving_within_the_grace_counts(start_daemon, endpoint, rank_processes):
    daemon = start_daemon(*DEBUG_FLAGS)
    session = fresh_session("grace")
    ranks = [rank_processes(r, daemon.endpoint, session, **quorum(2, LONG_GRACE))
             for r in range(WORLD)]
    send_and_wait(daemon, session, ranks[0], 1, 1)
    send_and_wait(daemon, session, ranks[1], 1, 2)  # the quorum is there; the grace runs
    answers = {2: ranks[2].step(1, weight=2.0), 0: ranks[0].answer(), 1: ranks[1].answer()}
    for info, _, _ in answers.values():
        assert info["contributors"] == (0, 1, 2) and info["total_weight"] == 4.0 and info["included"]
    expected = one_rank(endpoint, [weighted_mean([(1.0, grads_of(0, 1)), (1.0, grads_of(1, 1)),
                                                  (2.0, grads_of(2, 1))])])
    assert_all({r: params for r, (_, _, params) in answers.items()}, expected, "after step 1")


@pytest.mark.slow
def test_quorum_through_daemon_restarts(start_daemon, endpoint, rank_processes, tmp_path):
    flags = ("--state-dir", tmp_path / "state", "--durability", "journal", *DEBUG_FLAGS)
    daemon = start_daemon(*flags)
    session = fresh_session("quorum-restart")
    # Enough tries, each waiting for the channel, to ride over a restart between two steps.
    options = dict(quorum(), max_step_attempts=30, retry_backoff=0.05)
    ranks = [rank_processes(r, daemon.endpoint, session, **options) for r in range(WORLD)]
    applied = []

    def restart(crash):
        nonlocal daemon
        if crash:
            daemon.kill()  # no final checkpoint: the journal has the steps and their contributors
        else:
            assert daemon.stop() == 0  # a checkpoint, which empties the journal
        daemon = start_daemon(*flags, listen=daemon.endpoint, workdir=daemon.workdir)

    # Step 1 by ranks 0 and 1, then the daemon crashes and comes back from its journal.
    applied.append(quorum_step(daemon, session, 1, ranks[0], ranks[1])[0])
    restart(crash=True)
    after = one_rank(endpoint, applied)
    info, last_step, params = ranks[2].step(1)  # late, after the restart
    assert not info["included"] and last_step == 1 and info["contributors"] == (0, 1)
    assert_params(params, after, "late rank 2 after the crash")
    info, last_step, params = ranks[0].resend(1)  # rank 0 lost its answer: the journal knows it
    assert info["replayed"] and info["included"] and last_step == 1
    assert_params(params, after, "rank 0's retry after the crash")

    # Step 2 by ranks 2 and 1, then a clean restart from the checkpoint it writes.
    applied.append(quorum_step(daemon, session, 2, ranks[2], ranks[1])[0])
    restart(crash=False)
    after = one_rank(endpoint, applied)
    info, last_step, params = ranks[0].step(2)
    assert not info["included"] and last_step == 2 and info["contributors"] == (1, 2)
    assert_params(params, after, "late rank 0 after the clean restart")
    # The checkpoint keeps who contributed to step 2: rank 1, which did, retries and is told so.
    info, last_step, params = ranks[1].resend(2)
    assert info["replayed"] and info["included"] and last_step == 2
    assert info["contributors"] == (1, 2) and info["total_weight"] == 2.0
    assert_params(params, after, "rank 1's retry after the clean restart")

    # Step 3 goes on as usual; nothing was lost or applied twice.
    mean, params = quorum_step(daemon, session, 3, ranks[0], ranks[1], late=ranks[2])
    applied.append(mean)
    assert_all(params, one_rank(endpoint, applied), "after step 3")


# -- bad input -----------------------------------------------------------------------------------

def test_bad_weights_are_refused_naming_weight_and_change_nothing(endpoint, monkeypatch):
    model = TinyNet(seed=SEED)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                               world_size=1, rank=0) as opt:
        before = params_of(model)
        for name, p in model.named_parameters():
            p.grad = grads_of(0, 1)[name]
        for weight in (0.0, -1.0, math.nan, math.inf, -math.inf, 1.0000001e30, 1e308):
            with pytest.raises(ValueError, match=r"^weight: must be > 0 and at most 1e\+30, got"):
                opt.step(weight=weight)
        for weight in ("2", True, [1.0]):
            with pytest.raises(TypeError, match=r"^weight: must be a number"):
                opt.step(weight=weight)
        # What the check lets through, the daemon refuses the same way; the error passes through.
        monkeypatch.setattr(ranks_module, "check_weight", lambda w: w)
        for weight in (0.0, -1.0, math.nan, math.inf, 1e308):
            with pytest.raises(muond.MuondError) as err:
                opt.step(weight=weight)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "header.weight: must be > 0 and at most 1e+30" in err.value.details
        monkeypatch.undo()
        assert opt.last_step == 0 and opt.last_info is None
        assert opt.state_dict()["muond"]["last_step"] == 0
        assert_params(params_of(model), before, "after refused steps")
        # With one rank a weight changes nothing but the total it reports.
        opt.step(weight=torch.tensor(3.0))
        info = opt.last_info
        assert (info.step, info.contributors, info.total_weight, info.included) == (1, (0,), 3.0, True)
    assert_params(params_of(model), one_rank(endpoint, [grads_of(0, 1)]), "a weighted one-rank step")

    local = muond.LocalOptimizer(muond.default_param_groups(TinyNet(seed=SEED)))
    with pytest.raises(ValueError, match=r"^weight: must be > 0 and at most 1e\+30"):
        local.step(weight=0.0)
    assert local.last_step == 0


def test_the_clients_largest_weight_is_the_daemons():
    # One bound, written in the daemon's header and repeated by the Python client, which refuses
    # a larger weight before anything is sent.
    header = (Path(__file__).resolve().parents[2] / "server" / "session" / "step_plan.h").read_text()
    bound = re.search(r"inline constexpr double kMaxStepWeight = ([0-9.e+]+);", header)
    assert bound is not None, "kMaxStepWeight is not in server/session/step_plan.h"
    assert float(bound.group(1)) == ranks_module.MAX_WEIGHT


@pytest.mark.parametrize("options, error, message", [
    ({"sync_mode": "bogus"}, ValueError,
     r"^sync_mode: must be 'lockstep', 'quorum' or 'async', got 'bogus'"),
    ({"sync_mode": 2}, ValueError, r"^sync_mode: must be"),
    ({"sync_mode": "quorum", "min_ranks": 4}, ValueError,
     r"^min_ranks: must be between 1 and world_size \(3\), got 4"),
    ({"sync_mode": "quorum", "min_ranks": 0}, ValueError, r"^min_ranks: must be between 1"),
    ({"sync_mode": "quorum", "min_ranks": -1}, ValueError, r"^min_ranks: must be between 1"),
    ({"sync_mode": "quorum", "min_ranks": 2.0}, TypeError, r"^min_ranks: must be an int"),
    ({"sync_mode": "quorum", "grace_seconds": -0.5}, ValueError,
     r"^grace_seconds: must be finite and >= 0, got -0.5"),
    ({"sync_mode": "quorum", "grace_seconds": math.nan}, ValueError, r"^grace_seconds: must be finite"),
    ({"sync_mode": "quorum", "grace_seconds": math.inf}, ValueError, r"^grace_seconds: must be finite"),
    ({"sync_mode": "quorum", "grace_seconds": "1"}, TypeError, r"^grace_seconds: must be a number"),
    ({"min_ranks": 2}, ValueError, r"^min_ranks: applies to sync_mode='quorum' only"),
    ({"sync_mode": "lockstep", "grace_seconds": 1.0}, ValueError,
     r"^grace_seconds: applies to sync_mode='quorum' only"),
])
def test_bad_sync_options_are_refused_naming_the_argument(endpoint, options, error, message):
    session = fresh_session("bad-sync")
    with pytest.raises(error, match=message):
        muond.RemoteOptimizer(muond.default_param_groups(TinyNet(seed=SEED)), endpoint=endpoint,
                              session=session, world_size=WORLD, rank=0, **options)
    assert session not in {s.session_id for s in muond.Connection(endpoint).list_sessions()}


def test_quorum_is_refused_on_several_endpoints():
    with pytest.raises(ValueError, match=r"^sync_mode: quorum steps are not available on a sharded"):
        muond.RemoteOptimizer(muond.default_param_groups(TinyNet(seed=SEED)),
                              endpoints=["127.0.0.1:1", "127.0.0.1:2"], session=fresh_session("sharded"),
                              world_size=WORLD, rank=0, sync_mode="quorum")


@pytest.mark.parametrize("sync, field", [
    (ranks_module.Sync("quorum", 4, 0.0), "spec.sync.min_ranks: must be between 1 and world_size (3), got 4"),
    (ranks_module.Sync("quorum", 2, -0.5), "spec.sync.grace_seconds: must be finite and >= 0"),
])
def test_the_daemons_sync_errors_pass_through(endpoint, monkeypatch, sync, field):
    monkeypatch.setattr(ranks_module, "sync_of", lambda *args, **kwargs: sync)
    session = fresh_session("daemon-sync")
    with pytest.raises(muond.MuondError) as err:
        muond.RemoteOptimizer(muond.default_param_groups(TinyNet(seed=SEED)), endpoint=endpoint,
                              session=session, world_size=WORLD, rank=0, sync_mode="quorum")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details
    assert session not in {s.session_id for s in muond.Connection(endpoint).list_sessions()}


# -- without a daemon ------------------------------------------------------------------------------

def test_the_spec_carries_quorum_and_leaves_lockstep_unset():
    named, _ = named_groups(muond.default_param_groups(TinyNet(seed=SEED)))
    groups = [dict(options.resolve_group(g, {}), param_names=g["param_names"]) for g in named]

    def spec(sync):
        return session_spec.whole_spec(groups, [f"g{i}" for i in range(len(groups))], [],
                                       world_size=WORLD, wire_dtype="fp32", return_dtype="fp32",
                                       loss_scaler=None, sync=sync)

    assert not spec(ranks_module.Sync()).HasField("sync")
    quorum_spec = spec(ranks_module.sync_of("quorum", None, None, world_size=WORLD, num_daemons=1))
    assert (quorum_spec.sync.mode, quorum_spec.sync.min_ranks, quorum_spec.sync.grace_seconds) == \
        (pb.SYNC_MODE_QUORUM, WORLD, 0.0)


def test_an_answer_without_contributors_is_read_as_the_daemon_meant_it():
    # An older daemon: no contributors, `included` unset; it applied every rank's gradients.
    for quorum_session in (False, True):
        assert rank_report(pb.StepResult(step=3, applied=True), quorum_session) == ((), 0.0, True)
    assert rank_report(pb.StepResult(step=3, replayed=True), False) == ((), 0.0, True)
    # A daemon restored from a checkpoint answering a retry of a step from before: it no longer
    # knows who contributed, which a quorum session answers included = False.
    assert rank_report(pb.StepResult(step=3, replayed=True), True) == ((), 0.0, False)
    assert rank_report(pb.StepResult(step=3, replayed=True, included=True), True) == ((), 0.0, True)
    late = pb.StepResult(step=3, contributors=[0, 2], total_weight=2.5, included=False)
    assert rank_report(late, True) == ((0, 2), 2.5, False)


def test_a_sharded_result_keeps_the_ranks_report():
    commit = pb.StepHeader(step=4, phase=pb.STEP_PHASE_COMMIT)
    answers = [pb.StepResult(step=4, applied=True, contributors=[0, 1], total_weight=3.0,
                             included=True) for _ in range(2)]
    result = shard_step.result_of(commit, answers, 4)
    assert (result.step, list(result.contributors), result.total_weight, result.included) == \
        (4, [0, 1], 3.0, True)
