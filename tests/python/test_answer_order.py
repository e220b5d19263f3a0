"""StepHeader.answer_order: the Step stream answers the parameters it lists first, in that order,
then the others in the session's order, with the same values as in the session's order; a bad
order is refused naming it and applies nothing; the out-of-band steps, which answer every
parameter at once, refuse it. And the Python client asks for its model's forward order with
``land_in_forward``, so the first module's parameters land first whatever the groups' order."""

import grpc
import pytest
import torch
from torch import nn

import muond
from muond import wire
from muond._stubs import pb
from muond.client import Connection
from muond.transport import framing

SIZES = {"a": 3, "b": 5, "c": 7}


def spec():
    out = pb.SessionSpec()
    out.groups.add(name="g0", options=pb.GroupOptions(optimizer=pb.OPTIMIZER_ADAMW))
    for name, size in SIZES.items():
        out.parameters.add(name=name, shape=[size], group="g0", wire_dtype=pb.DTYPE_FP32)
    return out


def opened(conn, session_id):
    conn.create_session(session_id, spec())
    torch.manual_seed(11)
    values = {name: torch.randn(size) for name, size in SIZES.items()}
    conn.upload(session_id, [chunk for name, t in values.items()
                             for chunk, _ in [(pb.TensorChunk(name=name, offset=0, dtype=pb.DTYPE_FP32,
                                                              data=t.numpy().tobytes()), None)]])
    return values


class Recording(wire.ChunkAssembler):
    """A ChunkAssembler that notes the order in which the answer's tensors begin."""

    def __init__(self):
        super().__init__(SIZES)
        self.order = []

    def add(self, chunk):
        name = (chunk.meta if isinstance(chunk, wire.FramedChunk) else chunk).name
        if name not in self.order:
            self.order.append(name)
        super().add(chunk)


def step(conn, session_id, number, order=()):
    grads = [(name, torch.full((size,), 0.1 * (i + 1))) for i, (name, size) in enumerate(SIZES.items())]
    header = pb.StepHeader(session_id=session_id, step=number, answer_order=list(order))
    header.num_chunks, messages = framing.step_messages(grads, "fp32", 1 << 20, False)
    into = Recording()
    result = conn.step(header, messages, into)
    return result, into


def test_the_answer_comes_in_the_order_asked_with_the_same_values(endpoint):
    conn = Connection(endpoint)
    opened(conn, "py-order-asked")
    opened(conn, "py-order-plain")
    for number in (1, 2):
        asked_result, asked = step(conn, "py-order-asked", number, order=[2, 0])
        plain_result, plain = step(conn, "py-order-plain", number)
        assert asked.order == ["c", "a", "b"]
        assert plain.order == ["a", "b", "c"]
        assert asked_result.step == plain_result.step == number
        got, want = asked.tensors(), plain.tensors()
        assert got.keys() == want.keys()
        for key in got:
            assert torch.equal(got[key], want[key])
    conn.close_session("py-order-asked")
    conn.close_session("py-order-plain")


@pytest.mark.parametrize("order,message", [
    ([0, 0], r"header\.answer_order\[1\]: parameter 0 is listed already"),
    ([1, 3], r"header\.answer_order\[1\]: 3 is not a parameter index \(the session has 3\)"),
])
def test_a_bad_order_is_refused_naming_it_and_applies_nothing(endpoint, order, message):
    conn = Connection(endpoint)
    opened(conn, "py-order-bad")
    with pytest.raises(muond.MuondError, match=message) as info:
        step(conn, "py-order-bad", 1, order=order)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    result, _ = step(conn, "py-order-bad", 1)  # step 1 is still to come: nothing was applied
    assert result.step == 1 and result.applied
    conn.close_session("py-order-bad")


def test_an_out_of_band_step_refuses_an_order(endpoint):
    conn = Connection(endpoint)
    opened(conn, "py-order-shm")
    request = pb.StepSharedRequest()
    request.header.session_id = "py-order-shm"
    request.header.step = 1
    request.header.answer_order.append(0)
    with pytest.raises(muond.MuondError, match=r"header\.answer_order: a shared-memory step answers every "
                                                r"parameter at once") as info:
        conn.step_shared(request)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    conn.close_session("py-order-shm")


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.first = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.last = nn.Linear(16, 4)

    def forward(self, x):
        return self.last(torch.tanh(self.mid(torch.tanh(self.first(x)))))


def test_land_in_forward_asks_for_the_forward_order(endpoint, monkeypatch):
    from muond.transport import streamed
    landed = []
    arrived = streamed.Landing.arrived

    def noting(landing, name):
        landed.append(name)
        arrived(landing, name)
    monkeypatch.setattr(streamed.Landing, "arrived", noting)
    model = Chain()
    # Groups against the forward: the session's order is last, mid, first (and a bare scale).
    scale = nn.Parameter(torch.ones(4))
    named = dict(model.named_parameters())
    params = [(n, named[n]) for n in ("last.weight", "last.bias", "mid.weight", "mid.bias",
                                      "first.weight", "first.bias")] + [("scale", scale)]
    opt = muond.RemoteOptimizer([{"params": params, "optimizer": "adamw", "lr": 0.01}],
                                endpoint=endpoint, transport="grpc", overlap=True, land_in_forward=model)
    forward_order = ["scale", "first.weight", "first.bias", "mid.weight", "mid.bias", "last.weight",
                     "last.bias"]
    for number in range(1, 4):
        landed.clear()
        x = torch.randn(4, 8)
        (model(x) * scale).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        opt.flush()
        # The bare parameter (step() waits for it) first, then the modules as their forward ran.
        assert landed == forward_order
    opt.close()
