"""``ChunkFitting``: how ``RemoteOptimizer`` keeps its chunks within every daemon's chunk limit
(``--max-chunk-bytes``, ``ServerInfo.max_chunk_bytes``): lowered to the smallest limit when it
connects, and again, with the refused call made anew, when a daemon restarted with a smaller limit
refuses a chunk.

A mixin on the protocol ``OptimizerCore`` (optimizer_core.py): it reads and lowers the optimizer's
``chunk_bytes`` and tells its sessions; no state of its own. Used from the optimizer's thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, List, TypeVar

import grpc

from ._stubs import pb
from .client import Connection
from .errors import CHUNK_TOO_LARGE, MuondError

_log = logging.getLogger("muond")
_T = TypeVar("_T")


if TYPE_CHECKING:  # the members of RemoteOptimizer this mixin uses (optimizer_core.py)
    from .optimizer_core import OptimizerCore as _Core
else:
    _Core = object


class ChunkFitting(_Core):
    """The chunk-size half of ``RemoteOptimizer``'s connection (see the module's docstring)."""

    def _fit_chunks_to(self, conns: List[Connection], infos: List[pb.ServerInfo]) -> bool:
        """Lowers ``chunk_bytes`` to the smallest chunk limit of the daemons
        (``--max-chunk-bytes``, ``ServerInfo.max_chunk_bytes``), which refuse larger chunks;
        returns whether it was lowered."""
        limits = [(info.max_chunk_bytes, conn.endpoint) for conn, info in zip(conns, infos)
                  if 0 < info.max_chunk_bytes < self.chunk_bytes]
        if not limits:
            return False
        limit, endpoint = min(limits)
        _log.info("chunks of %d bytes, not %d: the daemon at %s takes no larger ones",
                  limit, self.chunk_bytes, endpoint)
        self.chunk_bytes = limit
        return True

    def _with_chunks_fitted(self, call: Callable[[], _T]) -> _T:
        """``call()``, made again with smaller chunks whenever a daemon refuses them as larger
        than it takes (CHUNK_TOO_LARGE, or gRPC's own message limit): a daemon restarted with a
        smaller ``--max-chunk-bytes`` since this optimizer asked. The limits are asked again and
        every session sends chunks no larger; the refused call changed nothing, so it is made
        again whole. The chunk size only falls, so this ends; a refusal that asking again does not
        explain is raised."""
        while True:
            try:
                return call()
            except MuondError as err:
                # gRPC's own message limit carries no reason; another reason (CALLER_BUSY) is no size.
                if err.reason != CHUNK_TOO_LARGE and (err.code != grpc.StatusCode.RESOURCE_EXHAUSTED or err.reason):
                    raise
                conns = [session.conn for session in self._sessions]
                if not self._fit_chunks_to(conns, [conn.server_info() for conn in conns]):
                    raise
                for session in self._sessions:
                    session.use_chunk_bytes(self.chunk_bytes)
