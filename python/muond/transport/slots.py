"""The slot layout that the shared-memory and CUDA IPC transports share.

Both register one flat block of memory per session (a memfd region, a device buffer) with a 4-byte
slot per element of every parameter, in the session's order: a try writes each gradient into its
slots (in the wire dtype) and references them in a ``StepSharedRequest``, with every parameter's
slots as where its value goes (in the return dtype); the daemon writes the parameters there, over
the gradients. A daemon that lost the block (it restarted) has the transport register it again.
A streamed try (``SlotStreamedTry``) writes each gradient into its slots as backward produces it.

``SlotRequests`` (one per transport, used from the thread stepping its session) keeps what does not
change from one step to the next: the request's tensor references, encoded, and the views of the
slots, for the last few (block, set of gradients) it saw, so that a step costs its copies, one small
header's encoding and one call, not two protobuf entries and two tensor views per parameter. Gradients whose slots lie end to end
(fp32 on the wire, in the session's order) go in with one ``torch.cat`` when they are small
enough that the threaded copy would not split them, or on a CUDA device (one kernel).
"""

from __future__ import annotations

import contextlib
from typing import AbstractSet, Any, Callable, Dict, Iterator, NamedTuple, Optional, Protocol, Sequence, Tuple

import grpc
import torch

from .. import wire
from .._stubs import pb
from ..errors import REGION_NOT_FOUND, MuondError
from . import host_copy
from .base import Grads, TransportContext
from .streamed import StreamedTry, check_identity, identity_of


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


class SlotTransport(Protocol):
    """What a slot transport (ShmTransport, CudaIpcTransport) gives its streamed tries."""

    ctx: TransportContext
    offsets: Dict[str, int]
    requests: "SlotRequests"

    def ready(self) -> Tuple[str, View]:
        """(the block's registered name, its view), registering it first when needed."""

    def send(self, request: bytes) -> pb.StepResult:
        """Runs one step call over the block (``request``: a StepSharedRequest's encoding)."""


def gradient_copy(ctx: TransportContext, offsets: Dict[str, int], view: View, name: str,
                  grad: torch.Tensor) -> host_copy.Pair:
    """(its slots, the gradient): the copy that writes one gradient into its slots, in the wire
    dtype."""
    slots = view(offsets[name], grad.numel(), wire.torch_dtype(ctx.wire_dtype))
    return slots, grad.detach().reshape(-1)


def write_gradient(ctx: TransportContext, offsets: Dict[str, int], view: View, name: str,
                   grad: torch.Tensor) -> None:
    """Writes one gradient into its slots, in the wire dtype."""
    host_copy.copy_all([gradient_copy(ctx, offsets, view, name, grad)])


Entry = Tuple[str, int, int]  # (tensor name, byte offset in the block, elements)


def encoded_entries(region: str, gradients: Sequence[Entry], wire_dtype: str, parameters: Sequence[Entry],
                    return_dtype: str) -> bytes:
    """The encoding of a StepSharedRequest without its header: each gradient's and each
    parameter's ``SharedTensor`` in the block ``region``, in the wire and the return dtype."""
    request = pb.StepSharedRequest()
    for entries, dtype, field in ((gradients, wire_dtype, request.gradients),
                                  (parameters, return_dtype, request.parameters)):
        itemsize = torch.empty(0, dtype=wire.torch_dtype(dtype)).element_size()
        for name, offset, numel in entries:
            field.add(name=name, region=region, offset=offset, byte_size=numel * itemsize,
                      dtype=wire.dtype_enum(dtype))
    return request.SerializeToString()


def shared_request(header: pb.StepHeader, entries: bytes) -> bytes:
    """The encoding of one try's StepSharedRequest: ``header``, less the fields of chunked steps,
    then ``entries`` (``encoded_entries``'s). Protobuf reads the two as one message."""
    request = pb.StepSharedRequest(header=header)
    request.header.ClearField("return_dtype")
    request.header.ClearField("num_chunks")
    return request.SerializeToString() + entries


def keep(cache: Dict[tuple, Any], key: tuple, value: Any, most: int = 4) -> Any:
    """Puts ``value`` in ``cache`` under ``key``, dropping the oldest entry beyond ``most``."""
    if len(cache) >= most:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


class _Layout(NamedTuple):
    """What one (block, gradients) pair's requests share: the tensor references (encoded), each
    gradient's slots, one view over all of them when they lie end to end, and each parameter's
    slots (where its value comes back)."""
    entries: bytes
    grad_slots: Dict[str, torch.Tensor]
    all_grads: Optional[torch.Tensor]
    views: Dict[str, torch.Tensor]
    owner: object  # what ``view`` views (kept alive, so that its id is not reused)


class SlotRequests:
    """The requests of one slot transport's tries, their unchanging parts kept (module doc)."""

    def __init__(self, ctx: TransportContext, offsets: Dict[str, int]):
        self._ctx = ctx
        self._offsets = offsets
        self._layouts: Dict[tuple, _Layout] = {}

    def forget(self) -> None:
        """Drops every layout (the block was closed or lost: its views must not keep it mapped)."""
        self._layouts.clear()

    def _layout(self, region: str, view: View, names: Tuple[str, ...], numels: Tuple[int, ...]) -> _Layout:
        owner = getattr(view, "__self__", view)  # a bound method is made anew at every access
        key = (region, id(owner), names, numels)
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        ctx, offsets = self._ctx, self._offsets
        wire_dtype, out_dtype = wire.torch_dtype(ctx.wire_dtype), wire.torch_dtype(ctx.return_dtype)
        entries = encoded_entries(region, [(name, offsets[name], numel) for name, numel in zip(names, numels)],
                                    ctx.wire_dtype, [(name, offsets[name], ctx.sizes[name]) for name in ctx.names],
                                    ctx.return_dtype)
        grad_slots = {name: view(offsets[name], numel, wire_dtype) for name, numel in zip(names, numels)}
        views: Dict[str, torch.Tensor] = {}
        for name in ctx.names:
            views[name] = view(offsets[name], ctx.sizes[name], out_dtype)
            param = ctx.by_name.get(name)
            if param is not None and param.numel() == ctx.sizes[name]:
                views[name] = views[name].view(param.shape)  # as copy_in wants it
        grad_itemsize = torch.empty(0, dtype=wire_dtype).element_size()
        end_to_end = grad_itemsize == SLOT_BYTES and len(names) > 1 and all(
            offsets[b] == offsets[a] + SLOT_BYTES * n for a, b, n in zip(names, names[1:], numels))
        all_grads = view(offsets[names[0]], sum(numels), wire_dtype) if end_to_end else None
        # The usual step needs one layout; steps leaving some gradients out, a few more.
        return keep(self._layouts, key, _Layout(entries, grad_slots, all_grads, views, owner))

    @torch.no_grad()
    def request(self, header: pb.StepHeader, region: str, view: View, grads: Grads,
                written: AbstractSet[str] = frozenset()) -> Tuple[bytes, Dict[str, torch.Tensor]]:
        """The request of one try (encoded) over the block ``region`` (seen through ``view``), with every
        gradient written into its slots (before every try: an answer overwrites them) unless it
        is one of ``written`` (a streamed try wrote those as they came), and the views the
        parameters will be in after it."""
        grads = list(grads)
        names = tuple(name for name, _ in grads)
        numels = tuple(g.numel() for _, g in grads)
        layout = self._layout(region, view, names, numels)
        request = shared_request(header, layout.entries)
        to_write = [(name, g.reshape(-1)) for name, g in grads if name not in written]  # (no_grad: untracked)
        together = layout.all_grads
        if (together is not None and not written
                and (together.device.type != "cpu" or together.numel() < host_copy.MIN_PIECE)
                and all(g.dtype == together.dtype and g.device == together.device for _, g in to_write)):
            torch.cat([g for _, g in to_write], out=together)
        else:
            host_copy.copy_all([(layout.grad_slots[name], g) for name, g in to_write])
        return request, dict(layout.views)


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


class SlotStreamedTry(StreamedTry):
    """A streamed try of a slot transport: each gradient is written into its slots as it comes
    (on the caller's thread and stream), and the step call at the end names them all. The
    transport provides ``ready()`` → (block name, view), registering the block when needed (at
    the try's beginning, before any gradient: a refusal then leaves nothing half done),
    ``send(request)`` → StepResult, and ``offsets``."""

    def __init__(self, transport: SlotTransport, header: pb.StepHeader,
                 out: Optional[Dict[str, torch.Tensor]]):
        transport.ready()
        self._transport = transport
        self._begun = identity_of(header)
        self._written: Dict[str, torch.Tensor] = {}
        self._request: Optional[bytes] = None
        self._views: Dict[str, torch.Tensor] = {}

    def add(self, name: str, grad: torch.Tensor) -> None:
        _, view = self._transport.ready()
        write_gradient(self._transport.ctx, self._transport.offsets, view, name, grad)
        self._written[name] = grad

    def send_rest(self, header: pb.StepHeader, more: Grads) -> None:
        check_identity(self._begun, header)
        region, view = self._transport.ready()
        grads = list(self._written.items()) + list(more)
        self._request, self._views = self._transport.requests.request(header, region, view, grads,
                                                                      written=self._written.keys())
        self._written = {}

    def result(self) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        request, self._request = self._request, None
        if request is None:
            raise RuntimeError("a streamed try's result was asked for before its input ended")
        return self._transport.send(request), self._views

    def cancel(self) -> None:
        self._request, self._written = None, {}
