"""The step transports from Python: which one ``transport=`` picks, steps over shared memory
bit-identical to steps over gRPC, and a process that dies leaving no region in the daemon. (ctest
runs this whole suite twice, with MUOND_TRANSPORT=shm and =grpc, so every other test covers both.)"""

import logging
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import muond
from muond._stubs import pb
from muond.client import Connection
from muond.errors import translated

from helpers import TinyNet, assert_bitwise, loss_of, params_of, clone_model


def regions(endpoint):
    conn = Connection(endpoint)
    try:
        with translated("SharedMemoryStatus"):
            return list(conn._stub.SharedMemoryStatus(pb.SharedMemoryStatusRequest()).regions)
    finally:
        conn.close()


def test_transport_choice(endpoint):
    model = TinyNet(seed=40)
    for wanted, chosen in (("auto", "shm"), ("grpc", "grpc"), ("shm", "shm")):
        with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                                   transport=wanted) as opt:
            assert opt.transport == chosen
    with pytest.raises(ValueError, match="transport"):
        muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                              transport="pigeon")


def test_connection_options_work_like_the_keywords(endpoint):
    model = TinyNet(seed=43)
    conn = muond.ConnectionOptions(endpoint=endpoint, transport="grpc", max_step_attempts=2,
                                   retry_backoff=0.5, timeout=30.0)
    with muond.RemoteOptimizer(muond.default_param_groups(model), connection=conn) as opt:
        assert opt.transport == "grpc" and opt.connection is conn
        assert opt.max_step_attempts == 2 and opt._conn.max_attempts == 2
        assert opt._conn.retry_backoff == 0.5 and opt._conn.timeout == 30.0
        loss_of(model, 1).backward()
        opt.step()
        assert opt.last_info.applied


def test_shm_is_refused_when_the_daemon_offers_none(start_daemon):
    daemon = start_daemon("--shm-socket", "none")
    model = TinyNet(seed=41)
    with pytest.raises(RuntimeError, match="--shm-socket none"):
        muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                              transport="shm")
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                               transport="auto") as opt:
        assert opt.transport == "grpc"  # auto falls back


def _refusals(caplog):
    """The muond logger's warnings that the shm transport gave way to gRPC."""
    return [r.getMessage() for r in caplog.records
            if r.name == "muond" and r.levelname == "WARNING" and "transport shm" in r.getMessage()]


def test_a_refused_region_falls_back_to_grpc_under_auto(start_daemon, caplog):
    # A region beyond --shm-max-region-bytes: the daemon refuses the memfd on its socket.
    daemon = start_daemon("--shm-max-region-bytes", "64")
    model = TinyNet(seed=44)
    with pytest.raises(ConnectionError, match="limit of 64"):
        muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                              transport="shm")
    caplog.clear()
    with caplog.at_level("WARNING", logger="muond"):
        with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                                   transport="auto") as opt:
            assert opt.transport == "grpc"
            for step in range(1, 3):
                opt.zero_grad()
                loss_of(model, step).backward()
                opt.step()
                assert opt.last_info.applied
    refusals = _refusals(caplog)
    assert len(refusals) == 1 and "limit of 64" in refusals[0], refusals


def test_a_region_refused_after_a_restart_falls_back_to_grpc_under_auto(start_daemon, tmp_path,
                                                                        caplog):
    # The daemon restarts (its state kept) with a limit the session's region is beyond: the retry
    # that registers the region again is refused, and that step and the next go over gRPC.
    work = tmp_path / "restarted"
    state = str(work / "state")
    daemon = start_daemon("--state-dir", state, workdir=work)
    model = TinyNet(seed=45)
    kwargs = dict(endpoint=daemon.endpoint, session="refused-later")
    with muond.RemoteOptimizer(muond.default_param_groups(model), transport="auto", **kwargs) as opt:
        assert opt.transport == "shm"
        caplog.clear()
        with caplog.at_level("WARNING", logger="muond"):
            for step in range(1, 4):
                if step == 2:
                    daemon.stop()
                    daemon = start_daemon("--state-dir", state, "--shm-max-region-bytes", "64",
                                          listen=daemon.endpoint, workdir=work)
                opt.zero_grad()
                loss_of(model, step).backward()
                opt.step()
                # Applied once each: the refused try sent nothing.
                assert opt.last_info.applied and opt.last_info.step == step
        refusals = _refusals(caplog)
        assert len(refusals) == 1 and "limit of 64" in refusals[0], refusals


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_shm_steps_equal_grpc_steps_bit_for_bit(endpoint, wire_dtype):
    a = TinyNet(seed=42)
    b = clone_model(a)
    kwargs = dict(endpoint=endpoint, wire_dtype=wire_dtype, max_grad_norm=0.5)
    with muond.RemoteOptimizer(muond.default_param_groups(a), transport="grpc", **kwargs) as over_grpc, \
         muond.RemoteOptimizer(muond.default_param_groups(b), transport="shm", **kwargs) as over_shm:
        for step in range(1, 5):
            for model, opt in ((a, over_grpc), (b, over_shm)):
                opt.zero_grad()
                loss_of(model, step).backward()
                opt.step()
            assert over_shm.last_info.grad_norm == over_grpc.last_info.grad_norm
            for (name, pa), pb_ in zip(params_of(a).items(), params_of(b).values()):
                assert torch.equal(pa, pb_), f"step {step}: {name}"


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_shm_steps_of_large_tensors_equal_grpc_steps_bit_for_bit(start_daemon, wire_dtype):
    # Tensors of several segments: the daemon copies them out of the region on its threads (three
    # here, whatever the cores), one segment (1 MiB of payload, the clients' default chunk) a
    # thread, and adds the segments' sums of squares in order: the norm has the bits of the gRPC
    # step's.
    endpoint = start_daemon("--threads", "3").endpoint
    torch.manual_seed(7)
    shapes = {"w": (1100, 1000), "b": (300_001,), "small": (5,)}
    a = {name: torch.nn.Parameter(torch.randn(shape) * 0.02) for name, shape in shapes.items()}
    b = {name: torch.nn.Parameter(p.detach().clone()) for name, p in a.items()}
    kwargs = dict(endpoint=endpoint, wire_dtype=wire_dtype, max_grad_norm=1.0)
    with muond.RemoteOptimizer([{"params": list(a.values()), "optimizer": "adamw"}],
                               transport="grpc", **kwargs) as over_grpc, \
         muond.RemoteOptimizer([{"params": list(b.values()), "optimizer": "adamw"}],
                               transport="shm", **kwargs) as over_shm:
        for step in range(1, 3):
            for name, shape in shapes.items():
                grad = torch.randn(shape) * 10.0 ** (step - 3)
                a[name].grad, b[name].grad = grad.clone(), grad.clone()
            over_grpc.step()
            over_shm.step()
            assert over_shm.last_info.grad_norm == over_grpc.last_info.grad_norm
            for name in shapes:
                assert torch.equal(a[name], b[name]), f"step {step}: {name}"


def _train_in_two_shards(endpoints):
    """Two AdamW steps, the state read and loaded again, a third step, in a session sharded over
    ``endpoints``: (the chunk size used, the parameters, the state read)."""
    torch.manual_seed(11)
    params = {"w": torch.nn.Parameter(torch.randn(300, 300)), "v": torch.nn.Parameter(torch.randn(200, 300))}
    with muond.RemoteOptimizer([{"params": list(params.values()), "optimizer": "adamw", "lr": 0.01}],
                               endpoints=endpoints) as opt:
        for step in range(1, 4):
            for p in params.values():
                p.grad = torch.randn(p.shape) * step
            opt.step()
            if step == 2:
                state = opt.state_dict()
                opt.load_state_dict(state)
        return opt.chunk_bytes, {n: p.detach().clone() for n, p in params.items()}, state


def test_chunks_fit_daemons_with_smaller_chunk_limits(endpoint, start_daemon, caplog):
    # Daemons taking chunks of at most 4 and 8 KiB refuse the clients' default 1 MiB ones
    # ("chunk.data: 360000 bytes for 'w' exceed the chunk limit"): the client sends chunks of the
    # smaller limit to both, in the upload, the steps and the loaded state, and trains as against a
    # daemon with the default limit, bit for bit.
    small = [start_daemon("--max-chunk-bytes", str(limit)).endpoint for limit in (8192, 4096)]
    with caplog.at_level(logging.INFO, logger="muond"):
        chunk_bytes, got, got_state = _train_in_two_shards(small)
    assert chunk_bytes == 4096
    assert f"chunks of 4096 bytes, not 1048576: the daemon at {small[1]} takes no larger ones" in caplog.text
    default_chunk_bytes, want, want_state = _train_in_two_shards([endpoint, start_daemon().endpoint])
    assert default_chunk_bytes == 1 << 20
    assert_bitwise(got, want, "parameters after steps in 4 KiB chunks")
    for index, slots in want_state["state"].items():
        for slot, value in slots.items():
            assert torch.equal(torch.as_tensor(got_state["state"][index][slot]), torch.as_tensor(value)), (index, slot)


def _restarting_run(start_daemon, tmp_path, restart_limits):
    """Four AdamW steps over gRPC, the state read after step 1 and loaded again before step 2; with
    ``restart_limits``, the daemon is restarted (same port and state folder) before the load with
    the first ``--max-chunk-bytes`` and before step 4 with the second. Returns (the chunk sizes the
    optimizer used, the parameters, the steps' answers)."""
    torch.manual_seed(12)
    params = {"w": torch.nn.Parameter(torch.randn(100, 100)), "v": torch.nn.Parameter(torch.randn(50, 100))}
    daemon = start_daemon("--state-dir", tmp_path / "state", workdir=tmp_path / "daemon")
    sizes, answers, saved = [], [], {}
    with muond.RemoteOptimizer([{"params": list(params.values()), "optimizer": "adamw", "lr": 0.01}],
                               endpoint=daemon.endpoint, transport="grpc", session="shrinking") as opt:
        for step in range(1, 5):
            if restart_limits and step in (2, 4):
                daemon.stop()
                limit = restart_limits[0 if step == 2 else 1]
                daemon = start_daemon("--state-dir", tmp_path / "state", "--max-chunk-bytes", limit,
                                      listen=daemon.endpoint, workdir=tmp_path / "daemon")
                opt._conn.server_info()  # the channel on the new daemon before the measured call
            if step == 2:
                opt.load_state_dict(saved)
                sizes.append(opt.chunk_bytes)
            for p in params.values():
                p.grad = torch.randn(p.shape) * step
            opt.step()
            answers.append((opt.last_info.step, opt.last_info.applied, opt.last_info.attempts))
            sizes.append(opt.chunk_bytes)
            if step == 1:
                saved = opt.state_dict()
    return sizes, {n: p.detach().clone() for n, p in params.items()}, answers


def test_a_daemon_restarted_with_a_smaller_chunk_limit_gets_smaller_chunks(start_daemon, tmp_path, caplog):
    # The optimizer fitted its chunks (1 MiB) to the daemon when it connected; restarted with
    # --max-chunk-bytes 8192, then 2048, the daemon refuses them (CHUNK_TOO_LARGE). The client asks
    # the limit again and sends the same call in smaller chunks: the loaded state (40 KB for "w")
    # and a step. Each step is applied once, in one try, and the run ends as one never restarted.
    with caplog.at_level(logging.INFO, logger="muond"):
        sizes, got, answers = _restarting_run(start_daemon, tmp_path / "restarted", (8192, 2048))
    assert sizes == [1 << 20, 8192, 8192, 8192, 2048]
    assert "chunks of 8192 bytes, not 1048576" in caplog.text
    assert "chunks of 2048 bytes, not 8192" in caplog.text
    want_sizes, want, want_answers = _restarting_run(start_daemon, tmp_path / "uninterrupted", ())
    assert want_sizes == [1 << 20] * 5
    assert [(step, applied) for step, applied, _ in answers] == [(s, True) for s in range(1, 5)]
    assert answers[3][2] == want_answers[3][2] == 1, "a try refused for its chunks' size is no try"
    assert_bitwise(got, want, "parameters after a daemon's chunk limit fell twice")


def test_a_process_that_dies_leaves_no_region(endpoint, tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = {sys.path!r}
        import muond
        from helpers import TinyNet, loss_of
        model = TinyNet(seed=43)
        opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint={endpoint!r},
                                    session="dies-{tmp_path.name}", transport="shm")
        loss_of(model, 1).backward()
        opt.step()
        print("stepped", flush=True)
        os._exit(3)  # no close, no atexit: as a crash
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    assert "stepped" in done.stdout
    # The daemon drops the region when it sees the dead process's socket close.
    deadline = time.monotonic() + 60
    while any(r.name.startswith(f"dies-{tmp_path.name}/") for r in regions(endpoint)):
        assert time.monotonic() < deadline, "the dead client's region is still registered"
        time.sleep(0.01)


@pytest.mark.once  # no daemon: a socket of the test's own
def test_a_socket_that_never_answers_fails_the_region_within_the_deadline(tmp_path):
    """A daemon whose shared-memory socket accepts but never answers (a stopped or wedged daemon)
    fails the region's set-up as a daemon that is away, within the connection's deadline, instead
    of waiting forever; without a deadline the wait has no limit, as a gRPC call's has none."""
    import socket
    import threading

    from muond.transport import shm

    address = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(4)
    outcome = []

    def set_up():
        try:
            shm.SharedRegion(address, 4096, grant="g", timeout=0.5)
            outcome.append("registered")
        except ConnectionError as err:
            outcome.append(err)

    trying = threading.Thread(target=set_up, daemon=True)
    trying.start()
    trying.join(timeout=60)
    listener.close()
    assert not trying.is_alive(), "the set-up still waits for an answer"
    [err] = outcome
    assert isinstance(err, ConnectionError)
    assert "did not answer on its shared-memory socket within 0.5 s" in str(err)


@pytest.mark.once  # shared memory, named
def test_a_silent_socket_during_a_step_fails_the_try_as_a_daemon_away(endpoint, tmp_path, monkeypatch):
    """A step that registers its region again (the region was dropped) and meets a socket that never
    answers fails that try with UNAVAILABLE after the connection's deadline, like a daemon that is
    away — a MuondError the step's tries handle, not a bare socket error — and applies nothing:
    the next step goes out with the same number."""
    import socket

    import grpc

    silent_address = str(tmp_path / "silent.sock")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(silent_address)
    silent.listen(4)
    model = TinyNet(seed=46)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, transport="shm",
                               max_step_attempts=1) as opt:
        loss_of(model, 1).backward()
        opt.step()
        session = opt._sessions[0]
        info = pb.ServerInfo()
        info.CopyFrom(session.conn.server_info())
        info.shm_socket = silent_address  # the daemon's grant, then a socket that never answers
        monkeypatch.setattr(session.conn, "server_info", lambda *args, **kwargs: info)
        monkeypatch.setattr(session.conn, "timeout", 10.0)
        session.transport.close()  # the region is gone: the next step registers one again
        opt.zero_grad()
        loss_of(model, 2).backward()
        with pytest.raises(muond.MuondError) as err:
            opt.step()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        assert "did not answer on its shared-memory socket within 10 s" in err.value.details
        monkeypatch.undo()
        opt.step()
        assert opt.last_info.step == 2 and opt.last_info.applied and not opt.last_info.replayed
    silent.close()


def _second_rank(endpoint, session, go, answered, finish):
    """Rank 1 of a two-rank session: attaches, steps once when told, sends back its parameters."""
    torch.set_num_threads(1)
    model = TinyNet(seed=47)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint, session=session,
                               world_size=2, rank=1, transport="grpc") as opt:
        assert go.wait(120)
        loss_of(model, 101).backward()
        opt.step()
        answered.put({n: p.detach().clone() for n, p in model.named_parameters()})
        assert finish.wait(120)  # the session stays open until rank 0 is done


@pytest.mark.once  # shared memory, named
def test_a_step_call_given_up_never_writes_its_answer_into_the_region(endpoint, tmp_path):
    """Rank 0's step waits for rank 1 past its deadline: the client gives the call up and gets on
    with the region (here: bytes of its own). When rank 1 arrives the step is taken, and the call
    still waiting in the daemon must not write its answer into the region over what the trainer
    wrote since; rank 0's next try of the step is answered as the step both ranks made."""
    import grpc

    from processes import rank_context

    session = f"given-up-{tmp_path.name}"
    context = rank_context()
    go, finish, answered = context.Event(), context.Event(), context.Queue()
    model = TinyNet(seed=47)
    conn = muond.ConnectionOptions(endpoint=endpoint, transport="shm", timeout=3.0, max_step_attempts=1)
    with muond.RemoteOptimizer(muond.default_param_groups(model), connection=conn, session=session,
                               world_size=2, rank=0) as opt:
        second = context.Process(target=_second_rank, args=(endpoint, session, go, answered, finish))
        second.start()
        try:
            loss_of(model, 1).backward()
            with pytest.raises(muond.MuondError) as err:
                opt.step()  # rank 1 has not stepped: the call waits past its deadline
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
            [region] = [r for r in regions(endpoint) if r.name.startswith(f"{session}/")]
            assert region.steps_in_flight == 1  # the call given up still waits for rank 1
            transport = opt._sessions[0].transport
            view = transport._region.tensor(0, transport._nbytes, torch.uint8)
            view.fill_(0x5A)  # the trainer's next use of its region
            go.set()
            theirs = answered.get(timeout=120)  # the step is taken and rank 1 answered
            deadline = time.monotonic() + 60
            while [r.steps_in_flight for r in regions(endpoint) if r.name == region.name] != [0]:
                assert time.monotonic() < deadline, "the given-up call never ended"
                time.sleep(0.01)
            assert bool((view == 0x5A).all()), "the given-up call wrote its answer into the region"
            opt.step()  # the step again: both ranks' step, answered as a replay
            assert opt.last_info.step == 1 and opt.last_info.replayed and opt.last_info.included
            for n, p in model.named_parameters():
                assert torch.equal(p.detach(), theirs[n]), n
        finally:
            finish.set()
            second.join(timeout=120)
    assert second.exitcode == 0
