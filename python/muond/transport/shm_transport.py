"""``ShmTransport``: a session's steps through a shared-memory region on the daemon's host.

The session's region (``shm.SharedRegion``, in the ``slots.py`` layout, or with zero copy the
``zero_copy.py`` one, which the model's tensors live in) is created and registered with
``RegisterSharedMemory`` when the transport opens, and again after the daemon lost it; a try is one
``StepShared`` call (docs/transports.md, "Shared memory"). A refusal of the region (its grant, the
memfd, or the registration: ``shm.RegionRefused``) is told apart from a daemon that is away, so
that "auto" can fall back to gRPC over it.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import grpc
import torch

from .._stubs import pb
from ..errors import MuondError
from . import shm
from .base import Facts, Grads, StepTransport, TransportContext
from .slots import SlotRequests, SlotStreamedTry, View, forgotten_when_lost, slot_layout
from .zero_copy import ZeroCopyArea


def _refused(err: MuondError) -> bool:
    """Whether ``err`` refused the region, rather than came from a daemon that is away (which a
    later try gets past)."""
    return err.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class ShmTransport(StepTransport):
    """The shared-memory transport of one session."""

    name = "shm"

    def __init__(self, ctx: TransportContext, facts: Facts):
        super().__init__(ctx, facts)
        self._region: Optional[shm.SharedRegion] = None
        self._region_name = ""
        self.offsets, self._nbytes = slot_layout(ctx.names, ctx.sizes)
        self.requests = SlotRequests(ctx, self.offsets)
        # With zero copy the model's parameters and gradients live in the region (zero_copy.py).
        self._area = ZeroCopyArea(ctx) if ctx.zero_copy else None
        if self._area is not None:
            self._nbytes = self._area.nbytes

    @classmethod
    def reasons_against(cls, facts: Facts, *, auto: bool) -> Iterator[str]:
        # One reason at most: each check needs the one before it to have passed.
        info = facts.daemon
        if not info.shm_socket:
            yield "the daemon offers no shared-memory transport (--shm-socket none)"
        elif not info.host_id or info.host_id != facts.here.host_id:
            yield "the daemon runs on another host"
        elif not shm.socket_reachable(info.shm_socket):
            yield f"the daemon's socket {info.shm_socket} cannot be reached from here"

    def open(self) -> None:
        """Registers the region now: a daemon that refuses it refuses it before the first step."""
        self._register()

    def _register(self) -> None:
        """Creates and registers this session's region. ``shm.RegionRefused`` when the daemon
        refuses it; a daemon that cannot be reached, or does not answer on its socket, is a
        MuondError (UNAVAILABLE for the socket), which a step's tries get past as any other."""
        self.close()
        info = self.ctx.conn.server_info()
        if not info.shm_socket:
            raise shm.RegionRefused("the daemon no longer offers shared memory")
        try:
            grant = self.ctx.conn.grant_shared_memory(info)
            region = shm.SharedRegion(info.shm_socket, max(self._nbytes, 1), grant,
                                      timeout=self.ctx.conn.timeout)
        except shm.RegionRefused:
            raise
        except ConnectionError as err:  # the socket: gone, closed or silent
            raise MuondError(grpc.StatusCode.UNAVAILABLE, str(err),
                             rpc="shared-memory socket") from err
        except MuondError as err:
            if not _refused(err):
                raise
            raise shm.RegionRefused(f"{err.rpc}: {err.details}") from err
        name = f"{self.ctx.session_id}/{region.ticket[:8]}"
        try:
            self.ctx.conn.register_shared_memory(name, region.ticket)
        except MuondError as err:
            region.close()
            if not _refused(err):
                raise
            raise shm.RegionRefused(f"{err.rpc}: {err.details}") from err
        except BaseException:
            region.close()
            raise
        self._region, self._region_name = region, name
        if self._area is not None:
            self._area.adopt(region.tensor)

    def ready(self) -> Tuple[str, View]:
        """(the region's name, its view), registering it first when needed."""
        if self._region is None:
            self._register()
        return self._region_name, self._region.tensor

    def send(self, request: bytes) -> pb.StepResult:
        with forgotten_when_lost(self.close, "region", "StepShared"):
            return self.ctx.conn.step_shared(request)

    def step(self, header: pb.StepHeader, grads: Grads,
             out: Optional[Dict[str, torch.Tensor]] = None
             ) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        """One try over shared memory; the parameters after it, as views of the region (with
        zero copy, none: they were written into the model's own tensors)."""
        region, view = self.ready()
        if self._area is not None:
            return self.send(self._area.request(header, region, grads)), {}
        request, views = self.requests.request(header, region, view, grads)
        return self.send(request), views

    def begin_streamed(self, header: pb.StepHeader,
                       out: Optional[Dict[str, torch.Tensor]] = None) -> SlotStreamedTry:
        return SlotStreamedTry(self, header, out)

    def close(self) -> None:
        self.requests.forget()
        if self._region is not None:
            # With zero copy the model's tensors live in the mapping: it stays until they go.
            self._region.close(keep_mapping=self._area is not None)
            self._region = None
