"""A connection to one muond daemon: the gRPC channel, the stub and one method per RPC.

This is the protocol layer under ``RemoteOptimizer``; it knows messages and chunk streams, not
torch optimizers. Every failed call raises ``MuondError`` (see ``errors.py``). Message size limits
are set explicitly on the channel, as the protocol asks of both sides.

Security: the channel is TLS when ``use_tls`` is set or any TLS file is given (``tls_ca_file`` to
verify the daemon, ``tls_client_cert_file`` and ``tls_client_key_file`` for mutual TLS), plaintext
otherwise. ``auth_token`` is sent as ``authorization: Bearer <token>`` metadata with every call;
it is per-call metadata rather than gRPC call credentials, so it also works over a plaintext
loopback channel (gRPC attaches call credentials to secure channels only).

Retries: the calls that are safe to repeat — GetServerInfo, CreateSession (create-or-attach),
ListSessions, GetParameters, GetState, Checkpoint, CloseSession — are retried on ``UNAVAILABLE`` (the daemon may
be restarting) up to ``max_attempts`` tries in all, waiting ``retry_backoff`` seconds, doubled
after each try; the last try's error then ends "(gave up after N tries)". Streams that send data
(UploadParameters, SetState, Step) are not retried here; ``RemoteOptimizer.step`` retries a step
itself, with the same step number, and says its tries the same way.

Thread-safety: a ``Connection`` may be shared between threads (gRPC channels are thread-safe);
each method call is independent.

Lifetime: ``close()`` closes the channel; it is idempotent. Connections still open when the
interpreter exits are closed by an ``atexit`` hook, while gRPC's threads still run: closing a
channel later, during interpreter finalization (from a ``__del__``), can block forever, and a
trainer that ends without ``close()`` — normally or with an uncaught exception — must still exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import grpc
from google.protobuf.message import DecodeError

from ._stubs import pb, pb_grpc
from .errors import MuondError, after_tries, on_later_try, translated
from .transport.framing import (parse_step_response, serialize_step_request, whole_step_answers,
                                whole_step_request)
from .wire import ChunkAssembler, FramedChunk

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
DEFAULT_MAX_ATTEMPTS = 4
DEFAULT_RETRY_BACKOFF = 0.1

# Every Connection not closed yet; closed at exit by _close_open_connections.
_OPEN_CONNECTIONS: "weakref.WeakSet[Connection]" = weakref.WeakSet()


def _close_open_connections() -> None:
    for connection in list(_OPEN_CONNECTIONS):
        try:
            connection.close()
        except Exception:  # noqa: BLE001 - exiting anyway; one failure must not keep others open
            pass


atexit.register(_close_open_connections)
# Reconnect quickly after a daemon restart (gRPC's default reconnection backoff grows to 2 min).
# Not grpc.min_reconnect_backoff_ms: gRPC uses it as the time one connection attempt may take (20 s
# by default), and at 100 ms every attempt that is not noticed within that time is abandoned and
# started over (see pause_before_retry).
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                      ("grpc.max_reconnect_backoff_ms", 2000)]

T = TypeVar("T")


def _read_pem(path, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"{option}: cannot read {path}: {err.strerror or err}") from err


def channel_credentials(*, use_tls: bool = False, tls_ca_file=None, tls_client_cert_file=None,
                        tls_client_key_file=None) -> Optional[grpc.ChannelCredentials]:
    """TLS channel credentials from PEM files, or None for plaintext (no TLS option set).

    ``tls_ca_file`` holds the roots that verify the daemon (default: gRPC's bundled / the
    system's roots); ``tls_client_cert_file`` and ``tls_client_key_file`` (both or neither) are the
    client's certificate chain and key for mutual TLS. An unreadable file is a ValueError naming
    the option.
    """
    if bool(tls_client_cert_file) != bool(tls_client_key_file):
        given, missing = (("tls_client_cert_file", "tls_client_key_file") if tls_client_cert_file
                          else ("tls_client_key_file", "tls_client_cert_file"))
        raise ValueError(f"{given} was given without {missing}: mutual TLS needs the client's "
                         f"certificate and its private key, set both or neither")
    if not (use_tls or tls_ca_file or tls_client_cert_file):
        return None
    roots = _read_pem(tls_ca_file, "tls_ca_file") if tls_ca_file else None
    cert = _read_pem(tls_client_cert_file, "tls_client_cert_file") if tls_client_cert_file else None
    key = _read_pem(tls_client_key_file, "tls_client_key_file") if tls_client_key_file else None
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key,
                                        certificate_chain=cert)


def _auth_metadata(token: Optional[str]) -> Optional[Tuple[Tuple[str, str], ...]]:
    if token is None or token == "":
        return None
    if not isinstance(token, str):
        raise TypeError(f"auth_token must be a str, got {type(token).__name__}")
    token = token.strip()
    if token.lower().startswith("bearer "):
        raise ValueError("auth_token is the token alone; 'Bearer ' is added by the client")
    if not token or any(c.isspace() or not (c.isascii() and c.isprintable()) for c in token):
        raise ValueError("auth_token must be printable ASCII without spaces (as in the daemon's "
                         "--auth-token-file)")
    return (("authorization", f"Bearer {token}"),)


class Connection:
    """A channel to ``endpoint`` ("host:port") and the muond.v1 stub on it.

    Args:
        endpoint: the daemon's address, e.g. "127.0.0.1:50051".
        max_message_bytes: gRPC send and receive limit; chunks stay far below it.
        timeout: deadline in seconds of every call (None: no deadline).
        credentials: ``grpc.ChannelCredentials`` for a TLS channel built by the caller; None for
            plaintext, or for TLS from the ``tls_*`` / ``use_tls`` arguments (not both).
        options: extra gRPC channel options, as (key, value) pairs.
        auth_token: bearer token sent as ``authorization: Bearer <token>`` with every call (the
            daemon's ``--auth-token-file``). Over plaintext anyone on the path can read it: use
            TLS beyond loopback.
        use_tls: TLS with the default roots (gRPC's bundled roots or ``$GRPC_DEFAULT_SSL_ROOTS_
            FILE_PATH``); implied by any of the TLS files.
        tls_ca_file: PEM roots to verify the daemon's certificate with.
        tls_client_cert_file, tls_client_key_file: PEM certificate chain and private key of this
            client, for a daemon that requires mutual TLS (``--tls-client-ca``); both or neither.
        tls_server_name: the name to verify the daemon's certificate against instead of the
            endpoint's host (``grpc.ssl_target_name_override``; meant for tests).
        max_attempts: tries of a call that is safe to repeat, on ``UNAVAILABLE`` (1: no retry).
        retry_backoff: seconds before the second try, doubled after each further one.

    Raises:
        ValueError: a client certificate without its key (or the reverse), an unreadable TLS
            file, TLS options together with ``credentials``, ``tls_server_name`` without TLS,
            or a malformed token.
    """

    def __init__(self, endpoint: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 timeout: Optional[float] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None,
                 options: Sequence[Tuple[str, object]] = (),
                 auth_token: Optional[str] = None, use_tls: bool = False,
                 tls_ca_file=None, tls_client_cert_file=None, tls_client_key_file=None,
                 tls_server_name: Optional[str] = None,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                 retry_backoff: float = DEFAULT_RETRY_BACKOFF):
        if not isinstance(endpoint, str) or not endpoint:  # gRPC would wait out a timeout resolving it
            raise ValueError(f"endpoint: must be the daemon's host:port, got {endpoint!r}")
        self.endpoint = endpoint
        self.timeout = timeout
        if int(max_attempts) < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.max_attempts = int(max_attempts)
        self.retry_backoff = float(retry_backoff)
        self._metadata = _auth_metadata(auth_token)
        tls = channel_credentials(use_tls=use_tls, tls_ca_file=tls_ca_file,
                                  tls_client_cert_file=tls_client_cert_file,
                                  tls_client_key_file=tls_client_key_file)
        if tls is not None and credentials is not None:
            raise ValueError("pass either credentials or the use_tls / tls_* options, not both")
        credentials = credentials or tls
        if tls_server_name and credentials is None:
            raise ValueError("tls_server_name applies to TLS only: set tls_ca_file or use_tls")
        self.uses_tls = credentials is not None
        self._max_message_bytes = int(max_message_bytes)
        opts = [("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes)] + _RECONNECT_OPTIONS
        if tls_server_name:
            opts.append(("grpc.ssl_target_name_override", tls_server_name))
        opts += list(options)
        if credentials is None:
            self._channel = grpc.insecure_channel(endpoint, options=opts)
        else:
            self._channel = grpc.secure_channel(endpoint, credentials, options=opts)
        self._stub = pb_grpc.MuondStub(self._channel)
        # Step with its chunk payloads kept out of protobuf (framing.py); the same messages.
        self._step = self._channel.stream_stream(
            "/muond.v1.Muond/Step", request_serializer=serialize_step_request,
            response_deserializer=parse_step_response)
        # A whole step in one call (StepWhole): the same messages, framed by framing.py as bytes.
        self._step_whole = self._channel.unary_unary("/muond.v1.Muond/StepWhole")
        # Steps over shared memory and CUDA IPC, taking their requests encoded (transport/slots.py
        # keeps the encoding of what does not change between steps).
        self._step_shared = self._channel.unary_unary(
            "/muond.v1.Muond/StepShared", response_deserializer=pb.StepSharedResponse.FromString)
        self._step_cuda = self._channel.unary_unary(
            "/muond.v1.Muond/StepCuda", response_deserializer=pb.StepSharedResponse.FromString)
        self._closed = False
        # The watcher that keeps the channel reconnecting after a call found it unreachable.
        self._reconnecting: Optional[grpc.Future] = None
        self._reconnecting_lock = threading.Lock()
        _OPEN_CONNECTIONS.add(self)

    # -- lifecycle ---------------------------------------------------------------------------

    def wait_ready(self, timeout: float) -> None:
        """Blocks until the channel is connected; MuondError(UNAVAILABLE) after ``timeout`` s.

        A TLS mismatch (plaintext against a TLS daemon, an untrusted certificate, a missing
        client certificate) looks like an unreachable daemon from here; the message says what
        to check and, where gRPC reports one, the transport's last error."""
        watcher = grpc.channel_ready_future(self._channel)
        try:
            watcher.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            watcher.cancel()  # its polling of the channel ends with it
            hint = (" (TLS: check tls_ca_file, the name in the daemon's certificate and, for "
                    "mutual TLS, the client certificate)" if self.uses_tls else
                    " (if the daemon serves TLS, set tls_ca_file or use_tls)")
            raise MuondError(grpc.StatusCode.UNAVAILABLE,
                             f"could not connect to the muond daemon at {self.endpoint} within "
                             f"{timeout:g} s{hint}{self._last_transport_error()}",
                             "connect") from None

    def _last_transport_error(self) -> str:
        """The reason gRPC gives for the failing connection, e.g. a TLS handshake error."""
        try:
            self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=1.0,
                                     metadata=self._metadata)
        except grpc.RpcError as err:
            details = err.details() if hasattr(err, "details") else ""
            if details and err.code() == grpc.StatusCode.UNAVAILABLE:
                return f"; last error: {details}"
        return ""

    def close(self) -> None:
        """Closes the channel; idempotent. During interpreter finalization (after the ``atexit``
        hook, e.g. from a ``__del__``) it does nothing, since gRPC's threads may be gone."""
        if self._closed or sys.is_finalizing():
            return
        with self._reconnecting_lock:
            self._closed = True
            watcher, self._reconnecting = self._reconnecting, None
        _OPEN_CONNECTIONS.discard(self)
        if watcher is not None:
            watcher.cancel()  # a no-op once it is done
        self._await_watchers_gone()
        self._channel.close()

    def _await_watchers_gone(self) -> None:
        """Waits (a moment at most: it wakes 5 times a second) for gRPC's thread that polls the
        channel for its watchers, if one runs, to see them gone and end: closing the channel
        under it makes it raise "Channel closed!" (a watcher that saw the channel ready, done,
        leaves the thread running until its next wake)."""
        state = getattr(self._channel, "_connectivity_state", None)
        deadline = time.monotonic() + 1.0
        while getattr(state, "polling", False) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _keep_reconnecting(self) -> Optional[grpc.Future]:
        """After a call found the daemon unreachable: a watcher that asks the channel to connect
        and keeps it polled until it is ready, then ends (None once closed). gRPC Python moves a
        channel's reconnection along (its backoff, the attempt) only while something polls the
        channel, a call in flight or a watcher, and a call on a channel whose last attempt failed
        fails at once and polls nothing: a connection that sat idle while its daemon came back
        otherwise kept failing for seconds after the daemon was there (about 7 s after a 3 s wait).
        """
        with self._reconnecting_lock:
            if self._closed:
                return None
            if self._reconnecting is None or self._reconnecting.done():
                self._reconnecting = grpc.channel_ready_future(self._channel)
            return self._reconnecting

    @contextlib.contextmanager
    def _translated(self, rpc: str) -> Iterator[None]:
        """``errors.translated``; an UNAVAILABLE call also keeps the channel reconnecting."""
        try:
            with translated(rpc):
                yield
        except MuondError as err:
            if err.code == grpc.StatusCode.UNAVAILABLE:
                self._keep_reconnecting()
            raise

    def pause_before_retry(self, seconds: float) -> None:
        """Waits ``seconds`` before a retry while the channel reconnects (``_keep_reconnecting``),
        so that the retry finds a restarted daemon."""
        deadline = time.monotonic() + seconds
        watcher = self._keep_reconnecting()
        if watcher is not None:
            try:
                watcher.result(timeout=seconds)
            except (grpc.FutureTimeoutError, grpc.FutureCancelledError):
                pass
        remaining = deadline - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)  # connected early: still keep the backoff

    def _retried(self, rpc: str, call: Callable[[], T]) -> T:
        """Runs ``call`` (a call that is safe to repeat), again on UNAVAILABLE, with backoff."""
        backoff = self.retry_backoff
        before: Optional[MuondError] = None
        for attempt in range(1, self.max_attempts + 1):
            try:
                with self._translated(rpc):
                    return call()
            except MuondError as err:
                if err.code != grpc.StatusCode.UNAVAILABLE:
                    if before is None:
                        raise
                    raise on_later_try(err, attempt, before) from err
                if attempt == 1 == self.max_attempts:
                    raise
                if attempt == self.max_attempts:
                    raise after_tries(err, attempt) from err
                before = err
            self.pause_before_retry(backoff)
            backoff *= 2
        raise AssertionError("unreachable")

    # -- unary calls ---------------------------------------------------------------------------

    def server_info(self, retried: bool = True) -> pb.ServerInfo:
        """The daemon's ServerInfo; with ``retried=False`` one try (a step's own retries go on
        after it fails)."""
        def ask() -> pb.ServerInfo:
            return self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=self.timeout,
                                            metadata=self._metadata)
        if not retried:
            with self._translated("GetServerInfo"):
                return ask()
        return self._retried("GetServerInfo", ask)

    def create_session(self, session_id: str, spec: pb.SessionSpec,
                       rank: Optional[int] = None) -> pb.CreateSessionResponse:
        """Creates the session, or attaches to it when it exists with an identical spec. Safe to
        repeat, hence retried; the tries carry one random ``create_token``, so a retry of a create
        whose answer was lost is answered ``attached=False`` as the first try was. With ``rank``, an
        asynchronous session's answer carries that rank's last push (``last_push``)."""
        request = pb.CreateSessionRequest(session_id=session_id, spec=spec,
                                          create_token=os.urandom(16))
        if rank is not None:
            request.rank = rank
        return self._retried("CreateSession", lambda: self._stub.CreateSession(
            request, timeout=self.timeout, metadata=self._metadata))

    def close_session(self, session_id: str) -> None:
        """Ends the session (its state and files are dropped). Retried on UNAVAILABLE; a retry
        that finds no session is taken as done: an earlier try closed it and its answer was lost,
        or the daemon restarted without it. ``NOT_FOUND`` on the first try. (A session created
        again under the same id between two tries would be the one the retry closes: the request
        names an id, not one session's life.)"""
        tries = 0

        def close() -> None:
            nonlocal tries
            tries += 1
            self._stub.CloseSession(pb.CloseSessionRequest(session_id=session_id),
                                    timeout=self.timeout, metadata=self._metadata)
        try:
            self._retried("CloseSession", close)
        except MuondError as err:
            if err.code != grpc.StatusCode.NOT_FOUND or tries == 1:
                raise

    def list_sessions(self) -> List[pb.SessionSummary]:
        """Every session the caller may see, in id order: the daemon answers in pages (each
        retried on ``UNAVAILABLE``); a session created or closed meanwhile may or may not be in
        it."""
        sessions: List[pb.SessionSummary] = []
        token = ""
        while True:
            request = pb.ListSessionsRequest(page_token=token,
                                             max_answer_bytes=max(self._max_message_bytes, 0))
            page = self._retried("ListSessions", lambda: self._stub.ListSessions(
                request, timeout=self.timeout, metadata=self._metadata))
            sessions.extend(page.sessions)
            if not page.next_page_token:
                return sessions
            # Ids come in order, so every token passes the one before; anything else would loop.
            if page.next_page_token <= token:
                raise MuondError(grpc.StatusCode.INTERNAL,
                                 "ListSessions: the daemon's next_page_token does not follow the "
                                 "page asked for (pages would repeat)")
            token = page.next_page_token

    def checkpoint(self, session_id: str) -> int:
        """Writes a checkpoint of the session on the daemon now; returns the step it holds.
        ``FAILED_PRECONDITION`` when the daemon runs without ``--state-dir``."""
        request = pb.CheckpointRequest(session_id=session_id)
        return int(self._retried("Checkpoint", lambda: self._stub.Checkpoint(
            request, timeout=self.timeout, metadata=self._metadata)).step)

    def state_digest(self, session_id: str) -> pb.StateDigest:
        """The digest of the session's whole state as it is now (``GetStateDigest``)."""
        request = pb.GetStateDigestRequest(session_id=session_id)
        return self._retried("GetStateDigest", lambda: self._stub.GetStateDigest(
            request, timeout=self.timeout, metadata=self._metadata))

    # -- streams -------------------------------------------------------------------------------

    def upload(self, session_id: str, chunks: Iterable[pb.TensorChunk],
               rank: Optional[int] = None) -> pb.UploadParametersResponse:
        """Uploads the initial parameters (every parameter whole; with ``rank``, that rank's
        parts of the partitioned ones)."""
        def requests():
            first = pb.UploadParametersRequest(session_id=session_id)
            if rank is not None:
                first.rank = rank
            yield first
            for chunk in chunks:
                yield pb.UploadParametersRequest(chunk=chunk)
        with _RequestStream(requests()) as stream, self._translated("UploadParameters"):
            return stream.finish(self._stub.UploadParameters(stream, timeout=self.timeout,
                                                             metadata=self._metadata))

    def step(self, header: pb.StepHeader, chunks: Iterable[bytes], into: ChunkAssembler,
             on_result: Optional[Callable[[pb.StepResult], None]] = None) -> pb.StepResult:
        """Runs one step: sends the header and the gradient chunks (serialized ``StepRequest``
        messages, ``framing.frame_chunks``), half-closes, then reads the StepResult and hands the
        returned parameter chunks to ``into``, each as a view of the received bytes.
        ``on_result`` is called with the StepResult as soon as it arrives, before the parameters
        that follow it."""
        def requests():
            yield pb.StepRequest(header=header)
            yield from chunks
        result = None
        with _RequestStream(requests()) as stream, self._translated("Step"):
            call = self._step(stream, timeout=self.timeout, metadata=self._metadata)
            try:
                for response in call:
                    result = _take_answer(response, into, result, on_result)
            finally:
                # An answer left unread (``into`` refused a chunk) ends here, not once the
                # exception holding this frame is collected: the daemon stops sending it.
                call.cancel()
            stream.finish(None)
        return _finished(result, into, "Step")

    def step_whole(self, header: pb.StepHeader, chunks: Iterable[bytes],
                   into: ChunkAssembler) -> pb.StepResult:
        """``step`` in one call (StepWhole, docs/protocol.md, Steps in one call): the same
        messages sent at once and the same answer received at once, without a stream's threads;
        for steps whose gradients and answer are small."""
        request = whole_step_request([pb.StepRequest(header=header), *chunks])
        with self._translated("StepWhole"):
            answer = self._step_whole(request, timeout=self.timeout, metadata=self._metadata)
        try:
            responses = list(whole_step_answers(answer))
        except (ValueError, DecodeError) as err:
            raise MuondError(grpc.StatusCode.INTERNAL, f"the daemon's StepWhole answer is not a "
                             f"StepAnswers encoding: {err}", "StepWhole") from None
        result = None
        for response in responses:
            result = _take_answer(response, into, result, None)
        return _finished(result, into, "StepWhole")

    def grant_shared_memory(self, info: "pb.ServerInfo") -> str:
        """A one-time grant that a connection to the daemon's shared-memory socket presents before
        it passes a memfd (``GrantSharedMemory``); ``""`` for a daemon that takes memfds without
        one (``info.shm_grants`` unset)."""
        if not info.shm_grants:
            return ""
        with self._translated("GrantSharedMemory"):
            return self._stub.GrantSharedMemory(pb.GrantSharedMemoryRequest(), timeout=self.timeout,
                                                metadata=self._metadata).grant

    def register_shared_memory(self, name: str, ticket: str) -> int:
        """Claims a region passed on the daemon's socket under ``name``; returns its size."""
        with self._translated("RegisterSharedMemory"):
            reply = self._stub.RegisterSharedMemory(
                pb.RegisterSharedMemoryRequest(name=name, ticket=ticket), timeout=self.timeout,
                metadata=self._metadata)
        return reply.byte_size

    def step_shared(self, request: Union[bytes, pb.StepSharedRequest]) -> pb.StepResult:
        """Runs one step whose tensors are in registered shared-memory regions (``request``: the
        message or its encoding)."""
        with self._translated("StepShared"):
            return self._step_shared(_encoded(request), timeout=self.timeout,
                                     metadata=self._metadata).result

    def register_cuda_memory(self, request: "pb.RegisterCudaMemoryRequest") -> int:
        """Registers an exported device allocation (CUDA IPC); returns its size."""
        with self._translated("RegisterCudaMemory"):
            return self._stub.RegisterCudaMemory(request, timeout=self.timeout,
                                                 metadata=self._metadata).byte_size

    def unregister_cuda_memory(self, name: str) -> None:
        with self._translated("UnregisterCudaMemory"):
            self._stub.UnregisterCudaMemory(pb.UnregisterCudaMemoryRequest(name=name),
                                            timeout=self.timeout, metadata=self._metadata)

    def step_cuda(self, request: Union[bytes, pb.StepSharedRequest]) -> pb.StepResult:
        """Runs one step whose tensors are in registered CUDA IPC regions (``request``: the message
        or its encoding)."""
        with self._translated("StepCuda"):
            return self._step_cuda(_encoded(request), timeout=self.timeout,
                                   metadata=self._metadata).result

    def open_nccl_channel(self, session_id: str, rank: int) -> "pb.OpenNcclChannelResponse":
        """Has the daemon create a two-rank NCCL communicator for this trainer rank; the answer
        carries its ncclUniqueId, to join within its timeout."""
        with self._translated("OpenNcclChannel"):
            return self._stub.OpenNcclChannel(
                pb.OpenNcclChannelRequest(session_id=session_id, rank=rank),
                timeout=self.timeout, metadata=self._metadata)

    def close_nccl_channel(self, channel: str) -> None:
        with self._translated("CloseNcclChannel"):
            self._stub.CloseNcclChannel(pb.CloseNcclChannelRequest(channel=channel),
                                        timeout=self.timeout, metadata=self._metadata)

    def step_nccl_future(self, request: "pb.StepNcclRequest") -> grpc.Future:
        """Starts a StepNccl call and returns at once (the tensors travel over NCCL meanwhile);
        ``step_nccl_result`` waits for its answer."""
        return self._stub.StepNccl.future(request, timeout=self.timeout, metadata=self._metadata)

    def step_nccl_result(self, future: grpc.Future) -> pb.StepResult:
        """The StepResult of a ``step_nccl_future`` call; MuondError when it failed (CANCELLED
        when it was cancelled)."""
        try:
            with self._translated("StepNccl"):
                return future.result().result
        except grpc.FutureCancelledError:
            raise MuondError(grpc.StatusCode.CANCELLED, "the call was cancelled", "StepNccl") from None

    def get_parameters(self, session_id: str, into: ChunkAssembler,
                       names: Sequence[str] = (), dtype: int = pb.DTYPE_FP32,
                       max_chunk_bytes: int = 0, rank: Optional[int] = None) -> int:
        """Reads parameters into ``into`` (with ``rank``: its parts of the partitioned ones);
        returns the session's last applied step. A read cut off by ``UNAVAILABLE`` is retried
        from the start."""
        request = pb.GetParametersRequest(session_id=session_id, names=list(names), dtype=dtype,
                                          max_chunk_bytes=max_chunk_bytes)
        if rank is not None:
            request.rank = rank

        def read() -> int:
            into.clear()
            last_step = None
            for response in self._stub.GetParameters(request, timeout=self.timeout,
                                                     metadata=self._metadata):
                if last_step is None:
                    last_step = response.last_step
                if response.HasField("chunk"):
                    into.add(response.chunk)
            return last_step or 0
        return self._retried("GetParameters", read)

    def get_state(self, session_id: str, into: ChunkAssembler,
                  max_chunk_bytes: int = 0, rank: Optional[int] = None) -> pb.StateHeader:
        """Reads the whole optimizer state (masters and slots) into ``into``, each tensor sent in
        the format the session stores it in (16-bit tensors as such, exactly); with ``rank``, that
        rank's parts of the partitioned parameters'. A read cut off by ``UNAVAILABLE`` is retried
        from the start."""
        request = pb.GetStateRequest(session_id=session_id, max_chunk_bytes=max_chunk_bytes,
                                     stored_dtypes=True)
        if rank is not None:
            request.rank = rank

        def read() -> Optional[pb.StateHeader]:
            into.clear()
            header = None
            for response in self._stub.GetState(request, timeout=self.timeout,
                                                metadata=self._metadata):
                if response.HasField("header"):
                    header = response.header
                else:
                    into.add(response.chunk)
            return header
        header = self._retried("GetState", read)
        if header is None:
            raise MuondError(grpc.StatusCode.INTERNAL, "the daemon's state had no StateHeader",
                             "GetState")
        return header

    def set_state(self, session_id: str, header: pb.StateHeader,
                  chunks: Iterable[pb.TensorChunk], rank: Optional[int] = None) -> int:
        """Replaces the session's state (with ``rank``: that rank's parts); returns its last
        step."""
        def requests():
            first = pb.SetStateRequest(session_id=session_id)
            if rank is not None:
                first.rank = rank
            yield first
            yield pb.SetStateRequest(header=header)
            for chunk in chunks:
                yield pb.SetStateRequest(chunk=chunk)
        with _RequestStream(requests()) as stream, self._translated("SetState"):
            return stream.finish(self._stub.SetState(
                stream, timeout=self.timeout, metadata=self._metadata)).last_step


def _encoded(request: Union[bytes, pb.StepSharedRequest]) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


def _take_answer(response, into: ChunkAssembler, result: Optional[pb.StepResult],
                 on_result: Optional[Callable[[pb.StepResult], None]]) -> Optional[pb.StepResult]:
    """One message of a step's answer: the StepResult (returned, and handed to ``on_result``), or
    parameter chunks for ``into``; returns the StepResult seen so far."""
    if isinstance(response, FramedChunk):
        into.add(response)
    elif response.HasField("result"):
        result = response.result
        if on_result is not None:
            on_result(result)
    elif response.HasField("packed"):
        into.add_packed(response.packed.chunks)
    else:
        into.add(response.chunk)
    return result


def _finished(result: Optional[pb.StepResult], into: ChunkAssembler, rpc: str) -> pb.StepResult:
    if result is None:
        raise MuondError(grpc.StatusCode.INTERNAL, "the daemon's step answer had no StepResult", rpc)
    into.finish()
    return result


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
