"""Rejections surface as muond.MuondError carrying the gRPC status code and the daemon's message;
client-side misuse is a ValueError/TypeError before anything is sent."""

import concurrent.futures
import os
import pickle
import re
import socket
import subprocess
from pathlib import Path

import grpc
import pytest
import torch

import muond
from muond import wire
from muond._stubs import pb
from muond.client import Connection
from conftest import Daemon, _daemon_binary
from helpers import TinyNet, loss_of


def spec_of(shape):
    spec = pb.SessionSpec()
    spec.groups.add(name="g0", options=pb.GroupOptions(optimizer=pb.OPTIMIZER_ADAMW))
    spec.parameters.add(name="w", shape=list(shape), group="g0", wire_dtype=pb.DTYPE_FP32)
    return spec


def test_unknown_session_is_not_found(endpoint):
    model = TinyNet(seed=30)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint)
    Connection(endpoint).close_session(opt.session_id)  # ended behind the optimizer's back
    loss_of(model, 1).backward()
    with pytest.raises(muond.MuondError) as info:
        opt.step()
    err = info.value
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert opt.session_id in err.details
    # TinyNet's step is small: over gRPC it goes in one StepWhole call.
    assert err.rpc == ("StepShared" if opt.transport == "shm" else "StepWhole") and "NOT_FOUND" in str(err)
    opt.close()  # ending an already ended session is fine


def test_wrong_size_upload_is_invalid_argument(endpoint):
    conn = Connection(endpoint)
    conn.create_session("bad-shape", spec_of((3, 4)))
    chunk = pb.TensorChunk(name="w", offset=0, dtype=pb.DTYPE_FP32, data=bytes(4 * 5))
    with pytest.raises(muond.MuondError) as info:
        conn.upload("bad-shape", [chunk])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "w" in info.value.details
    conn.close_session("bad-shape")


def test_out_of_order_step_is_failed_precondition(endpoint):
    model = TinyNet(seed=31)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint) as opt:
        loss_of(model, 1).backward()
        opt.last_step = 5  # as if the client skipped ahead
        with pytest.raises(muond.MuondError) as info:
            opt.step()
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "1" in info.value.details  # names the expected step
        opt.last_step = 0
        opt.step()  # a rejected request changed nothing: step 1 still works
        assert opt.last_step == 1


def test_invalid_option_value_is_invalid_argument(endpoint):
    model = TinyNet(seed=32)
    with pytest.raises(muond.MuondError) as info:
        muond.RemoteOptimizer(muond.default_param_groups(model, muon={"ns_steps": 0}),
                              endpoint=endpoint)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "ns_steps" in info.value.details


@pytest.mark.parametrize("shape", [(0, 4), (0, 3, 4), (4, 0)])
def test_an_empty_parameter_is_refused_naming_it(endpoint, shape):
    """The client names the parameter before anything is sent (a zero first dimension once divided
    by zero in its placement cost); the daemon refuses such a spec itself, naming its shape."""
    param = torch.nn.Parameter(torch.zeros(shape))
    with pytest.raises(ValueError, match=rf"parameter 'p0' has no elements \(shape {re.escape(str(shape))}\)"):
        muond.RemoteOptimizer([{"params": [param], "optimizer": "muon"}], endpoint=endpoint)
    conn = Connection(endpoint)
    with pytest.raises(muond.MuondError, match=r"spec.parameters\[0\].shape: dimension \d is 0"):
        conn.create_session(f"empty-{len(shape)}-{shape[0]}", spec_of(shape))
    conn.close()


def test_unreachable_daemon_is_unavailable():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(muond.MuondError) as info:
        muond.RemoteOptimizer([torch.nn.Parameter(torch.zeros(2, 2))],
                              endpoint=f"127.0.0.1:{port}", connect_timeout=0.5)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_retry_that_gives_up_says_how_many_tries(start_daemon):
    daemon = start_daemon()
    model = TinyNet(seed=33)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint, transport="grpc",
                                max_step_attempts=3, retry_backoff=0.01)
    loss_of(model, 1).backward()
    opt.step()
    daemon.stop()  # the session goes with it: no close
    loss_of(model, 2).backward()
    with pytest.raises(muond.MuondError) as stepped:
        opt.step()
    conn = Connection(daemon.endpoint, max_attempts=2, retry_backoff=0.01)
    with pytest.raises(muond.MuondError) as listed:
        conn.list_sessions()
    conn.close()
    assert stepped.value.code == grpc.StatusCode.UNAVAILABLE
    assert stepped.value.details.endswith("(gave up after 3 tries)"), stepped.value.details
    assert listed.value.code == grpc.StatusCode.UNAVAILABLE and listed.value.rpc == "ListSessions"
    assert listed.value.details.endswith("(gave up after 2 tries)"), listed.value.details


def test_a_refusal_on_a_later_try_says_what_the_try_before_met(endpoint):
    # The first try of a step is lost (as a daemon's restart would lose it) and, meanwhile, the
    # session went (the daemon restarted without it): the retry's NOT_FOUND says it was a retry.
    model = TinyNet(seed=34)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, retry_backoff=0.01)
    loss_of(model, 1).backward()
    opt.step()
    daemon_session = opt._sessions[0]  # pylint: disable=protected-access
    real_step = daemon_session.step

    def lost_then_closed(header, *args, **kwargs):
        daemon_session.step = real_step
        Connection(endpoint).close_session(opt.session_id)
        raise muond.MuondError(grpc.StatusCode.UNAVAILABLE, "injected: connection reset", "Step")

    daemon_session.step = lost_then_closed
    loss_of(model, 2).backward()
    with pytest.raises(muond.MuondError) as stepped:
        opt.step()
    assert stepped.value.code == grpc.StatusCode.NOT_FOUND
    assert stepped.value.details.endswith(
        "(on try 2; the try before met UNAVAILABLE: injected: connection reset)"), stepped.value.details

    # The same for the calls the connection retries; a first try's refusal stays as it was.
    conn = Connection(endpoint, retry_backoff=0.01)
    real_digest, tries = conn._stub.GetStateDigest, []

    def unreachable_once(*args, **kwargs):
        tries.append(1)
        if len(tries) == 1:
            raise muond.MuondError(grpc.StatusCode.UNAVAILABLE, "injected: " + "x" * 200, "GetStateDigest")
        return real_digest(*args, **kwargs)

    conn._stub.GetStateDigest = unreachable_once
    with pytest.raises(muond.MuondError) as digest:
        conn.state_digest(opt.session_id)
    assert digest.value.code == grpc.StatusCode.NOT_FOUND and digest.value.rpc == "GetStateDigest"
    assert digest.value.details.endswith("(on try 2; the try before met UNAVAILABLE: injected: "
                                         + "x" * 150 + "…)"), digest.value.details
    with pytest.raises(muond.MuondError) as again:
        conn.state_digest(opt.session_id)
    assert "on try" not in again.value.details
    conn.close()


def test_a_close_whose_answer_was_lost_is_done_when_its_retry_finds_no_session(endpoint):
    conn = Connection(endpoint, retry_backoff=0.01)
    conn.create_session("closed-once", spec_of((3, 4)))
    real_close, calls = conn._stub.CloseSession, []

    def answer_lost(*args, **kwargs):  # the first try closes the session; its answer never comes
        calls.append(args[0].session_id)
        answer = real_close(*args, **kwargs)
        if len(calls) == 1:
            raise muond.MuondError(grpc.StatusCode.UNAVAILABLE, "injected: answer lost", "CloseSession")
        return answer

    conn._stub.CloseSession = answer_lost
    conn.close_session("closed-once")  # the retry's NOT_FOUND: the first try's close
    assert calls == ["closed-once", "closed-once"]
    assert "closed-once" not in [s.session_id for s in conn.list_sessions()]
    with pytest.raises(muond.MuondError) as first:  # a first try's NOT_FOUND is the caller's
        conn.close_session("closed-once")
    assert first.value.code == grpc.StatusCode.NOT_FOUND and "closed-once" in first.value.details
    conn.close()


def test_a_create_whose_answer_was_lost_is_still_answered_as_a_create(endpoint, monkeypatch):
    """The first try of CreateSession creates the session and its answer is lost; the retry carries
    the same create_token, so the daemon answers it as the create it was (attached False), and the
    optimizer knows it made the session (a refused open would close it) and uploads its parameters.
    Another optimizer's open of the same session still attaches."""
    from muond._stubs import pb_grpc  # noqa: PLC0415

    real_stub, answers = pb_grpc.MuondStub, []

    class AnswerLostOnce(real_stub):
        def __init__(self, channel):
            super().__init__(channel)
            create = self.CreateSession

            def answer_lost(request, **kwargs):
                answer = create(request, **kwargs)
                answers.append((request.create_token, answer.attached))
                if len(answers) == 1:
                    raise muond.MuondError(grpc.StatusCode.UNAVAILABLE, "injected: answer lost",
                                           "CreateSession")
                return answer
            self.CreateSession = answer_lost

    monkeypatch.setattr(pb_grpc, "MuondStub", AnswerLostOnce)
    model = TinyNet(seed=5)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                session="lost-create", retry_backoff=0.01)
    monkeypatch.setattr(pb_grpc, "MuondStub", real_stub)
    (token, first), (retry_token, retried) = answers
    assert len(token) == 16 and retry_token == token
    assert (first, retried) == (False, False)
    assert not opt.attached
    loss_of(model, 1).backward()
    opt.step()
    other = muond.RemoteOptimizer(muond.default_param_groups(TinyNet(seed=6)), endpoint=endpoint,
                                  session="lost-create")
    assert other.attached and other.last_step == 1
    other.close(keep_session=True)
    opt.close()


def test_labels_are_checked_before_sending_and_an_attach_must_agree_with_them(endpoint):
    params = lambda: [("w", torch.nn.Parameter(torch.zeros(3, 4)))]  # noqa: E731
    for labels, error, message in (({"Run": "a"}, ValueError, "labels: key 'Run'"),
                                   ({"run": 1}, TypeError, "labels\\['run'\\]: must be a str"),
                                   ({"run": "a\nb"}, ValueError, "control characters"),
                                   (["run"], TypeError, "labels: must be a dict")):
        with pytest.raises(error, match=message):
            muond.RemoteOptimizer(params(), endpoint=endpoint, labels=labels)
    with muond.RemoteOptimizer(params(), endpoint=endpoint, labels={"run": "a"}) as first:
        with pytest.raises(muond.MuondError) as refused:
            muond.RemoteOptimizer(params(), endpoint=endpoint, session=first.session_id,
                                  labels={"run": "b"})
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert "spec.labels['run']: the session's is 'a', this request's 'b'" in refused.value.details
        # A client that gives no labels (or one from before them) attaches as before.
        # Labels the daemon refuses, at an attach too: INVALID_ARGUMENT (a request refused for
        # itself), not ALREADY_EXISTS (a spec that differs); the session is as it was.
        conn = Connection(endpoint)
        [summary] = [s for s in conn.list_sessions() if s.session_id == first.session_id]
        bad = pb.SessionSpec()
        bad.CopyFrom(summary.spec)
        bad.labels["Run\n"] = "a"
        with pytest.raises(muond.MuondError) as invalid:
            conn.create_session(first.session_id, bad)
        assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT, invalid.value
        assert "spec.labels: key 'Run\\x0a'" in invalid.value.details, invalid.value.details
        [after] = [s for s in conn.list_sessions() if s.session_id == first.session_id]
        assert dict(after.spec.labels) == {"run": "a"}
        conn.close()
        other = muond.RemoteOptimizer(params(), endpoint=endpoint, session=first.session_id)
        assert other.attached and other.labels == {}
        other.close(keep_session=True)


def test_an_empty_endpoint_is_refused_at_once():
    with pytest.raises(ValueError, match="endpoint: must be the daemon's host:port, got ''"):
        Connection("")


def test_client_side_misuse_raises_before_sending():
    w = torch.nn.Parameter(torch.zeros(4, 4))
    b = torch.nn.Parameter(torch.zeros(4))
    unused = "127.0.0.1:1"  # never contacted: every case fails before connecting
    with pytest.raises(TypeError, match="ns_step"):
        muond.RemoteOptimizer([w], endpoint=unused, ns_step=3)
    with pytest.raises(ValueError, match="momentum"):
        muond.RemoteOptimizer([{"params": [b], "optimizer": "adamw", "momentum": 0.9}],
                              endpoint=unused)
    with pytest.raises(ValueError, match="Muon needs matrices"):
        muond.RemoteOptimizer([b], endpoint=unused)
    with pytest.raises(ValueError, match="unknown optimizer"):
        muond.RemoteOptimizer([w], endpoint=unused, optimizer="adam")
    with pytest.raises(ValueError, match="contradicts"):
        muond.RemoteOptimizer([{"params": [w], "optimizer": "adamw", "use_muon": True}],
                              endpoint=unused)
    with pytest.raises(ValueError, match="scale_mode"):
        muond.RemoteOptimizer([w], endpoint=unused, scale_mode="rms")
    with pytest.raises(ValueError, match="wire dtype"):
        muond.RemoteOptimizer([w], endpoint=unused, wire_dtype="int2")


def test_muond_error_pickles():
    err = muond.MuondError(grpc.StatusCode.NOT_FOUND, "session 'x' not found", "Step")
    copy = pickle.loads(pickle.dumps(err))
    assert copy.code == err.code and copy.details == err.details and str(copy) == str(err)


def test_complex_and_repeated_tensors_are_refused_naming_the_parameter(endpoint):
    # A complex parameter would lose its imaginary part to the real fp32 masters; one tensor given
    # twice would count twice in the norm and be updated twice. Both before anything is sent.
    z = torch.nn.Parameter(torch.randn(4, dtype=torch.cfloat))
    w = torch.nn.Parameter(torch.randn(4, 4))
    for make in (lambda p: muond.RemoteOptimizer(p, endpoint=endpoint), muond.LocalOptimizer):
        with pytest.raises(TypeError, match="parameter 'z': a complex tensor"):
            make([{"params": [("z", z)], "optimizer": "adamw"}])
        with pytest.raises(ValueError, match="parameters 'w' and 'w2' are the same tensor"):
            make([{"params": [("w", w), ("w2", w)], "optimizer": "adamw"}])


def test_a_refused_construction_leaves_no_session_behind(endpoint):
    # The upload of a non-finite initial value is refused after the session was created: the
    # session goes with the failed constructor, and the same id can be created afresh.
    session = "refused-construction"
    bad = torch.nn.Parameter(torch.tensor([1.0, float("nan")]))
    with pytest.raises(muond.MuondError, match="nan"):
        muond.RemoteOptimizer([{"params": [("w", bad)], "optimizer": "adamw"}], endpoint=endpoint,
                              session=session)
    assert session not in {s.session_id for s in Connection(endpoint).list_sessions()}
    good = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    with muond.RemoteOptimizer([{"params": [("w", good)], "optimizer": "adamw"}], endpoint=endpoint,
                               session=session) as opt:
        assert not opt.attached


def _under_an_address_space_limit(test):
    """The skips of a test that limits the daemon's address space (prlimit --as)."""
    test = pytest.mark.skipif(bool(os.environ.get("ASAN_OPTIONS")),
                              reason="AddressSanitizer's allocator ends the process on a failed allocation "
                                     "instead of throwing std::bad_alloc")(test)
    return pytest.mark.skipif(os.environ.get("MUOND_TEST_BACKEND", "cpu") != "cpu",
                              reason="the CPU backend's host allocations are what the address-space limit "
                                     "bounds")(test)


def _address_space(pid):
    status = (Path("/proc") / str(pid) / "status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:"))) * 1024


@_under_an_address_space_limit
def test_a_session_larger_than_the_daemons_memory_is_resource_exhausted(tmp_path):
    """With its address space limited to what it holds plus 2 GiB (as a container's or strict
    overcommit's limit would), a daemon cannot allocate a session of 2^31 AdamW elements (24 GiB of
    state): CreateSession answers RESOURCE_EXHAUSTED naming the failed allocation, not UNKNOWN,
    and the daemon serves on."""
    daemon = Daemon(_daemon_binary(), tmp_path / "daemon")
    held = _address_space(daemon.proc.pid)
    subprocess.run(["prlimit", "--pid", str(daemon.proc.pid), f"--as={held + (2 << 30)}"], check=True)
    try:
        conn = Connection(daemon.endpoint)
        with pytest.raises(muond.MuondError) as info:
            conn.create_session("too-large", spec_of((1 << 31,)))
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert "a host allocation failed" in info.value.details
        assert "too-large" not in {s.session_id for s in conn.list_sessions()}
        conn.close()
        model = TinyNet(seed=33)
        with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint) as opt:
            loss_of(model, 1).backward()
            opt.step()
            assert opt.last_info.applied
        assert daemon.alive()
    finally:
        daemon.stop()


@_under_an_address_space_limit
def test_a_first_step_after_sessions_filled_the_address_space_is_answered(tmp_path):
    """OpenBLAS maps a 128 MiB work buffer for a calling thread at its first product, and retries
    a failed map for ever. A daemon whose address space its sessions filled to under one such
    buffer must still answer a Muon session's first step (its Newton-Schulz products): the backend
    maps it as it starts. Without that, the step never came back and held the compute pool, so
    every other session's steps waited too. The matrix is large enough for OpenBLAS to multiply it
    on all its threads."""
    daemon = Daemon(_daemon_binary(), tmp_path / "daemon")
    try:
        torch.manual_seed(35)
        w = torch.nn.Parameter(torch.randn(256, 256))
        opt = muond.RemoteOptimizer([{"params": [("w", w)], "optimizer": "muon"}], endpoint=daemon.endpoint)
        limit = _address_space(daemon.proc.pid) + (1 << 30)
        subprocess.run(["prlimit", "--pid", str(daemon.proc.pid), f"--as={limit}"], check=True)
        conn = Connection(daemon.endpoint)
        # AdamW sessions until under 100 MiB are left, keeping about 40 MiB for the step's own
        # buffers and gRPC's: the first at 32 bytes an element (more than AdamW takes), the next
        # at what the previous one took.
        filled, per_element = 0, 32.0
        while (room := limit - _address_space(daemon.proc.pid)) >= (100 << 20):
            elements = int((room - (40 << 20)) / per_element)
            conn.create_session(f"fill-{filled}", spec_of((elements,)))
            per_element = (room - (limit - _address_space(daemon.proc.pid))) / elements
            filled += 1
        assert filled > 0
        conn.close()
        w.grad = torch.randn(256, 256)
        stepped = concurrent.futures.ThreadPoolExecutor(1).submit(opt.step)
        # The bound only ends a daemon that spins: the step takes milliseconds when it is answered.
        stepped.result(timeout=120)
        assert opt.last_info.applied
        opt.close()
        assert daemon.alive()
    finally:
        daemon.stop()


def test_a_read_that_asks_for_a_parameter_twice_is_refused(endpoint):
    """A short GetParameters request must not have the daemon stream one tensor back over and over."""
    model = TinyNet(seed=34)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint) as opt:
        name = opt._names[0]
        conn = Connection(endpoint)
        into = wire.ChunkAssembler({name: opt._sizes[name]})
        with pytest.raises(muond.MuondError) as info:
            conn.get_parameters(opt.session_id, into, names=[name, name])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"names[1]: '{name}' is asked for twice (also names[0])" in info.value.details
        assert conn.get_parameters(opt.session_id, into, names=[name]) == 0
        conn.close()


def test_a_reader_that_stops_reading_holds_up_no_step(endpoint):
    """A client that opens a GetParameters stream and stops reading it (a stalled monitor, a slow
    link) must not hold the session's next step until its deadline: the step is taken at once, and
    when the reader reads on it gets exactly the parameters of the step its answer named."""
    torch.manual_seed(35)
    # 64 MiB of fp32: far more than gRPC's flow control and the sockets buffer for a stream no one reads.
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])
    params = list(model.parameters())
    with muond.RemoteOptimizer([{"params": params, "optimizer": "adamw", "lr": 0.01}],
                               endpoint=endpoint) as opt:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        after_1 = {name: p.detach().clone() for name, p in zip(opt._names, params)}
        conn = Connection(endpoint)
        request = pb.GetParametersRequest(session_id=opt.session_id, max_chunk_bytes=64 << 10)
        responses = conn._stub.GetParameters(request, timeout=600, metadata=conn._metadata)
        first = next(responses)  # the answer has begun; nothing more is read for now
        assert first.last_step == 1
        for p in params:
            p.grad = torch.randn_like(p)
        stepped = concurrent.futures.ThreadPoolExecutor(1).submit(opt.step)
        # Before, the step waited for the reader: until its 600 s deadline. Taken, it takes a second.
        stepped.result(timeout=120)
        assert opt.last_info.step == 2 and opt.last_info.applied
        assert not torch.equal(params[0].detach(), after_1[opt._names[0]])
        into = wire.ChunkAssembler({name: opt._sizes[name] for name in opt._names})
        into.add(first.chunk)
        for response in responses:
            into.add(response.chunk)
        read = into.tensors()
        for name in opt._names:
            assert torch.equal(read[(name, "")].view_as(after_1[name]), after_1[name]), name
        conn.close()
