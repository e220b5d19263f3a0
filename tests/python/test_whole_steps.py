"""StepWhole: a small step's Step-stream messages in one call and its answer in one, against the
real daemon. The gRPC transport takes it for steps whose gradients and answer are each at most
``WHOLE_STEP_BYTES`` and fit the daemon's message limit, and the Step stream for larger ones; both
give the same parameters bit for bit. A whole step keeps every rule of the stream (a resent step is answered from the record, a
missing chunk applies nothing), and a request that is not a StepMessages is refused naming it,
with nothing applied."""

import grpc
import pytest
import torch
import torch.nn.functional as F

import muond
from muond import client as client_module
from muond._stubs import pb
from muond.client import Connection
from muond.transport import framing, grpc_transport

from helpers import TinyNet, assert_bitwise, batch
from test_answer_order import SIZES, opened, step

# The test names its transport: whole steps are the gRPC transport's.
pytestmark = pytest.mark.once


class Calls:
    """Counts the client's Step streams and StepWhole calls."""

    def __init__(self, monkeypatch):
        self.streams = self.wholes = 0
        stream, whole = Connection.step, Connection.step_whole

        def counted_stream(conn, *args, **kwargs):
            self.streams += 1
            return stream(conn, *args, **kwargs)

        def counted_whole(conn, *args, **kwargs):
            self.wholes += 1
            return whole(conn, *args, **kwargs)

        monkeypatch.setattr(Connection, "step", counted_stream)
        monkeypatch.setattr(Connection, "step_whole", counted_whole)


def train(endpoint, steps=4):
    model = TinyNet(seed=3)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                               transport="grpc") as opt:
        for t in range(1, steps + 1):
            x, y = batch(t)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert opt.last_info.step == t
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_small_steps_go_whole_and_equal_streamed_ones(endpoint, monkeypatch):
    calls = Calls(monkeypatch)
    whole = train(endpoint)
    assert (calls.wholes, calls.streams) == (4, 0)
    monkeypatch.setattr(grpc_transport, "WHOLE_STEP_BYTES", 1000)  # TinyNet's answer is ~20 KB
    streamed = train(endpoint)
    assert (calls.wholes, calls.streams) == (4, 4)
    assert_bitwise(whole, streamed, "parameters after whole and streamed steps")


@pytest.mark.parametrize("elements, calls", [(200_000, (1, 0)), (262_144, (0, 1))], ids=["800KB", "1MiB"])
def test_a_whole_step_fits_the_daemons_message_limit(start_daemon, monkeypatch, elements, calls):
    # --max-chunk-bytes 4096 limits the daemon's messages to 1 MiB + 4 KiB: 800 KB of gradients in
    # 4 KiB chunks still fit one call, 1 MiB with its chunks' fields does not and takes the stream
    # (a StepWhole of it was refused RESOURCE_EXHAUSTED), both answered in full.
    daemon = start_daemon("--max-chunk-bytes", "4096")
    counted = Calls(monkeypatch)
    param = torch.nn.Parameter(torch.zeros(elements))
    with muond.RemoteOptimizer([{"params": [param], "optimizer": "sgd", "lr": 0.5}], endpoint=daemon.endpoint,
                               transport="grpc", chunk_bytes=4096) as opt:
        param.grad = torch.ones(elements)
        opt.step()
    assert (counted.wholes, counted.streams) == calls
    assert torch.equal(param.detach(), torch.full((elements,), -0.5))


def step_messages(session_id, number, pack=False):
    """Step ``number``'s header and messages: a gradient of 0.5 for every parameter."""
    grads = [(name, torch.full((size,), 0.5)) for name, size in SIZES.items()]
    header = pb.StepHeader(session_id=session_id, step=number, packed_answer=pack)
    header.num_chunks, messages = framing.step_messages(grads, "fp32", 1 << 20, pack)
    return header, list(messages)


def test_a_resent_whole_step_is_answered_from_the_record(endpoint):
    conn = Connection(endpoint)
    opened(conn, "py-whole-resent")
    answers = []
    for _ in range(2):
        header, messages = step_messages("py-whole-resent", 1, pack=True)
        into = muond.wire.ChunkAssembler(SIZES)
        answers.append((conn.step_whole(header, messages, into), into.tensors()))
    (first, first_values), (again, again_values) = answers
    assert first.applied and not first.replayed
    assert again.replayed and again.step == 1
    assert_bitwise(again_values, first_values, "the resent step's answer")
    result, _ = step(conn, "py-whole-resent", 2)  # the next step is 2: step 1 was applied once
    assert result.step == 2 and result.applied
    conn.close_session("py-whole-resent")


def raw_whole(conn, request: bytes):
    with client_module.translated("StepWhole"):
        return conn._step_whole(request, timeout=10)  # pylint: disable=protected-access


@pytest.mark.parametrize("request_bytes,message", [
    (b"\x12\x01x", r"messages\[0\]: a StepMessages holds only its messages \(field 1, length-delimited\); "
                   r"found field 2 of wire type 2"),
    (b"\x0a\x05ab", r"messages\[0\]: the encoding ends inside the message"),
    (b"\x0a\xff", r"messages\[0\]: the encoding ends inside the message"),
    (b"", r"header: the first message of a step must be its header"),
])
def test_a_request_that_is_not_step_messages_is_refused_naming_it(endpoint, request_bytes, message):
    conn = Connection(endpoint)
    opened(conn, "py-whole-bad")
    with pytest.raises(muond.MuondError, match=message) as info:
        raw_whole(conn, request_bytes)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    result, _ = step(conn, "py-whole-bad", 1)  # nothing was applied: step 1 is still to come
    assert result.step == 1 and result.applied and not result.replayed
    conn.close_session("py-whole-bad")


def test_a_whole_step_whose_answer_cannot_fit_one_message_is_refused_before_it_applies(start_daemon):
    """A StepWhole whose parameters alone are more than the daemon's message limit (1 MiB + 4 KiB
    here) could be applied and then never answered: it is refused naming the call's messages, with
    nothing applied, and the step goes through on the stream."""
    daemon = start_daemon("--max-chunk-bytes", "4096")
    big = torch.nn.Parameter(torch.zeros(300_000))  # 1.2 MB of fp32 parameters
    small = torch.nn.Parameter(torch.zeros(4))
    with muond.RemoteOptimizer([{"params": [("big", big), ("small", small)], "optimizer": "sgd", "lr": 0.5}],
                               endpoint=daemon.endpoint, transport="grpc", chunk_bytes=4096) as opt:
        conn = opt._sessions[0].conn
        # A few bytes of gradient (big has none this step); the answer carries every parameter.
        header = pb.StepHeader(session_id=opt.session_id, step=1)
        header.num_chunks, messages = framing.step_messages([("small", torch.ones(4))], "fp32", 4096, False)
        with pytest.raises(muond.MuondError, match=r"messages: the answer's parameters alone take 1200016 "
                                                   r"bytes in fp32, over the daemon's message limit of "
                                                   r"1052672 .*nothing was applied") as info:
            raw_whole(conn, framing.whole_step_request([pb.StepRequest(header=header), *messages]))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        big.grad, small.grad = torch.ones(300_000), torch.ones(4)
        opt.step()  # step 1 is still to come: the stream applies it
        assert opt.last_info.step == 1 and opt.last_info.applied and not opt.last_info.replayed
    assert torch.equal(big.detach(), torch.full((300_000,), -0.5))


def test_a_whole_step_missing_a_chunk_applies_nothing(endpoint):
    conn = Connection(endpoint)
    opened(conn, "py-whole-short")
    header, messages = step_messages("py-whole-short", 1)
    messages = messages[:-1]  # three announced, two sent
    with pytest.raises(muond.MuondError, match=r"header\.num_chunks: the stream ended after 2 of 3 "
                                               r"announced chunks; the step was not applied"):
        raw_whole(conn, framing.whole_step_request([pb.StepRequest(header=header), *messages]))
    result, _ = step(conn, "py-whole-short", 1)
    assert result.step == 1 and result.applied and not result.replayed
    conn.close_session("py-whole-short")


def test_the_answer_framing_is_checked(endpoint):
    conn = Connection(endpoint)
    opened(conn, "py-whole-framing")
    header, messages = step_messages("py-whole-framing", 1)
    answer = raw_whole(conn, framing.whole_step_request([pb.StepRequest(header=header), *messages]))
    parsed = list(framing.whole_step_answers(answer))
    assert parsed[0].HasField("result") and parsed[0].result.step == 1
    assert [chunk.meta.name for chunk in parsed[1:]] == list(SIZES)  # one framed chunk each
    for broken in (answer[:-1], b"\x12" + answer[1:]):
        with pytest.raises(ValueError):
            list(framing.whole_step_answers(broken))
    conn.close_session("py-whole-framing")
