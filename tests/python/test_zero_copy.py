"""Zero copy over shared memory (``shm_zero_copy=True``, docs/transports.md): the model's parameters
and gradients live in the session's region, the daemon writes the updated parameters straight into
the model, and every step equals, bit for bit, the same step through the ordinary shm transport."""

import uuid

import pytest
import torch
import torch.nn as nn

import muond
from helpers import TinyNet, loss_of

STEPS = 4


def groups(model):
    return muond.default_param_groups(model)


def assert_equal_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def pair(endpoint, seed=12, **kwargs):
    plain_model, model = TinyNet(seed=seed), TinyNet(seed=seed)
    plain = muond.RemoteOptimizer(groups(plain_model), endpoint=endpoint, transport="shm")
    opt = muond.RemoteOptimizer(groups(model), endpoint=endpoint, transport="shm", shm_zero_copy=True,
                                **kwargs)
    return plain_model, plain, model, opt


@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_copy_steps_equal_ordinary_shm_steps_and_stay_in_place(endpoint, set_to_none):
    plain_model, plain, model, opt = pair(endpoint)
    assert opt.transport == "shm"
    storage = [p.data_ptr() for p in model.parameters()]
    for step in range(1, STEPS + 1):
        for m, o in ((plain_model, plain), (model, opt)):
            loss_of(m, step).backward()
            o.step()
        grads = [p.grad.data_ptr() for p in model.parameters()]
        for m, o in ((plain_model, plain), (model, opt)):
            o.zero_grad(set_to_none=set_to_none)
        assert_equal_params(model, plain_model)
        # The daemon wrote the parameters where the model keeps them; after the first step every
        # gradient lives in the region too, so the next backward accumulates there.
        assert [p.data_ptr() for p in model.parameters()] == storage
        if step > 1 and not set_to_none:
            assert grads == previous_grads
        previous_grads = grads
    plain.close()
    opt.close()
    # The model keeps working after the session is gone: its memory stays mapped here.
    loss_of(model, 99).backward()


def test_parameters_without_a_gradient_are_left_out(endpoint):
    plain_model, plain, model, opt = pair(endpoint, seed=13)
    for step in range(1, STEPS + 1):
        for m, o in ((plain_model, plain), (model, opt)):
            loss = loss_of(m, step) if step % 2 else m.head(torch.ones(3, 24)).square().mean()
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
        assert_equal_params(model, plain_model)
    plain.close()
    opt.close()


def test_a_restarted_daemon_gets_a_new_region_and_nothing_is_lost(start_daemon, tmp_path, endpoint):
    flags = ("--state-dir", tmp_path / "state", "--durability", "journal")
    daemon = start_daemon(*flags)
    plain_model, model = TinyNet(seed=14), TinyNet(seed=14)
    plain = muond.RemoteOptimizer(groups(plain_model), endpoint=endpoint, transport="shm")
    opt = muond.RemoteOptimizer(groups(model), endpoint=daemon.endpoint, transport="shm",
                                shm_zero_copy=True, session=f"zero-copy-{uuid.uuid4().hex[:8]}",
                                max_step_attempts=6,
                                retry_backoff=0.05)
    for step in range(1, 3):
        for m, o in ((plain_model, plain), (model, opt)):
            loss_of(m, step).backward()
            o.step()
            o.zero_grad(set_to_none=False)
    daemon.kill()
    start_daemon(*flags, listen=daemon.endpoint, workdir=daemon.workdir)
    for step in range(3, 5):
        for m, o in ((plain_model, plain), (model, opt)):
            loss_of(m, step).backward()
            o.step()
            o.zero_grad(set_to_none=False)
        assert_equal_params(model, plain_model)
    assert opt.last_step == 4
    plain.close()
    opt.close()


@pytest.mark.parametrize("kwargs, reason", [
    ({"transport": "grpc"}, "shm transport"),
    ({"wire_dtype": "bf16"}, "fp32"),
    ({"overlap": True}, "overlap"),
    ({"delay": 1}, "delay"),
])
def test_settings_it_cannot_work_with_are_refused_naming_it(endpoint, kwargs, reason):
    kwargs = {"transport": "shm", **kwargs}
    with pytest.raises(ValueError, match="shm_zero_copy") as refused:
        muond.RemoteOptimizer(groups(TinyNet()), endpoint=endpoint, shm_zero_copy=True, **kwargs)
    assert reason in str(refused.value)


def test_bf16_parameters_are_refused(endpoint):
    model = TinyNet().to(torch.bfloat16)
    with pytest.raises(ValueError, match="not fp32 on the CPU"):
        muond.RemoteOptimizer(groups(model), endpoint=endpoint, transport="shm", shm_zero_copy=True)
