"""A ctypes binding of NCCL (``libnccl.so.2``), for the NCCL transport (``nccl_transport.py``).

Only what a two-rank point-to-point channel takes: ``ncclGetVersion``, ``ncclCommInitRank`` (the
``ncclUniqueId`` passed by value, a 128-byte structure), ``ncclGroupStart``/``ncclGroupEnd``,
``ncclSend``/``ncclRecv`` of bytes (``ncclUint8``), ``ncclCommAbort``, ``ncclCommDestroy`` and
``ncclGetErrorString``. The library is the one torch already loaded when it can be found
(``/proc/self/maps``), else ``libnccl.so.2`` by name, else a copy in site-packages
(nvidia/nccl/lib, torch/lib). Every failing call raises ``RuntimeError`` naming the call and
NCCL's message.

``Communicator`` owns one ``ncclComm_t`` and is used by one thread at a time, except
``request_abort()``, which any thread may call (it ends transfers whose peer gave up).

Loading is lazy: importing this module works on a machine without NCCL.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Optional, Sequence, Tuple

from .cuda_runtime import load_library

UNIQUE_ID_BYTES = 128
NCCL_UINT8 = 1  # ncclDataType_t ncclUint8 (ncclInt8 = ncclChar = 0)
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes, passed by value."""
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def unique_id(raw: bytes) -> UniqueId:
    """The ``ncclUniqueId`` of the 128 bytes ``OpenNcclChannel`` answered."""
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an ncclUniqueId has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    uid = UniqueId()
    ctypes.memmove(ctypes.addressof(uid), bytes(raw), UNIQUE_ID_BYTES)
    return uid


def version_string(code: int) -> str:
    """NCCL's version code as "major.minor.patch" (2.9 and later: major·10000 + minor·100 +
    patch; earlier: major·1000 + minor·100 + patch)."""
    code = int(code)
    if code <= 0:
        return "none"
    if code >= 20900:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


_lock = threading.Lock()
_nccl: Optional["Nccl"] = None


class Nccl:
    """The functions of one loaded libnccl."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        self._sig("ncclGetErrorString", ctypes.c_char_p, [c_int])
        self._sig("ncclGetVersion", c_int, [ctypes.POINTER(c_int)])
        self._sig("ncclCommInitRank", c_int, [ctypes.POINTER(c_void_p), c_int, UniqueId, c_int])
        self._sig("ncclGroupStart", c_int, [])
        self._sig("ncclGroupEnd", c_int, [])
        for name in ("ncclSend", "ncclRecv"):
            self._sig(name, c_int, [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p])
        self._sig("ncclCommAbort", c_int, [c_void_p])
        self._sig("ncclCommDestroy", c_int, [c_void_p])

    def _sig(self, name: str, restype, argtypes) -> None:
        fn = getattr(self.lib, name)
        fn.restype = restype
        fn.argtypes = argtypes

    def error_string(self, code: int) -> str:
        text = self.lib.ncclGetErrorString(int(code))
        return text.decode("utf-8", "replace") if text else f"error {code}"

    def check(self, call: str, code: int) -> None:
        if code != NCCL_SUCCESS:
            raise RuntimeError(f"{call} failed: {self.error_string(code)} (ncclResult {code})")

    def version(self) -> int:
        out = ctypes.c_int()
        self.check("ncclGetVersion", self.lib.ncclGetVersion(ctypes.byref(out)))
        return int(out.value)

    def group_start(self) -> None:
        self.check("ncclGroupStart", self.lib.ncclGroupStart())


def nccl() -> Nccl:
    """NCCL (loaded once); RuntimeError when it cannot be loaded."""
    global _nccl
    with _lock:
        if _nccl is None:
            _nccl = Nccl(load_library("NCCL library", "libnccl", ["libnccl.so.2", "libnccl.so"],
                                      ["nvidia/nccl/lib", "torch/lib", "nvidia/cu13/lib",
                                       "nvidia/cu12/lib"]))
        return _nccl


def local_version() -> int:
    """This process's NCCL version code, 0 when NCCL cannot be loaded."""
    try:
        return nccl().version()
    except (RuntimeError, AttributeError):
        return 0


class Communicator:
    """One rank of an NCCL communicator, joined with ``ncclCommInitRank`` on the current CUDA
    device (blocking until every rank joined). ``transfer`` runs point-to-point operations as one
    group on a stream.

    Aborting: ``abort()`` from the owning thread; ``request_abort()`` from any other thread (e.g.
    when the peer's side of the exchange failed). The latter aborts from a helper thread only
    once the owner has sat in ``ncclGroupEnd`` for a moment (connection set-up waits there for the
    peer, and only an abort ends that wait); otherwise it marks the communicator, and the owner
    aborts it at its ``transfer``'s next boundary and raises. So the communicator is not freed
    while the owner is enqueueing operations on it."""

    def __init__(self, nranks: int, uid: bytes, rank: int):
        self._nccl = nccl()
        self._lock = threading.Lock()
        self._blocked = False
        self.abort_requested = False
        self.aborted = False
        comm = ctypes.c_void_p()
        self._nccl.check("ncclCommInitRank", self._nccl.lib.ncclCommInitRank(
            ctypes.byref(comm), int(nranks), unique_id(uid), int(rank)))
        self._comm: Optional[int] = int(comm.value or 0)

    def transfer(self, sends: Sequence[Tuple[int, int]], recvs: Sequence[Tuple[int, int]],
                 peer: int, stream: int) -> None:
        """``ncclSend`` of every (pointer, bytes) in ``sends`` then ``ncclRecv`` into every one of
        ``recvs``, to and from ``peer``, as one group enqueued on ``stream`` (uint8 counts). An
        entry of no bytes (a rank's empty part) is left out, as the daemon leaves it out: NCCL
        would still pair a zero-byte send with a receive."""
        with self._lock:
            comm = self._comm
        if self.abort_requested:
            self.abort()
            raise RuntimeError("NCCL transfer: the exchange failed on the peer's side; the "
                               "communicator was aborted")
        if not comm:
            raise RuntimeError(f"NCCL transfer: the communicator was "
                               f"{'aborted' if self.aborted else 'destroyed'}")
        lib, handle, s = self._nccl.lib, ctypes.c_void_p(comm), ctypes.c_void_p(stream)
        self._nccl.group_start()
        try:
            for ptr, nbytes in ((p, n) for p, n in sends if n):
                self._nccl.check("ncclSend", lib.ncclSend(ctypes.c_void_p(ptr), int(nbytes),
                                                          NCCL_UINT8, int(peer), handle, s))
            for ptr, nbytes in ((p, n) for p, n in recvs if n):
                self._nccl.check("ncclRecv", lib.ncclRecv(ctypes.c_void_p(ptr), int(nbytes),
                                                          NCCL_UINT8, int(peer), handle, s))
        finally:
            with self._lock:
                self._blocked = True
                late = self.abort_requested  # asked for while the group was being built
            if late:
                threading.Thread(target=self._abort_if_still_blocked, daemon=True,
                                 name="muond-nccl-abort").start()
            try:
                code = lib.ncclGroupEnd()  # always: the group must be closed, even after an error
            finally:
                with self._lock:
                    self._blocked = False
        if self.abort_requested:
            self.abort()
            raise RuntimeError("NCCL transfer: the exchange failed on the peer's side; the "
                               "communicator was aborted")
        self._nccl.check("ncclGroupEnd", code)

    def _abort_if_still_blocked(self, wait: float = 0.05) -> None:
        """Aborts once the owner has been inside ``ncclGroupEnd`` for ``wait`` seconds (it
        entered it after an abort was requested, so only an abort ends a wait for the peer)."""
        time.sleep(wait)
        with self._lock:
            if not self._blocked or not self._comm:
                return
            comm, self._comm = self._comm, None
            self.aborted = True
        self._nccl.lib.ncclCommAbort(ctypes.c_void_p(comm))

    def request_abort(self) -> None:
        """From any thread: aborts soon if the owner is blocked in ``ncclGroupEnd`` (waiting for
        the peer), else at the owner's next ``transfer`` or its end."""
        with self._lock:
            self.abort_requested = True
            blocked = self._blocked and bool(self._comm)
        if blocked:
            threading.Thread(target=self._abort_if_still_blocked, daemon=True,
                             name="muond-nccl-abort").start()

    def abort(self) -> None:
        """Aborts the communicator: transfers in flight end (with an error) and it is freed.
        Idempotent."""
        with self._lock:
            comm, self._comm = self._comm, None
            if not comm:
                return
            self.aborted = True
        self._nccl.lib.ncclCommAbort(ctypes.c_void_p(comm))
