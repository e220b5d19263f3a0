"""The GPU step transports from Python: CUDA IPC (a device buffer shared with a daemon on this node)
and NCCL (a two-rank communicator with the daemon).

Without a GPU (most machines): what ``transport=`` picks or refuses for CPU parameters against the
real daemon, the transport decision table, the CUDA runtime and NCCL bindings' pure helpers and the
communicator's abort logic (on a stand-in library). With a CUDA GPU and a daemon on the cuda
backend: steps over cuda_ipc equal to steps over grpc, a replayed step and a refused byte size;
with two GPUs, steps over NCCL (NCCL refuses two ranks on one GPU)."""

import ctypes
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
import torch.nn.functional as F

import muond
from muond._stubs import pb
from muond.errors import MuondError
from muond.transport import choice, cuda_runtime, nccl, shm, slots
from muond.transport.base import Facts, Here, parameter_device
from muond.transport.cuda_ipc_transport import LivenessTicket
from muond.transport.nccl_transport import several_ranks_per_gpu
from muond.transport.slots import SLOT_BYTES, slot_layout

from helpers import TinyNet, batch, clone_model, loss_of, no_gpu, rel_err

GPU_REASON = "needs a CUDA GPU and a daemon on the cuda backend"
needs_gpu = pytest.mark.skipif(no_gpu(), reason=GPU_REASON)
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs and a daemon on the cuda backend (NCCL refuses two ranks on one GPU "
           "before 2.30, and without NCCL_MULTI_RANK_GPU_ENABLE=1)")


# -- without a GPU: the real daemon (CPU backend here) -------------------------------------------

@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
def test_gpu_transport_with_cpu_parameters_is_refused_naming_it(endpoint, transport):
    model = TinyNet(seed=60)
    with pytest.raises(RuntimeError, match=f"transport='{transport}' is not possible") as err:
        muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                              transport=transport)
    assert "not on a CUDA device" in str(err.value)


def test_auto_with_cpu_parameters_keeps_the_host_transports(endpoint, start_daemon):
    model = TinyNet(seed=61)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                               transport="auto") as opt:
        assert opt.transport == "shm"
        loss_of(model, 1).backward()
        opt.step()
        assert opt.last_info.applied
    no_shm = start_daemon("--shm-socket", "none")
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=no_shm.endpoint,
                               transport="auto") as opt:
        assert opt.transport == "grpc"


def test_unknown_transport_lists_the_gpu_ones(endpoint):
    with pytest.raises(ValueError, match="cuda_ipc, nccl"):
        muond.RemoteOptimizer(muond.default_param_groups(TinyNet(seed=62)), endpoint=endpoint,
                              transport="rdma")


def test_the_daemon_describes_its_gpu_transports(endpoint):
    conn = muond.Connection(endpoint)
    try:
        info = conn.server_info()
    finally:
        conn.close()
    if "cuda_ipc" not in pb.ServerInfo.DESCRIPTOR.fields_by_name:
        pytest.skip("the generated stubs predate ServerInfo.cuda_ipc (rebuild the stubs)")
    if info.backend == "cpu":
        assert not info.cuda_ipc and info.cuda_device_uuid == "" and info.nccl_version == 0
    else:
        assert info.cuda_ipc and info.cuda_device_uuid.startswith(("GPU-", "MIG-"))


def test_the_shm_socket_issues_liveness_tickets(endpoint):
    conn = muond.Connection(endpoint)
    try:
        info = conn.server_info()
    finally:
        conn.close()
    with pytest.raises(ConnectionError, match="GrantSharedMemory"):
        LivenessTicket(info.shm_socket)  # a connection without a grant
    conn = muond.Connection(endpoint)
    try:
        grants = [conn.grant_shared_memory(info) for _ in range(2)]
    finally:
        conn.close()
    ticket = LivenessTicket(info.shm_socket, grants[0])
    try:
        assert ticket.ticket and ticket.ticket.isprintable() and " " not in ticket.ticket
        again = LivenessTicket(info.shm_socket, grants[1])
        assert again.ticket != ticket.ticket
        again.close()
    finally:
        ticket.close()
    with pytest.raises(ConnectionError, match="cannot connect"):
        LivenessTicket("@muond-test-no-such-socket")


def test_a_daemon_without_a_gpu_refuses_the_gpu_calls(endpoint):
    model = TinyNet(seed=67)
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=endpoint,
                               transport="grpc") as opt:
        conn = opt._conn
        if conn.server_info().backend != "cpu":
            pytest.skip("the daemon runs on a GPU")
        calls = [
            ("RegisterCudaMemory", lambda: conn.register_cuda_memory(pb.RegisterCudaMemoryRequest(
                name=f"{opt.session_id}/cuda", session_id=opt.session_id, mem_handle=b"\0" * 64,
                byte_size=4, event_handle=b"\0" * 64))),
            ("OpenNcclChannel", lambda: conn.open_nccl_channel(opt.session_id, 0)),
        ]
        for rpc, call in calls:
            with pytest.raises(MuondError) as err:
                call()
            assert err.value.rpc == rpc
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
        # A step encoded as the CUDA IPC transport sends it (transport/slots.py: the header's
        # encoding, then the entries'): the daemon reads both, finds the session the header names
        # and refuses the first entry's parameter, which the session does not have.
        entries = slots.encoded_entries(f"{opt.session_id}/cuda", [("nope", 0, 4)], "fp32", [], "fp32")
        with pytest.raises(MuondError, match=r"gradients\[0\]\.name: unknown parameter 'nope'") as err:
            conn.step_cuda(slots.shared_request(pb.StepHeader(session_id=opt.session_id, step=1), entries))
        assert (err.value.rpc, err.value.code) == ("StepCuda", grpc.StatusCode.NOT_FOUND)
        # Nothing was left behind: the session still steps.
        loss_of(model, 1).backward()
        opt.step()
        assert opt.last_info.applied


# -- pure helpers --------------------------------------------------------------------------------

def test_handle_structures_have_the_c_sizes():
    assert ctypes.sizeof(cuda_runtime.IpcMemHandle) == 64
    assert ctypes.sizeof(cuda_runtime.IpcEventHandle) == 64
    assert ctypes.sizeof(nccl.UniqueId) == 128
    raw = bytes(range(128))
    uid = nccl.unique_id(raw)
    assert ctypes.string_at(ctypes.addressof(uid), 128) == raw  # NULs and all
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.unique_id(b"\0" * 64)
    handle = cuda_runtime.IpcMemHandle()
    ctypes.memmove(ctypes.addressof(handle), b"\0\1" * 32, 64)
    assert cuda_runtime.handle_bytes(handle) == b"\0\1" * 32


def test_device_uuids_are_formatted_as_nvidia_smi_prints_them():
    raw = bytes.fromhex("5f8a1c2e3b4d4e6f8091a2b3c4d5e6f7")
    expected = "GPU-5f8a1c2e-3b4d-4e6f-8091-a2b3c4d5e6f7"
    assert cuda_runtime.format_uuid(raw) == expected
    assert cuda_runtime.format_uuid("5f8a1c2e-3b4d-4e6f-8091-a2b3c4d5e6f7") == expected  # torch 2.x str
    assert cuda_runtime.format_uuid("GPU-5F8A1C2E-3B4D-4E6F-8091-A2B3C4D5E6F7") == expected
    assert cuda_runtime.format_uuid(SimpleNamespace(bytes=raw)) == expected  # torch's _CUuuid
    assert cuda_runtime.format_uuid("MIG-abc").startswith("MIG-")
    with pytest.raises(ValueError, match="16 bytes"):
        cuda_runtime.format_uuid(b"short")
    assert cuda_runtime.same_uuid(expected, expected.upper().replace("GPU-", "gpu-"))
    assert not cuda_runtime.same_uuid("", "")


def test_slot_layout_gives_every_element_four_bytes():
    offsets, total = slot_layout(["a", "b", "c", "d"], {"a": 3, "b": 0, "c": 5, "d": 1})
    assert offsets == {"a": 0, "b": 12, "c": 12, "d": 32}
    assert total == 36 and SLOT_BYTES == 4
    assert all(o % 4 == 0 for o in offsets.values())
    # Typed views: aligned offsets pass, misaligned or overrunning ones are refused.
    assert cuda_runtime.byte_range(12, 5, torch.float32, 36) == slice(12, 32)
    assert cuda_runtime.byte_range(12, 5, torch.bfloat16, 36) == slice(12, 22)
    with pytest.raises(ValueError, match="aligned"):
        cuda_runtime.byte_range(2, 1, torch.float32, 36)
    with pytest.raises(ValueError, match="end past"):
        cuda_runtime.byte_range(32, 2, torch.float32, 36)


def test_nccl_version_codes():
    assert nccl.version_string(22809) == "2.28.9"
    assert nccl.version_string(21003) == "2.10.3"
    assert nccl.version_string(2804) == "2.8.4"
    assert nccl.version_string(0) == "none"


def _info(**fields):
    base = dict(cuda_ipc=True, host_id="host-a", cuda_device_uuid="GPU-daemon", nccl_version=22809,
                backend="cuda", shm_socket="")  # no shm: its check connects to the socket
    base.update(fields)
    return SimpleNamespace(**base)


def _here(device=0, uuid="GPU-mine", host="host-a", nccl_version=22809, why=""):
    return Here(device=device, why_no_device=why, host_id=host, uuid=uuid, nccl_version=nccl_version)


def decide(wanted, info, here, endpoint="the daemon"):
    """The names of the transports ``transport=wanted`` tries, best first."""
    return [t.name for t in choice.candidates(wanted, Facts(lambda: info, here), endpoint)]


def test_the_transport_decision_table():
    cpu = _here(device=None, why="the parameters are on cpu, not on a CUDA device")
    # auto: the daemon's own GPU and another GPU of the node both take CUDA IPC (NCCL next, on
    # another GPU only); another host takes NCCL; CPU parameters or a CPU daemon take nothing but
    # the host transports (here grpc: these daemons offer no shared memory).
    assert decide("auto", _info(cuda_device_uuid="GPU-mine"), _here()) == ["cuda_ipc", "grpc"]
    assert decide("auto", _info(), _here()) == ["cuda_ipc", "nccl", "grpc"]
    assert decide("auto", _info(), _here(nccl_version=0)) == ["cuda_ipc", "grpc"]
    assert decide("auto", _info(host_id="host-b"), _here()) == ["nccl", "grpc"]
    assert decide("auto", _info(host_id="host-b", nccl_version=0), _here()) == ["grpc"]
    # On this host NCCL is only the fallback of a CUDA IPC registration that failed.
    assert decide("auto", _info(cuda_ipc=False), _here()) == ["grpc"]
    assert decide("auto", _info(), cpu) == ["grpc"]
    assert decide("auto", _info(cuda_ipc=False, nccl_version=0, backend="cpu"), _here()) == ["grpc"]
    # explicit: that transport, or a RuntimeError naming it and saying why.
    assert decide("cuda_ipc", _info(), _here()) == ["cuda_ipc"]
    assert decide("nccl", _info(host_id="host-b"), _here()) == ["nccl"]
    with pytest.raises(RuntimeError, match="Duplicate GPU detected") as err:
        decide("nccl", _info(cuda_device_uuid="gpu-MINE"), _here(uuid="GPU-mine"), "d:1")
    assert "transport='nccl' is not possible with d:1" in str(err.value)
    assert "transport='auto' uses cuda_ipc" in str(err.value)
    with pytest.raises(RuntimeError, match="transport='cuda_ipc'.*another host"):
        decide("cuda_ipc", _info(host_id="host-b"), _here())
    with pytest.raises(RuntimeError, match="transport='cuda_ipc'.*no CUDA IPC.*'cpu'.*not on a CUDA"):
        decide("cuda_ipc", _info(cuda_ipc=False, backend="cpu"), cpu)
    with pytest.raises(RuntimeError, match="transport='nccl'.*daemon has no NCCL"):
        decide("nccl", _info(nccl_version=0), _here())
    with pytest.raises(RuntimeError, match="transport='nccl'.*cannot load NCCL"):
        decide("nccl", _info(host_id="host-b"), _here(nccl_version=0))
    with pytest.raises(RuntimeError, match="transport='shm' is not possible with d:1: the daemon "
                                           "offers no shared-memory transport"):
        decide("shm", _info(), _here(), "d:1")
    with pytest.raises(RuntimeError, match="transport='shm'.*runs on another host"):
        decide("shm", _info(shm_socket="@muond", host_id="host-b"), _here())

    # grpc by name asks the daemon nothing.
    def no_call():
        raise AssertionError("GetServerInfo was called")
    assert [t.name for t in choice.candidates("grpc", Facts(no_call, _here()), "d:1")] == ["grpc"]
    assert choice.NAMES == ("auto", "cuda_ipc", "nccl", "shm", "grpc")


def test_parameter_device():
    assert parameter_device([torch.zeros(2)])[0] is None
    assert "not on a CUDA device" in parameter_device([torch.zeros(2)])[1]
    assert "no parameters" in parameter_device([])[1]
    here = Here([torch.zeros(1)])
    assert here.device is None and here.host_id == shm.local_host_id()
    assert here.uuid == "" and here.nccl_version == 0  # nothing loaded for CPU parameters


def test_library_errors_name_the_call():
    try:
        rt = cuda_runtime.runtime()
    except RuntimeError as err:
        assert "libcudart" in str(err)
    else:
        with pytest.raises(RuntimeError, match=r"^cudaMalloc failed: .*\(cudaError 2\)"):
            rt.check("cudaMalloc", 2)
        rt.check("cudaFree", 0)
    try:
        lib = nccl.nccl()
    except RuntimeError as err:
        assert "libnccl" in str(err)
        assert nccl.local_version() == 0
    else:
        assert lib.version() >= 20000 and nccl.local_version() == lib.version()
        with pytest.raises(RuntimeError, match=r"^ncclSend failed: .*\(ncclResult 4\)"):
            lib.check("ncclSend", 4)


class _FakeNccl:
    """A stand-in for libnccl: ncclGroupEnd blocks (as while connecting to a peer that never
    comes) until ncclCommAbort."""

    def __init__(self, blocks: bool):
        self.blocks = blocks
        self.aborted = threading.Event()
        self.calls = []
        outer = self

        class Lib:
            def ncclGroupStart(self):
                outer.calls.append("start")
                return 0

            def ncclGroupEnd(self):
                outer.calls.append("end")
                if outer.blocks and not outer.aborted.wait(10):
                    return 3
                return 6 if outer.aborted.is_set() else 0  # ncclRemoteError after an abort

            def ncclSend(self, *args):
                outer.calls.append("send")
                return 0

            def ncclRecv(self, *args):
                outer.calls.append("recv")
                return 0

            def ncclCommAbort(self, comm):
                outer.calls.append("abort")
                outer.aborted.set()
                return 0

            def ncclGetErrorString(self, code):
                return b"fake error"
        self.lib = Lib()

    def check(self, call, code):
        if code:
            raise RuntimeError(f"{call} failed: fake ({code})")

    def group_start(self):
        self.check("ncclGroupStart", self.lib.ncclGroupStart())


def _communicator(fake):
    comm = nccl.Communicator.__new__(nccl.Communicator)
    comm._nccl = fake
    comm._lock = threading.Lock()
    comm._blocked = False
    comm.abort_requested = False
    comm.aborted = False
    comm._comm = 1234
    return comm


def test_an_abort_requested_between_transfers_is_taken_at_the_next_one():
    fake = _FakeNccl(blocks=False)
    comm = _communicator(fake)
    comm.transfer([(1, 8)], [], 0, 0)
    assert fake.calls == ["start", "send", "end"]
    comm.request_abort()  # from the call's thread: the owner is not blocked, so only marked
    assert "abort" not in fake.calls
    with pytest.raises(RuntimeError, match="peer's side"):
        comm.transfer([], [(2, 8)], 0, 0)
    assert fake.calls[-1] == "abort" and comm.aborted
    with pytest.raises(RuntimeError, match="aborted"):
        comm.transfer([], [(2, 8)], 0, 0)
    comm.abort()  # idempotent
    assert fake.calls.count("abort") == 1


def test_a_transfer_leaves_out_empty_parts_as_the_daemon_does():
    # A rank's empty part of a partitioned parameter: the daemon posts no transfer for it, and a
    # zero-byte send would still wait for a matching receive.
    fake = _FakeNccl(blocks=False)
    comm = _communicator(fake)
    comm.transfer([(1, 8), (0, 0), (3, 4)], [(0, 0), (5, 8)], 0, 0)
    assert fake.calls == ["start", "send", "send", "recv", "end"]


def test_an_abort_requested_while_waiting_for_the_peer_ends_the_wait():
    fake = _FakeNccl(blocks=True)
    comm = _communicator(fake)
    errors = []

    def owner():
        try:
            comm.transfer([(1, 8)], [], 0, 0)
        except RuntimeError as err:
            errors.append(err)
    thread = threading.Thread(target=owner)
    thread.start()
    deadline = time.monotonic() + 5
    while not comm._blocked:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    comm.request_abort()
    thread.join(5)
    assert not thread.is_alive(), "the abort did not end the wait"
    assert fake.calls.count("abort") == 1 and comm.aborted
    assert errors and "peer's side" in str(errors[0])


def test_an_abort_requested_while_the_group_is_built_still_ends_the_wait():
    fake = _FakeNccl(blocks=True)
    comm = _communicator(fake)
    real_send = fake.lib.ncclSend

    def send_then_fail_the_call(*args):
        comm.request_abort()  # the call failed while this side was enqueueing
        return real_send(*args)
    fake.lib.ncclSend = send_then_fail_the_call
    with pytest.raises(RuntimeError, match="peer's side"):
        comm.transfer([(1, 8)], [], 0, 0)
    assert fake.calls.count("abort") == 1


# -- with a GPU ----------------------------------------------------------------------------------

def _cuda_loss(model, step):
    x, y = [t.cuda(next(model.parameters()).device) for t in batch(step)]
    return F.cross_entropy(model(x), y)


def _train_side_by_side(endpoint, transport, steps=5, device="cuda:0", exact=False, **kwargs):
    """The same model trained over grpc and over ``transport``. The GPU paths sum the gradient
    norm on the device, so it may differ from the host's in its last bits; without clipping
    nothing else depends on it and the parameters must be bit-identical (``exact``), with clipping
    they must agree within a tight tolerance."""
    a = TinyNet(seed=63).to(device)
    b = clone_model(a)
    storage = {n: p.data_ptr() for n, p in b.named_parameters()}
    with muond.RemoteOptimizer(muond.default_param_groups(a), endpoint=endpoint, transport="grpc",
                               **kwargs) as over_grpc, \
         muond.RemoteOptimizer(muond.default_param_groups(b), endpoint=endpoint,
                               transport=transport, **kwargs) as over_gpu:
        assert over_gpu.transport == transport
        for step in range(1, steps + 1):
            losses = []
            for model, opt in ((a, over_grpc), (b, over_gpu)):
                opt.zero_grad()
                loss = _cuda_loss(model, step)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            assert abs(losses[0] - losses[1]) <= 1e-6 * abs(losses[0]), f"step {step}: {losses}"
            na, nb = over_grpc.last_info.grad_norm, over_gpu.last_info.grad_norm
            assert abs(na - nb) <= 1e-6 * max(abs(na), 1e-30), f"step {step}: norms {na} {nb}"
            assert over_gpu.last_info.applied and over_gpu.last_step == step
            for (name, pa), pb_ in zip(a.named_parameters(), b.parameters()):
                if exact:
                    assert torch.equal(pb_.detach(), pa.detach()), f"step {step}: {name}"
                else:
                    assert rel_err(pb_.detach(), pa.detach()) <= 1e-5, f"step {step}: {name}"
    for name, p in b.named_parameters():
        assert p.is_cuda and p.data_ptr() == storage[name], f"{name} was not updated in place"


@needs_gpu
@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_cuda_ipc_steps_equal_grpc_steps(cuda_daemon, wire_dtype):
    daemon, _ = cuda_daemon()
    _train_side_by_side(daemon.endpoint, "cuda_ipc", wire_dtype=wire_dtype, exact=True)


@needs_gpu
def test_cuda_ipc_steps_with_clipping_match_grpc_steps(cuda_daemon):
    daemon, _ = cuda_daemon()
    _train_side_by_side(daemon.endpoint, "cuda_ipc", max_grad_norm=0.5)


@needs_gpu
def test_auto_takes_cuda_ipc_for_cuda_parameters(cuda_daemon):
    daemon, info = cuda_daemon()
    model = TinyNet(seed=64).cuda()
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                               transport="auto") as opt:
        assert opt.transport == "cuda_ipc"
    if info.nccl_version > 0 and cuda_runtime.same_uuid(info.cuda_device_uuid,
                                                        cuda_runtime.device_uuid(0)):
        with pytest.raises(RuntimeError, match="Duplicate GPU detected"):
            muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                                  transport="nccl")


@needs_gpu
def test_a_resent_cuda_ipc_step_is_replayed(cuda_daemon):
    # What a retry after a lost answer looks like: the same step number again.
    daemon, _ = cuda_daemon()
    model = TinyNet(seed=65).cuda()
    # The parameters are changed in place below on purpose, for the replay to overwrite.
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                               transport="cuda_ipc", parameters_changed="ignore") as opt:
        _cuda_loss(model, 1).backward()
        opt.step()
        after_one = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.last_step = 0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # a replay writes the step's parameters back over these
        opt.step()
        assert opt.last_info.replayed and opt.last_step == 1
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), after_one[name]), name
        opt.step()
        assert opt.last_info.applied and not opt.last_info.replayed and opt.last_step == 2


@needs_gpu
def test_a_wrong_byte_size_is_refused_naming_the_field(cuda_daemon):
    daemon, _ = cuda_daemon()
    model = TinyNet(seed=66).cuda()
    with muond.RemoteOptimizer(muond.default_param_groups(model), endpoint=daemon.endpoint,
                               transport="cuda_ipc") as opt:
        transport = opt._sessions[0].transport
        name = opt._names[0]
        header = opt._header(1, {})
        header.ClearField("return_dtype")
        header.ClearField("num_chunks")
        request = pb.StepSharedRequest(header=header)
        numel = opt._by_name[name].numel()
        request.gradients.add(name=name, region=transport.region, offset=0,
                              byte_size=4 * numel - 4, dtype=pb.DTYPE_FP32)
        offsets, _ = slot_layout(opt._names, opt._sizes)
        for n in opt._names:
            request.parameters.add(name=n, region=transport.region, offset=offsets[n],
                                   byte_size=4 * opt._sizes[n], dtype=pb.DTYPE_FP32)
        with pytest.raises(MuondError) as err:
            opt._conn.step_cuda(request)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "gradients[0].byte_size" in err.value.details
        # Nothing was applied: the next step is step 1.
        _cuda_loss(model, 1).backward()
        opt.step()
        assert opt.last_step == 1 and opt.last_info.applied


@needs_two_gpus
def test_nccl_steps_equal_grpc_steps(cuda_daemon):
    daemon, info = cuda_daemon("--device", "1")
    if info.nccl_version <= 0:
        pytest.fail(f"the daemon on cuda:1 reports no NCCL: {info}")
    _train_side_by_side(daemon.endpoint, "nccl", device="cuda:0", exact=True)
    _train_side_by_side(daemon.endpoint, "nccl", device="cuda:0", wire_dtype="bf16",
                        max_grad_norm=0.5)


def _nccl_allows_one_gpu() -> bool:
    return torch.cuda.is_available() and several_ranks_per_gpu(nccl.local_version())


@pytest.mark.skipif(not _nccl_allows_one_gpu(),
                    reason="needs a CUDA GPU with NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 "
                           "(both ranks on one GPU)")
def test_nccl_steps_on_one_gpu_equal_grpc_steps(cuda_daemon):
    daemon, _ = cuda_daemon()
    _train_side_by_side(daemon.endpoint, "nccl", device="cuda:0", exact=True)
