"""A daemon on the cuda backend beyond the happy path of its GPU transport: a CUDA IPC step whose
client event never completes fails by the call's deadline and leaves the daemon serving; a client
killed in the middle of a CUDA IPC step leaves a session another client attaches to and steps;
GetParameters and state_dict after GPU steps hold exactly what the steps produced; journal
durability with CUDA IPC steps survives a SIGKILL of the daemon; ``--device N`` and
CUDA_VISIBLE_DEVICES pick the device the daemon reports. Each test needs a CUDA GPU and skips,
saying so, without one (MUOND_REQUIRE_GPU=1 makes them run and fail instead)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import grpc
import pytest
import torch
import torch.nn.functional as F

import muond
from muond.errors import MuondError
from muond.transport import cuda_runtime

from conftest import REPO_ROOT
from helpers import TinyNet, batch, clone_model, loss_of, no_gpu

pytestmark = pytest.mark.skipif(no_gpu(), reason="needs a CUDA GPU and a daemon on the cuda backend")


@pytest.fixture
def cuda_daemon(start_daemon, monkeypatch):
    """``cuda_daemon(*flags, **start_daemon_kwargs)``: a daemon on the cuda backend, which must
    offer CUDA IPC; returns it and its ServerInfo."""
    def start(*flags, **kwargs):
        monkeypatch.setenv("MUOND_TEST_BACKEND", "cuda")
        daemon = start_daemon(*flags, **kwargs)
        return daemon, server_info(daemon.endpoint)
    return start


def server_info(endpoint):
    conn = muond.Connection(endpoint)
    try:
        info = conn.server_info()
    finally:
        conn.close()
    assert info.backend == "cuda" and info.cuda_ipc, f"not a daemon on the cuda backend: {info}"
    return info


def cuda_loss(model, step):
    x, y = [t.cuda() for t in batch(step)]
    return F.cross_entropy(model(x), y)


def train(model, opt, steps):
    for step in steps:
        opt.zero_grad()
        cuda_loss(model, step).backward()
        opt.step()
        assert opt.last_info.applied, f"step {step}: {opt.last_info}"


def spin(seconds):
    """Keeps the current stream busy for about ``seconds`` (torch's spin kernel), so that an event
    recorded after it completes only then."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    khz = getattr(props, "clock_rate", 0) or 2_000_000  # kHz; 2 GHz when torch does not say
    torch.cuda._sleep(int(seconds * khz * 1000))


def assert_same_state(a, b):
    assert a["muond"]["last_step"] == b["muond"]["last_step"]
    for i, slots in a["state"].items():
        for slot, value in slots.items():
            other = b["state"][i][slot]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"parameter {i} slot {slot} differs"
            else:
                assert value == other, f"parameter {i} slot {slot}"


def test_an_event_that_never_completes_fails_the_step_by_its_deadline(cuda_daemon):
    daemon, _ = cuda_daemon()
    model = TinyNet(seed=70).cuda()
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                               transport="cuda_ipc", timeout=2.0, max_step_attempts=1) as opt:
        train(model, opt, [1])
        opt.zero_grad()
        cuda_loss(model, 2).backward()
        spin(10)  # the gradients' copies and the event come after this on the stream
        started = time.monotonic()
        with pytest.raises(MuondError) as err:
            opt.step()
        waited = time.monotonic() - started
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert waited < 8, f"the step waited {waited:.1f} s for an event past its 2 s deadline"
        # The daemon polls the client's event from the host: its own stream is not held up, so
        # another session steps while the client's GPU is still busy.
        other = TinyNet(seed=71)
        with muond.RemoteOptimizer(muond.default_param_groups(other), endpoint=daemon.endpoint,
                                   transport="grpc") as cpu_side:
            loss_of(other, 1).backward()
            cpu_side.step()
            assert cpu_side.last_info.applied
        torch.cuda.synchronize()
        # Nothing of the failed step was applied: it is still step 2.
        opt.step()
        assert opt.last_info.applied and opt.last_step == 2
    assert daemon.alive(), daemon.log_tail()


CHILD = textwrap.dedent("""
    import sys, torch, torch.nn.functional as F
    sys.path[:0] = [{tests!r}, {python!r}]
    import muond
    from helpers import TinyNet, batch
    model = TinyNet(seed=72).cuda()
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint={endpoint!r},
                                session={session!r}, transport="cuda_ipc")
    def loss(step):
        x, y = [t.cuda() for t in batch(step)]
        return F.cross_entropy(model(x), y)
    loss(1).backward()
    opt.step()
    opt.zero_grad()
    loss(2).backward()
    torch.cuda._sleep(int(60 * 2_000_000 * 1000))  # step 2's event completes after a minute
    print("stepping", flush=True)
    opt.step()
""")


def test_a_client_killed_mid_step_leaves_a_session_another_client_steps(cuda_daemon):
    # The dead client's step waits for an event that will never complete. Its call has no deadline
    # of its own and --rpc-timeout is long, but its connection closed with the process: the call is
    # cancelled and the daemon ends the wait at the next poll, so the session is free again well
    # before the timeout.
    daemon, _ = cuda_daemon("--rpc-timeout", "300")
    session = f"killed-{uuid.uuid4().hex[:8]}"
    script = CHILD.format(tests=str(REPO_ROOT / "tests" / "python"), python=str(REPO_ROOT / "python"),
                          endpoint=daemon.endpoint, session=session)
    # The child imports what this process does (the generated stubs may live in a temporary
    # folder on sys.path).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.strip() == "stepping", line + child.stdout.read()
        time.sleep(1.0)  # StepCuda is in the daemon, waiting for the event
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert daemon.alive(), daemon.log_tail()
    # The dead client's liveness connection closed: its registration is gone. A new client
    # attaches to the session, which holds step 1 (step 2's gradients never arrived).
    model = TinyNet(seed=73).cuda()
    started = time.monotonic()
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                               session=session, transport="cuda_ipc") as opt:
        assert opt.attached and opt.last_step == 1
        train(model, opt, [2])
        assert time.monotonic() - started < 60, "the dead client's step held the session until --rpc-timeout"
        train(model, opt, [3])
        assert opt.last_step == 3
    assert daemon.alive(), daemon.log_tail()


def test_get_parameters_and_state_dict_after_gpu_steps(cuda_daemon):
    daemon, _ = cuda_daemon()
    a = TinyNet(seed=74).cuda()
    b = clone_model(a)
    with muond.RemoteOptimizer(muond.default_param_groups(a), endpoint=daemon.endpoint,
                               transport="cuda_ipc") as over_ipc, \
         muond.RemoteOptimizer(muond.default_param_groups(b), endpoint=daemon.endpoint,
                               transport="grpc") as over_grpc:
        train(a, over_ipc, range(1, 5))
        train(b, over_grpc, range(1, 5))
        stepped = {n: p.detach().clone() for n, p in a.named_parameters()}
        # GetParameters reads the masters the device steps wrote: exactly what the steps
        # returned into the parameters.
        with torch.no_grad():
            for p in a.parameters():
                p.zero_()
        assert over_ipc._sessions[0].refresh() == 4
        # The raw refresh wrote the model, as the optimizer's own calls do: noted as they note it.
        over_ipc._note_parameters()
        for name, p in a.named_parameters():
            assert torch.equal(p.detach(), stepped[name]), name
        # Without clipping, CUDA IPC steps equal gRPC steps bit for bit (test_gpu_transports),
        # and so do the states.
        saved = over_ipc.state_dict()
        assert_same_state(saved, over_grpc.state_dict())
        # A state saved after GPU steps loads back and training goes on from it.
        train(a, over_ipc, [5, 6])
        over_ipc.load_state_dict(saved)
        assert over_ipc.last_step == 4
        for name, p in a.named_parameters():
            assert torch.equal(p.detach(), stepped[name]), name
        assert_same_state(over_ipc.state_dict(), saved)


def test_journal_durability_with_cuda_ipc_steps(cuda_daemon, tmp_path):
    flags = ("--state-dir", tmp_path / "state", "--durability", "journal")
    daemon, _ = cuda_daemon(*flags, workdir=tmp_path / "d")
    session = f"journal-{uuid.uuid4().hex[:8]}"
    model = TinyNet(seed=75).cuda()
    twin = clone_model(model)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                                session=session, transport="cuda_ipc")
    train(model, opt, range(1, 5))
    before = opt.state_dict()
    opt.close(keep_session=True)
    # SIGKILL: no shutdown, no checkpoint; the journal holds every acknowledged step.
    endpoint, workdir = daemon.endpoint, daemon.workdir
    daemon.kill()
    daemon, _ = cuda_daemon(*flags, listen=endpoint, workdir=workdir)
    with muond.RemoteOptimizer(muond.default_param_groups(twin), endpoint=daemon.endpoint,
                               session=session, transport="cuda_ipc") as again:
        assert again.attached and again.last_step == 4
        assert_same_state(again.state_dict(), before)
        for (name, p), q in zip(twin.named_parameters(), model.parameters()):
            assert torch.equal(p.detach(), q.detach()), name
        train(twin, again, [5, 6])


def test_device_flag_and_cuda_visible_devices_pick_the_device(cuda_daemon, monkeypatch):
    count = torch.cuda.device_count()
    uuids = [cuda_runtime.device_uuid(i) for i in range(count)]
    # --device N names the device among those visible: the daemon reports its UUID.
    last = count - 1
    _, info = cuda_daemon("--device", str(last))
    assert cuda_runtime.same_uuid(info.cuda_device_uuid, uuids[last]), (info, uuids)
    # CUDA_VISIBLE_DEVICES renumbers: the last GPU alone is device 0 of the daemon.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuids[last])
    _, info = cuda_daemon("--device", "0")
    assert cuda_runtime.same_uuid(info.cuda_device_uuid, uuids[last]), (info, uuids)
    # A device past those visible is refused at start, naming it.
    with pytest.raises(RuntimeError, match="muond exited") as err:
        cuda_daemon("--device", "1")
    assert "device" in str(err.value).lower()
    # No visible device at all: the cuda backend cannot start, and says why.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match="muond exited") as err:
        cuda_daemon()
    assert "cuda" in str(err.value).lower()
