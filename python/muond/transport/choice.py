"""Which step transport carries one daemon's steps: the one asked for by name, or for "auto" the
first of ``TRANSPORTS`` that is viable and opens.

The order, best first (docs/transports.md, "Choosing"): ``cuda_ipc`` (parameters on one CUDA
device, a daemon on ``--backend cuda`` on this node: its own GPU or another one), ``nccl`` (NCCL on
both sides and the daemon on another GPU: another host, or this host's other GPU when registering
CUDA IPC memory failed), ``shm`` (the daemon on this host, its socket reachable), ``grpc`` (any
daemon). Each class says why it cannot be had (``StepTransport.viable``); a transport asked for by
name that is not viable is a RuntimeError naming it with every reason.
"""

from __future__ import annotations

import logging
from typing import Dict, Iterator, Tuple, Type

from .base import Facts, StepTransport, TransportContext
from .cuda_ipc_transport import CudaIpcTransport
from .grpc_transport import GrpcTransport
from .nccl_transport import NcclTransport
from .shm_transport import ShmTransport

_log = logging.getLogger("muond")

TRANSPORTS: Tuple[Type[StepTransport], ...] = (CudaIpcTransport, NcclTransport, ShmTransport,
                                                GrpcTransport)
BY_NAME: Dict[str, Type[StepTransport]] = {t.name: t for t in TRANSPORTS}
# What ``transport=`` accepts.
NAMES: Tuple[str, ...] = ("auto",) + tuple(BY_NAME)


def check_name(wanted: str) -> str:
    """``wanted`` when it names a transport or is "auto"; ValueError listing them otherwise."""
    if wanted not in NAMES:
        raise ValueError(f"transport: '{wanted}' is not one of {', '.join(NAMES)}")
    return wanted


def candidates(wanted: str, facts: Facts, endpoint: str) -> Iterator[Type[StepTransport]]:
    """The transports to try for ``wanted``, best first: for "auto" each viable one in
    ``TRANSPORTS`` order (``grpc`` last, always viable), looked at only when the one before it did
    not open; else the one named, or at once a RuntimeError saying why it is not possible with
    ``endpoint``."""
    if wanted == "auto":
        return (t for t in TRANSPORTS if t.viable(facts, auto=True) is None)
    transport = BY_NAME[check_name(wanted)]
    why = transport.viable(facts)
    if why:
        raise RuntimeError(f"transport='{wanted}' is not possible with {endpoint}: {why}")
    return iter((transport,))


def open_transport(wanted: str, ctx: TransportContext, facts: Facts) -> StepTransport:
    """The transport for ``wanted``, opened: the first of ``candidates`` whose ``open`` works.
    A failure to open one asked for by name is raised; "auto" logs it and tries the next."""
    for transport_class in candidates(wanted, facts, ctx.endpoint):
        transport = transport_class(ctx, facts)
        try:
            transport.open()
        except (RuntimeError, OSError) as err:  # MuondError is a RuntimeError
            transport.close()
            if wanted != "auto":
                raise
            _log.warning("session %s on %s: transport %s is not usable (%s); trying the next",
                         ctx.session_id, ctx.endpoint, transport.name, err)
            continue
        return transport
    raise AssertionError("unreachable: grpc is always viable and opens")
