"""Asynchronous sessions from Python (``sync_mode="async"``) against the real daemon, one process per
rank: every push is applied once, on arrival, as the next global step, and the parameters equal, bit
for bit, a one-rank session fed the same gradients in the recorded global order (each step's lrs
times 1 / (1 + staleness) under inverse scaling, as per-step lr overrides); a push more than
max_staleness global steps behind is dropped without an exception, the rank takes the latest
parameters and its next push goes through; a resend is answered from the rank's record and not
applied again; a SIGKILLed daemon (journal) and a cleanly stopped one (checkpoint) come back with the
same parameters and every rank's push record, and the ranks continue exactly once; a killed rank
restarted from its state dict resumes its push numbering; bad options are refused naming the
argument.

The test driver sends the pushes one after another (each rank answers before the next push starts),
so the global order is the order of the calls; nothing waits on time.
"""

import dataclasses
import io
import math
import traceback

import pytest
import torch

import muond
from muond import options, ranks as ranks_module, session_spec
from muond._stubs import pb
from muond.naming import named_groups

from helpers import TinyNet, params_of
from processes import rank_context
from test_heterogeneous_ranks import (SEED, Rank, _packed, assert_params, fresh_session,
                                      grads_of)
# The bodies of the sync option tests, given the async cases (imported under names pytest does
# not collect again).
from test_heterogeneous_ranks import (
    test_bad_sync_options_are_refused_naming_the_argument as refused_naming_the_argument,
    test_the_daemons_sync_errors_pass_through as the_daemons_error_passes_through)

WORLD = 3
# Enough tries, each waiting for the channel, to ride over a daemon restart between two pushes.
RETRIES = dict(max_step_attempts=30, retry_backoff=0.05)


def asynchronous(max_staleness, scaling="none", **more):
    return {"sync_mode": "async", "max_staleness": max_staleness, "staleness_scaling": scaling,
            **more}


# -- one process per rank --------------------------------------------------------------------------

def _async_rank_main(rank, endpoint, session, options, pipe):
    """A rank's process: makes its RemoteOptimizer, then runs the parent's commands — ("push",
    data, weight): its gradients of ``data`` as its next push; ("resend", data, weight): the same,
    numbered as its last push (a retry whose answer was lost); ("save",): its state dict;
    ("load", state): ``load_state_dict``; ("close",) — answering each with what it saw."""
    torch.set_num_threads(1)
    try:
        model = TinyNet(seed=SEED)
        opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                    session=session, world_size=WORLD, rank=rank, **options)

        def seen(**more):
            return {"last_step": opt.last_step, "pushes": opt.pushes,
                    "stale_pushes": opt.stale_pushes, "params": _packed(params_of(model)), **more}

        pipe.send(("ready", seen(attached=opt.attached)))
        while True:
            try:
                command, *args = pipe.recv()
            except EOFError:
                return
            if command == "close":
                opt.close(keep_session=True)
                pipe.send(("closed", {}))
                return
            if command == "save":
                pipe.send(("saved", {"state": _packed(opt.state_dict())}))
                continue
            if command == "load":
                opt.load_state_dict(torch.load(io.BytesIO(args[0])))
                pipe.send(("loaded", seen()))
                continue
            data, weight = args
            if command == "resend":
                opt.pushes -= 1
            for name, p in model.named_parameters():
                p.grad = grads_of(rank, data)[name]
            opt.step(weight=weight)
            pipe.send(("pushed", seen(info=dataclasses.asdict(opt.last_info))))
    except BaseException:  # noqa: BLE001 - the parent reports it
        pipe.send(("error", traceback.format_exc()))


class AsyncRank(Rank):
    """The parent's handle of one rank process of an asynchronous session (``Rank``'s, with
    another process body: its own constructor starts it)."""

    def __init__(self, rank, endpoint, session, **options):  # pylint: disable=super-init-not-called
        context = rank_context()
        self.rank = rank
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=_async_rank_main, daemon=True,
                                       args=(rank, endpoint, session, options, theirs))
        self.process.start()
        theirs.close()
        self.ready = self._unpacked(self._answer("ready"))

    @staticmethod
    def _unpacked(body):
        body["params"] = torch.load(io.BytesIO(body["params"]))
        return body

    def push(self, data, weight=None, command="push"):
        """The rank pushes its gradients of ``data``; returns what it saw (``info``: last_info)."""
        self.pipe.send((command, data, weight))
        return self._unpacked(self._answer("pushed"))

    def resend(self, data, weight=None):
        return self.push(data, weight, command="resend")

    def save(self):
        self.pipe.send(("save",))
        return self._answer("saved")["state"]

    def load(self, state):
        self.pipe.send(("load", state))
        return self._unpacked(self._answer("loaded"))


@pytest.fixture
def rank_processes():
    """``start(rank, endpoint, session, **options)`` starts a rank process; every one still alive
    is closed after the test (keeping the session, which the daemon's stop ends)."""
    started = []

    def start(rank, endpoint, session, **options):
        process = AsyncRank(rank, endpoint, session, **options)
        started.append(process)
        return process

    yield start
    for process in started:
        try:
            process.close()
        except (AssertionError, OSError):
            process.kill()


# -- the reference ---------------------------------------------------------------------------------

class OneRank:
    """A one-rank lock-step session from the ranks' initial parameters, stepped with the pushes'
    gradients in the global order, each step's lrs times the factor given with it."""

    def __init__(self, endpoint):
        self.model = TinyNet(seed=SEED)
        self.opt = muond.RemoteOptimizer(muond.default_param_groups(self.model),
                                         endpoint=endpoint, world_size=1, rank=0)
        self.lrs = [group["lr"] for group in self.opt.param_groups]

    def step(self, grads, factor=1.0):
        for group, lr in zip(self.opt.param_groups, self.lrs):
            group["lr"] = lr * factor
        for name, p in self.model.named_parameters():
            p.grad = grads[name].clone()
        self.opt.step()
        assert self.opt.last_info.applied
        return params_of(self.model)

    def close(self):
        self.opt.close()


@pytest.fixture
def one_rank():
    made = []

    def make(endpoint):
        made.append(OneRank(endpoint))
        return made[-1]

    yield make
    for reference in made:
        reference.close()


def factor(scaling, staleness):
    """The lr factor of a push ``staleness`` behind, as docs/ranks.md writes it."""
    name, *params = (scaling,) if isinstance(scaling, str) else scaling
    if name == "inverse":
        return 1.0 / (1.0 + staleness)
    if name == "polynomial":  # FedAsync's
        return (1.0 + staleness) ** -params[0]
    if name == "hinge":  # FedAsync's
        a, b = params
        return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)
    return 1.0


def assert_pushed(seen, *, global_step, staleness, rank, pushes, weight=1.0):
    """A push applied now as ``global_step``, the latest: the rank holds its parameters."""
    info = seen["info"]
    assert info["applied"] and info["included"] and not info["replayed"] and not info["stale"]
    assert (info["global_step"], info["staleness"], info["step"]) == (global_step, staleness,
                                                                     global_step)
    assert (info["contributors"], info["total_weight"]) == ((rank,), weight)
    assert (seen["last_step"], seen["pushes"]) == (global_step, pushes)


# -- the order, the bound, resends ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["none", "inverse", ("polynomial", 0.5), ("polynomial", 2),
                                     ("hinge", 0.5, 1)])
def test_every_push_is_the_next_global_step_once_and_equals_one_rank(endpoint, rank_processes,
                                                                      one_rank, scaling):
    session = fresh_session(f"async-{scaling if isinstance(scaling, str) else scaling[0]}")
    ranks = [rank_processes(r, endpoint, session, **asynchronous(3, scaling))
             for r in range(WORLD)]
    for rank in ranks:
        assert (rank.ready["last_step"], rank.ready["pushes"]) == (0, 0)
    reference = one_rank(endpoint)
    # (rank, its data, weight, the staleness the push has: global steps since its base).
    pushes = [(0, 1, None, 0), (1, 1, 2.5, 1), (2, 1, None, 2), (0, 2, None, 2), (2, 2, None, 1),
              (1, 2, None, 3)]
    count = [0] * WORLD
    for global_step, (r, data, weight, staleness) in enumerate(pushes, start=1):
        count[r] += 1
        seen = ranks[r].push(data, weight)
        assert_pushed(seen, global_step=global_step, staleness=staleness, rank=r,
                      pushes=count[r], weight=1.0 if weight is None else weight)
        expected = reference.step(grads_of(r, data), factor(scaling, staleness))
        assert_params(seen["params"], expected, f"rank {r}'s push {count[r]}")


def test_a_stale_push_is_dropped_and_the_rank_takes_the_latest_parameters(endpoint,
                                                                          rank_processes,
                                                                          one_rank):
    session = fresh_session("async-stale")
    ranks = [rank_processes(r, endpoint, session, **asynchronous(1)) for r in range(WORLD)]
    reference = one_rank(endpoint)
    reference.step(grads_of(0, 1))
    assert_pushed(ranks[0].push(1), global_step=1, staleness=0, rank=0, pushes=1)
    latest = ranks[1].push(1)
    assert_pushed(latest, global_step=2, staleness=1, rank=1, pushes=1)
    assert_params(latest["params"], reference.step(grads_of(1, 1)), "after global step 2")

    # Rank 2's push computed on global step 0 is 2 behind, more than 1: no exception, nothing
    # applied, and the rank holds the session's latest parameters, the base of its next push.
    seen = ranks[2].push(1)
    info = seen["info"]
    assert info["stale"] and not info["applied"] and not info["included"]
    assert (info["step"], info["global_step"], info["staleness"]) == (2, None, 2)
    assert (info["contributors"], info["total_weight"], info["skip_reason"]) == ((), 0.0,
                                                                                "push too stale")
    assert math.isnan(info["grad_norm"])
    assert (seen["last_step"], seen["pushes"], seen["stale_pushes"]) == (2, 0, 1)
    assert_params(seen["params"], latest["params"], "the stale rank's refreshed parameters")

    # Its push number stayed free: the next push is its first, fresh, and goes through.
    seen = ranks[2].push(2)
    assert_pushed(seen, global_step=3, staleness=0, rank=2, pushes=1)
    assert seen["stale_pushes"] == 1
    assert_params(seen["params"], reference.step(grads_of(2, 2)), "after global step 3")


@pytest.mark.slow
def test_a_resend_is_answered_from_the_record_and_not_applied_again(endpoint, rank_processes,
                                                                   one_rank):
    session = fresh_session("async-resend")
    ranks = [rank_processes(r, endpoint, session, **asynchronous(4)) for r in range(2)]
    reference = one_rank(endpoint)
    ranks[0].push(1)
    reference.step(grads_of(0, 1))
    latest = ranks[1].push(1)
    assert_params(latest["params"], reference.step(grads_of(1, 1)), "after global step 2")

    # Rank 0 lost its answer and sends push 1 again: the global step it became, the session's
    # latest parameters, no second update.
    seen = ranks[0].resend(1)
    info = seen["info"]
    assert info["replayed"] and info["included"] and not info["stale"]
    assert (info["global_step"], info["staleness"], info["step"]) == (1, 0, 2)
    assert info["contributors"] == (0,)
    assert (seen["last_step"], seen["pushes"]) == (2, 1)
    assert_params(seen["params"], latest["params"], "rank 0's resend")

    seen = ranks[0].push(2)
    assert_pushed(seen, global_step=3, staleness=0, rank=0, pushes=2)
    assert_params(seen["params"], reference.step(grads_of(0, 2)), "after global step 3")


# -- restarts --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_daemon_restarts_keep_the_global_order_and_every_ranks_record(start_daemon, endpoint,
                                                                      rank_processes, one_rank,
                                                                      tmp_path):
    flags = ("--state-dir", tmp_path / "state", "--durability", "journal")
    daemon = start_daemon(*flags)
    session = fresh_session("async-restart")
    ranks = [rank_processes(r, daemon.endpoint, session, **asynchronous(8, "inverse", **RETRIES))
             for r in range(WORLD)]
    reference = one_rank(endpoint)  # on another daemon, which lives through the restarts

    def push(r, data, global_step, staleness, pushes):
        seen = ranks[r].push(data)
        assert_pushed(seen, global_step=global_step, staleness=staleness, rank=r, pushes=pushes)
        expected = reference.step(grads_of(r, data), factor("inverse", staleness))
        assert_params(seen["params"], expected, f"global step {global_step}")
        return seen

    def restart(crash):
        nonlocal daemon
        if crash:
            daemon.kill()  # SIGKILL: only the checkpoint and the journal after it remain
        else:
            assert daemon.stop() == 0  # a checkpoint, which empties the journal
        daemon = start_daemon(*flags, listen=daemon.endpoint, workdir=daemon.workdir)

    # push(rank, its data, the global step it becomes, its staleness, the rank's pushes)
    push(2, 1, 1, 0, 1)
    push(0, 1, 2, 1, 1)
    push(2, 2, 3, 1, 2)  # based on global step 1
    before = push(1, 1, 4, 3, 1)["params"]

    # The journal replays the pushes in their global order, each with its staleness (and so its
    # lr factor): the same parameters, bit for bit; every rank's last push is a resend still.
    restart(crash=True)
    seen = ranks[1].resend(1)
    assert seen["info"]["replayed"] and seen["info"]["global_step"] == 4
    assert (seen["last_step"], seen["pushes"]) == (4, 1)
    assert_params(seen["params"], before, "the parameters after the crash")
    push(0, 2, 5, 2, 2)  # based on global step 2

    # A clean stop writes a checkpoint that keeps the records too.
    restart(crash=False)
    seen = ranks[0].resend(2)
    assert seen["info"]["replayed"] and seen["info"]["global_step"] == 5
    push(2, 3, 6, 2, 3)  # based on global step 3
    push(1, 2, 7, 2, 2)  # based on global step 4 (its resend's answer)


@pytest.mark.slow
def test_a_killed_rank_restarts_from_its_state_dict_exactly_once(endpoint, rank_processes,
                                                                  one_rank):
    session = fresh_session("async-rank-restart")
    options = asynchronous(8)
    ranks = [rank_processes(r, endpoint, session, **options) for r in range(2)]
    reference = one_rank(endpoint)
    for r, data in ((0, 1), (1, 1)):
        ranks[r].push(data)
        reference.step(grads_of(r, data))
    saved = ranks[1].save()  # after its push 1; its data position is 2
    state = torch.load(io.BytesIO(saved))["muond"]
    assert (state["rank"], state["pushes"], state["last_step"]) == (1, 1, 2)
    for r, data in ((1, 2), (0, 2)):
        ranks[r].push(data)
        latest = reference.step(grads_of(r, data))

    # Rank 1 dies after its push 2 was applied, before saving again. A new process attaches at
    # global step 4 and resumes from the state saved after push 1: the daemon's state is kept.
    ranks[1].kill()
    ranks[1] = rank_processes(1, endpoint, session, **options)
    assert ranks[1].ready["attached"] and ranks[1].ready["last_step"] == 4
    seen = ranks[1].load(saved)
    assert (seen["last_step"], seen["pushes"]) == (4, 1)
    assert_params(seen["params"], latest, "the restarted rank's parameters")

    # It redoes the work after its save: push 2 again, answered from its record, not applied.
    seen = ranks[1].push(2)
    assert seen["info"]["replayed"] and seen["info"]["global_step"] == 3
    assert (seen["last_step"], seen["pushes"]) == (4, 2)
    assert_params(seen["params"], latest, "the restarted rank's resend")
    seen = ranks[1].push(3)
    assert_pushed(seen, global_step=5, staleness=0, rank=1, pushes=3)
    assert_params(seen["params"], reference.step(grads_of(1, 3)), "after global step 5")


def _pushing_rank_main(rank, endpoint, session, pushes, queue):
    """A rank's process that pushes as fast as it can: another rank's push regularly replaces the
    parameters before this rank's answer goes out (on the CPU backend the answer reads the masters
    themselves), and the daemon must answer the latest ones rather than fail."""
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
        opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                    session=session, world_size=WORLD, rank=rank,
                                    **asynchronous(10 * pushes))
        newer = 0
        for _ in range(pushes):
            model(torch.randn(4, 128)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            info = opt.last_info
            # Applied once, answered with the parameters after its own global step or a later one.
            # An answer cut off because the copies of answers in flight ran past their budget (one
            # copy of the parameters, docs/protocol.md, The answer) is tried again by the client and
            # answered from the rank's record: replayed, still this push's own outcome.
            assert info.applied and info.step >= info.global_step, (info.step, info.global_step, info.replayed)
            newer += info.step > info.global_step
        opt.close(keep_session=True)
        queue.put((rank, opt.pushes, newer, None))
    except BaseException:  # noqa: B902 - reported to the parent
        queue.put((rank, 0, 0, traceback.format_exc()))


@pytest.mark.slow
def test_ranks_pushing_at_once_get_the_latest_parameters_never_an_error(endpoint):
    """Pushes racing each other: every push is applied once and answered, with the parameters after
    its own global step or a later one (then ``step`` names it); none fails because another rank's
    push replaced the parameters before its answer was sent (nor while it was sent: the client's
    retry is answered from its record)."""
    session, pushes = fresh_session("async-race"), 60
    context = rank_context()
    queue = context.Queue()
    processes = [context.Process(target=_pushing_rank_main, args=(r, endpoint, session, pushes, queue))
                 for r in range(WORLD)]
    for p in processes:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in processes)
    for p in processes:
        p.join(timeout=60)
    assert [error for *_, error in results] == [None] * WORLD, results
    assert [count for _, count, _, _ in results] == [pushes] * WORLD
    conn = muond.Connection(endpoint)
    assert next(s.last_step for s in conn.list_sessions() if s.session_id == session) == WORLD * pushes
    conn.close_session(session)
    conn.close()
    print("answers carrying a later step's parameters:", [newer for _, _, newer, _ in results])


@pytest.mark.slow
def test_a_rank_restarted_from_a_state_dict_two_pushes_back_redoes_them_as_resends(
        endpoint, rank_processes, one_rank):
    """Saved after push 1, a rank pushed 2 and 3 before it died. From that state dict it redoes
    pushes 2 and 3: both were taken, so both are resends that apply nothing (push 2, older than the
    record, with its global step not kept; push 3 from the record), and push 4 goes on."""
    session = fresh_session("async-two-back")
    options = asynchronous(8)
    ranks = [rank_processes(r, endpoint, session, **options) for r in range(2)]
    reference = one_rank(endpoint)
    ranks[1].push(1)
    reference.step(grads_of(1, 1))
    saved = ranks[1].save()
    for r, data in ((1, 2), (0, 1), (1, 3)):
        ranks[r].push(data)
        latest = reference.step(grads_of(r, data))
    ranks[1].kill()
    ranks[1] = rank_processes(1, endpoint, session, **options)
    assert ranks[1].load(saved)["pushes"] == 1
    older = ranks[1].push(2)
    assert older["info"]["replayed"] and not older["info"]["applied"]
    assert older["info"]["global_step"] == 0 and (older["last_step"], older["pushes"]) == (4, 2)
    assert_params(older["params"], latest, "the resend of an older push")
    last = ranks[1].push(3)
    assert last["info"]["replayed"] and last["info"]["applied"] and last["info"]["global_step"] == 4
    assert_params(last["params"], latest, "the resend of the last push")
    seen = ranks[1].push(4)
    assert_pushed(seen, global_step=5, staleness=0, rank=1, pushes=4)
    assert_params(seen["params"], reference.step(grads_of(1, 4)), "after global step 5")


def test_set_state_on_an_async_session_keeps_the_numbering_and_survives_a_restart(start_daemon,
                                                                                   tmp_path):
    """SetState (which carries no push records) replaces the state of an asynchronous session
    with one of global step 1: the rank's numbering goes on, its record forgets the global step
    its last push became (0 in a resend's answer), and the checkpoint written then restores after
    a crash instead of being refused. The Python client never sends SetState once a push was
    applied; the optimizer's own state-transfer calls send it raw here."""
    flags = ("--state-dir", tmp_path / "state")
    daemon = start_daemon(*flags)
    model = TinyNet(seed=SEED)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                                session=fresh_session("async-set-state"), **asynchronous(8),
                                **RETRIES)

    def push():
        model(torch.arange(8)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    push()
    saved = opt.state_dict()
    state, meta = saved["state"], saved["muond"]
    push()
    push()
    assert opt.last_step == 3
    step = opt._sessions[0].set_state(opt._state_header(0, meta, state),  # pylint: disable=protected-access
                                      opt._state_chunks(opt._indices_of[0], state))  # pylint: disable=protected-access
    assert step == 1
    daemon.kill()  # SetState wrote a checkpoint; only it remains
    daemon = start_daemon(*flags, listen=daemon.endpoint, workdir=daemon.workdir)
    assert opt._sessions[0].refresh() == 1  # pylint: disable=protected-access
    # The raw refresh wrote the model, as the optimizer's own calls do: noted as they note it.
    opt._note_parameters()  # pylint: disable=protected-access
    opt.pushes = 2  # resend push 3, the record's
    push()
    assert opt.last_info.replayed and opt.last_info.applied and opt.last_info.global_step == 0
    assert (opt.pushes, opt.last_step) == (3, 1)
    push()
    assert not opt.last_info.replayed and (opt.last_info.global_step, opt.pushes) == (2, 4)
    opt.close()


def test_a_restarted_rank_without_its_state_dict_continues_its_numbering(endpoint):
    """A rank that attaches again hears its last push from the daemon (CreateSession with its
    rank): without any saved state it continues with the next number, and a second rank that never
    pushed starts at 1; nothing is refused or applied twice."""
    session = fresh_session("async-attach")

    def attach(rank):
        model = TinyNet(seed=SEED)
        return model, muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                            session=session, world_size=2, rank=rank,
                                            **asynchronous(8))

    model, opt = attach(0)
    for step in range(1, 4):
        model(torch.arange(8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.pushes == 3 and opt.last_step == 3
    opt.close(keep_session=True)
    model, again = attach(0)
    other_model, other = attach(1)
    assert (again.pushes, other.pushes) == (3, 0)
    assert again.last_step == other.last_step == 3
    model(torch.arange(8)).square().mean().backward()
    again.step()
    assert (again.pushes, again.last_info.global_step, again.last_info.replayed) == (4, 4, False)
    other_model(torch.arange(8)).square().mean().backward()
    other.step()
    assert (other.pushes, other.last_info.global_step) == (1, 5)
    other.close(keep_session=True)
    again.close()


def test_a_state_dict_loads_whole_into_a_session_without_pushes(endpoint, one_rank):
    """A session with no push applied (new, or lost by its daemon) takes a saved state whole, and
    the rank's pushes start at 1 again; a state dict of another rank is refused."""
    reference = one_rank(endpoint)
    first, second = fresh_session("async-saved"), fresh_session("async-load")

    def rank_optimizer(session, rank, world_size=1):
        model = TinyNet(seed=SEED)
        opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                    session=session, world_size=world_size, rank=rank,
                                    **asynchronous(2))
        return model, opt

    model, opt = rank_optimizer(first, 0)
    with opt:
        for data in (1, 2):
            for name, p in model.named_parameters():
                p.grad = grads_of(0, data)[name]
            opt.step()
            reference.step(grads_of(0, data))
        saved = opt.state_dict()
    assert (saved["muond"]["pushes"], saved["muond"]["last_step"]) == (2, 2)

    model, opt = rank_optimizer(second, 0)
    with opt:
        opt.load_state_dict(saved)
        assert (opt.last_step, opt.pushes) == (2, 0)
        for name, p in model.named_parameters():
            p.grad = grads_of(0, 3)[name]
        opt.step()
        assert (opt.last_info.global_step, opt.pushes, opt.last_info.staleness) == (3, 1, 0)
        assert_params(params_of(model), reference.step(grads_of(0, 3)), "after the load")

    other = fresh_session("async-other-rank")
    _, opt = rank_optimizer(other, 1, world_size=2)
    with opt:
        with pytest.raises(ValueError, match=r"saved by rank 0, this optimizer is rank 1"):
            opt.load_state_dict(saved)
        assert (opt.last_step, opt.pushes) == (0, 0)
    muond.Connection(endpoint).close_session(other)  # rank 1 leaves a shared session open


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("given, error, message", [
    ({"sync_mode": "async"}, ValueError, r"^max_staleness: required with sync_mode='async'"),
    (asynchronous(-1), ValueError, r"^max_staleness: must be >= 0, got -1"),
    (asynchronous(1.5), TypeError, r"^max_staleness: must be an int, got float"),
    (asynchronous(True), TypeError, r"^max_staleness: must be an int, got bool"),
    (asynchronous(2, "linear"), ValueError,
     r"^staleness_scaling: must be 'none', 'inverse', \('polynomial', a\) .*got 'linear'"),
    (asynchronous(2, 1), ValueError, r"^staleness_scaling: must be 'none', .*got 1"),
    (asynchronous(2, ("polynomial", -1)), ValueError,
     r"^staleness_scaling: a must be finite and > 0, got -1"),
    (asynchronous(2, "polynomial"), ValueError,
     r"^staleness_scaling: give \('polynomial', a\), got 'polynomial'"),
    (asynchronous(2, ("hinge", 1.0)), ValueError, r"^staleness_scaling: give \('hinge', a, b\)"),
    (asynchronous(2, ("hinge", 1.0, -1)), ValueError, r"^staleness_scaling: b must be an int >= 0"),
    (asynchronous(2, ("inverse", 1.0)), ValueError, r"^staleness_scaling: give 'inverse'"),
    (asynchronous(2, min_ranks=2), ValueError, r"^min_ranks: applies to sync_mode='quorum' only"),
    (asynchronous(2, grace_seconds=1.0), ValueError,
     r"^grace_seconds: applies to sync_mode='quorum' only"),
    ({"max_staleness": 2}, ValueError, r"^max_staleness: applies to sync_mode='async' only"),
    ({"sync_mode": "quorum", "staleness_scaling": "inverse"}, ValueError,
     r"^staleness_scaling: applies to sync_mode='async' only"),
    ({"sync_mode": "asynchronous"}, ValueError,
     r"^sync_mode: must be 'lockstep', 'quorum' or 'async', got 'asynchronous'"),
])
def test_bad_async_options_are_refused_naming_the_argument(endpoint, given, error, message):
    refused_naming_the_argument(endpoint, given, error, message)


def test_async_is_refused_on_several_endpoints():
    with pytest.raises(ValueError, match=r"^sync_mode: asynchronous steps are not available on a "
                                         r"sharded session"):
        muond.RemoteOptimizer(muond.default_param_groups(TinyNet(seed=SEED)),
                              endpoints=["127.0.0.1:1", "127.0.0.1:2"],
                              session=fresh_session("sharded"), world_size=WORLD, rank=0,
                              **asynchronous(2))


def test_the_daemons_refusal_passes_through(endpoint, monkeypatch):
    the_daemons_error_passes_through(endpoint, monkeypatch,
                                     ranks_module.Sync("async", max_staleness=-1),
                                     "spec.sync.max_staleness: must be >= 0, got -1")


def test_the_spec_carries_the_async_fields():
    named, _ = named_groups(muond.default_param_groups(TinyNet(seed=SEED)))
    groups = [dict(options.resolve_group(g, {}), param_names=g["param_names"]) for g in named]
    for scaling, enum, a, b in (("none", pb.STALENESS_SCALING_NONE, 0.0, 0),
                                ("INVERSE", pb.STALENESS_SCALING_INVERSE, 0.0, 0),
                                (("polynomial", 0.5), pb.STALENESS_SCALING_POLYNOMIAL, 0.5, 0),
                                (("hinge", 2.0, 3), pb.STALENESS_SCALING_HINGE, 2.0, 3)):
        sync = ranks_module.sync_of("async", None, None, world_size=WORLD, num_daemons=1,
                                    max_staleness=5, staleness_scaling=scaling)
        spec = session_spec.whole_spec(groups, [f"g{i}" for i in range(len(groups))], [],
                                       world_size=WORLD, wire_dtype="fp32", return_dtype="fp32",
                                       loss_scaler=None, sync=sync)
        assert (spec.sync.mode, spec.sync.max_staleness, spec.sync.staleness_scaling,
                spec.sync.min_ranks, spec.sync.grace_seconds) == (pb.SYNC_MODE_ASYNC, 5, enum, 0, 0.0)
        assert (spec.sync.staleness_a, spec.sync.staleness_b) == (a, b)
