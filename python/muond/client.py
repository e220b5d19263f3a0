"""A connection to one muond daemon: the gRPC channel, the stub and one method per RPC.

This is the protocol layer under ``RemoteOptimizer``; it knows messages and chunk streams, not
torch optimizers. Every failed call raises ``MuondError`` (see ``errors.py``). Message size limits
are set explicitly on the channel, as the protocol asks of both sides.

Thread-safety: a ``Connection`` may be shared between threads (gRPC channels are thread-safe);
each method call is independent.
"""

from __future__ import annotations

import threading
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc

from ._stubs import pb, pb_grpc
from .errors import MuondError, translated
from .wire import ChunkAssembler

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


class Connection:
    """A channel to ``endpoint`` ("host:port") and the muond.v1 stub on it.

    Args:
        endpoint: the daemon's address, e.g. "127.0.0.1:50051".
        max_message_bytes: gRPC send and receive limit; chunks stay far below it.
        timeout: deadline in seconds of every call (None: no deadline).
        credentials: ``grpc.ChannelCredentials`` for a TLS channel; None for plaintext.
        options: extra gRPC channel options, as (key, value) pairs.
    """

    def __init__(self, endpoint: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 timeout: Optional[float] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 options: Sequence[Tuple[str, object]] = ()):
        self.endpoint = endpoint
        self.timeout = timeout
        opts = [("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes)] + list(options)
        if credentials is None:
            self._channel = grpc.insecure_channel(endpoint, options=opts)
        else:
            self._channel = grpc.secure_channel(endpoint, credentials, options=opts)
        self._stub = pb_grpc.MuondStub(self._channel)

    # -- lifecycle ---------------------------------------------------------------------------

    def wait_ready(self, timeout: float) -> None:
        """Blocks until the channel is connected; MuondError(UNAVAILABLE) after ``timeout`` s."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise MuondError(grpc.StatusCode.UNAVAILABLE,
                             f"could not connect to the muond daemon at {self.endpoint} within "
                             f"{timeout:g} s", "connect") from None

    def close(self) -> None:
        self._channel.close()

    # -- unary calls ---------------------------------------------------------------------------

    def server_info(self) -> pb.ServerInfo:
        with translated("GetServerInfo"):
            return self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=self.timeout)

    def create_session(self, session_id: str, spec: pb.SessionSpec) -> pb.CreateSessionResponse:
        with translated("CreateSession"):
            return self._stub.CreateSession(
                pb.CreateSessionRequest(session_id=session_id, spec=spec), timeout=self.timeout)

    def close_session(self, session_id: str) -> None:
        with translated("CloseSession"):
            self._stub.CloseSession(pb.CloseSessionRequest(session_id=session_id),
                                    timeout=self.timeout)

    def list_sessions(self) -> List[pb.SessionSummary]:
        with translated("ListSessions"):
            return list(self._stub.ListSessions(pb.ListSessionsRequest(),
                                                timeout=self.timeout).sessions)

    # -- streams -------------------------------------------------------------------------------

    def upload(self, session_id: str,
               chunks: Iterable[pb.TensorChunk]) -> pb.UploadParametersResponse:
        """Uploads the initial parameters (every parameter whole)."""
        def requests():
            yield pb.UploadParametersRequest(session_id=session_id)
            for chunk in chunks:
                yield pb.UploadParametersRequest(chunk=chunk)
        with _RequestStream(requests()) as stream, translated("UploadParameters"):
            return stream.finish(self._stub.UploadParameters(stream, timeout=self.timeout))

    def step(self, header: pb.StepHeader, chunks: Iterable[pb.TensorChunk],
             into: ChunkAssembler) -> pb.StepResult:
        """Runs one step: sends the header and the gradient chunks, half-closes, then reads the
        StepResult and feeds the returned parameter chunks to ``into``."""
        def requests():
            yield pb.StepRequest(header=header)
            for chunk in chunks:
                yield pb.StepRequest(chunk=chunk)
        result = None
        with _RequestStream(requests()) as stream, translated("Step"):
            for response in self._stub.Step(stream, timeout=self.timeout):
                if response.HasField("result"):
                    result = response.result
                else:
                    into.add(response.chunk)
            stream.finish(None)
        if result is None:
            raise MuondError(grpc.StatusCode.INTERNAL, "the daemon's step answer had no StepResult",
                             "Step")
        return result

    def get_parameters(self, session_id: str, into: ChunkAssembler,
                       names: Sequence[str] = (), dtype: int = pb.DTYPE_FP32,
                       max_chunk_bytes: int = 0) -> int:
        """Reads parameters into ``into``; returns the session's last applied step."""
        request = pb.GetParametersRequest(session_id=session_id, names=list(names), dtype=dtype,
                                          max_chunk_bytes=max_chunk_bytes)
        last_step = None
        with translated("GetParameters"):
            for response in self._stub.GetParameters(request, timeout=self.timeout):
                if last_step is None:
                    last_step = response.last_step
                if response.HasField("chunk"):
                    into.add(response.chunk)
        return last_step or 0

    def get_state(self, session_id: str, into: ChunkAssembler,
                  max_chunk_bytes: int = 0) -> pb.StateHeader:
        """Reads the whole optimizer state (masters and slots) into ``into``."""
        request = pb.GetStateRequest(session_id=session_id, max_chunk_bytes=max_chunk_bytes)
        header = None
        with translated("GetState"):
            for response in self._stub.GetState(request, timeout=self.timeout):
                if response.HasField("header"):
                    header = response.header
                else:
                    into.add(response.chunk)
        if header is None:
            raise MuondError(grpc.StatusCode.INTERNAL, "the daemon's state had no StateHeader",
                             "GetState")
        return header

    def set_state(self, session_id: str, header: pb.StateHeader,
                  chunks: Iterable[pb.TensorChunk]) -> int:
        """Replaces the session's state; returns its last step."""
        def requests():
            yield pb.SetStateRequest(session_id=session_id)
            yield pb.SetStateRequest(header=header)
            for chunk in chunks:
                yield pb.SetStateRequest(chunk=chunk)
        with _RequestStream(requests()) as stream, translated("SetState"):
            return stream.finish(self._stub.SetState(stream, timeout=self.timeout)).last_step


class _RequestStream:
    """Wraps a request generator so an exception raised while producing requests (e.g. while
    encoding a tensor) reaches the caller instead of surfacing as a bare CANCELLED call.

    gRPC pulls the requests from its own thread. An exception there cancels the call (so the
    daemon never sees a truncated stream as complete); the exception is kept and re-raised on the
    caller's thread in place of the cancellation.
    """

    def __init__(self, requests: Iterator):
        self._requests = requests
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._requests)
        except StopIteration:
            raise
        except BaseException as err:  # noqa: BLE001 - handed back to the caller's thread
            with self._lock:
                self._error = err
            raise

    def _raise_pending(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def finish(self, value):
        self._raise_pending()
        return value

    def __enter__(self) -> "_RequestStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            self._raise_pending()  # the producer's error explains the failed call
        return False
