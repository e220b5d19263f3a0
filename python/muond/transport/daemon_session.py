"""``DaemonSession``: one daemon's session as a ``RemoteOptimizer`` sees it.

It owns the connection to one daemon, knows which of the optimizer's parameters that daemon's
session holds (all of them, or one shard's), holds the session's step transport (``choice.py``
picks it) and runs one try of a step — whole, prepare or commit (docs/sharding.md) — through it,
writing the returned parameters into the parameter tensors. Retrying, the step counter and the
decision over several shards belong to ``RemoteOptimizer``.

Not thread-safe: a ``RemoteOptimizer`` may drive its sessions from worker threads, one thread per
session at a time.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import grpc
import torch

from .. import quantize, wire
from .._stubs import pb
from ..client import Connection
from ..errors import MuondError
from . import host_copy
from .base import Facts, Grads, Here, StepTransport, TransportContext
from .choice import open_transport
from .grpc_transport import GrpcTransport
from .shm import RegionRefused
from .streamed import Landing, StreamedTry

_log = logging.getLogger("muond")


class DaemonSession:
    """The session ``session_id`` on the daemon behind ``conn``, holding the parameters
    ``names`` (a subset of ``by_name``, in the optimizer's order), for trainer rank ``rank``;
    ``answer_first`` says which parameters a streamed answer should bring first (names);
    ``server_info``, the daemon's ``ServerInfo`` when the caller has asked for it already."""

    def __init__(self, conn: Connection, session_id: str, names: Sequence[str],
                 by_name: Dict[str, torch.Tensor], *, wire_dtype: str, return_dtype: str,
                 chunk_bytes: int, rank: int = 0, zero_copy: bool = False,
                 answer_first: Callable[[], Sequence[str]] = tuple, partitioned: bool = False,
                 server_info: Optional[pb.ServerInfo] = None):
        self.conn = conn
        # The session has partitioned groups: this rank uploads and reads back its parts.
        self.partitioned = partitioned
        self.rank = rank
        self.endpoint = conn.endpoint
        self.session_id = session_id
        self.names: List[str] = list(names)
        self.by_name = {n: by_name[n] for n in self.names}
        self.sizes = {n: by_name[n].numel() for n in self.names}
        # Optimizer slots smaller than their parameter (NorMuon's second moment): (name, slot) →
        # elements; set by the optimizer that knows the groups.
        self.slot_sizes: Dict[Tuple[str, str], int] = {}
        self.loss_scale = 0.0  # the session loss scaler's scale when opened (0: none)
        self.chunk_bytes = chunk_bytes
        self._context = TransportContext(conn, session_id, tuple(self.names), self.sizes,
                                         self.by_name, wire_dtype, return_dtype, chunk_bytes, rank,
                                         zero_copy, answer_first)
        # The daemon's ServerInfo: the one given (already asked), else asked when first needed.
        self._facts = Facts(conn.server_info if server_info is None else lambda: server_info,
                            Here(self.by_name.values()))
        # gRPC until choose_transport (it needs nothing set up, so it serves before then too)
        self.transport: StepTransport = GrpcTransport(self._context, self._facts)
        self._wanted = "grpc"
        self.created = False  # open() made the session (rather than attaching to one)

    # -- the session -----------------------------------------------------------------------------

    def open(self, spec: pb.SessionSpec, rank: Optional[int] = None) -> Tuple[bool, int]:
        """Creates the session and uploads the parameters, or attaches and reads them back.
        Returns (attached, last_step). With ``rank`` (asynchronous sessions), ``last_push`` is
        that rank's last push as the daemon recorded it."""
        reply = self.conn.create_session(self.session_id, spec, rank)
        self.last_push = int(reply.last_push)
        # Whether this open made the session (not attached to one that was there): what a failed
        # sharded attach rolls back, and nothing else.
        self.created = not reply.attached
        self.loss_scale = float(reply.loss_scale)
        # What the session's last step ran with beyond its groups' options (None: not known).
        self.last_overrides = ({o.group: o for o in reply.last_overrides} if reply.last_overrides_known
                               else None)
        # Under a partition every rank uploads its own parts, until the first step is applied.
        if reply.attached and reply.initialized and not (self.partitioned and reply.last_step == 0):
            return True, self.refresh()
        try:
            self.conn.upload(self.session_id, self._param_chunks(),
                             rank=self.rank if self.partitioned else None)
        except MuondError as err:
            # Another rank uploaded and stepped between this open's two calls (it attached to the
            # session this one created, or created the one this one attached to, before either
            # had uploaded; an asynchronous or quorum rank steps without waiting for this one), so
            # this upload comes too late. The session's parameters are the ranks' common start:
            # take them, as an attach to an initialized session does.
            if err.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return bool(reply.attached), self.refresh()
        if any(g.options.master_dtype not in ("", "fp32") for g in spec.groups):
            self.refresh()  # 16-bit masters hold the values rounded: the parameters follow them
        elif self.partitioned and (self.rank or any(g.partition.replicas > 1 for g in spec.groups)):
            # The replicated parameters are rank 0's (it uploaded first), an HSDP part the first of its
            # replicas' to upload it, which may be another rank's than rank 0's.
            self.refresh()
        return bool(reply.attached), 0

    def roll_back(self) -> None:
        """Closes the session when this object's open() created it (best effort: a daemon that
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
            if self.partitioned and self.by_name[name].numel() == 0:
                continue  # a part holding none of its parameter
            yield from wire.encode(name, self.by_name[name], "fp32", max_chunk_bytes=self.chunk_bytes)

    def refresh(self) -> int:
        """Copies the daemon's masters into the parameters; returns the session's last step."""
        into = wire.ChunkAssembler(self.sizes)
        last_step = self.conn.get_parameters(self.session_id, into, dtype=pb.DTYPE_FP32,
                                             max_chunk_bytes=self.chunk_bytes,
                                             rank=self.rank if self.partitioned else None)
        copy_in(self.by_name, {name: t for (name, _), t in into.tensors().items()})
        return last_step

    def use_chunk_bytes(self, chunk_bytes: int) -> None:
        """Cuts what it sends into chunks of at most ``chunk_bytes`` from now on (the daemon
        takes no larger ones)."""
        self.chunk_bytes = chunk_bytes
        self._context = dataclasses.replace(self._context, chunk_bytes=chunk_bytes)
        if isinstance(self.transport, GrpcTransport):  # the one transport that sends chunks
            self.transport.close()
            self.transport = GrpcTransport(self._context, self._facts)

    # -- the transport ---------------------------------------------------------------------------

    def choose_transport(self, wanted: str) -> str:
        """Opens the transport ``wanted`` (a name of ``choice.NAMES``) and returns its name.
        RuntimeError when one asked for by name is impossible, saying why."""
        self.transport.close()
        self._wanted = wanted
        if quantize.is_quantized(self._context.wire_dtype):
            # Block-quantized gradients are chunks of the gRPC stream: the other transports write
            # whole elements into place.
            if wanted not in ("auto", "grpc"):
                raise RuntimeError(f"transport='{wanted}' is not possible with wire_dtype "
                                   f"'{self._context.wire_dtype}': quantized gradients travel "
                                   f"over grpc only")
            wanted = "grpc"
        self.transport = open_transport(wanted, self._context, self._facts)
        return self.transport.name

    def _fall_back(self, err: Exception) -> None:
        """After the daemon refused what the transport needs (``shm.RegionRefused``): "auto"
        goes on over gRPC, saying why once; a transport asked for by name raises ``err``."""
        if self._wanted != "auto":
            raise err
        _log.warning("session %s on %s: transport %s refused (%s); its steps go over grpc",
                     self.session_id, self.endpoint, self.transport.name, err)
        self.transport.close()
        self.transport = GrpcTransport(self._context, self._facts)

    # -- one try of a step -----------------------------------------------------------------------

    def step(self, header: pb.StepHeader, grads: Grads,
             out: Optional[Dict[str, torch.Tensor]] = None) -> pb.StepResult:
        """One try of the step ``header`` with this session's ``grads``; the parameters it
        answers (none for a prepare) are copied into ``out`` (None: the parameter tensors)."""
        try:
            result, values = self.transport.step(self._own(header), grads, out)
        except RegionRefused as err:  # before anything was sent: the try goes over gRPC instead
            self._fall_back(err)
            result, values = self.transport.step(self._own(header), grads, out)
        if header.phase != pb.STEP_PHASE_PREPARE:
            copy_in(out or self.by_name, values)
        return result

    def begin_streamed(self, header: pb.StepHeader,
                       out: Optional[Dict[str, torch.Tensor]] = None) -> "StreamedStep":
        """A streamed try of the step ``header`` names (its options come at the end)."""
        try:
            streamed = self.transport.begin_streamed(self._own(header), out)
        except RegionRefused as err:
            self._fall_back(err)
            streamed = self.transport.begin_streamed(self._own(header), out)
        return StreamedStep(self, streamed, out)

    def _own(self, header: pb.StepHeader) -> pb.StepHeader:
        """A copy of ``header`` naming this daemon's session."""
        own = pb.StepHeader()
        own.CopyFrom(header)
        own.session_id = self.session_id
        return own

    # -- state and lifecycle ---------------------------------------------------------------------

    def checkpoint(self) -> int:
        return self.conn.checkpoint(self.session_id)

    def get_state(self) -> Tuple[pb.StateHeader, Dict[Tuple[str, str], torch.Tensor]]:
        into = wire.ChunkAssembler(self.sizes, slot_sizes=self.slot_sizes)
        header = self.conn.get_state(self.session_id, into, max_chunk_bytes=self.chunk_bytes,
                                     rank=self.rank if self.partitioned else None)
        return header, into.tensors()

    def set_state(self, header: pb.StateHeader, chunks: Iterator[pb.TensorChunk]) -> int:
        return self.conn.set_state(self.session_id, header, chunks,
                                   rank=self.rank if self.partitioned else None)

    def close(self, end_session: bool) -> None:
        """Ends the session when ``end_session`` (a session already gone is fine), then closes
        the transport (its region, device memory or channel) and the connection."""
        try:
            if end_session:
                try:
                    self.conn.close_session(self.session_id)
                except MuondError as err:
                    if err.code != grpc.StatusCode.NOT_FOUND:
                        raise
        finally:
            try:
                self.transport.close()
            finally:
                self.conn.close()


class StreamedStep:
    """A streamed try on one daemon session (``streamed.py``): the gradients go in as they come,
    and ``finish`` copies the answer's parameters into ``out`` like ``DaemonSession.step``."""

    def __init__(self, session: DaemonSession, streamed: StreamedTry,
                 out: Optional[Dict[str, torch.Tensor]]):
        self._session = session
        self._try = streamed
        self._out = out

    def add(self, name: str, grad: torch.Tensor) -> None:
        self._try.add(name, grad)

    def send_rest(self, header: pb.StepHeader, more: Grads) -> None:
        """Ends the input (see ``StreamedTry.send_rest``); cancels the try when that fails."""
        try:
            self._try.send_rest(self._session._own(header), more)
        except BaseException:
            self._try.cancel()
            raise

    def result(self) -> pb.StepResult:
        result, values = self._try.result()
        copy_in(self._out or self._session.by_name, values)
        return result

    def answer(self) -> Tuple[pb.StepResult, Landing]:
        """The result as soon as it is in, and the landing of the parameters still arriving
        (``StreamedTry.answer``); values a transport hands back are copied in first."""
        result, values, landing = self._try.answer()
        copy_in(self._out or self._session.by_name, values)
        return result, landing

    def cancel(self) -> None:
        self._try.cancel()


@torch.no_grad()
def copy_in(by_name: Dict[str, torch.Tensor], values: Dict[str, torch.Tensor]) -> None:
    """Copies each of ``values`` into the parameter of that name, in place (large host copies
    split over threads, ``host_copy.py``)."""
    pairs = []
    for name, value in values.items():
        dst = by_name[name]
        pairs.append((dst, value if value.shape == dst.shape else value.view(dst.shape)))
    host_copy.copy_all(pairs)
