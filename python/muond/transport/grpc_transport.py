"""``GrpcTransport``: a session's steps as chunks on the ``Step`` stream; works with any daemon.

The gradients go as framed chunks (``framing.py``) in the wire dtype, after a header announcing
their number (so that the daemon tells a stream cut short from a whole one); the answer's chunks are
decoded straight into the parameter tensors (``wire.ChunkAssembler`` with ``into=``).
A step whose gradients and answer are small (``WHOLE_STEP_BYTES`` each) sends the same messages in
one ``StepWhole`` call instead, when the daemon offers it (``ServerInfo.whole_steps``).

A streamed try (``GrpcStreamedTry``) opens the stream with a header marked ``streamed`` at the first
gradient and sends each gradient's chunks while backward goes on; the count and the step's options
follow in a closing ``StepEnd`` (docs/protocol.md, "Streamed steps"). Its ``answer()`` returns as
soon as the ``StepResult`` is in; each parameter is reported to the try's ``Landing`` once its last
chunk is written, while the rest are still arriving (``RemoteOptimizer(land_in_forward=)``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import grpc
import torch

from .. import wire
from .._stubs import pb
from ..errors import MuondError
from . import framing
from .base import Facts, Grads, StepTransport, TransportContext
from .streamed import Landing, StreamedTry, check_identity, end_of, identity_of


# A step whose gradients and answer each carry at most this much payload goes in one StepWhole call
# rather than on a Step stream: a stream costs a fixed ~1 ms more (the client's request and channel
# threads, the daemon's reads and writes one message at a time), which only larger steps amortize.
WHOLE_STEP_BYTES = 1 << 20
# What a whole step's request and answer are taken to carry beyond their payload, against the daemon's
# message limit (ServerInfo.max_message_bytes): per chunk, its TensorChunk's fields and framing
# without the name (offset, dtype, a shape of up to 4 dimensions, the data's tag and length, the
# message's and the list entry's tags and lengths), per parameter an answer_order entry or a sum of
# squares, and the header or the StepResult with its groups' telemetry.
WHOLE_STEP_CHUNK_OVERHEAD = 96
WHOLE_STEP_PARAMETER_OVERHEAD = 16
WHOLE_STEP_FIXED_OVERHEAD = 64 << 10


def _overhead(tensors: Iterable[Tuple[str, int]]) -> int:
    """What a whole step's request or answer carries beyond the payload of ``tensors`` (name,
    chunks), by the allowances above."""
    return WHOLE_STEP_FIXED_OVERHEAD + sum(
        (len(name.encode()) + WHOLE_STEP_CHUNK_OVERHEAD) * chunks + WHOLE_STEP_PARAMETER_OVERHEAD
        for name, chunks in tensors)


class GrpcTransport(StepTransport):
    """The gRPC stream transport of one session."""

    name = "grpc"

    @classmethod
    def reasons_against(cls, facts: Facts, *, auto: bool) -> Iterator[str]:
        return iter(())  # every daemon serves Step; nothing to ask it

    def __init__(self, ctx: TransportContext, facts: Facts):
        super().__init__(ctx, facts)
        self._offer: Optional[pb.ServerInfo] = None  # the daemon's, until a step finds it gone
        self._index = {name: i for i, name in enumerate(ctx.names)}

    def answer_order(self) -> List[int]:
        """``StepHeader.answer_order``: the indices, in this session, of ``ctx.answer_first()``'s
        parameters that it holds. A daemon that predates the field answers in its own order."""
        index = self._index
        return [index[name] for name in self.ctx.answer_first() if name in index]

    def step(self, header: pb.StepHeader, grads: Grads,
             out: Optional[Dict[str, torch.Tensor]] = None
             ) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        ctx = self.ctx
        pack = self.offer().packed_chunks
        header.num_chunks, messages = framing.step_messages(grads, ctx.wire_dtype, ctx.chunk_bytes, pack)
        header.packed_answer = pack
        header.answer_order[:] = self.answer_order()
        into = wire.ChunkAssembler(ctx.sizes, ctx.return_dtype, into=out or ctx.by_name)
        run = ctx.conn.step_whole if self._whole(grads) else ctx.conn.step
        try:
            return run(header, messages, into), {}  # written in place
        except MuondError as err:
            if err.code == grpc.StatusCode.UNAVAILABLE:
                self._offer = None  # a restarted daemon may offer something else
            raise

    def _whole(self, grads: Grads) -> bool:
        """Whether the step goes in one call (StepWhole): the daemon offers it, the gradients and
        the answer are each at most ``WHOLE_STEP_BYTES`` of payload, and each fits the daemon's
        message limit with the overheads above (a daemon with a small ``--max-chunk-bytes`` has a
        limit of little more than 1 MiB, which a stream's messages keep one by one)."""
        offer = self.offer()
        if not offer.whole_steps:
            return False
        ctx = self.ctx
        sent = sum(wire.payload_bytes(g.numel(), ctx.wire_dtype) for _, g in grads)
        answer_payload, answer_size = self._answer_bytes
        if max(sent, answer_payload) > WHOLE_STEP_BYTES:
            return False
        sent += _overhead((name, wire.chunk_count(g.numel(), ctx.wire_dtype, ctx.chunk_bytes)) for name, g in grads)
        return max(sent, answer_size) <= offer.max_message_bytes

    @functools.cached_property
    def _answer_bytes(self) -> Tuple[int, int]:
        """(payload, payload and overheads) of a whole step's answer: every parameter of the
        session in the answers' dtype, the same at every step."""
        ctx = self.ctx
        payload = sum(ctx.sizes.values()) * wire.itemsize(ctx.return_dtype)
        return payload, payload + _overhead((name, wire.chunk_count(n, ctx.return_dtype, ctx.chunk_bytes))
                                            for name, n in ctx.sizes.items())

    def offer(self) -> pb.ServerInfo:
        """The daemon's ServerInfo (packed chunks, streamed steps), asked once, and again after a
        step found the daemon gone; one try, as part of the step's."""
        if self._offer is None:
            self._offer = self.ctx.conn.server_info(retried=False)
        return self._offer

    def begin_streamed(self, header: pb.StepHeader,
                       out: Optional[Dict[str, torch.Tensor]] = None) -> StreamedTry:
        if not self.offer().streamed_steps:
            return super().begin_streamed(header, out)  # an older daemon: gathered, sent at the end
        return GrpcStreamedTry(self, header, out)


class _LandingAssembler(wire.ChunkAssembler):
    """A ``ChunkAssembler`` writing into ``into`` that reports each tensor to ``landing`` once its
    last chunk is written where it belongs (a tensor that is not contiguous is copied in then,
    not at ``finish``), so that nothing is written to a tensor after it arrived."""

    def __init__(self, sizes: Dict[str, int], dtype: str, into: Dict[str, torch.Tensor],
                 landing: Landing):
        super().__init__(sizes, dtype, into=into)
        self._landing = landing

    def add(self, chunk) -> None:
        super().add(chunk)
        meta = chunk.meta if isinstance(chunk, wire.FramedChunk) else chunk
        key = (meta.name, meta.slot)
        if self._filled[key] != self._size(key):
            return
        flat, target = self._buffers[key], self._into.get(meta.name)
        if target is not None and not meta.slot and flat.data_ptr() != target.data_ptr():
            with torch.no_grad():
                target.copy_(flat.view(target.shape))
        self._landing.arrived(meta.name)

    def add_packed(self, chunks) -> None:
        for chunk in chunks:  # each reported as it lands
            self.add(chunk)

    def finish(self) -> None:
        self.tensors()  # only the check: every tensor was written in as it completed


class _Abandoned(Exception):
    """Raised into the request stream to cancel a streamed try's call."""


_END = object()


class GrpcStreamedTry(StreamedTry):
    """A streamed try on the ``Step`` stream. The call runs on a worker thread from the first
    gradient on; gRPC pulls each gradient's chunks from a queue as they come (the chunk bytes are
    read from the tensor there, which is why a gradient must stay unchanged until the input
    ended)."""

    def __init__(self, transport: GrpcTransport, header: pb.StepHeader,
                 out: Optional[Dict[str, torch.Tensor]]):
        ctx = transport.ctx
        self._ctx = ctx
        self._begun = identity_of(header)
        self._begun.streamed = True
        self._begun.packed_answer = transport.offer().packed_chunks
        self._begun.answer_order[:] = transport.answer_order()
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._input_ended = threading.Event()  # set once the producer let go of every gradient
        self._chunks = 0
        self._ended = False
        self._landing = Landing(ctx.names)
        self._result: Optional[pb.StepResult] = None
        self._answered = threading.Event()  # set once the result is in, or the call ended
        into = _LandingAssembler(ctx.sizes, ctx.return_dtype, out or ctx.by_name, self._landing)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="muond-stream")
        self._call = self._worker.submit(ctx.conn.step, self._begun, self._requests(), into,
                                         self._on_result)
        # A call that ends early (refused, broken) reads no more gradients either.
        self._call.add_done_callback(self._call_ended)

    def _on_result(self, result: pb.StepResult) -> None:
        self._result = result
        self._answered.set()

    def _call_ended(self, call: concurrent.futures.Future) -> None:
        self._input_ended.set()
        self._landing.end(None if call.cancelled() else call.exception())
        self._answered.set()

    def _requests(self) -> Iterator[object]:
        try:
            while True:
                item = self._queue.get()
                if item is _END:
                    header = self._queue.get()
                    yield pb.StepRequest(end=end_of(header, self._chunks))
                    return
                if item is None:
                    raise _Abandoned("the streamed step was abandoned")
                name, grad = item
                for chunk in framing.frame_chunks(name, grad, self._ctx.wire_dtype,
                                                  max_chunk_bytes=self._ctx.chunk_bytes):
                    self._chunks += 1
                    yield chunk
        finally:
            self._input_ended.set()

    def add(self, name: str, grad: torch.Tensor) -> None:
        if self._ended:
            raise RuntimeError(f"gradient '{name}' added to a streamed step whose input ended")
        self._queue.put((name, grad))

    def send_rest(self, header: pb.StepHeader, more: Grads) -> None:
        check_identity(self._begun, header)
        for name, grad in more:
            self.add(name, grad)
        self._ended = True
        self._queue.put(_END)
        self._queue.put(header)
        self._input_ended.wait()  # no gradient is read after this

    def result(self) -> Tuple[pb.StepResult, Dict[str, torch.Tensor]]:
        try:
            return self._call.result(), {}  # written in place
        finally:
            self._worker.shutdown(wait=False)

    def answer(self) -> Tuple[pb.StepResult, Dict[str, torch.Tensor], Landing]:
        """Returns once the ``StepResult`` is in; the parameters go on landing on the worker (an
        ordinary thread: interpreter exit waits for it). A call that failed before its result
        raises here, as ``result()`` would; one that fails after it fails the landing."""
        self._answered.wait()
        if self._result is None:
            result, values = self.result()  # ended without a result: raises its failure
            return result, values, Landing.landed()
        self._worker.shutdown(wait=False)
        return self._result, {}, self._landing

    def cancel(self) -> None:
        self._ended = True
        self._queue.put(None)
        try:
            self._call.result()
        except BaseException:  # noqa: BLE001 - the cancelled call's failure is the expected end
            pass
        finally:
            self._worker.shutdown(wait=False)
