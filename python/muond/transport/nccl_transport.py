"""``NcclTransport``: one session's steps over a two-rank NCCL communicator with the daemon (rank
0; this trainer rank 1), for trainer GPUs on other nodes or devices (docs/transports.md).

A channel: ``OpenNcclChannel(session, rank)`` answers an ``ncclUniqueId`` the daemon made; this
side joins with ``ncclCommInitRank(2, id, 1)`` on the parameters' device. A step issues
``StepNccl`` without waiting (the stub's ``.future``), then sends every gradient (contiguous, in
the wire dtype, as ``count = byte_size`` uint8 elements) to peer 0 as one group, then receives every
parameter (in the return dtype, into a receive buffer per parameter) as one group, then waits for
the answer and hands the buffers over to be copied into the parameters. Every NCCL operation goes
on torch's current stream of that device, ordered after the backward pass that made the
gradients and before the copies that read the answer; nothing waits on the host but the answer.
A prepare (a sharded step's first phase) answers no parameters: it lists none and receives none.

Failures: when the call fails (or this side's NCCL does), the communicator is aborted here — which
also ends transfers still waiting for the daemon — and the channel is dropped (closed on the daemon
too, best effort); the next try opens a new one. ``ABORTED`` and a channel the daemon no longer
knows become ``UNAVAILABLE``, so ``RemoteOptimizer`` retries the same step number (the daemon
applies a step once and answers a resend as a replay).
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Iterator, List, Optional, Tuple

import grpc
import torch

from .. import wire
from .._stubs import pb
from ..errors import CHANNEL_NOT_FOUND, MuondError
from .base import Facts, Grads, StepTransport, TransportContext
from .cuda_runtime import same_uuid

_log = logging.getLogger("muond")

DAEMON_RANK = 0
CLIENT_RANK = 1


def _failed(future: grpc.Future) -> bool:
    """Whether a finished call failed (or was cancelled)."""
    try:
        return future.cancelled() or future.exception() is not None
    except Exception:  # noqa: BLE001 - cancelled between the two checks
        return True


def several_ranks_per_gpu(nccl_version: int) -> bool:
    """Whether NCCL puts two ranks on one GPU: 2.30 and later with NCCL_MULTI_RANK_GPU_ENABLE=1 (in
    both processes' environments); earlier versions refuse ("Duplicate GPU detected")."""
    return nccl_version >= 23000 and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"


class NcclTransport(StepTransport):
    """The NCCL transport of one session, on the CUDA device holding its parameters."""

    name = "nccl"

    def __init__(self, ctx: TransportContext, facts: Facts):
        super().__init__(ctx, facts)
        self.device = int(facts.here.device)
        self.channel = ""
        self._comm = None  # nccl.Communicator
        self._received: Dict[str, torch.Tensor] = {}

    @classmethod
    def reasons_against(cls, facts: Facts, *, auto: bool) -> Iterator[str]:
        info, here = facts.daemon, facts.here
        daemon_nccl = getattr(info, "nccl_version", 0)
        if daemon_nccl <= 0:
            yield "the daemon has no NCCL (ServerInfo.nccl_version is 0)"
        if here.device is not None and here.nccl_version <= 0:
            yield "this process cannot load NCCL (libnccl.so.2)"
        daemon_uuid = getattr(info, "cuda_device_uuid", "")
        if (here.device is not None and same_uuid(here.uuid, daemon_uuid)
                and not several_ranks_per_gpu(min(here.nccl_version, daemon_nccl))):
            yield (f"the daemon computes on this process's own GPU ({daemon_uuid}), and NCCL "
                   f"refuses two ranks on one GPU (\"Duplicate GPU detected\"); "
                   f"transport='auto' uses cuda_ipc there")
        if here.device is None:
            yield here.why_no_device or "the parameters are not on a CUDA device"
        same_host = bool(info.host_id) and info.host_id == here.host_id
        if auto and same_host and not getattr(info, "cuda_ipc", False):
            yield ("the daemon is on this host without CUDA IPC; there transport='auto' takes NCCL "
                   "only after a CUDA IPC registration failed")

    # -- the channel -----------------------------------------------------------------------------

    def open(self) -> None:
        """Opens a channel on the daemon and joins its communicator (blocks until joined)."""
        from .nccl import Communicator  # noqa: PLC0415 - needs NCCL
        self.drop_channel()
        reply = self.ctx.conn.open_nccl_channel(self.ctx.session_id, self.ctx.rank)
        if reply.nranks not in (0, 2) or reply.client_rank not in (0, CLIENT_RANK):
            self._close_on_daemon(reply.channel)
            raise MuondError(grpc.StatusCode.INTERNAL,
                             f"the daemon's NCCL channel has {reply.nranks} ranks with this client "
                             f"rank {reply.client_rank}; this client joins two-rank channels as "
                             f"rank {CLIENT_RANK}", "OpenNcclChannel")
        try:
            with torch.cuda.device(self.device):
                self._comm = Communicator(2, reply.unique_id, CLIENT_RANK)
        except BaseException:
            self._close_on_daemon(reply.channel)
            raise
        self.channel = reply.channel
        if not self._received:
            dtype = wire.torch_dtype(self.ctx.return_dtype)
            device = torch.device("cuda", self.device)
            self._received = {n: torch.empty(self.ctx.sizes[n], dtype=dtype, device=device)
                              for n in self.ctx.names}

    def _close_on_daemon(self, channel: str) -> None:
        if not channel:
            return
        try:
            self.ctx.conn.close_nccl_channel(channel)
        except MuondError as err:  # gone already (a failed step closes it; a restart loses it)
            _log.debug("session %s: CloseNcclChannel %s: %s", self.ctx.session_id, channel, err)

    def drop_channel(self) -> None:
        """Aborts this side's communicator (never blocks on the peer) and closes the channel on
        the daemon, best effort."""
        comm, self._comm = self._comm, None
        channel, self.channel = self.channel, ""
        if comm is not None:
            comm.abort()
        self._close_on_daemon(channel)

    # -- one try of a step -----------------------------------------------------------------------

    def step(self, header: pb.StepHeader, grads: Grads,
             out: Optional[Dict[str, torch.Tensor]] = None
             ) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        """One try; the parameters after it, in this transport's receive buffers (none for a
        prepare)."""
        if self._comm is None:
            self.open()
        from .cuda_runtime import current_stream_handle  # noqa: PLC0415 - needs CUDA
        request = pb.StepNcclRequest(header=header, channel=self.channel)
        request.header.ClearField("return_dtype")
        request.header.ClearField("num_chunks")
        device = torch.device("cuda", self.device)
        grad_dtype = wire.torch_dtype(self.ctx.wire_dtype)
        sends: List[torch.Tensor] = []  # referenced until the answer: NCCL reads them meanwhile
        with torch.no_grad():
            for name, g in grads:
                flat = g.detach().to(device=device, dtype=grad_dtype).contiguous().view(-1)
                sends.append(flat)
                request.gradients.add(name=name, dtype=wire.dtype_enum(self.ctx.wire_dtype),
                                      byte_size=flat.numel() * flat.element_size())
        receiving = header.phase != pb.STEP_PHASE_PREPARE
        for name in (self.ctx.names if receiving else []):  # a prepare answers none: lists none
            buffer = self._received[name]
            request.parameters.add(name=name, dtype=wire.dtype_enum(self.ctx.return_dtype),
                                   byte_size=buffer.numel() * buffer.element_size())
        comm = self._comm
        stream = current_stream_handle(device)

        future = self.ctx.conn.step_nccl_future(request)
        # A call that fails while this side waits in NCCL for the daemon ends that wait.
        future.add_done_callback(lambda f: comm.request_abort() if _failed(f) else None)
        local_error: Optional[BaseException] = None
        try:
            with torch.cuda.device(self.device):
                if sends:
                    comm.transfer([(t.data_ptr(), t.numel() * t.element_size()) for t in sends],
                                  [], DAEMON_RANK, stream)
                if receiving and self.ctx.names:
                    comm.transfer([], [(self._received[n].data_ptr(),
                                        self._received[n].numel() * self._received[n].element_size())
                                       for n in self.ctx.names], DAEMON_RANK, stream)
        except RuntimeError as err:
            local_error = err
            comm.abort()
            future.cancel()
        try:
            result = self.ctx.conn.step_nccl_result(future)
        except MuondError as err:
            self.drop_channel()
            if local_error is not None and err.code == grpc.StatusCode.CANCELLED:
                raise MuondError(grpc.StatusCode.UNAVAILABLE,
                                 f"the NCCL transfer failed on this side: {local_error}",
                                 "StepNccl") from local_error
            if err.code == grpc.StatusCode.ABORTED or err.reason == CHANNEL_NOT_FOUND:
                raise MuondError(grpc.StatusCode.UNAVAILABLE,
                                 f"the NCCL channel broke ({err.code.name}: {err.details}); the "
                                 f"retry opens a new one", "StepNccl") from err
            raise
        if local_error is not None:  # the daemon answered, but this side's transfer failed
            self.drop_channel()
            raise MuondError(grpc.StatusCode.UNAVAILABLE,
                             f"the NCCL transfer failed on this side: {local_error}",
                             "StepNccl") from local_error
        del sends
        return result, (dict(self._received) if receiving else {})

    def close(self) -> None:
        """Closes the channel on the daemon and aborts this side's communicator (an abort never
        waits for the peer, which is gone or closing)."""
        comm, self._comm = self._comm, None
        channel, self.channel = self.channel, ""
        self._close_on_daemon(channel)
        if comm is not None:
            comm.abort()
        self._received = {}
