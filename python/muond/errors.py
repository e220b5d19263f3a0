"""The exception the muond client raises when the daemon (or the transport) rejects a call.

Every gRPC failure is converted here, in one place, into ``MuondError`` carrying the status code
and the daemon's message, which names the offending field (e.g. ``INVALID_ARGUMENT: parameter
'w1': shape [4, 3] does not match the spec [3, 4]``). Client-side misuse that never reaches the
daemon (an unknown option name, a parameter in two groups) raises ``ValueError``/``TypeError``
as torch optimizers do.

Exceptions are plain values, safe to pass between threads.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import grpc


class MuondError(RuntimeError):
    """A call to the muond daemon failed.

    Attributes:
        code: the ``grpc.StatusCode`` (e.g. ``grpc.StatusCode.NOT_FOUND`` for an unknown session).
        details: the daemon's message, which names the offending field.
        rpc: the name of the call that failed, e.g. ``"Step"``.
    """

    def __init__(self, code: grpc.StatusCode, details: str, rpc: str = ""):
        self.code = code
        self.details = details or ""
        self.rpc = rpc
        where = f"{rpc}: " if rpc else ""
        super().__init__(f"{where}{code.name}: {self.details}")

    def __reduce__(self):  # keeps the exception picklable (multiprocessing, test runners)
        return (type(self), (self.code, self.details, self.rpc))


def from_rpc_error(err: grpc.RpcError, rpc: str) -> MuondError:
    """Converts a ``grpc.RpcError`` raised by a stub call into a ``MuondError``."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return MuondError(code if code is not None else grpc.StatusCode.UNKNOWN, details or "", rpc)


@contextlib.contextmanager
def translated(rpc: str) -> Iterator[None]:
    """Context manager turning ``grpc.RpcError`` raised inside it into ``MuondError``."""
    try:
        yield
    except grpc.RpcError as err:
        raise from_rpc_error(err, rpc) from None
