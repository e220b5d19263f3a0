"""The Step stream's messages with their tensor payloads kept out of protobuf.

Built the ordinary way, a gradient chunk is copied from the tensor into ``bytes``, into a
``TensorChunk``, into the ``StepRequest`` and into its serialization; an answer chunk is parsed into
a message whose ``data`` is one more copy. Here a chunk to send is a small protobuf prefix joined to
the tensor's own bytes (one copy, straight from the tensor's memory), and an answer chunk's payload
is a view of the received bytes, decoded once, straight into the parameter (``ParameterWriter``).
The bytes on the wire are exactly the protobuf encoding of ``StepRequest`` and ``StepResponse``.

``parse_step_response`` takes the fast path only for the plain encoding of one chunk; any other
message is parsed by protobuf. Pure functions plus ``ParameterWriter``, which is not thread-safe:
use one per call.
"""

from __future__ import annotations

import warnings
from typing import Dict, Iterator, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch

from ._stubs import pb
from . import wire

_CHUNK_TAG = (2 << 3) | 2  # StepRequest.chunk / StepResponse.chunk, length-delimited
_DATA_TAG = (4 << 3) | 2   # TensorChunk.data
_DATA_FIELD = 4


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
    """The serialized ``StepRequest`` of each chunk of one tensor (the first carries its shape);
    an empty tensor is one chunk. As many chunks as ``wire.chunk_count`` says."""
    data = wire.host_bytes(tensor, dtype)  # the tensor's own memory when it is fp32 on the CPU
    itemsize = wire.itemsize(dtype)
    per_chunk = max(1, max_chunk_bytes // itemsize) * itemsize
    enum = wire.dtype_enum(dtype)
    start = 0
    while True:
        piece = data[start:start + per_chunk]
        meta = pb.TensorChunk(name=name, offset=start // itemsize, dtype=enum)
        if start == 0 and wire.CHUNK_HAS_SHAPE:
            meta.shape.extend(tensor.shape)
        inner = meta.SerializeToString() + bytes((_DATA_TAG,)) + _varint(len(piece))
        prefix = bytes((_CHUNK_TAG,)) + _varint(len(inner) + len(piece)) + inner
        yield b"".join((prefix, piece))
        start += per_chunk
        if start >= len(data):
            return


def serialize_step_request(message: Union[bytes, pb.StepRequest]) -> bytes:
    """The request serializer of the Step stream: framed chunks pass through as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


class FramedChunk(NamedTuple):
    """An answer chunk: every field but ``data`` in ``meta``; the payload as a view."""
    meta: pb.TensorChunk
    payload: memoryview


def parse_step_response(data: bytes) -> Union[pb.StepResponse, FramedChunk]:
    """The response deserializer of the Step stream."""
    framed = _parse_chunk(memoryview(data))
    return framed if framed is not None else pb.StepResponse.FromString(data)


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
    except ValueError:
        return None
    except Exception:  # noqa: BLE001 - protobuf's DecodeError: leave the message to protobuf
        return None
    return FramedChunk(chunk, payload if payload is not None else memoryview(b""))


_NUMPY = {"fp32": "<f4", "bf16": "<i2", "fp16": "<f2"}


def _payload_tensor(payload: memoryview, dtype: str) -> torch.Tensor:
    """The payload's elements as a tensor viewing the received bytes (read-only: only read)."""
    array = np.frombuffer(payload, dtype=_NUMPY[dtype])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": the tensor is only read
        values = torch.from_numpy(array)
    return values.view(torch.bfloat16) if dtype == "bf16" else values


class ParameterWriter:
    """Decodes the answer chunks of a step straight into the parameters (``copy_`` from a view of
    the received bytes, converting the dtype on the way; a CUDA parameter receives each chunk
    from host memory). A parameter that is not contiguous goes through an fp32 host buffer and is
    copied in by ``finish()``.

    Chunks are checked as ``wire.ChunkAssembler`` checks them (known name, in order, complete).
    Should the stream break after some chunks, those parameters hold the daemon's answer already
    and the others not yet; a retry of the step (a replay) writes every one of them again.
    """

    def __init__(self, params: Dict[str, torch.Tensor], default_dtype: str = "fp32"):
        self._params = params
        self._default = default_dtype
        self._flat: Dict[str, torch.Tensor] = {}
        self._filled: Dict[str, int] = {}

    def _destination(self, name: str) -> torch.Tensor:
        flat = self._flat.get(name)
        if flat is None:
            param = self._params[name]
            if param.is_contiguous():
                flat = param.detach().view(-1)
            else:
                flat = torch.empty(param.numel(), dtype=torch.float32)
            self._flat[name] = flat
            self._filled[name] = 0
        return flat

    def add(self, chunk: Union[pb.TensorChunk, FramedChunk]) -> None:
        meta, payload = (chunk.meta, chunk.payload) if isinstance(chunk, FramedChunk) \
            else (chunk, memoryview(chunk.data))
        if meta.name not in self._params or meta.slot:
            raise ValueError(f"the daemon sent a chunk of unknown tensor '{meta.name}'")
        flat = self._destination(meta.name)
        if meta.offset != self._filled[meta.name]:
            raise ValueError(f"chunk of '{meta.name}' at offset {meta.offset}, expected "
                             f"{self._filled[meta.name]}")
        dtype = wire.dtype_from_enum(meta.dtype, self._default)
        if len(payload) % wire.itemsize(dtype):
            raise ValueError(f"chunk of '{meta.name}' is not a whole number of {dtype} elements")
        count = len(payload) // wire.itemsize(dtype)
        if meta.offset + count > flat.numel():
            raise ValueError(f"chunk of '{meta.name}' at offset {meta.offset} overruns its "
                             f"{flat.numel()} elements")
        if count:
            with torch.no_grad():
                flat[meta.offset:meta.offset + count].copy_(_payload_tensor(payload, dtype))
        self._filled[meta.name] += count

    def finish(self) -> None:
        """Checks that every parameter that arrived is complete and copies in the buffered ones."""
        for name, filled in self._filled.items():
            param = self._params[name]
            if filled != param.numel():
                raise ValueError(f"tensor '{name}' arrived with {filled} of {param.numel()} "
                                 "elements")
            flat = self._flat[name]
            if flat.data_ptr() != param.data_ptr() or flat.device != param.device:
                with torch.no_grad():
                    param.copy_(flat.view(param.shape))
