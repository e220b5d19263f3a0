"""``CudaIpcTransport``: one session's steps through device memory shared with a daemon on this
node (docs/transports.md).

It allocates one flat device buffer for the session (``cuda_runtime.DeviceBuffer``, on the
parameters' device) in the ``slots.py`` layout and registers it with ``RegisterCudaMemory``: its
IPC memory handle, its size, an interprocess event's handle, the device, and a liveness ticket from
the daemon's ``shm_socket`` (the byte ``L``, no descriptor; the daemon answers ``ok <ticket>`` and
drops the registration when that connection closes, so a client that dies leaves nothing behind).

A step copies each gradient into its slots (in the wire dtype, device to device, on torch's current
stream), records the event on that stream (the daemon's reads wait for it on the device) and calls
``StepCuda`` with ``SharedTensor`` references to the slots; the daemon writes the parameters (in
the return dtype) into the same slots and synchronizes before answering, and the views of those
slots are then copied into the parameters. Retries are ``StepShared``'s: on ``UNAVAILABLE`` (a
restarted daemon lost the registration) the same buffer is registered again before the next try.
"""

from __future__ import annotations

import logging
import secrets
import socket
from typing import Dict, Iterator, Optional, Tuple

import torch

from .._stubs import pb
from ..errors import MuondError
from . import shm
from .base import Facts, Grads, StepTransport, TransportContext
from .slots import SLOT_BYTES, SlotRequests, SlotStreamedTry, View, forgotten_when_lost, slot_layout

_log = logging.getLogger("muond")


class LivenessTicket:
    """A connection to the daemon's ``shm_socket`` that keeps a registration alive: after the
    ``grant`` (``Connection.grant_shared_memory``), the byte ``L`` (no descriptor attached),
    answered ``ok <ticket>``. Closing it (or exiting) drops what was registered with the ticket.
    ``timeout``: the seconds each answer on the socket may take (None: no limit)."""

    def __init__(self, socket_address: str, grant: str = "", timeout: Optional[float] = None):
        self._sock: Optional[socket.socket] = shm.connect(socket_address, grant, timeout)
        try:
            shm.send(self._sock, lambda: self._sock.sendall(b"L"))
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


class CudaIpcTransport(StepTransport):
    """The CUDA IPC transport of one session, on the CUDA device holding its parameters."""

    name = "cuda_ipc"

    def __init__(self, ctx: TransportContext, facts: Facts):
        super().__init__(ctx, facts)
        self.device = int(facts.here.device)
        self.shm_socket = facts.daemon.shm_socket
        self.offsets, self._nbytes = slot_layout(ctx.names, ctx.sizes)
        self.requests = SlotRequests(ctx, self.offsets)
        self._buffer = None  # cuda_runtime.DeviceBuffer, kept across re-registrations
        self._liveness: Optional[LivenessTicket] = None
        self.region = ""  # the registered name; empty when not registered

    @classmethod
    def reasons_against(cls, facts: Facts, *, auto: bool) -> Iterator[str]:
        info, here = facts.daemon, facts.here
        if not getattr(info, "cuda_ipc", False):
            yield (f"the daemon offers no CUDA IPC (its backend is "
                   f"'{getattr(info, 'backend', '') or 'unknown'}'; CUDA IPC needs --backend cuda)")
        if not info.host_id or info.host_id != here.host_id:
            yield "the daemon runs on another host (CUDA IPC works within one node)"
        if here.device is None:
            yield here.why_no_device or "the parameters are not on a CUDA device"

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
                grant = self.ctx.conn.grant_shared_memory(self.ctx.conn.server_info())
                self._liveness = LivenessTicket(self.shm_socket, grant,
                                                timeout=self.ctx.conn.timeout)
                ticket = self._liveness.ticket
            except (ConnectionError, OSError, MuondError) as err:
                _log.debug("session %s: no liveness ticket for its CUDA memory (%s); it lives "
                           "until unregistered or the session closes", self.ctx.session_id, err)
        name = f"{self.ctx.session_id}/cuda-{secrets.token_hex(4)}"
        request = pb.RegisterCudaMemoryRequest(
            name=name, session_id=self.ctx.session_id, mem_handle=self._buffer.mem_handle,
            byte_size=self._buffer.nbytes, event_handle=self._buffer.event_handle,
            device=self.device, liveness_ticket=ticket)
        try:
            self.ctx.conn.register_cuda_memory(request)
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
                self.ctx.conn.unregister_cuda_memory(self.region)
            except MuondError as err:
                _log.debug("session %s: UnregisterCudaMemory %s: %s", self.ctx.session_id,
                           self.region, err)
        self.region = ""
        self.requests.forget()
        if self._liveness is not None:
            self._liveness.close()
            self._liveness = None

    # -- one try of a step -----------------------------------------------------------------------

    def ready(self) -> Tuple[str, View]:
        """(the buffer's registered name, its view), registering it first when needed."""
        if not self.region:
            self.open()
        return self.region, self._buffer.view

    def send(self, request: bytes) -> pb.StepResult:
        """Runs ``request`` once the work on this device's current stream (the gradients'
        copies into the buffer) is done: the daemon waits for the recorded event."""
        from .cuda_runtime import current_stream_handle  # noqa: PLC0415 - needs CUDA
        with torch.cuda.device(self.device):
            self._buffer.record(current_stream_handle(torch.device("cuda", self.device)))
        with forgotten_when_lost(self.drop_registration, "CUDA memory", "StepCuda"):
            return self.ctx.conn.step_cuda(request)

    def step(self, header: pb.StepHeader, grads: Grads,
             out: Optional[Dict[str, torch.Tensor]] = None
             ) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        """One try; the parameters after it, as views of the device buffer."""
        region, view = self.ready()
        with torch.cuda.device(self.device):
            request, views = self.requests.request(header, region, view, grads)
        return self.send(request), views

    def begin_streamed(self, header: pb.StepHeader,
                       out: Optional[Dict[str, torch.Tensor]] = None) -> SlotStreamedTry:
        """Each gradient is copied into the buffer on the stream backward produced it on (the
        hook's current stream), and the event recorded before the call orders the daemon after
        those copies when they share the device's current stream, as backward's do by default."""
        return SlotStreamedTry(self, header, out)

    def close(self) -> None:
        """Unregisters the buffer (best effort) and lets it go; the device memory is freed once
        no tensor views it."""
        self.drop_registration(unregister=True)
        self._buffer = None
