"""``ZeroCopyArea``: a session's parameters and gradients living in its shared-memory region
(``RemoteOptimizer(shm_zero_copy=True)``, docs/transports.md, "Zero copy").

The region holds every parameter (fp32, in the session's order) and then every gradient. When the
region is registered the area *adopts* the model's tensors: each parameter's values are copied in
once and its ``.data`` becomes the region's view, and likewise each ``.grad`` that exists. From then
on backward accumulates straight into the region (as long as ``.grad`` is zeroed in place, not set
to None) and the daemon writes the updated parameters straight into the model: a step copies
nothing on this side. A gradient found elsewhere at a step (``zero_grad(set_to_none=True)`` made
backward allocate a new one) is copied in and ``.grad`` pointed at the region again.

A region the daemon lost (it restarted) is replaced: a new one adopts the tensors from the old, whose
memory stays mapped here until no tensor views it. Not thread-safe; one owner, the shm transport.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .._stubs import pb
from . import host_copy
from .base import Grads, TransportContext
from .slots import SLOT_BYTES, View, encoded_entries, keep, shared_request


class ZeroCopyArea:
    """The layout of one session's zero-copy region, and the tensors it has adopted."""

    def __init__(self, ctx: TransportContext):
        self._ctx = ctx
        total = sum(int(ctx.sizes[name]) for name in ctx.names)
        self.param_offsets: Dict[str, int] = {}
        self.grad_offsets: Dict[str, int] = {}
        offset = 0
        for name in ctx.names:
            self.param_offsets[name] = offset
            self.grad_offsets[name] = SLOT_BYTES * total + offset
            offset += SLOT_BYTES * int(ctx.sizes[name])
        self.nbytes = 2 * SLOT_BYTES * total
        self._view: Optional[View] = None
        self._grad_ptrs: Dict[str, int] = {}  # where each gradient's slots begin, once adopted
        # The requests' tensor entries (encoded, no header) by (region, gradients named, their
        # sizes): the same from one step to the next.
        self._templates: Dict[tuple, bytes] = {}

    def _param_view(self, name: str) -> torch.Tensor:
        return self._view(self.param_offsets[name], self._ctx.sizes[name], torch.float32)

    def _grad_view(self, name: str) -> torch.Tensor:
        return self._view(self.grad_offsets[name], self._ctx.sizes[name], torch.float32)

    @torch.no_grad()
    def adopt(self, view: View) -> None:
        """Moves every parameter, and every gradient there is, into the region ``view`` sees."""
        self._view = view
        copies = []
        for name in self._ctx.names:
            param = self._ctx.by_name[name]
            copies.append((self._param_view(name), param.detach().reshape(-1)))
            if param.grad is not None:
                copies.append((self._grad_view(name), param.grad.detach().reshape(-1)))
        host_copy.copy_all(copies)
        self._grad_ptrs = {name: self._grad_view(name).data_ptr() for name in self._ctx.names}
        self._templates.clear()
        for name in self._ctx.names:
            param = self._ctx.by_name[name]
            param.data = self._param_view(name).view(param.shape)
            if param.grad is not None:
                param.grad = self._grad_view(name).view(param.shape)

    @torch.no_grad()
    def request(self, header: pb.StepHeader, region: str, grads: Grads) -> bytes:
        """The request of one try (encoded): each gradient referenced where it lies in the region (copied
        in first, and its ``.grad`` pointed there, when backward put it elsewhere), and every
        parameter's slots as where its value goes, in place in the model."""
        moved = [(name, g) for name, g in grads if g.data_ptr() != self._grad_ptrs[name]]
        host_copy.copy_all([(self._grad_view(name), g.detach().reshape(-1)) for name, g in moved])
        for name, g in moved:
            param = self._ctx.by_name[name]
            if param.grad is g:
                param.grad = self._grad_view(name).view(param.shape)
        return shared_request(header, self._template(region, grads))

    def _template(self, region: str, grads: Grads) -> bytes:
        names = tuple(name for name, _ in grads)
        numels = tuple(g.numel() for _, g in grads)
        key = (region, names, numels)
        template = self._templates.get(key)
        if template is None:  # the usual step needs one; steps leaving gradients out, a few more
            sizes = self._ctx.sizes
            template = keep(self._templates, key, encoded_entries(
                region, [(name, self.grad_offsets[name], numel) for name, numel in zip(names, numels)], "fp32",
                [(name, self.param_offsets[name], sizes[name]) for name in self._ctx.names], "fp32"))
        return template


def check_zero_copy(params: List[Tuple[str, torch.Tensor]], wire_dtype: str, return_dtype: str,
                    transport: str, num_daemons: int, *, overlap: bool, delay: int) -> str:
    """The transport to ask for with ``shm_zero_copy`` ("shm"); ValueError naming it and every
    reason these settings cannot live in a zero-copy region."""
    reasons = []
    if transport not in ("auto", "shm"):
        reasons.append(f"it needs the shm transport, not {transport!r}")
    if num_daemons > 1:
        reasons.append("it needs one daemon, not several endpoints")
    if overlap or delay:
        reasons.append("not with overlap or delay (the daemon writes the model's parameters "
                       "in place while the step runs)")
    if wire_dtype != "fp32" or return_dtype != "fp32":
        reasons.append(f"gradients and parameters travel as fp32 (wire_dtype={wire_dtype!r}, "
                       f"return_dtype={return_dtype!r})")
    for name, p in params:
        if p.device.type != "cpu" or p.dtype != torch.float32:
            reasons.append(f"parameter '{name}' is {p.dtype} on {p.device}, not fp32 on the CPU")
            break
    if reasons:
        raise ValueError("shm_zero_copy: " + "; ".join(reasons))
    return "shm"
