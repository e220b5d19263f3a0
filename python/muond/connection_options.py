"""``ConnectionOptions``: how a ``RemoteOptimizer`` reaches its daemons and moves its tensors.

One frozen value for what used to be a dozen keyword arguments: the daemons (``endpoint`` or
``endpoints``), deadlines, security (token, TLS), retries, the step transport and the chunk size::

    conn = muond.ConnectionOptions(endpoint="muond.internal:50051", auth_token=token,
                                   tls_ca_file="ca.pem", transport="grpc")
    opt = muond.RemoteOptimizer(groups, connection=conn)

Each field may still be given to ``RemoteOptimizer`` as a keyword of the same name instead; giving
one both ways is a TypeError naming it. The methods resolve the defaults that depend on the
environment (``$MUOND_ENDPOINT``, ``$MUOND_TRANSPORT``) and check the values.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc

from . import wire
from .client import DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_RETRY_BACKOFF, Connection
from .transport import choice

DEFAULT_ENDPOINT = "127.0.0.1:50051"


@dataclass(frozen=True)
class ConnectionOptions:
    """How to reach the daemons of one ``RemoteOptimizer``'s session.

    Attributes:
        endpoint: the daemon's "host:port"; default ``$MUOND_ENDPOINT`` or 127.0.0.1:50051.
        endpoints: several daemons ("host:port" each, in a fixed order) to spread the session
            over instead of one ``endpoint``; each holds whole parameters, placed by optimizer
            cost (``muond.placement``). Attaching later needs the same list in the same order.
        timeout: deadline in seconds of each call (None: none).
        connect_timeout: seconds to wait for the daemon at construction.
        credentials: ``grpc.ChannelCredentials`` for TLS built by the caller, instead of the
            ``tls_*`` options; None for plaintext.
        auth_token: bearer token (a token of the daemon's ``--auth-token-file``), sent as
            ``authorization: Bearer <token>`` with every call. The session belongs to it.
        use_tls: TLS with the default roots; implied by any ``tls_*`` file.
        tls_ca_file: PEM roots to verify the daemon's certificate with.
        tls_client_cert_file, tls_client_key_file: this client's PEM certificate chain and key,
            for a daemon that requires mutual TLS; both or neither.
        tls_server_name: verify the daemon's certificate against this name instead of the
            endpoint's host (tests).
        max_step_attempts: tries of a step that fails with UNAVAILABLE or DEADLINE_EXCEEDED,
            each resent with the same step number (the daemon applies each step exactly once, so
            a resend after a lost answer does not update twice); also the tries of the calls
            that are safe to repeat (attach, reading parameters or state, checkpoint) on
            UNAVAILABLE. Default 4.
        retry_backoff: seconds before the second try, doubled after each further one.
        transport: how steps' tensors travel: "grpc" (chunked streams), "shm" (a shared-memory
            region registered with a daemon on this host; gradients are copied into it and the
            parameters out of it, one copy each way), "cuda_ipc" (CUDA parameters, a daemon on
            ``--backend cuda`` on this node: one device buffer shared with the daemon over CUDA
            IPC, gradients and parameters copied device to device, on the daemon's GPU or another
            one of the node), "nccl" (CUDA parameters, a daemon on ``--backend cuda`` with NCCL on
            another GPU, typically another node: the tensors travel over a two-rank NCCL
            communicator; NCCL refuses two ranks on one GPU, so the daemon's own GPU is an error,
            for which "auto" takes cuda_ipc) or "auto": cuda_ipc when the parameters are on a CUDA
            device and the daemon offers CUDA IPC on this host (nccl should registering the memory
            fail and it fits), nccl for a daemon with NCCL on another host, else shm when the
            daemon is on this host and offers it, else grpc. Default ``$MUOND_TRANSPORT`` or
            "auto". A transport named explicitly that cannot work is a RuntimeError naming it and
            saying why. ``opt.transport`` says which was chosen (also logged on the "muond"
            logger; with several daemons, each chooses its own, e.g. "grpc+shm"). Every step
            semantic is the same on all of them (retries, replays, ranks, shards).
        chunk_bytes: size of the tensor chunks sent and asked for (a whole number of bytes, at
            least 1); a daemon that takes smaller ones (``muond --max-chunk-bytes``) gets chunks of
            its limit instead.
    """
    endpoint: Optional[str] = None
    endpoints: Optional[Sequence[str]] = None
    timeout: Optional[float] = None
    connect_timeout: float = 10.0
    credentials: Optional[grpc.ChannelCredentials] = None
    auth_token: Optional[str] = None
    use_tls: bool = False
    tls_ca_file: Optional[str] = None
    tls_client_cert_file: Optional[str] = None
    tls_client_key_file: Optional[str] = None
    tls_server_name: Optional[str] = None
    max_step_attempts: Optional[int] = None
    retry_backoff: float = DEFAULT_RETRY_BACKOFF
    transport: Optional[str] = None
    chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES

    @classmethod
    def from_arguments(cls, connection: Optional["ConnectionOptions"], endpoint: Optional[str],
                       keywords: Dict[str, Any]) -> Tuple["ConnectionOptions", Dict[str, Any]]:
        """(the options, the other keywords) of ``RemoteOptimizer(params, endpoint, ...,
        connection=connection, **keywords)``: ``connection`` with the fields given one by one
        (``endpoint``, or a keyword named after a field), which it must leave unset."""
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in keywords.items() if k in fields}
        rest = {k: v for k, v in keywords.items() if k not in fields}
        if endpoint is not None:
            given["endpoint"] = endpoint
        if connection is None:
            return cls(**given), rest
        if not isinstance(connection, ConnectionOptions):
            raise TypeError(f"connection: a muond.ConnectionOptions, not "
                            f"{type(connection).__name__}")
        if given:
            field = sorted(given)[0]
            raise TypeError(f"'{field}' was given both as an argument and in connection=; give "
                            f"it in one place")
        return connection, rest

    def endpoint_list(self) -> List[str]:
        """The daemons of the session: ``endpoints`` as given, or the one ``endpoint``."""
        if self.endpoint == "":  # not taken for "unset": a wrong daemon would answer the default
            raise ValueError("endpoint: empty; give the daemon's host:port, or leave it unset for "
                             "$MUOND_ENDPOINT or " + DEFAULT_ENDPOINT)
        if self.endpoints is None:
            return [self.endpoint or os.environ.get("MUOND_ENDPOINT") or DEFAULT_ENDPOINT]
        if self.endpoint is not None:
            raise ValueError("endpoint and endpoints: give one or the other")
        if isinstance(self.endpoints, str):
            raise TypeError("endpoints: a list of \"host:port\" strings, not one string")
        listed = [str(e) for e in self.endpoints]
        if not listed:
            raise ValueError("endpoints: needs at least one daemon")
        for i, address in enumerate(listed):
            if not address:
                raise ValueError(f"endpoints[{i}]: empty")
            if listed.index(address) != i:
                raise ValueError(f"endpoints[{i}]: '{address}' is listed twice "
                                 f"(endpoints[{listed.index(address)}])")
        return listed

    def check(self) -> None:
        """ValueError or TypeError naming the first field that cannot work, before anything
        connects: addresses and files that are not text, times that are not positive numbers of
        seconds, counts that are not whole numbers, an unknown transport."""
        for name in ("endpoint", "auth_token", "tls_ca_file", "tls_client_cert_file", "tls_client_key_file",
                     "tls_server_name"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name}: a string, not {type(value).__name__}")
        if not isinstance(self.use_tls, bool):
            raise TypeError(f"use_tls: True or False, not {self.use_tls!r}")
        if self.credentials is not None and not isinstance(self.credentials, grpc.ChannelCredentials):
            raise TypeError(f"credentials: a grpc.ChannelCredentials, not {type(self.credentials).__name__}")
        _check_seconds("timeout", self.timeout, optional=True)
        _check_seconds("connect_timeout", self.connect_timeout)
        _check_seconds("retry_backoff", self.retry_backoff, zero=True)
        self.endpoint_list()
        self.chunk_size()
        self.step_attempts()
        self.transport_name()

    def chunk_size(self) -> int:
        """``chunk_bytes``; ValueError unless it is a whole number of at least 1."""
        size = self.chunk_bytes
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise ValueError(f"chunk_bytes: must be a whole number of bytes, at least 1, got {size!r}")
        return int(size)

    def step_attempts(self) -> int:
        """``max_step_attempts``, or its default; ValueError below 1."""
        attempts = DEFAULT_MAX_ATTEMPTS if self.max_step_attempts is None else self.max_step_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, numbers.Integral) or attempts < 1:
            raise ValueError(f"max_step_attempts must be at least 1 (a whole number), got {attempts!r}")
        return int(attempts)

    def transport_name(self) -> str:
        """``transport``, else ``$MUOND_TRANSPORT``, else "auto"; ValueError for an unknown one."""
        wanted = self.transport if self.transport is not None else \
            os.environ.get("MUOND_TRANSPORT") or "auto"
        return choice.check_name(wanted)

    def connect(self, address: str) -> Connection:
        """A ``Connection`` to the daemon at ``address`` with these options."""
        return Connection(address, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
                          timeout=self.timeout, credentials=self.credentials,
                          auth_token=self.auth_token, use_tls=self.use_tls,
                          tls_ca_file=self.tls_ca_file,
                          tls_client_cert_file=self.tls_client_cert_file,
                          tls_client_key_file=self.tls_client_key_file,
                          tls_server_name=self.tls_server_name,
                          max_attempts=self.step_attempts(),
                          retry_backoff=float(self.retry_backoff))


def _check_seconds(name: str, value: Any, *, optional: bool = False, zero: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` is a finite number of seconds above 0 (or 0 too
    with ``zero``; or None with ``optional``)."""
    if value is None and optional:
        return
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero)):
        bound = "at least 0" if zero else "above 0"
        raise ValueError(f"{name}: must be a finite number of seconds {bound}, got {value!r}")
