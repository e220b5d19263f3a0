"""``GrpcTransport``: a session's steps as chunks on the ``Step`` stream; works with any daemon.

The gradients go as framed chunks (``framing.py``) in the wire dtype, after a header announcing
their number (so that the daemon tells a stream cut short from a whole one); the answer's chunks are
decoded straight into the parameter tensors (``wire.ChunkAssembler`` with ``into=``).
"""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

import torch

from .. import wire
from .._stubs import pb
from . import framing
from .base import Facts, Grads, StepTransport


class GrpcTransport(StepTransport):
    """The gRPC stream transport of one session."""

    name = "grpc"

    @classmethod
    def reasons_against(cls, facts: Facts, *, auto: bool) -> Iterator[str]:
        return iter(())  # every daemon serves Step; nothing to ask it

    def step(self, header: pb.StepHeader, grads: Grads
             ) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        ctx = self.ctx
        header.num_chunks = sum(wire.chunk_count(g.numel(), ctx.wire_dtype, ctx.chunk_bytes)
                                for _, g in grads)
        into = wire.ChunkAssembler(ctx.sizes, ctx.return_dtype, into=ctx.by_name)
        return ctx.conn.step(header, self._chunks(grads), into), {}  # written in place

    def _chunks(self, grads: Grads) -> Iterator[bytes]:
        for name, g in grads:
            yield from framing.frame_chunks(name, g, self.ctx.wire_dtype,
                                            max_chunk_bytes=self.ctx.chunk_bytes)
