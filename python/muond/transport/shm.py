"""The client side of muond's shared-memory transport.

A ``SharedRegion`` is a memfd this process maps and passes to the daemon over the daemon's
Unix-domain socket (``ServerInfo.shm_socket``), on a connection that first presented a grant from
``GrantSharedMemory``; the daemon answers with a one-time ticket that ``RegisterSharedMemory``
claims, by the same caller. The memfd is sealed against shrinking and growing (the daemon
refuses memory it could be made to fault on). The socket stays open as long as the region: when it
closes, because the region was closed or this process exited or crashed, the daemon drops every
region it passed. Nothing is named where another process could find it.

Tensors view the region directly (``torch.frombuffer``): the trainer copies gradients in and the
updated parameters out, one copy each way. Not thread-safe.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
from typing import Any, Callable, Optional

import torch


def local_host_id() -> str:
    """This machine's boot id, to compare with ``ServerInfo.host_id``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _address(socket_address: str) -> str:
    # "@name" is Linux's abstract namespace: a leading NUL byte on the wire.
    return "\0" + socket_address[1:] if socket_address.startswith("@") else socket_address


REACHABLE_SECONDS = 5.0  # how long socket_reachable waits for a connection to be taken


def socket_reachable(socket_address: str) -> bool:
    """Whether the daemon's socket accepts a connection from here (same host, same network
    namespace) within REACHABLE_SECONDS."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(REACHABLE_SECONDS)
            s.connect(_address(socket_address))
        return True
    except OSError:
        return False


class RegionRefused(ConnectionError):
    """The daemon answered a refusal on its socket (a grant or a memfd it will not take), or
    refused to register the region: not a daemon that is away, so trying again will not help."""


def connect(socket_address: str, grant: str, timeout: Optional[float] = None) -> socket.socket:
    """A connection to the daemon's socket that presented ``grant`` (none when ``""``: a daemon
    without ``ServerInfo.shm_grants``). ConnectionError when the socket cannot be reached or does
    not answer within ``timeout`` seconds (the connection's deadline; None: no limit), RegionRefused
    when the daemon refuses the grant."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)  # every wait on this socket: the connect, sends, each answer
        try:
            sock.connect(_address(socket_address))
        except OSError as err:
            raise ConnectionError(f"cannot connect to the daemon's shared-memory socket "
                                  f"'{socket_address}': {err}") from None
        if grant:
            send(sock, lambda: sock.sendall(b"G" + grant.encode("ascii")))
            answer = read_line(sock)
            if answer != "ok":
                raise RegionRefused(f"the daemon refused the shared-memory grant: {answer}")
    except BaseException:
        sock.close()
        raise
    return sock


def send(sock: socket.socket, sending: Callable[[], Any]) -> None:
    """Runs ``sending`` (a send on ``sock``); a socket that cannot take it (closed, or full past
    its timeout) is a ConnectionError, as a daemon that is away."""
    try:
        sending()
    except OSError as err:
        raise ConnectionError(f"the daemon's shared-memory socket did not take a request: "
                              f"{err}") from None


def read_line(sock: socket.socket) -> str:
    """One answer line of the daemon's socket, without its newline."""
    data = b""
    while not data.endswith(b"\n") and len(data) < 4096:
        try:
            piece = sock.recv(4096 - len(data))
        except socket.timeout:
            raise ConnectionError(f"the daemon did not answer on its shared-memory socket within "
                                  f"{sock.gettimeout():g} s") from None
        if not piece:
            raise ConnectionError("the daemon closed its shared-memory socket without an answer")
        data += piece
    return data.decode("utf-8", "replace").rstrip("\n")


class SharedRegion:
    """``nbytes`` of memory shared with the daemon listening on ``socket_address``, passed on a
    connection that presented ``grant`` (``Connection.grant_shared_memory``); ``timeout``: the
    seconds each answer on the socket may take (None: no limit)."""

    def __init__(self, socket_address: str, nbytes: int, grant: str = "",
                 timeout: Optional[float] = None):
        if nbytes <= 0:
            raise ValueError("a shared-memory region has at least one byte")
        self.nbytes = int(nbytes)
        self._map: Optional[mmap.mmap] = None
        self._sock: Optional[socket.socket] = None
        fd = os.memfd_create("muond-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._sock = connect(socket_address, grant, timeout)
            send(self._sock, lambda: socket.send_fds(self._sock, [b"R"], [fd]))
            answer = self._read_line()
        except BaseException:
            self.close()
            raise
        finally:
            os.close(fd)  # the mapping and the daemon keep the memory alive
        words = answer.split(" ", 2)
        if len(words) != 3 or words[0] != "ok" or int(words[2]) != self.nbytes:
            self.close()
            raise RegionRefused(f"the daemon refused the shared-memory region: {answer}")
        self.ticket = words[1]

    def _read_line(self) -> str:
        return read_line(self._sock)

    def tensor(self, offset: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements viewing the region from byte ``offset`` (an empty
        one for none: a rank's empty part of a partitioned parameter)."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=offset)

    def close(self, keep_mapping: bool = False) -> None:
        """Drops the region in the daemon (by closing the socket) and here. Tensors viewing it must
        be gone first, unless ``keep_mapping``: the memory then stays mapped here for as long as a
        tensor made by ``tensor()`` holds it (torch keeps the mapping object alive, though not
        from being unmapped by an explicit close)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if keep_mapping:
            self._map = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # views still alive: the mapping goes with the last of them
                pass
            self._map = None
