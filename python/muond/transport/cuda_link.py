"""The client side of the CUDA IPC transport: one session's steps through device memory shared
with a daemon on this node (docs/transports.md).

A ``CudaIpcLink`` allocates one flat device buffer for the session (``cuda_runtime.DeviceBuffer``,
on the parameters' device) with a 4-byte slot per element of every parameter — the layout of the
shared-memory transport's region — and registers it with ``RegisterCudaMemory``: its IPC memory
handle, its size, an interprocess event's handle, the device, and a liveness ticket from the
daemon's ``shm_socket`` (the byte ``L``, no descriptor; the daemon answers ``ok <ticket>`` and
drops the registration when that connection closes, so a client that dies leaves nothing behind).

A step copies each gradient into its slot (in the wire dtype, device to device, on torch's current
stream), records the event on that stream (the daemon's reads wait for it on the device) and calls
``StepCuda`` with ``SharedTensor`` references to the slots; the daemon writes the parameters (in
the return dtype) into the same slots and synchronizes before answering, and the views of those
slots are then copied into the parameters. Retries are ``StepShared``'s: on ``UNAVAILABLE`` (a
restarted daemon lost the registration) the same buffer is registered again before the next try.

Not thread-safe: one step at a time, as ``SessionLink``.
"""

from __future__ import annotations

import logging
import secrets
import socket
from typing import Dict, List, Optional, Sequence, Tuple

import grpc
import torch

from . import shm
from .. import wire
from .._stubs import pb
from ..client import Connection
from ..errors import REGION_NOT_FOUND, MuondError
from .gpu_transport import GpuLink

_log = logging.getLogger("muond")

SLOT_BYTES = 4  # one slot per element: fp32 at most, in either direction


def slot_layout(names: Sequence[str], sizes: Dict[str, int]) -> Tuple[Dict[str, int], int]:
    """(byte offset of each parameter's slots, total bytes) for ``SLOT_BYTES`` per element, in
    ``names`` order; every offset is a multiple of 4, so fp32, bf16 and fp16 views all align."""
    offsets: Dict[str, int] = {}
    offset = 0
    for name in names:
        offsets[name] = offset
        offset += SLOT_BYTES * int(sizes[name])
    return offsets, offset


class LivenessTicket:
    """A connection to the daemon's ``shm_socket`` that keeps a registration alive: the byte
    ``L`` (no descriptor attached), answered ``ok <ticket>``. Closing it (or exiting) drops what
    was registered with the ticket."""

    def __init__(self, socket_address: str):
        self._sock: Optional[socket.socket] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                self._sock.connect(shm._address(socket_address))
            except OSError as err:
                raise ConnectionError(f"cannot connect to the daemon's socket "
                                      f"'{socket_address}': {err}") from None
            self._sock.sendall(b"L")
            answer = self._read_line()
        except BaseException:
            self.close()
            raise
        words = answer.split()
        if len(words) < 2 or words[0] != "ok":
            self.close()
            raise ConnectionError(f"the daemon refused a liveness ticket: {answer}")
        self.ticket = words[1]

    def _read_line(self) -> str:
        return shm.read_line(self._sock)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class CudaIpcLink(GpuLink):
    """The CUDA IPC transport of one session (``names`` with ``sizes`` elements, on CUDA device
    ``device``) on the daemon behind ``conn``."""

    transport = "cuda_ipc"

    def __init__(self, conn: Connection, session_id: str, names: Sequence[str],
                 sizes: Dict[str, int], device: int, *, wire_dtype: str, return_dtype: str,
                 shm_socket: str = ""):
        super().__init__(conn, session_id, names, sizes, device, wire_dtype=wire_dtype,
                         return_dtype=return_dtype)
        self.shm_socket = shm_socket
        self._offsets, self._nbytes = slot_layout(self.names, self.sizes)
        self._buffer = None  # cuda_runtime.DeviceBuffer, kept across re-registrations
        self._liveness: Optional[LivenessTicket] = None
        self.region = ""  # the registered name; empty when not registered

    # -- registration ----------------------------------------------------------------------------

    def open(self) -> None:
        """Allocates the buffer (once) and registers it (again, after the daemon lost it)."""
        from .cuda_runtime import DeviceBuffer  # noqa: PLC0415 - needs CUDA
        self.drop_registration()
        if self._buffer is None:
            self._buffer = DeviceBuffer(max(self._nbytes, SLOT_BYTES), self.device)
        ticket = ""
        if self.shm_socket:
            try:
                self._liveness = LivenessTicket(self.shm_socket)
                ticket = self._liveness.ticket
            except (ConnectionError, OSError) as err:
                _log.debug("session %s: no liveness ticket for its CUDA memory (%s); it lives "
                           "until unregistered or the session closes", self.session_id, err)
        name = f"{self.session_id}/cuda-{secrets.token_hex(4)}"
        request = pb.RegisterCudaMemoryRequest(
            name=name, session_id=self.session_id, mem_handle=self._buffer.mem_handle,
            byte_size=self._buffer.nbytes, event_handle=self._buffer.event_handle,
            device=self.device, liveness_ticket=ticket)
        try:
            self.conn.register_cuda_memory(request)
        except BaseException:
            self.drop_registration()
            raise
        self.region = name

    def drop_registration(self, unregister: bool = False) -> None:
        """Forgets the registration here (after the daemon lost it), or with ``unregister`` also
        tells the daemon (best effort: a daemon that is gone or closed the session has dropped it
        already); closing the liveness connection drops it in the daemon either way."""
        if unregister and self.region:
            try:
                self.conn.unregister_cuda_memory(self.region)
            except MuondError as err:
                _log.debug("session %s: UnregisterCudaMemory %s: %s", self.session_id,
                           self.region, err)
        self.region = ""
        if self._liveness is not None:
            self._liveness.close()
            self._liveness = None

    # -- one try of a step -----------------------------------------------------------------------

    def step(self, header: pb.StepHeader, grads: List[Tuple[str, torch.Tensor]]
             ) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        """One try of ``header`` (session id set) with ``grads``; the result and the parameters
        after it, as views of the device buffer (valid until the next step)."""
        if not self.region:
            self.open()
        request = pb.StepSharedRequest(header=header)
        request.header.ClearField("return_dtype")
        request.header.ClearField("num_chunks")
        grad_dtype = wire.torch_dtype(self.wire_dtype)
        out_dtype = wire.torch_dtype(self.return_dtype)
        views: Dict[str, torch.Tensor] = {}
        with torch.no_grad(), torch.cuda.device(self.device):
            # Written before every try: an answer overwrites the gradients with the parameters.
            for name, g in grads:
                view = self._buffer.view(self._offsets[name], g.numel(), grad_dtype)
                view.copy_(g.detach().reshape(-1))
                request.gradients.add(name=name, region=self.region, offset=self._offsets[name],
                                      byte_size=g.numel() * view.element_size(),
                                      dtype=wire.dtype_enum(self.wire_dtype))
            for name in self.names:
                views[name] = self._buffer.view(self._offsets[name], self.sizes[name], out_dtype)
                request.parameters.add(name=name, region=self.region, offset=self._offsets[name],
                                       byte_size=self.sizes[name] * views[name].element_size(),
                                       dtype=wire.dtype_enum(self.return_dtype))
            from .cuda_runtime import current_stream_handle  # noqa: PLC0415 - needs CUDA
            self._buffer.record(current_stream_handle(torch.device("cuda", self.device)))
        try:
            result = self.conn.step_cuda(request)
        except MuondError as err:
            if err.code == grpc.StatusCode.UNAVAILABLE:
                self.drop_registration()  # a restarted daemon has lost it
            elif err.reason == REGION_NOT_FOUND:
                self.drop_registration()
                raise MuondError(grpc.StatusCode.UNAVAILABLE,
                                 f"the daemon lost this session's CUDA memory (restarted?): "
                                 f"{err.details}", "StepCuda") from None
            raise
        return result, views

    def close(self) -> None:
        """Unregisters the buffer (best effort) and lets it go; the device memory is freed once
        no tensor views it."""
        self.drop_registration(unregister=True)
        self._buffer = None
