"""Requests protobuf cannot parse, sent as raw bytes to the real daemon, as a client of another
language or a broken one could: a string field that is not UTF-8 is refused INVALID_ARGUMENT naming
the field by its path, a malformed message naming the message, on unary calls and on every kind of
stream, and nothing of the call is used — a session not created, an upload or a state load whose
last message does not parse changes nothing, a step not taken. The daemon goes on serving."""
import struct

import grpc
import pytest

from muond._stubs import pb
from muond.client import Connection

pytestmark = pytest.mark.once  # raw gRPC calls: the step transport is not the subject

PLACEHOLDER = b"Zq"  # two bytes a test message holds once, replaced by two that are not UTF-8
NOT_UTF8 = b"\xff\xfe"


def spoiled(message) -> bytes:
    """``message`` serialized, its one PLACEHOLDER replaced by bytes that are not UTF-8."""
    data = message.SerializeToString()
    assert data.count(PLACEHOLDER) == 1
    return data.replace(PLACEHOLDER, NOT_UTF8)


def raw(channel, method, kind):
    call = getattr(channel, kind)
    return call(f"/muond.v1.Muond/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b)


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if not isinstance(result, bytes):
            list(result)  # a server stream: its status comes at the end
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value


def spec(names=("w",), labels=None):
    s = pb.SessionSpec()
    s.groups.add(name="g0", options=pb.GroupOptions(optimizer=pb.OPTIMIZER_ADAMW))
    for name in names:
        s.parameters.add(name=name, shape=[2, 3], group="g0", wire_dtype=pb.DTYPE_FP32)
    for key, value in (labels or {}).items():
        s.labels[key] = value
    return s


def chunk(name, values, **fields):
    return pb.TensorChunk(name=name, offset=0, dtype=pb.DTYPE_FP32, shape=[2, 3],
                          data=struct.pack(f"<{len(values)}f", *values), **fields)


def digest(conn, session_id):
    d = conn.state_digest(session_id)
    return (d.step, d.digest)


def test_a_string_that_is_not_utf8_is_refused_naming_its_field(endpoint):
    channel = grpc.insecure_channel(endpoint)
    conn = Connection(endpoint)
    create = raw(channel, "CreateSession", "unary_unary")

    # Unary calls: a field deep in the request, a map's key, a malformed message.
    err = refusal(lambda: create(spoiled(pb.CreateSessionRequest(
        session_id="enc-a", spec=spec(("w", "vZq"))))))
    assert err.details().startswith("spec.parameters[1].name: is not UTF-8"), err.details()
    err = refusal(lambda: create(spoiled(pb.CreateSessionRequest(
        session_id="enc-a", spec=spec(labels={"team": "x", "Zq": "y"})))))
    assert err.details().startswith("spec.labels.key: is not UTF-8"), err.details()
    err = refusal(lambda: create(b"\x0a\x05ab"))  # session_id says 5 bytes, 2 follow
    assert err.details().startswith("request: not a valid muond.v1.CreateSessionRequest"), err.details()
    assert "enc-a" not in [s.session_id for s in conn.list_sessions()], "nothing was created"

    # A session to aim the streams at, with a state to compare.
    conn.create_session("enc-b", spec(("w", "v")))
    conn.upload("enc-b", [chunk("w", [1, 2, 3, 4, 5, 6]), chunk("v", [6, 5, 4, 3, 2, 1])])
    before = digest(conn, "enc-b")

    # A server stream's one request.
    err = refusal(lambda: raw(channel, "GetParameters", "unary_stream")(spoiled(pb.GetParametersRequest(
        session_id="enc-b", names=["w", "Zq"]))))
    assert err.details().startswith("names[1]: is not UTF-8"), err.details()

    # Client streams whose last message does not parse: every chunk before it is good, and still
    # nothing is uploaded or loaded.
    upload = [pb.UploadParametersRequest(session_id="enc-b").SerializeToString(),
              pb.UploadParametersRequest(chunk=chunk("w", [9] * 6)).SerializeToString(),
              pb.UploadParametersRequest(chunk=chunk("v", [9] * 6)).SerializeToString(),
              spoiled(pb.UploadParametersRequest(chunk=chunk("Zq", [9] * 6)))]
    err = refusal(lambda: raw(channel, "UploadParameters", "stream_unary")(iter(upload)))
    assert err.details().startswith("chunk.name: is not UTF-8"), err.details()
    # A whole state (the session's own, its masters zeroed), then one message that does not parse.
    state = [pb.GetStateResponse.FromString(m) for m in raw(channel, "GetState", "unary_stream")(
        pb.GetStateRequest(session_id="enc-b").SerializeToString())]
    zeroed = []
    for message in state[1:]:
        zero = pb.SetStateRequest(chunk=message.chunk)
        if zero.chunk.slot == "master":
            zero.chunk.data = bytes(len(zero.chunk.data))
        zeroed.append(zero.SerializeToString())
    set_state = [pb.SetStateRequest(session_id="enc-b").SerializeToString(),
                 pb.SetStateRequest(header=state[0].header).SerializeToString(), *zeroed]
    err = refusal(lambda: raw(channel, "SetState", "stream_unary")(
        iter(set_state + [spoiled(pb.SetStateRequest(chunk=pb.TensorChunk(name="w", slot="Zq")))])))
    assert err.details().startswith("chunk.slot: is not UTF-8"), err.details()
    assert digest(conn, "enc-b") == before
    raw(channel, "SetState", "stream_unary")(iter(set_state))  # the same state alone loads
    zeroed_digest = digest(conn, "enc-b")
    assert zeroed_digest != before
    conn.set_state("enc-b", state[0].header, [m.chunk for m in state[1:]])  # back as it was
    assert digest(conn, "enc-b") == before

    # The step stream: its header, and a gradient chunk after a good header.
    step = raw(channel, "Step", "stream_stream")
    header = pb.StepRequest(header=pb.StepHeader(session_id="enc-b", step=1, num_chunks=2))
    err = refusal(lambda: step(iter([spoiled(pb.StepRequest(header=pb.StepHeader(
        session_id="enc-b", step=1, num_chunks=2, overrides=[pb.GroupOverride(group="Zq", lr=0.1)])))])))
    assert err.details().startswith("header.overrides[0].group: is not UTF-8"), err.details()
    err = refusal(lambda: step(iter([header.SerializeToString(),
                                     pb.StepRequest(chunk=chunk("w", [1] * 6)).SerializeToString(),
                                     spoiled(pb.StepRequest(chunk=chunk("Zq", [1] * 6)))])))
    assert err.details().startswith("chunk.name: is not UTF-8"), err.details()
    assert digest(conn, "enc-b") == before, "no step was taken"

    # And the daemon serves on: the same step, well formed, is taken.
    answers = list(step(iter([header.SerializeToString(),
                              pb.StepRequest(chunk=chunk("w", [1] * 6)).SerializeToString(),
                              pb.StepRequest(chunk=chunk("v", [1] * 6)).SerializeToString()])))
    assert pb.StepResponse.FromString(answers[0]).result.step == 1
    assert digest(conn, "enc-b")[0] == 1
    conn.close_session("enc-b")
