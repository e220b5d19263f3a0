"""The exception the muond client raises when the daemon (or the transport) rejects a call.

Every gRPC failure is converted here, in one place, into ``MuondError`` carrying the status code
and the daemon's message, which names the offending field (e.g. ``INVALID_ARGUMENT: parameter
'w1': shape [4, 3] does not match the spec [3, 4]``). Client-side misuse that never reaches the
daemon (an unknown option name, a parameter in two groups) raises ``ValueError``/``TypeError``
as torch optimizers do.

A refusal the client acts on also carries a machine-readable ``reason`` (``REGION_NOT_FOUND``,
``STEP_NOT_PREPARED``, ...): the daemon sends it as a ``google.rpc.ErrorInfo`` of domain
``muond.v1`` in the status details (docs/protocol.md, Error reasons). The client decides on the
reason, never on the message text.

Exceptions are plain values, safe to pass between threads.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import grpc

from ._stubs import pb

# The reasons the client acts on: names of muond.v1.ErrorReason.
REGION_NOT_FOUND = pb.ErrorReason.Name(pb.REGION_NOT_FOUND)
CHANNEL_NOT_FOUND = pb.ErrorReason.Name(pb.CHANNEL_NOT_FOUND)
STEP_NOT_PREPARED = pb.ErrorReason.Name(pb.STEP_NOT_PREPARED)
SESSION_NOT_FOUND = pb.ErrorReason.Name(pb.SESSION_NOT_FOUND)
PUSH_TOO_STALE = pb.ErrorReason.Name(pb.PUSH_TOO_STALE)
CHUNK_TOO_LARGE = pb.ErrorReason.Name(pb.CHUNK_TOO_LARGE)
CALLER_BUSY = pb.ErrorReason.Name(pb.CALLER_BUSY)

_DETAILS_KEY = "grpc-status-details-bin"
_ERROR_INFO_TYPE_URL = "type.googleapis.com/google.rpc.ErrorInfo"
_DOMAIN = "muond.v1"


class MuondError(RuntimeError):
    """A call to the muond daemon failed.

    Attributes:
        code: the ``grpc.StatusCode`` (e.g. ``grpc.StatusCode.NOT_FOUND`` for an unknown session).
        details: the daemon's message, which names the offending field.
        rpc: the name of the call that failed, e.g. ``"Step"``.
        reason: the daemon's machine-readable reason (e.g. ``REGION_NOT_FOUND``); ``""`` when it
            gave none.
    """

    def __init__(self, code: grpc.StatusCode, details: str, rpc: str = "", reason: str = ""):
        self.code = code
        self.details = details or ""
        self.rpc = rpc
        self.reason = reason or ""
        where = f"{rpc}: " if rpc else ""
        super().__init__(f"{where}{code.name}: {self.details}")

    def __reduce__(self):  # keeps the exception picklable (multiprocessing, test runners)
        return (type(self), (self.code, self.details, self.rpc, self.reason))


def reason_in_details(details: bytes) -> str:
    """The muond.v1 ErrorInfo reason in serialized status details (a google.rpc.Status); ``""``
    when there is none."""
    status = pb.RpcStatus()
    try:
        status.ParseFromString(details)
    except Exception:  # noqa: BLE001 - a malformed trailer carries no reason
        return ""
    for any_detail in status.details:
        if any_detail.type_url != _ERROR_INFO_TYPE_URL:
            continue
        info = pb.ErrorInfo()
        try:
            info.ParseFromString(any_detail.value)
        except Exception:  # noqa: BLE001
            continue
        if info.domain == _DOMAIN:
            return info.reason
    return ""


def after_tries(err: MuondError, tries: int) -> MuondError:
    """The last try's failure of a call retried until it gave up, saying how many tries were made
    (code, call and reason kept); ``err`` itself after one try."""
    if tries <= 1:
        return err
    return MuondError(err.code, f"{err.details} (gave up after {tries} tries)", err.rpc, err.reason)


def on_later_try(err: MuondError, tries: int, before: Optional[MuondError]) -> MuondError:
    """A refusal that ended a retried call on a later try, saying so and what the try before met
    (say, NOT_FOUND after UNAVAILABLE: the daemon restarted without the session); code, call and
    reason kept. ``err`` itself on the first try."""
    if tries <= 1 or before is None:
        return err
    met = before.details if len(before.details) <= 160 else before.details[:160] + "…"
    return MuondError(err.code, f"{err.details} (on try {tries}; the try before met "
                                f"{before.code.name}: {met})", err.rpc, err.reason)


def _reason_of(err: grpc.RpcError) -> str:
    try:
        trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    except Exception:  # noqa: BLE001 - an error raised before the call had trailers
        return ""
    for key, value in trailers or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            return reason_in_details(value)
    return ""


def from_rpc_error(err: grpc.RpcError, rpc: str) -> MuondError:
    """Converts a ``grpc.RpcError`` raised by a stub call into a ``MuondError``."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return MuondError(code if code is not None else grpc.StatusCode.UNKNOWN, details or "", rpc, _reason_of(err))


@contextlib.contextmanager
def translated(rpc: str) -> Iterator[None]:
    """Context manager turning ``grpc.RpcError`` raised inside it into ``MuondError``."""
    try:
        yield
    except grpc.RpcError as err:
        raise from_rpc_error(err, rpc) from None
