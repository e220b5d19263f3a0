"""The Step stream's messages with their tensor payloads kept out of protobuf.

Built the ordinary way, a gradient chunk is copied from the tensor into ``bytes``, into a
``TensorChunk``, into the ``StepRequest`` and into its serialization; an answer chunk is parsed into
a message whose ``data`` is one more copy. Here a chunk to send is a small protobuf prefix joined to
the tensor's own bytes (one copy, straight from the tensor's memory), and an answer chunk's payload
is a view of the received bytes (``wire.FramedChunk``), decoded once, straight into the parameter
(``wire.ChunkAssembler`` with ``into=``).
The bytes on the wire are exactly the protobuf encoding of ``StepRequest`` and ``StepResponse``.

``parse_step_response`` takes the fast path only for the plain encoding of one chunk; any other
message is parsed by protobuf. ``whole_step_request`` and ``whole_step_answers`` carry the same
messages in one ``StepMessages`` and one ``StepAnswers`` (StepWhole). Pure functions.
"""

from __future__ import annotations

import functools
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .._stubs import pb
from .. import quantize, wire
from ..wire import FramedChunk

_CHUNK_TAG = (2 << 3) | 2  # StepRequest.chunk / StepResponse.chunk, length-delimited
_DATA_TAG = (4 << 3) | 2   # TensorChunk.data
_DATA_FIELD = 4
_PACKED_TAG = (4 << 3) | 2         # StepRequest.packed, length-delimited
_PACKED_CHUNKS_TAG = (1 << 3) | 2  # PackedChunks.chunks
_MESSAGES_TAG = (1 << 3) | 2  # StepMessages.messages / StepAnswers.messages (StepWhole)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: memoryview, pos: int) -> Tuple[int, int]:
    """(value, next position); ValueError when the varint runs off the end or past 10 bytes."""
    value = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise ValueError("varint longer than 10 bytes")


def _skip_field(data: memoryview, pos: int, wire_type: int) -> int:
    """Position after a field's value; ValueError for groups or unknown wire types."""
    if wire_type == 0:
        return _read_varint(data, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        length, pos = _read_varint(data, pos)
        return pos + length
    if wire_type == 5:
        return pos + 4
    raise ValueError(f"wire type {wire_type}")


def frame_chunks(name: str, tensor: torch.Tensor, dtype: str,
                 max_chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The serialized ``StepRequest`` of each chunk of one tensor (``wire.chunk_pieces``; the
    payload comes from the tensor's own memory when it is fp32 on the CPU)."""
    for meta, piece in wire.chunk_pieces(name, tensor, dtype, max_chunk_bytes=max_chunk_bytes):
        inner = meta.SerializeToString() + bytes((_DATA_TAG,)) + _varint(len(piece))
        prefix = bytes((_CHUNK_TAG,)) + _varint(len(inner) + len(piece)) + inner
        yield b"".join((prefix, piece))


# A tensor is packed with others when it is at most 1/16 of the chunk size (64 KiB of the default
# 1 MiB), as the daemon packs its answers: smaller messages cost more per byte than the copy.
PACKED_TENSOR_FRACTION = 4


def step_messages(grads: Sequence[Tuple[str, torch.Tensor]], dtype: str, max_chunk_bytes: int,
                  pack: bool) -> Tuple[int, Iterator[bytes]]:
    """(how many, the serialized ``StepRequest`` messages) carrying ``grads``: each tensor's framed
    chunks; with ``pack``, the small tensors gathered into ``PackedChunks`` messages of at most
    ``max_chunk_bytes`` of data instead (docs/protocol.md, "Packed chunks"). The messages are made
    as they are pulled, each from its tensors as they are then."""
    limit = max_chunk_bytes // PACKED_TENSOR_FRACTION
    plan: List[Tuple[bool, List[Tuple[str, torch.Tensor]]]] = []  # (packed?, tensors)
    packing: List[Tuple[str, torch.Tensor]] = []
    packed_bytes = 0
    for name, g in grads:
        nbytes = wire.payload_bytes(g.numel(), dtype)
        if not (pack and 0 < nbytes <= limit):
            plan.append((False, [(name, g)]))
            continue
        if packed_bytes + nbytes > max_chunk_bytes:
            plan.append((True, packing))
            packing, packed_bytes = [], 0
        packing.append((name, g))
        packed_bytes += nbytes
    if packing:
        plan.append((True, packing))
    count = sum(1 if packed else wire.chunk_count(tensors[0][1].numel(), dtype, max_chunk_bytes)
                for packed, tensors in plan)

    def messages() -> Iterator[bytes]:
        for packed, tensors in plan:
            if not packed:
                yield from frame_chunks(*tensors[0], dtype, max_chunk_bytes=max_chunk_bytes)
                continue
            yield _packed_message(tensors, dtype, max_chunk_bytes)
    return count, messages()


def _packed_message(tensors: List[Tuple[str, torch.Tensor]], dtype: str, max_chunk_bytes: int) -> bytes:
    """The encoding of ``StepRequest{packed: {chunks}}`` of whole small tensors, each chunk's
    payload joined from one host copy of them all (``wire.host_bytes_of``), behind the prefix its
    name, shape and size always get (``_packed_chunk_prefix``)."""
    if quantize.is_quantized(dtype):  # each tensor's blocks are its own
        pieces = [piece for name, g in tensors
                  for piece in wire.chunk_pieces(name, g, dtype, max_chunk_bytes=max_chunk_bytes)]
        return _packed_encoding([(_packed_chunk_prefix_of(meta, len(data)), data) for meta, data in pieces])
    data = wire.host_bytes_of([g for _, g in tensors], dtype)
    itemsize = wire.itemsize(dtype)
    chunks = []
    start = 0
    for name, g in tensors:
        size = g.numel() * itemsize
        chunks.append((_packed_chunk_prefix(name, tuple(g.shape), dtype, size), data[start:start + size]))
        start += size
    return _packed_encoding(chunks)


def _packed_encoding(chunks: List[Tuple[bytes, memoryview]]) -> bytes:
    body = sum(len(prefix) + len(piece) for prefix, piece in chunks)
    return b"".join([bytes((_PACKED_TAG,)), _varint(body), *(part for chunk in chunks for part in chunk)])


@functools.lru_cache(maxsize=4096)
def _packed_chunk_prefix(name: str, shape: Tuple[int, ...], dtype: str, size: int) -> bytes:
    """What precedes a whole tensor's payload of ``size`` bytes in a ``PackedChunks``: the entry's
    tag and length, then its ``TensorChunk`` up to the data's tag and length. The same every step
    for the same tensor, so made once."""
    meta = pb.TensorChunk(name=name, offset=0, dtype=wire.dtype_enum(dtype))
    if wire.CHUNK_HAS_SHAPE:
        meta.shape.extend(shape)
    return _packed_chunk_prefix_of(meta, size)


def _packed_chunk_prefix_of(meta: pb.TensorChunk, size: int) -> bytes:
    inner = meta.SerializeToString() + bytes((_DATA_TAG,)) + _varint(size)
    return bytes((_PACKED_CHUNKS_TAG,)) + _varint(len(inner) + size) + inner


def serialize_step_request(message: Union[bytes, pb.StepRequest]) -> bytes:
    """The request serializer of the Step stream: framed chunks pass through as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def parse_step_response(data: Union[bytes, memoryview]) -> Union[pb.StepResponse, FramedChunk]:
    """The response deserializer of the Step stream (and of each StepWhole answer message)."""
    framed = _parse_chunk(memoryview(data))
    return framed if framed is not None else pb.StepResponse.FromString(bytes(data))


def whole_step_request(messages: Iterable[Union[bytes, pb.StepRequest]]) -> bytes:
    """The encoding of ``StepMessages{messages}`` (StepWhole's request): each message as the Step
    stream would send it (``serialize_step_request``), framed as one entry of the repeated field."""
    parts: List[bytes] = []
    for message in messages:
        data = serialize_step_request(message)
        parts += [bytes((_MESSAGES_TAG,)), _varint(len(data)), data]
    return b"".join(parts)


def whole_step_answers(data: bytes) -> Iterator[Union[pb.StepResponse, FramedChunk]]:
    """The messages of a ``StepAnswers`` encoding (StepWhole's answer), each parsed as the Step
    stream's (``parse_step_response``; a chunk's payload stays a view of ``data``). ValueError for
    anything but entries of its repeated field."""
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        tag, pos = _read_varint(view, pos)
        if tag != _MESSAGES_TAG:
            raise ValueError(f"field {tag >> 3} of wire type {tag & 7} at byte {pos}")
        length, pos = _read_varint(view, pos)
        if pos + length > len(view):
            raise ValueError(f"an entry of {length} bytes at byte {pos} runs past the end")
        yield parse_step_response(view[pos:pos + length])
        pos += length


def _parse_chunk(view: memoryview) -> Optional[FramedChunk]:
    try:
        if len(view) < 2 or view[0] != _CHUNK_TAG:
            return None
        length, pos = _read_varint(view, 1)
        if pos + length != len(view):
            return None
        meta = bytearray()
        payload = None
        while pos < len(view):
            tag, after_tag = _read_varint(view, pos)
            if tag >> 3 == _DATA_FIELD and tag & 7 == 2:
                size, start = _read_varint(view, after_tag)
                if start + size > len(view):
                    return None
                payload = view[start:start + size]  # protobuf keeps the last value
                pos = start + size
                continue
            end = _skip_field(view, after_tag, tag & 7)
            if end > len(view):
                return None
            meta += view[pos:end]
            pos = end
        chunk = pb.TensorChunk.FromString(bytes(meta))
    except Exception:  # noqa: BLE001 - ValueError or protobuf's DecodeError: protobuf's to refuse
        return None
    return FramedChunk(chunk, payload if payload is not None else memoryview(b""))
