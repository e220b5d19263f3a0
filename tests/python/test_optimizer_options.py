"""``RemoteOptimizer``'s infrastructure in typed option objects (muond.optimizer_options), against the
real daemon: each object given whole trains exactly as its fields given as shorthand keywords; a
field given both ways, or an object of the wrong type, is a TypeError naming it with nothing sent;
each object refuses a bad field or combination naming the field; the mixins' protocol
(muond.optimizer_core.OptimizerCore) holds on a built optimizer; and the constructor and public
methods stay short."""

import ast
import inspect
import textwrap

import pytest
import torch

import muond
from muond.optimizer_core import OptimizerCore


def model(seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def train(opt, net, steps=4):
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        opt.zero_grad()
        net(torch.randn(8, 6, generator=gen)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def test_objects_and_their_shorthands_train_alike(endpoint):
    a, b = model(), model()
    with muond.RemoteOptimizer(muond.default_param_groups(a), endpoint=endpoint, world_size=1, rank=0,
                               wire_dtype="bf16", max_grad_norm=0.5, delay=0) as short:
        ours = train(short, a)
        info_short = short.last_info
    with muond.RemoteOptimizer(muond.default_param_groups(b),
                               connection=muond.ConnectionOptions(endpoint=endpoint),
                               ranks=muond.RankOptions(world_size=1, rank=0),
                               wire=muond.WireOptions(wire_dtype="bf16"),
                               step=muond.StepOptions(max_grad_norm=0.5),
                               timing=muond.TimingOptions(delay=0)) as whole:
        theirs = train(whole, b)
        assert (whole.wire_dtype, whole.max_grad_norm, whole.world_size) == ("bf16", 0.5, 1)
        assert whole.last_info.grad_norm == info_short.grad_norm
    for x, y in zip(ours, theirs):
        assert torch.equal(x, y)


@pytest.mark.parametrize("kwargs, named", [
    ({"ranks": muond.RankOptions(world_size=2), "rank": 0}, "'rank' was given both"),
    ({"timing": muond.TimingOptions(), "overlap": True}, "'overlap' was given both"),
    ({"wire": muond.WireOptions(), "wire_dtype": "bf16"}, "'wire_dtype' was given both"),
    ({"step": muond.StepOptions(), "max_grad_norm": 1.0}, "'max_grad_norm' was given both"),
    ({"connection": muond.ConnectionOptions(), "timeout": 3.0}, "'timeout' was given both"),
    ({"ranks": {"world_size": 2}}, "ranks: a muond.RankOptions, not dict"),
    ({"world_size": 2.5}, "^world_size: must be an int, got float 2.5"),
    ({"world_size": 2, "rank": True}, "^rank: must be an int, got bool True"),
    ({"timing": True}, "timing: a muond.TimingOptions, not bool"),
])
def test_a_field_given_twice_or_a_wrong_object_is_a_type_error(kwargs, named):
    # No daemon listens at port 9: the error comes before anything is sent.
    if "connection" not in kwargs:
        kwargs["endpoint"] = "127.0.0.1:9"
    with pytest.raises(TypeError, match=named):
        muond.RemoteOptimizer(muond.default_param_groups(model()), **kwargs)


@pytest.mark.parametrize("kwargs, named", [
    ({"ranks": muond.RankOptions(world_size=2, rank=2)}, r"rank: must be in \[0, 2\)"),
    ({"ranks": muond.RankOptions(world_size=2, rank=0, sync_mode="quorum", min_ranks=3)},
     "min_ranks: must be between 1 and world_size"),
    ({"ranks": muond.RankOptions(min_ranks=1)}, "min_ranks: applies to sync_mode='quorum' only"),
    ({"ranks": muond.RankOptions(sync_mode="async")}, "max_staleness"),
    ({"timing": muond.TimingOptions(delay=2)}, "delay: must be 0"),
    ({"timing": muond.TimingOptions(land_in_forward=torch.nn.Linear(2, 2))},
     "land_in_forward: needs overlap=True"),
    ({"timing": muond.TimingOptions(delay=1), "loss_scaler": True}, "delay: not with a loss scaler"),
    ({"timing": muond.TimingOptions(overlap=True), "endpoints": ["127.0.0.1:9", "127.0.0.1:10"]},
     "overlap: needs one daemon"),
    ({"wire": muond.WireOptions(return_dtype="int3")}, "int3"),
    ({"return_dtype": "int8"}, "^return_dtype: unsupported wire dtype 'int8'"),
    ({"wire_dtype": "int8", "transport": "shm"},
     "^transport: 'shm' is not possible with wire_dtype 'int8': quantized gradients travel over grpc only"),
    ({"step": muond.StepOptions(max_grad_norm=-1.0)}, "max_grad_norm must be finite and > 0"),
    ({"wire": muond.WireOptions(shm_zero_copy=True, wire_dtype="bf16")}, "shm_zero_copy:"),
    ({"endpoint": ""}, "^endpoint: empty; give the daemon's host:port"),
    ({"chunk_bytes": 0}, "chunk_bytes: must be a whole number of bytes, at least 1, got 0"),
    ({"chunk_bytes": 1.5}, "chunk_bytes: .* got 1.5"),
    ({"chunk_bytes": "4096"}, "chunk_bytes: .* got '4096'"),
    ({"timeout": -1}, "timeout: must be a finite number of seconds above 0, got -1"),
    ({"connect_timeout": float("nan")}, "connect_timeout: .* got nan"),
    ({"retry_backoff": "1"}, "retry_backoff: must be a finite number of seconds at least 0, got '1'"),
    ({"max_step_attempts": 2.5}, r"max_step_attempts must be at least 1 \(a whole number\), got 2.5"),
])
def test_each_object_refuses_naming_the_field(kwargs, named):
    if "endpoints" not in kwargs:
        kwargs.setdefault("endpoint", "127.0.0.1:9")
    with pytest.raises(ValueError, match=named):
        muond.RemoteOptimizer(muond.default_param_groups(model()), **kwargs)


@pytest.mark.parametrize("kwargs, named", [
    ({"endpoint": 5}, "endpoint: a string, not int"),
    ({"auth_token": b"token"}, "auth_token: a string, not bytes"),
    ({"use_tls": "yes"}, "use_tls: True or False, not 'yes'"),
    ({"credentials": "tls"}, "credentials: a grpc.ChannelCredentials, not str"),
])
def test_connection_fields_of_the_wrong_type_are_refused_naming_them(kwargs, named):
    kwargs.setdefault("endpoint", "127.0.0.1:9")
    with pytest.raises(TypeError, match=named):
        muond.RemoteOptimizer(muond.default_param_groups(model()), **kwargs)


def test_the_mixins_protocol_holds_on_a_built_optimizer(endpoint):
    members = set(OptimizerCore.__annotations__) | {
        name for name, value in vars(OptimizerCore).items()
        if not name.startswith("__") and (callable(value) or isinstance(value, property))}
    assert {"_sessions", "_header", "_async", "last_step"} <= members
    with muond.RemoteOptimizer(muond.default_param_groups(model()), endpoint=endpoint) as opt:
        missing = sorted(name for name in members if not hasattr(opt, name))
    assert not missing, f"RemoteOptimizer lacks {missing} of OptimizerCore"


def _body_lines(function):
    """The lines of a function's body, from its first statement to its last."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    return tree.body[-1].end_lineno - tree.body[0].lineno + 1


def test_the_constructor_and_public_methods_stay_short():
    assert _body_lines(muond.RemoteOptimizer.__init__) <= 40
    for name, member in inspect.getmembers(muond.RemoteOptimizer, inspect.isfunction):
        if name.startswith("_") or member.__module__.split(".")[0] != "muond":
            continue
        assert len(inspect.getsource(member).splitlines()) <= 60, name
