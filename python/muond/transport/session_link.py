"""``SessionLink``: one daemon's session as a ``RemoteOptimizer`` sees it.

A link owns the connection to one daemon, knows which of the optimizer's parameters that daemon's
session holds (all of them, or one shard's), picks the step transport (gRPC streams, a
shared-memory region on the daemon's host, or device memory: CUDA IPC or NCCL, see
``gpu_transport.py``) and runs one try of a step — whole, prepare or commit (docs/sharding.md) —
writing the returned parameters into the parameter tensors. Retrying, the step counter and the
decision over several shards belong to ``RemoteOptimizer``.

Not thread-safe: a ``RemoteOptimizer`` may drive its links from worker threads, one thread per
link at a time.
"""

from __future__ import annotations

import logging
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import grpc
import torch

from . import framing
from . import gpu_transport
from . import shm
from .. import wire
from .._stubs import pb
from ..client import Connection
from ..errors import REGION_NOT_FOUND, MuondError

_log = logging.getLogger("muond")


class SessionLink:
    """The session ``session_id`` on the daemon behind ``conn``, holding the parameters
    ``names`` (a subset of ``by_name``, in the optimizer's order)."""

    def __init__(self, conn: Connection, session_id: str, names: Sequence[str],
                 by_name: Dict[str, torch.Tensor], *, wire_dtype: str, return_dtype: str,
                 chunk_bytes: int):
        self.conn = conn
        self.endpoint = conn.endpoint
        self.session_id = session_id
        self.names: List[str] = list(names)
        self.by_name = {n: by_name[n] for n in self.names}
        self.sizes = {n: by_name[n].numel() for n in self.names}
        # Optimizer slots smaller than their parameter (NorMuon's second moment): (name, slot) →
        # elements; set by the optimizer that knows the groups.
        self.slot_sizes: Dict[Tuple[str, str], int] = {}
        self.loss_scale = 0.0  # the session loss scaler's scale when opened (0: none)
        self.wire_dtype = wire_dtype
        self.return_dtype = return_dtype
        self.chunk_bytes = chunk_bytes
        self.transport = "grpc"
        self._region: Optional[shm.SharedRegion] = None
        self._region_name = ""
        self._offsets: Dict[str, int] = {}
        self._gpu = None  # a cuda_link.CudaIpcLink or nccl_link.NcclLink
        self.created = False  # open() made the session (rather than attaching to one)

    # -- the session -----------------------------------------------------------------------------

    def open(self, spec: pb.SessionSpec) -> Tuple[bool, int]:
        """Creates the session and uploads the parameters, or attaches and reads them back.
        Returns (attached, last_step)."""
        reply = self.conn.create_session(self.session_id, spec)
        # Whether this open made the session (not attached to one that was there): what a failed
        # sharded attach rolls back, and nothing else.
        self.created = not reply.attached
        self.loss_scale = float(reply.loss_scale)
        if reply.attached and reply.initialized:
            return True, self.refresh()
        self.conn.upload(self.session_id, self._param_chunks())
        if any(g.options.master_dtype not in ("", "fp32") for g in spec.groups):
            self.refresh()  # 16-bit masters hold the values rounded: the parameters follow them
        return bool(reply.attached), 0

    def roll_back(self) -> None:
        """Closes the session when this link's open created it (best effort: a daemon that
        cannot be reached keeps it until it is closed there)."""
        if not self.created:
            return
        self.created = False
        try:
            self.conn.close_session(self.session_id)
        except MuondError:
            pass

    def _param_chunks(self) -> Iterator[pb.TensorChunk]:
        for name in self.names:
            yield from wire.encode(name, self.by_name[name], "fp32", max_chunk_bytes=self.chunk_bytes)

    def refresh(self) -> int:
        """Copies the daemon's masters into the parameters; returns the session's last step."""
        into = wire.ChunkAssembler(self.sizes)
        last_step = self.conn.get_parameters(self.session_id, into, dtype=pb.DTYPE_FP32,
                                             max_chunk_bytes=self.chunk_bytes)
        copy_in(self.by_name, {name: t for (name, _), t in into.tensors().items()})
        return last_step

    # -- transports ------------------------------------------------------------------------------

    def choose_transport(self, wanted: str, rank: int = 0) -> str:
        """"grpc", "shm", "cuda_ipc" or "nccl" for ``wanted`` (one of those or "auto"); the GPU
        transports are set up here (``gpu_transport.py``). RuntimeError when a transport asked for
        by name is impossible, saying why."""
        self.drop_gpu()
        if wanted == "grpc":
            self.transport = "grpc"
            return self.transport
        info = self.conn.server_info()
        if wanted in ("auto",) + gpu_transport.GPU_TRANSPORTS and self._set_up_gpu(wanted, info, rank):
            return self.transport
        why = ""
        if not info.shm_socket:
            why = "the daemon offers no shared-memory transport (--shm-socket none)"
        elif not info.host_id or info.host_id != shm.local_host_id():
            why = "the daemon runs on another host"
        elif not shm.socket_reachable(info.shm_socket):
            why = f"the daemon's socket {info.shm_socket} cannot be reached from here"
        if why and wanted == "shm":
            raise RuntimeError(f"transport='shm' is not possible with {self.endpoint}: {why}")
        self.transport = "grpc" if why else "shm"
        return self.transport

    def _set_up_gpu(self, wanted: str, info: pb.ServerInfo, rank: int) -> bool:
        """Sets up the GPU transport ``wanted`` (or, for "auto", the first that fits and works);
        False when "auto" finds none."""
        if wanted == "auto" and not getattr(info, "cuda_ipc", False) \
                and getattr(info, "nccl_version", 0) <= 0:
            return False  # a daemon without GPU transports: nothing to look at here
        here = gpu_transport.Here.of(self.by_name.values())
        for choice in gpu_transport.decide(wanted, info, here, self.endpoint):
            if choice == "cuda_ipc":
                from .cuda_link import CudaIpcLink  # noqa: PLC0415 - GPU only
                link = CudaIpcLink(self.conn, self.session_id, self.names, self.sizes, here.device,
                                   wire_dtype=self.wire_dtype, return_dtype=self.return_dtype,
                                   shm_socket=info.shm_socket)
            else:
                from .nccl_link import NcclLink  # noqa: PLC0415 - GPU only
                link = NcclLink(self.conn, self.session_id, self.names, self.sizes, here.device,
                                wire_dtype=self.wire_dtype, return_dtype=self.return_dtype,
                                rank=rank)
            try:
                link.open()
            except (RuntimeError, OSError) as err:  # MuondError is a RuntimeError
                link.close()
                if wanted != "auto":
                    raise
                _log.warning("session %s on %s: transport %s is not usable (%s); trying the next",
                             self.session_id, self.endpoint, choice, err)
                continue
            self._gpu, self.transport = link, choice
            return True
        return False

    def drop_gpu(self) -> None:
        if self._gpu is not None:
            gpu, self._gpu = self._gpu, None
            gpu.close()

    def _set_up_region(self) -> None:
        """Creates and registers this session's region: one 4-byte slot per element of every
        parameter, holding its gradient on the way in and its value on the way out."""
        self.drop_region()
        info = self.conn.server_info()
        if not info.shm_socket:
            raise MuondError(grpc.StatusCode.FAILED_PRECONDITION,
                             "the daemon no longer offers shared memory", "StepShared")
        offset = 0
        offsets = {}
        for name in self.names:
            offsets[name] = offset
            offset += 4 * self.sizes[name]
        region = shm.SharedRegion(info.shm_socket, max(offset, 1))
        name = f"{self.session_id}/{region.ticket[:8]}"
        try:
            self.conn.register_shared_memory(name, region.ticket)
        except BaseException:
            region.close()
            raise
        self._region, self._region_name, self._offsets = region, name, offsets

    def drop_region(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None

    # -- one try of a step -----------------------------------------------------------------------

    def step(self, header: pb.StepHeader,
             grads: List[Tuple[str, torch.Tensor]]) -> pb.StepResult:
        """One try of the step ``header`` with this session's ``grads``; the parameters it
        answers (none for a prepare) are copied into the parameter tensors."""
        header = pb.StepHeader.FromString(header.SerializeToString())
        header.session_id = self.session_id
        if self._gpu is not None:
            result, views = self._gpu.step(header, grads)
            if header.phase != pb.STEP_PHASE_PREPARE:
                copy_in(self.by_name, views)
            return result
        if self.transport == "shm":
            result, views = self._step_shared(header, grads)
            if header.phase != pb.STEP_PHASE_PREPARE:
                copy_in(self.by_name, views)
            return result
        # The announced count lets the daemon tell a stream cut short from a whole one.
        header.num_chunks = sum(wire.chunk_count(g.numel(), self.wire_dtype, self.chunk_bytes)
                                for _, g in grads)
        into = wire.ChunkAssembler(self.sizes, self.return_dtype, into=self.by_name)
        return self.conn.step(header, self._grad_chunks(grads), into)

    def _grad_chunks(self, grads: List[Tuple[str, torch.Tensor]]) -> Iterator[bytes]:
        for name, g in grads:
            yield from framing.frame_chunks(name, g, self.wire_dtype, max_chunk_bytes=self.chunk_bytes)

    def _step_shared(self, header: pb.StepHeader, grads: List[Tuple[str, torch.Tensor]]
                     ) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        """One try over shared memory; the parameters after it, as views of the region."""
        if self._region is None:
            self._set_up_region()
        request = pb.StepSharedRequest(header=header)
        request.header.ClearField("return_dtype")
        request.header.ClearField("num_chunks")
        grad_dtype = wire.torch_dtype(self.wire_dtype)
        # Written before every try: an answer overwrites the gradients with the parameters.
        for name, g in grads:
            view = self._region.tensor(self._offsets[name], g.numel(), grad_dtype)
            view.copy_(g.reshape(-1))
            request.gradients.add(name=name, region=self._region_name, offset=self._offsets[name],
                                  byte_size=g.numel() * view.element_size(),
                                  dtype=wire.dtype_enum(self.wire_dtype))
        out_dtype = wire.torch_dtype(self.return_dtype)
        views = {}
        for name in self.names:
            views[name] = self._region.tensor(self._offsets[name], self.sizes[name], out_dtype)
            request.parameters.add(name=name, region=self._region_name, offset=self._offsets[name],
                                   byte_size=self.sizes[name] * views[name].element_size(),
                                   dtype=wire.dtype_enum(self.return_dtype))
        try:
            result = self.conn.step_shared(request)
        except MuondError as err:
            if err.code == grpc.StatusCode.UNAVAILABLE:
                self.drop_region()  # a restarted daemon has lost it
            elif err.reason == REGION_NOT_FOUND:
                self.drop_region()
                raise MuondError(grpc.StatusCode.UNAVAILABLE,
                                 f"the daemon lost this session's region (restarted?): {err.details}",
                                 "StepShared") from None
            raise
        return result, views

    # -- state and lifecycle ---------------------------------------------------------------------

    def checkpoint(self) -> int:
        return self.conn.checkpoint(self.session_id)

    def get_state(self) -> Tuple[pb.StateHeader, Dict[Tuple[str, str], torch.Tensor]]:
        into = wire.ChunkAssembler(self.sizes, slot_sizes=self.slot_sizes)
        header = self.conn.get_state(self.session_id, into, max_chunk_bytes=self.chunk_bytes)
        return header, into.tensors()

    def set_state(self, header: pb.StateHeader, chunks: Iterator[pb.TensorChunk]) -> int:
        return self.conn.set_state(self.session_id, header, chunks)

    def close(self, end_session: bool) -> None:
        """Ends the session when ``end_session`` (a session already gone is fine), then drops
        the region or the GPU transport's memory or channel and closes the connection."""
        try:
            if end_session:
                try:
                    self.conn.close_session(self.session_id)
                except MuondError as err:
                    if err.code != grpc.StatusCode.NOT_FOUND:
                        raise
        finally:
            try:
                self.drop_region()
                self.drop_gpu()
            finally:
                self.conn.close()


@torch.no_grad()
def copy_in(by_name: Dict[str, torch.Tensor], values: Dict[str, torch.Tensor]) -> None:
    """Copies each of ``values`` into the parameter of that name, in place."""
    for name, value in values.items():
        param = by_name[name]
        param.copy_(value.view(param.shape), non_blocking=False)
