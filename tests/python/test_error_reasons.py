"""Machine-readable error reasons: each reason the client acts on arrives as ``MuondError.reason``
(from the google.rpc.ErrorInfo in the status details), refusals no client acts on carry none, and
the client's recovery follows the reason whatever the message says."""

import threading
import time

import grpc
import pytest
import torch

import muond
from muond import errors
from muond._stubs import pb
from muond.client import Connection
from helpers import TinyNet, loss_of


def small_spec():
    spec = pb.SessionSpec()
    spec.groups.add(name="g0", options=pb.GroupOptions(optimizer=pb.OPTIMIZER_ADAMW))
    spec.parameters.add(name="b", shape=[4], group="g0", wire_dtype=pb.DTYPE_FP32)
    return spec


def upload(conn, session_id):
    chunk = pb.TensorChunk(name="b", offset=0, dtype=pb.DTYPE_FP32, data=bytes(16))
    conn.upload(session_id, [chunk])


def step_naming(session_id, parameter, region):
    request = pb.StepSharedRequest()
    request.header.session_id = session_id
    request.header.step = 1
    request.gradients.add(name=parameter, region=region, offset=0, byte_size=16)
    return request


def test_the_reasons_are_those_of_the_api():
    assert errors.REGION_NOT_FOUND == "REGION_NOT_FOUND"
    assert errors.CHANNEL_NOT_FOUND == "CHANNEL_NOT_FOUND"
    assert errors.STEP_NOT_PREPARED == "STEP_NOT_PREPARED"
    assert errors.SESSION_NOT_FOUND == "SESSION_NOT_FOUND"


def test_an_unregistered_region_is_region_not_found(endpoint):
    conn = Connection(endpoint)
    conn.create_session("py-reason-region", small_spec())
    upload(conn, "py-reason-region")
    with pytest.raises(muond.MuondError) as info:
        conn.step_shared(step_naming("py-reason-region", "b", "never-registered"))
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert info.value.reason == errors.REGION_NOT_FOUND
    # An unknown parameter is NOT_FOUND too, and no reason to drop a region.
    with pytest.raises(muond.MuondError) as info:
        conn.step_shared(step_naming("py-reason-region", "nope", "never-registered"))
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert info.value.reason == ""
    conn.close_session("py-reason-region")


def test_an_unknown_session_is_session_not_found(endpoint):
    with pytest.raises(muond.MuondError) as info:
        Connection(endpoint).close_session("py-reason-never-created")
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert info.value.reason == errors.SESSION_NOT_FOUND


def test_a_commit_that_was_not_prepared_is_step_not_prepared(endpoint):
    conn = Connection(endpoint)
    spec = small_spec()
    spec.shard.endpoints.append(endpoint)
    spec.shard.index = 0
    spec.shard.num_parameters = 1
    spec.shard.parameters.append(0)
    conn.create_session("py-reason-commit", spec)
    upload(conn, "py-reason-commit")
    header = pb.StepHeader(session_id="py-reason-commit", step=1, num_chunks=0,
                           phase=pb.STEP_PHASE_COMMIT, decision=pb.ShardDecision(grad_norm=1.0))
    with pytest.raises(muond.MuondError) as info:
        conn.step(header, [], None)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.reason == errors.STEP_NOT_PREPARED
    conn.close_session("py-reason-commit")


def test_a_step_stream_stops_when_its_session_is_closed(endpoint):
    """A session closed while a step's chunks are still arriving ends that stream at its next chunk
    with SESSION_NOT_FOUND; it does not wait for the rest of the announced chunks."""
    conn = Connection(endpoint)
    spec = pb.SessionSpec()
    spec.groups.add(name="g0", options=pb.GroupOptions(optimizer=pb.OPTIMIZER_ADAMW))
    spec.parameters.add(name="b", shape=[3 * 1024], group="g0", wire_dtype=pb.DTYPE_FP32)
    conn.create_session("py-closed-mid-stream", spec)
    conn.upload("py-closed-mid-stream", [pb.TensorChunk(name="b", dtype=pb.DTYPE_FP32, data=bytes(3 * 4096))])
    closed, give_up = threading.Event(), threading.Event()

    def messages():
        yield pb.StepRequest(header=pb.StepHeader(session_id="py-closed-mid-stream", step=1, num_chunks=3))
        for k in range(3):
            if k == 1:
                closed.wait(timeout=60)
            if k == 2:  # only a stream that was not stopped waits here, and ends one chunk short
                give_up.wait(timeout=60)
                return
            yield pb.StepRequest(chunk=pb.TensorChunk(name="b", offset=1024 * k, dtype=pb.DTYPE_FP32,
                                                      data=bytes(4096)))

    answers = conn._stub.Step(messages(), timeout=120)
    deadline = time.monotonic() + 60
    while not any(s.session_id == "py-closed-mid-stream" and s.last_transport == "grpc"
                  for s in conn.list_sessions()):  # the daemon has the step's header
        assert time.monotonic() < deadline, "the step never reached the daemon"
        time.sleep(0.01)
    conn.close_session("py-closed-mid-stream")
    closed.set()
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(answers)
    finally:
        give_up.set()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
    assert "was closed" in info.value.details()
    assert errors.from_rpc_error(info.value, "Step").reason == errors.SESSION_NOT_FOUND
    conn.close()


def test_the_reason_survives_pickling_and_shard_naming():
    err = muond.MuondError(grpc.StatusCode.NOT_FOUND, "gone", "StepShared", errors.REGION_NOT_FOUND)
    import pickle  # noqa: PLC0415
    assert pickle.loads(pickle.dumps(err)).reason == errors.REGION_NOT_FOUND


def details_with(reason, message, domain="muond.v1"):
    info = pb.ErrorInfo(reason=reason, domain=domain)
    status = pb.RpcStatus(code=5, message=message)
    status.details.add(type_url="type.googleapis.com/google.rpc.ErrorInfo", value=info.SerializeToString())
    return status.SerializeToString()


def test_the_reason_is_read_from_the_details_not_the_message():
    assert errors.reason_in_details(details_with("REGION_NOT_FOUND", "reworded entirely")) == "REGION_NOT_FOUND"
    assert errors.reason_in_details(details_with("REGION_NOT_FOUND", "x", domain="example.com")) == ""
    assert errors.reason_in_details(b"\xff\xff not a status") == ""
    assert errors.reason_in_details(b"") == ""


@pytest.mark.parametrize("reason, message, dropped", [
    (errors.REGION_NOT_FOUND, "the memory is gone (any wording)", True),
    ("", "gradients[0].region: no shared-memory region 'r'", False),  # old wording, no reason
])
def test_a_region_is_dropped_on_the_reason_whatever_the_message(endpoint, reason, message, dropped):
    model = TinyNet(seed=71)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, transport="shm") as opt:
        loss_of(model, 1).backward()
        opt.step()
        session = opt._sessions[0]
        assert session.transport._region is not None

        def refuse(request):
            raise muond.MuondError(grpc.StatusCode.NOT_FOUND, message, "StepShared", reason)

        real = session.conn.step_shared
        session.conn.step_shared = refuse
        try:
            with pytest.raises(muond.MuondError) as info:
                session.step(pb.StepHeader(step=2),
                             [(n, torch.zeros(session.sizes[n])) for n in session.names])
        finally:
            session.conn.step_shared = real
        assert (session.transport._region is None) == dropped
        assert info.value.code == (grpc.StatusCode.UNAVAILABLE if dropped else grpc.StatusCode.NOT_FOUND)
