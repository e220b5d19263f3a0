"""Overlap and delay from Python (docs/overlap.md): gradients streamed during backward
(``overlap=True``) and the delayed parameter update (``delay=1``) against the real daemon, on the
suite's step transport (MUOND_TRANSPORT: shm and gRPC).

Every comparison is bit for bit: a streamed step sends the same gradients as a plain one, and a
delayed step applies the same update one step later, so nothing may differ at all."""

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import grpc
import pytest
import torch
import torch.nn as nn

import muond
from helpers import TinyNet, loss_of, run_ranks
from muond.client import Connection

STEPS = 5


def groups(model):
    return muond.default_param_groups(model)


def assert_equal_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def plain_and(endpoint, seed=31, **kwargs):
    """(plain model, its optimizer, model, optimizer with ``kwargs``), equal models."""
    plain_model, model = TinyNet(seed=seed), TinyNet(seed=seed)
    plain = muond.RemoteOptimizer(groups(plain_model), endpoint=endpoint)
    other = muond.RemoteOptimizer(groups(model), endpoint=endpoint, **kwargs)
    return plain_model, plain, model, other


def train_step(model, opt, step):
    loss_of(model, step).backward()
    opt.step()
    opt.zero_grad()


def test_streamed_steps_equal_plain_steps_and_go_out_during_backward(endpoint):
    plain_model, plain, model, opt = plain_and(endpoint, overlap=True)
    with_grad = sum(1 for p in model.parameters() if p.requires_grad)
    for step in range(1, STEPS + 1):
        train_step(plain_model, plain, step)
        assert opt.gradients_in_flight == 0
        loss_of(model, step).backward()
        # Handed to the daemon by backward's hooks, before step() is called.
        assert opt.gradients_in_flight == with_grad
        opt.step()
        opt.zero_grad()
        assert opt.gradients_in_flight == 0
        assert opt.last_step == plain.last_step == step
        assert opt.last_info.grad_norm == plain.last_info.grad_norm
        assert_equal_params(model, plain_model)
    assert opt.streamed_steps == STEPS
    plain.close()
    opt.close()


def test_gradient_accumulation_sends_only_the_last_micro_batch(endpoint):
    plain_model, plain, model, opt = plain_and(endpoint, overlap=True)
    for step in range(1, STEPS + 1):
        for micro in range(3):
            loss_of(plain_model, 10 * step + micro).backward()
        plain.step()
        plain.zero_grad()
        with opt.no_sync():
            for micro in range(2):
                loss_of(model, 10 * step + micro).backward()
                assert opt.gradients_in_flight == 0
        loss_of(model, 10 * step + 2).backward()
        opt.step()
        opt.zero_grad()
        assert_equal_params(model, plain_model)
    assert opt.streamed_steps == STEPS
    plain.close()
    opt.close()


class WithSpare(nn.Module):
    """TinyNet and a matrix that only odd steps use."""

    def __init__(self, seed):
        super().__init__()
        self.net = TinyNet(seed=seed)
        torch.manual_seed(seed + 1)
        self.spare = nn.Linear(16, 16, bias=False)

    def loss(self, step):
        out = loss_of(self.net, step)
        if step % 2:
            out = out + self.spare(torch.ones(16)).square().mean()
        return out


@pytest.mark.parametrize("set_to_none", [True, False])
def test_parameters_without_a_gradient_are_left_out_as_in_a_plain_step(endpoint, set_to_none):
    plain_model, model = WithSpare(41), WithSpare(41)
    plain = muond.RemoteOptimizer(groups(plain_model), endpoint=endpoint)
    opt = muond.RemoteOptimizer(groups(model), endpoint=endpoint, overlap=True)
    for step in range(1, STEPS + 1):
        for m, o in ((plain_model, plain), (model, opt)):
            m.loss(step).backward()
            o.step()
            o.zero_grad(set_to_none=set_to_none)
        assert_equal_params(model, plain_model)
    plain.close()
    opt.close()


def test_a_gradient_changed_after_backward_is_sent_as_changed(endpoint):
    plain_model, plain, model, opt = plain_and(endpoint, overlap=True)
    for step in range(1, 4):
        for m, o in ((plain_model, plain), (model, opt)):
            loss_of(m, step).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)  # in place, after the hooks
            o.step()
            o.zero_grad()
        assert_equal_params(model, plain_model)
    assert opt.streamed_steps == 0  # every step sent its gradients again, plainly
    plain.close()
    opt.close()


def test_a_second_backward_without_no_sync_falls_back_to_a_plain_step(endpoint):
    plain_model, plain, model, opt = plain_and(endpoint, overlap=True)
    for m, o in ((plain_model, plain), (model, opt)):
        loss_of(m, 1).backward()
        loss_of(m, 2).backward()
        o.step()
        o.zero_grad()
    assert_equal_params(model, plain_model)
    assert opt.last_step == 1 and opt.streamed_steps == 0
    plain.close()
    opt.close()


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


def backward_that_fails(model: TinyNet) -> None:
    """A backward that raises at the embedding's output: the layers after it have their gradients
    (and their hooks sent them) when it does."""
    hidden = _FailingBackward.apply(model.emb(torch.arange(32) % 7))
    out = model.head(torch.tanh(model.down(model.norm(torch.nn.functional.gelu(model.up(hidden))))))
    with pytest.raises(RuntimeError, match="on purpose"):
        out.square().mean().backward()


def test_a_backward_that_raises_applies_nothing(endpoint):
    plain_model, plain, model, opt = plain_and(endpoint, overlap=True)
    before = [p.detach().clone() for p in model.parameters()]
    backward_that_fails(model)
    assert opt.gradients_in_flight > 0
    opt.zero_grad()
    assert opt.state_dict()["muond"]["last_step"] == 0  # the daemon applied nothing
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    for step in range(1, 4):  # training goes on as if the failed iteration never happened
        train_step(plain_model, plain, step)
        train_step(model, opt, step)
        assert_equal_params(model, plain_model)
    assert opt.last_step == 3
    plain.close()
    opt.close()


def _wait_for_streams(address: str, count: int) -> None:
    """Until the daemon counts ``count`` streamed steps (gRPC Step calls) in flight."""
    from test_ops_metrics import sample, scrape
    deadline = time.monotonic() + 60
    while sample(scrape(address), "muond_calls_in_flight", method="Step") != count:
        assert time.monotonic() < deadline, f"the daemon never had {count} streamed steps open"
        time.sleep(0.02)


@pytest.mark.once  # over gRPC, named: the daemon's in-flight calls show the stream
@pytest.mark.parametrize("refused", ["grad_scale", "qk_logits", "backward"])
def test_a_step_refused_before_it_goes_out_leaves_no_stream_open(start_daemon, refused):
    """What backward streamed of a step that is then refused (a bad argument to step(), or a
    backward that raised and zero_grad) is cancelled on the daemon at once, not held open until
    the optimizer closes; the next step streams as usual and training equals plain steps."""
    from test_ops_metrics import metrics_address
    daemon = start_daemon("--metrics-listen", "127.0.0.1:0")
    address = metrics_address(daemon.endpoint)
    plain_model, plain, model, opt = plain_and(daemon.endpoint, transport="grpc", overlap=True)
    train_step(plain_model, plain, 1)
    train_step(model, opt, 1)
    if refused == "backward":
        backward_that_fails(model)
    else:
        loss_of(model, 2).backward()
    assert opt.gradients_in_flight > 0
    _wait_for_streams(address, 1)
    if refused == "grad_scale":
        with pytest.raises(ValueError, match="grad_scale"):
            opt.step(grad_scale=-1.0)
    elif refused == "qk_logits":
        with pytest.raises(ValueError, match="qk_logits"):
            opt.step(qk_logits={"no such weight": [1.0]})
    if refused != "backward":
        _wait_for_streams(address, 0)  # step() cancelled it
    opt.zero_grad()
    _wait_for_streams(address, 0)
    assert opt.last_step == 1 and opt.gradients_in_flight == 0
    for step in (2, 3):
        train_step(plain_model, plain, step)
        train_step(model, opt, step)
        assert_equal_params(model, plain_model)
    assert opt.last_step == 3 and opt.streamed_steps == 3
    plain.close()
    opt.close()


def test_a_daemon_killed_mid_stream_loses_and_repeats_nothing(start_daemon, tmp_path, endpoint):
    flags = ("--state-dir", tmp_path / "state", "--durability", "journal")
    daemon = start_daemon(*flags)
    plain_model, model = TinyNet(seed=52), TinyNet(seed=52)
    plain = muond.RemoteOptimizer(groups(plain_model), endpoint=endpoint)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, overlap=True,
                                session=f"killed-{uuid.uuid4().hex[:8]}", max_step_attempts=4,
                                retry_backoff=0.05)
    for step in (1, 2):
        train_step(plain_model, plain, step)
        train_step(model, opt, step)
    train_step(plain_model, plain, 3)
    loss_of(model, 3).backward()
    assert opt.gradients_in_flight > 0  # step 3's stream is open on the daemon
    daemon.kill()
    start_daemon(*flags, listen=daemon.endpoint, workdir=daemon.workdir)
    opt.step()  # the stream broke: step 3 is sent again, plainly, to the restarted daemon
    opt.zero_grad()
    assert opt.last_step == 3 and opt.last_info.attempts > 1 and not opt.last_info.replayed
    assert_equal_params(model, plain_model)
    train_step(plain_model, plain, 4)
    train_step(model, opt, 4)
    assert_equal_params(model, plain_model)
    plain.close()
    opt.close()


def test_overlap_needs_one_daemon(endpoint):
    with pytest.raises(ValueError, match="overlap"):
        muond.RemoteOptimizer(groups(TinyNet()), endpoints=[endpoint, "127.0.0.1:9"], overlap=True)


# -- delay ----------------------------------------------------------------------------------------

def fixed_gradients(model, step):
    """Gradients that do not depend on the parameters, so that a delayed optimizer gets the very
    gradients a plain one does."""
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.1


@pytest.mark.parametrize("warmup", [0, 2])
def test_delayed_steps_apply_the_same_updates_one_step_later(endpoint, warmup):
    plain_model, plain, model, opt = plain_and(endpoint, delay=1, delay_warmup=warmup)
    history = [[p.detach().clone() for p in plain_model.parameters()]]
    for step in range(1, STEPS + 1):
        fixed_gradients(plain_model, step)
        plain.step()
        history.append([p.detach().clone() for p in plain_model.parameters()])
        fixed_gradients(model, step)
        opt.step()
        # A warm-up step is whole; after it the model holds the parameters of the step before.
        holds = step if step <= warmup else step - 1
        for p, q in zip(model.parameters(), history[holds]):
            assert torch.equal(p.detach(), q)
        assert opt.last_step == holds
    opt.flush()
    assert_equal_params(model, plain_model)
    assert opt.last_step == STEPS and opt.last_info.step == STEPS
    plain.close()
    opt.close()


def test_delay_with_overlap_equals_delay_alone(endpoint):
    delayed_model, model = TinyNet(seed=63), TinyNet(seed=63)
    delayed = muond.RemoteOptimizer(groups(delayed_model), endpoint=endpoint, delay=1)
    opt = muond.RemoteOptimizer(groups(model), endpoint=endpoint, delay=1, overlap=True)
    for step in range(1, STEPS + 1):
        train_step(delayed_model, delayed, step)
        train_step(model, opt, step)
        assert_equal_params(model, delayed_model)
    assert opt.streamed_steps >= STEPS - 1  # the first began before anything was in flight
    delayed.flush()
    opt.flush()
    assert_equal_params(model, delayed_model)
    delayed.close()
    opt.close()


def test_close_lands_the_step_in_flight(endpoint):
    plain_model, plain, model, opt = plain_and(endpoint, delay=1, session=f"landed-{uuid.uuid4().hex[:8]}")
    for step in range(1, 4):
        fixed_gradients(plain_model, step)
        plain.step()
        fixed_gradients(model, step)
        opt.step()
    opt.close(keep_session=True)  # step 3 was in flight
    assert_equal_params(model, plain_model)
    again = muond.RemoteOptimizer(groups(TinyNet(seed=99)), endpoint=endpoint, session=opt.session_id)
    assert again.last_step == 3
    for p, q in zip(again.param_groups, plain.param_groups):
        for a, b in zip(p["params"], q["params"]):
            assert torch.equal(a.detach(), b.detach())
    again.close()
    plain.close()


def test_a_delayed_step_that_fails_is_raised_by_the_next_step(start_daemon):
    daemon = start_daemon()
    model = TinyNet(seed=71)
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, delay=1,
                                max_step_attempts=1)
    fixed_gradients(model, 1)
    opt.step()
    opt.flush()
    daemon.kill()
    fixed_gradients(model, 2)
    opt.step()  # returns: step 2 fails on the worker
    with pytest.raises(muond.MuondError):
        opt.step()
    with pytest.raises(muond.MuondError):
        opt.close()


@pytest.mark.parametrize("kwargs, field", [
    ({"delay": 2}, "delay"),
    ({"delay": 1, "delay_warmup": -1}, "delay_warmup"),
    ({"delay": 1, "loss_scaler": True}, "delay"),
])
def test_bad_delay_options_are_refused_naming_them(endpoint, kwargs, field):
    with pytest.raises(ValueError, match=field):
        muond.RemoteOptimizer(groups(TinyNet()), endpoint=endpoint, **kwargs)


# -- ranks and shards ---------------------------------------------------------------------------

def ranks_train(endpoint, **kwargs):
    """Two ranks (threads) of one lock-step session, each on its own batches; rank 0's model."""
    session = f"ranks-{uuid.uuid4().hex[:8]}"
    models = [TinyNet(seed=81), TinyNet(seed=81)]
    errors = []

    def rank_loop(rank):
        try:
            opt = muond.RemoteOptimizer(groups(models[rank]), endpoint=endpoint, session=session,
                                        world_size=2, rank=rank, **kwargs)
            for step in range(1, STEPS + 1):
                train_step(models[rank], opt, 100 * rank + step)
            opt.flush()
            assert opt.last_step == STEPS
            opt.close(keep_session=rank != 0)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    run_ranks(rank_loop, 2, errors)
    assert_equal_params(models[0], models[1])
    return models[0]


@pytest.mark.parametrize("kwargs, reference", [({"overlap": True}, {}),
                                               ({"overlap": True, "delay": 1}, {"delay": 1})])
def test_ranks_keep_their_semantics(endpoint, kwargs, reference):
    assert_equal_params(ranks_train(endpoint, **kwargs), ranks_train(endpoint, **reference))


def test_a_delayed_sharded_session_applies_the_same_updates(start_daemon):
    daemons = [start_daemon().endpoint, start_daemon().endpoint]
    plain_model, model = TinyNet(seed=91), TinyNet(seed=91)
    plain = muond.RemoteOptimizer(groups(plain_model), endpoints=daemons)
    opt = muond.RemoteOptimizer(groups(model), endpoints=daemons, delay=1)
    for step in range(1, STEPS + 1):
        fixed_gradients(plain_model, step)
        plain.step()
        fixed_gradients(model, step)
        opt.step()
    opt.flush()
    assert_equal_params(model, plain_model)
    assert opt.state_dict()["muond"]["last_step"] == STEPS
    plain.close()
    opt.close()


# -- parameters landing during the next forward (land_in_forward) --------------------------------

class Chain(nn.Module):
    """Three linear layers, registered in the order the forward uses them: one AdamW group
    answers their parameters in forward order."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(8, 32)
        self.mid = nn.Linear(32, 32)
        self.last = nn.Linear(32, 4)

    def forward(self, x):
        return self.last(torch.tanh(self.mid(torch.tanh(self.first(x)))))


def chain_groups(model, extra=()):
    return [{"params": list(model.named_parameters()) + list(extra), "optimizer": "adamw",
             "lr": 0.01}]


def chain_batch(step):
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)


def chain_loss(model, step):
    x, y = chain_batch(step)
    return torch.nn.functional.mse_loss(model(x), y)


def chain_step(model, opt, step):
    chain_loss(model, step).backward()
    opt.step()
    opt.zero_grad()


def chains(endpoint, seed, transport=None, model_type=None):
    """(plain model, its optimizer, model, optimizer with land_in_forward), equal models; over
    gRPC when asked (the transport whose answers land tensor by tensor), else the suite's."""
    make = model_type or Chain
    plain_model, model = make(seed), make(seed)
    kwargs = {"transport": transport} if transport else {}
    plain = muond.RemoteOptimizer(chain_groups(plain_model), endpoint=endpoint, **kwargs)
    opt = muond.RemoteOptimizer(chain_groups(model), endpoint=endpoint, overlap=True,
                                land_in_forward=model, **kwargs)
    return plain_model, plain, model, opt


def chunk_name(chunk):
    from muond import wire
    return (chunk.meta if isinstance(chunk, wire.FramedChunk) else chunk).name


class HeldBack:
    """Over gRPC: every answer stops before the tensor ``name`` until something waits for that
    tensor to land (a module's forward, ``step()``, ``flush()``, ``close()``...): a return leg as
    slow as can be, timed by events alone. ``released`` is set by that wait; clear it to hold
    the next answer back too."""

    def __init__(self, monkeypatch, name):
        from muond.transport import grpc_transport, streamed
        self.released = threading.Event()
        add, wait = grpc_transport._LandingAssembler.add, streamed.Landing.wait

        def held_add(assembler, chunk):
            if chunk_name(chunk) == name:
                self.released.wait(timeout=300)  # a safety net only: a wait releases it
            add(assembler, chunk)

        def releasing_wait(landing, names=None):
            if (names is None or name in list(names)) and name in landing.missing():
                self.released.set()
            wait(landing, names)
        monkeypatch.setattr(grpc_transport._LandingAssembler, "add", held_add)
        monkeypatch.setattr(streamed.Landing, "wait", releasing_wait)


def test_parameters_landing_in_forward_equal_plain_steps(endpoint):
    # TinyNet in Muon and AdamW groups: the answer's order is not the forward's, which only
    # changes how long a module waits.
    plain_model, model = TinyNet(seed=33), TinyNet(seed=33)
    plain = muond.RemoteOptimizer(groups(plain_model), endpoint=endpoint)
    opt = muond.RemoteOptimizer(groups(model), endpoint=endpoint, overlap=True,
                                land_in_forward=model)
    for step in range(1, STEPS + 1):
        plain_loss, loss = loss_of(plain_model, step), loss_of(model, step)
        assert torch.equal(loss, plain_loss)  # every module's forward waited for its parameters
        assert_equal_params(model, plain_model)  # every module ran: all of them landed
        plain_loss.backward()
        plain.step()
        plain.zero_grad()
        loss.backward()
        opt.step()
        opt.zero_grad()
        # The step's result is in when step() returns, the parameters perhaps not yet.
        assert opt.last_step == plain.last_step == step
        assert opt.last_info.grad_norm == plain.last_info.grad_norm
    opt.flush()
    assert_equal_params(model, plain_model)
    assert opt.streamed_steps == STEPS
    plain.close()
    opt.close()


def test_a_module_forward_waits_for_its_own_parameters_only(endpoint, monkeypatch):
    plain_model, plain, model, opt = chains(endpoint, 5, transport="grpc")
    held = HeldBack(monkeypatch, "last.weight")
    seen = []

    def at_mid(module, inputs):  # runs after the optimizer's hook on mid: mid's are in
        seen.append((held.released.is_set(), model.last.weight.detach().clone()))
    model.mid.register_forward_pre_hook(at_mid)
    for step in range(1, STEPS + 1):
        plain_loss, loss = chain_loss(plain_model, step), chain_loss(model, step)
        assert torch.equal(loss, plain_loss)
        if step > 1:
            released_at_mid, weight_at_mid = seen[-1]
            # first and mid ran while last.weight was still held back, the step before's ...
            assert not released_at_mid and torch.equal(weight_at_mid, stale)
            # ... and last's forward waited for it, which released it.
            assert held.released.is_set()
            assert not torch.equal(model.last.weight.detach(), stale)
        assert_equal_params(model, plain_model)
        plain_loss.backward()
        plain.step()
        plain.zero_grad()
        loss.backward()
        stale = model.last.weight.detach().clone()
        held.released.clear()
        opt.step()
        opt.zero_grad()
    opt.flush()
    assert_equal_params(model, plain_model)
    plain.close()
    opt.close()


def test_a_parameter_no_module_holds_lands_before_step_returns(endpoint, monkeypatch):
    plain_model, model = Chain(6), Chain(6)
    scales = [nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))]
    plain = muond.RemoteOptimizer(chain_groups(plain_model, [("scale", scales[0])]),
                                  endpoint=endpoint)
    opt = muond.RemoteOptimizer(chain_groups(model, [("scale", scales[1])]), endpoint=endpoint,
                                overlap=True, land_in_forward=model)
    held = HeldBack(monkeypatch, "scale")  # over gRPC, until step() waits for it
    for step in range(1, STEPS + 1):
        for m, o, scale in ((plain_model, plain, scales[0]), (model, opt, scales[1])):
            x, y = chain_batch(step)
            torch.nn.functional.mse_loss(m(x) * scale, y).backward()
            held.released.clear()
            o.step()
            o.zero_grad()
        assert torch.equal(scales[1].detach(), scales[0].detach())  # read with no flush()
    opt.flush()
    assert_equal_params(model, plain_model)
    plain.close()
    opt.close()


class FunctionalHead(nn.Module):
    """A head module that is never called: its weight is used by the model's own forward."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(8, 32)
        self.head = nn.Linear(32, 4, bias=False)

    def forward(self, x):
        return torch.nn.functional.linear(torch.tanh(self.body(x)), self.head.weight)


def test_a_weight_used_without_its_module_stops_the_next_step(endpoint, monkeypatch):
    plain_model, plain, model, opt = chains(endpoint, 8, model_type=FunctionalHead)
    # Over gRPC head.weight stays on its way until step() waits for it: the forward below reads
    # the old one (were it written between that read and backward, autograd would refuse the
    # backward instead: the weight saved for it changed in place).
    HeldBack(monkeypatch, "head.weight")
    for m, o in ((plain_model, plain), (model, opt)):  # nothing is landing before step 1
        chain_step(m, o, 1)
    chain_loss(model, 2).backward()  # head.weight was read before it landed: caught
    with pytest.raises(RuntimeError, match="'head.weight'.*no forward waited"):
        opt.step()
    opt.zero_grad()
    assert opt.last_step == 1 and opt.state_dict()["muond"]["last_step"] == 1  # nothing sent
    for step in range(2, 4):  # flush() before such a forward, and training goes on
        for m, o in ((plain_model, plain), (model, opt)):
            o.flush()
            chain_step(m, o, step)
        opt.flush()
        assert_equal_params(model, plain_model)
    plain.close()
    opt.close()


def test_a_return_leg_cut_off_is_raised_at_the_next_wait_and_read_back(endpoint, monkeypatch):
    from muond.transport import grpc_transport
    plain_model, plain, model, opt = chains(endpoint, 9, transport="grpc")
    add = grpc_transport._LandingAssembler.add
    cut = threading.Event()

    def cut_off_add(assembler, chunk):
        if cut.is_set() and chunk_name(chunk) == "mid.weight":
            cut.clear()
            raise muond.MuondError(grpc.StatusCode.UNAVAILABLE, "the answer was cut off on purpose",
                                   "Step")
        add(assembler, chunk)
    monkeypatch.setattr(grpc_transport._LandingAssembler, "add", cut_off_add)
    for step in range(1, STEPS + 1):
        chain_step(plain_model, plain, step)
        chain_loss(model, step).backward()
        if step == 2:
            cut.set()
        opt.step()  # step 2 is applied on the daemon, and its answer breaks after first.*
        opt.zero_grad()
        assert opt.last_step == step
        if step == 2:
            with pytest.raises(muond.MuondError, match="after step 2 did not all land: 4 of 6 cut "
                               "off, first 'mid.weight'; every parameter was read back.*on purpose"
                               ) as raised:
                chain_loss(model, 3)  # mid's forward waits for mid.weight: the failure
            assert raised.value.code == grpc.StatusCode.UNAVAILABLE
        opt.flush()
        assert_equal_params(model, plain_model)  # step 2's were read back from the daemon
    plain.close()
    opt.close()


@pytest.mark.parametrize("call", ["close", "flush", "state_dict", "state_digest"])
def test_calls_through_the_optimizer_wait_for_the_landing(endpoint, monkeypatch, call):
    plain_model, plain, model, opt = chains(endpoint, 10, transport="grpc")
    held = HeldBack(monkeypatch, "last.bias")  # the answer's last tensor
    for step in (1, 2):
        chain_step(plain_model, plain, step)
        chain_loss(model, step).backward()
        held.released.clear()
        opt.step()
        opt.zero_grad()
    assert not held.released.is_set()  # step 2's last.bias is still held back
    assert not torch.equal(model.last.bias.detach(), plain_model.last.bias.detach())
    if call == "close":
        opt.close(keep_session=True)
    else:
        getattr(opt, call)()
    assert held.released.is_set()
    assert_equal_params(model, plain_model)
    if call == "close":
        again = muond.RemoteOptimizer(chain_groups(Chain(0)), endpoint=endpoint,
                                      session=opt.session_id)
        assert again.last_step == 2
        again.close()
    else:
        opt.close()
    plain.close()


LANDING_TRAINER = textwrap.dedent("""
    import atexit, sys
    import torch
    import muond

    endpoint, session = sys.argv[1:3]
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    plain_model, model = make(), make()
    plain = muond.RemoteOptimizer(muond.default_param_groups(plain_model), endpoint=endpoint,
                                  transport="grpc")
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                session=session, transport="grpc", overlap=True,
                                land_in_forward=model)
    for step in range(3):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(step))
        for m, o in ((plain_model, plain), (model, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()

    @atexit.register
    def landed():  # after the interpreter joined the thread the answer lands on
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), plain_model.parameters()))
        print("landed" if same else "NOT landed", flush=True)
    print("stepped", flush=True)
""")


def test_interpreter_exit_waits_for_the_landing(endpoint):
    # The script ends right after its last step(), without flush() or close().
    session = f"exit-landing-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", LANDING_TRAINER, endpoint, session],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["stepped", "landed"], done.stderr
    conn = Connection(endpoint)
    try:
        assert {s.session_id: s for s in conn.list_sessions()}[session].last_step == 3
        conn.close_session(session)
    finally:
        conn.close()


@pytest.mark.parametrize("kwargs, error, field", [
    ({}, ValueError, "overlap=True"),
    ({"overlap": True, "delay": 1}, ValueError, "delay"),
    ({"overlap": True, "land_in_forward": "model"}, TypeError, "torch.nn.Module"),
])
def test_bad_land_in_forward_is_refused_naming_it(endpoint, kwargs, error, field):
    model = TinyNet()
    kwargs.setdefault("land_in_forward", model)
    with pytest.raises(error, match=f"land_in_forward.*{field}"):
        muond.RemoteOptimizer(groups(model), endpoint=endpoint, **kwargs)
