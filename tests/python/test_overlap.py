"""Overlap and delay from Python (docs/overlap.md): gradients streamed during backward
(``overlap=True``) and the delayed parameter update (``delay=1``) against the real daemon, on the
suite's step transport (MUOND_TRANSPORT: shm and gRPC).

Every comparison is bit for bit: a streamed step sends the same gradients as a plain one, and a
delayed step applies the same update one step later, so nothing may differ at all."""

import threading
import uuid

import pytest
import torch
import torch.nn as nn

import muond
from helpers import TinyNet, loss_of

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


def test_a_backward_that_raises_applies_nothing(endpoint):
    plain_model, plain, model, opt = plain_and(endpoint, overlap=True)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.arange(32) % 7
    # The failure sits at the embedding's output: the layers after it have their gradients (and
    # their hooks sent them) when backward raises.
    hidden = _FailingBackward.apply(model.emb(x))
    out = model.head(torch.tanh(model.down(model.norm(torch.nn.functional.gelu(model.up(hidden))))))
    with pytest.raises(RuntimeError, match="on purpose"):
        out.square().mean().backward()
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

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
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
