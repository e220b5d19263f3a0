"""The slot layout that the shared-memory and CUDA IPC transports share.

Both register one flat block of memory per session (a memfd region, a device buffer) with a 4-byte
slot per element of every parameter, in the session's order: a try writes each gradient into its
slots (in the wire dtype) and references them in a ``StepSharedRequest``, with every parameter's
slots as where its value goes (in the return dtype); the daemon writes the parameters there, over
the gradients. A daemon that lost the block (it restarted) has the transport register it again.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, Sequence, Tuple

import grpc
import torch

from .. import wire
from .._stubs import pb
from ..errors import REGION_NOT_FOUND, MuondError
from .base import Grads, TransportContext

SLOT_BYTES = 4  # one slot per element: fp32 at most, in either direction


def slot_layout(names: Sequence[str], sizes: Dict[str, int]) -> Tuple[Dict[str, int], int]:
    """(byte offset of each parameter's slots, total bytes) for ``SLOT_BYTES`` per element, in
    ``names`` order; every offset is a multiple of 4, so fp32, bf16 and fp16 views all align."""
    offsets: Dict[str, int] = {}
    offset = 0
    for name in names:
        offsets[name] = offset
        offset += SLOT_BYTES * int(sizes[name])
    return offsets, offset


View = Callable[[int, int, torch.dtype], torch.Tensor]  # (byte offset, elements, dtype) → tensor


@torch.no_grad()
def slot_request(header: pb.StepHeader, ctx: TransportContext, region: str,
                 offsets: Dict[str, int], view: View, grads: Grads
                 ) -> Tuple[pb.StepSharedRequest, Dict[str, torch.Tensor]]:
    """The request of one try over the block ``region`` (seen through ``view``), with every
    gradient written into its slots (before every try: an answer overwrites them), and the
    views the parameters will be in after it."""
    request = pb.StepSharedRequest(header=header)
    request.header.ClearField("return_dtype")
    request.header.ClearField("num_chunks")
    grad_dtype = wire.torch_dtype(ctx.wire_dtype)
    for name, g in grads:
        slots = view(offsets[name], g.numel(), grad_dtype)
        slots.copy_(g.detach().reshape(-1))
        request.gradients.add(name=name, region=region, offset=offsets[name],
                              byte_size=g.numel() * slots.element_size(),
                              dtype=wire.dtype_enum(ctx.wire_dtype))
    out_dtype = wire.torch_dtype(ctx.return_dtype)
    views: Dict[str, torch.Tensor] = {}
    for name in ctx.names:
        views[name] = view(offsets[name], ctx.sizes[name], out_dtype)
        request.parameters.add(name=name, region=region, offset=offsets[name],
                               byte_size=ctx.sizes[name] * views[name].element_size(),
                               dtype=wire.dtype_enum(ctx.return_dtype))
    return request, views


@contextlib.contextmanager
def forgotten_when_lost(forget: Callable[[], None], what: str, rpc: str) -> Iterator[None]:
    """Around a step call: ``forget()`` the registration when the daemon may have lost it
    (``UNAVAILABLE``: it restarted) or says it has (``REGION_NOT_FOUND``, made ``UNAVAILABLE``
    so that the step is retried, registering ``what`` again)."""
    try:
        yield
    except MuondError as err:
        if err.code == grpc.StatusCode.UNAVAILABLE:
            forget()
        elif err.reason == REGION_NOT_FOUND:
            forget()
            raise MuondError(grpc.StatusCode.UNAVAILABLE,
                             f"the daemon lost this session's {what} (restarted?): {err.details}",
                             rpc) from None
        raise
