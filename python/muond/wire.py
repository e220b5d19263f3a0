"""Tensors on the wire: dtype names, encoding into ``TensorChunk`` messages and reassembly.

Tensors travel as raw little-endian bytes in chunks of at most ``max_chunk_bytes``; ``offset`` is
the index of a chunk's first element. Encoding converts on the tensor's own device first (so a
CUDA gradient crosses PCIe already in the wire dtype) and then copies to host memory once.
Reassembly decodes every chunk once, straight into one fp32 host buffer per tensor or into the
tensor it updates (a parameter).

A step's gradients may also travel block-quantized (``int8``, ``int4``: ``quantize.py``); those
names are gradient dtypes only (``gradient_dtype_name``), and a session declares them as fp32.

Pure functions plus ``ChunkAssembler``, which is not thread-safe: use one per call.
"""

from __future__ import annotations

import sys
import warnings
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import quantize
from ._stubs import pb

DEFAULT_CHUNK_BYTES = 1 << 20

# Canonical names of the wire dtypes and their aliases (torch dtypes are accepted too).
_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
}
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ENUM = {"fp32": pb.DTYPE_FP32, "bf16": pb.DTYPE_BF16, "fp16": pb.DTYPE_FP16}
_FROM_ENUM = {v: k for k, v in _ENUM.items()}
_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
# TensorChunk.shape (the sender's shape, checked by the daemon) is newer than the first API
# version; stubs generated from an older proto simply don't send it.
CHUNK_HAS_SHAPE = "shape" in pb.TensorChunk.DESCRIPTOR.fields_by_name

DTypeLike = Union[str, torch.dtype]
ChunkKey = Tuple[str, str]  # (tensor name, state slot or "")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical dtype name ("fp32", "bf16" or "fp16")."""
    return _TORCH[name]


def dtype_name(value: DTypeLike) -> str:
    """Canonical wire dtype name ("fp32", "bf16" or "fp16") for a name or torch dtype."""
    if isinstance(value, torch.dtype):
        for name, dt in _TORCH.items():
            if dt == value:
                return name
        raise ValueError(f"unsupported wire dtype {value}; use float32, bfloat16 or float16")
    name = _ALIASES.get(str(value).lower())
    if name is None:
        raise ValueError(f"unsupported wire dtype {value!r}; use 'fp32', 'bf16' or 'fp16'")
    return name


def gradient_dtype_name(value: DTypeLike) -> str:
    """``dtype_name`` for gradients on the wire, which may also be block-quantized: "int8" or
    "int4" (``quantize.py``)."""
    if isinstance(value, str) and value.lower() in quantize.BITS:
        return value.lower()
    try:
        return dtype_name(value)
    except ValueError:
        raise ValueError(f"unsupported gradient wire dtype {value!r}; use 'fp32', 'bf16', 'fp16', "
                         f"'int8' or 'int4'") from None


def dtype_enum(name: str) -> int:
    """The ``muond.v1.DType`` value of a canonical dtype name; a quantized one is declared fp32
    (the daemon decodes its chunks to fp32 values)."""
    return pb.DTYPE_FP32 if quantize.is_quantized(name) else _ENUM[name]


def host_bytes(tensor: torch.Tensor, dtype: str) -> memoryview:
    """The tensor's elements in ``dtype`` as little-endian bytes in host memory (one copy)."""
    x = tensor.detach()
    if x.dtype != _TORCH[dtype]:
        x = x.to(_TORCH[dtype])
    x = x.contiguous().cpu().reshape(-1)
    if dtype != "fp32":
        x = x.view(torch.int16)  # numpy has no bfloat16; the bytes are what matter
    array = x.numpy()
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        array = array.byteswap()
    return memoryview(array).cast("B")


def host_bytes_of(tensors: Sequence[torch.Tensor], dtype: str) -> memoryview:
    """The elements of ``tensors``, one tensor after the other, as ``host_bytes`` gives one's: one
    concatenation (on their device, when they share it and a dtype), one conversion and one copy to
    the host for them all."""
    flats = [t.detach().reshape(-1) for t in tensors]
    if len({(f.device, f.dtype) for f in flats}) > 1:
        flats = [f.to(device="cpu", dtype=_TORCH[dtype]) for f in flats]
    return host_bytes(torch.cat(flats), dtype)


def chunk_pieces(name: str, tensor: torch.Tensor, dtype: str, *, slot: str = "",
                 max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Tuple[pb.TensorChunk, memoryview]]:
    """Yields each chunk of one tensor as (the chunk without its data, its payload as a view of the
    tensor's host bytes); the first carries the shape. An empty tensor is one chunk (fp32 when
    ``dtype`` is quantized: it has no block)."""
    if quantize.is_quantized(dtype):
        if tensor.numel():
            yield from quantize.chunk_pieces(name, tensor, dtype, with_shape=CHUNK_HAS_SHAPE,
                                             max_chunk_bytes=max_chunk_bytes)
            return
        dtype = "fp32"
    data = host_bytes(tensor, dtype)
    itemsize = _ITEMSIZE[dtype]
    per_chunk = max(1, max_chunk_bytes // itemsize) * itemsize
    enum = _ENUM[dtype]
    start = 0
    while True:
        meta = pb.TensorChunk(name=name, offset=start // itemsize, dtype=enum, slot=slot)
        if start == 0 and CHUNK_HAS_SHAPE:
            meta.shape.extend(tensor.shape)
        yield meta, data[start:start + per_chunk]
        start += per_chunk
        if start >= len(data):
            return


def encode(name: str, tensor: torch.Tensor, dtype: str, *, slot: str = "",
           max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """Yields the chunks of one tensor; the first carries its shape. An empty tensor is one chunk."""
    for chunk, piece in chunk_pieces(name, tensor, dtype, slot=slot, max_chunk_bytes=max_chunk_bytes):
        chunk.data = bytes(piece)
        yield chunk


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` on the wire (not for a quantized one: ``payload_bytes``)."""
    return _ITEMSIZE[dtype]


def payload_bytes(numel: int, dtype: str) -> int:
    """Bytes of payload a tensor of ``numel`` elements puts on the wire in ``dtype``."""
    return quantize.payload_bytes(numel, dtype) if quantize.is_quantized(dtype) \
        else numel * _ITEMSIZE[dtype]


def chunk_count(numel: int, dtype: str, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """How many chunks ``encode`` yields for a tensor of ``numel`` elements (at least one)."""
    if quantize.is_quantized(dtype):
        return quantize.chunk_count(numel, dtype, max_chunk_bytes) if numel else 1
    itemsize = _ITEMSIZE[dtype]
    per_chunk = max(1, max_chunk_bytes // itemsize) * itemsize
    return max(1, -(-numel * itemsize // per_chunk))


class FramedChunk(NamedTuple):
    """A received chunk: every field but ``data`` in ``meta``; the payload as a view."""
    meta: pb.TensorChunk
    payload: memoryview


_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_quiet = False  # whether torch has given its one warning about read-only buffers


def payload_tensor(payload: memoryview, dtype: str) -> torch.Tensor:
    """A payload's elements (at least one) as a tensor viewing its bytes, read-only: only ever
    read. The wire is little-endian, as every machine muond builds for."""
    global _quiet
    if _quiet:
        return torch.frombuffer(payload, dtype=_TORCH[dtype])
    # torch warns that the buffer is not writable once per process, then never again: that once
    # is kept quiet here (a catch_warnings around every chunk cost more than decoding a small one).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        values = torch.frombuffer(payload, dtype=_TORCH[dtype])
    _quiet = True
    return values


class ChunkAssembler:
    """Collects the chunks of a response into one fp32 tensor per (name, slot), decoding each
    payload once with ``copy_`` (bf16 and fp16 converted on the way).

    ``sizes`` gives the element count of every tensor name that may arrive, ``slot_sizes`` that
    of an optimizer slot smaller than its parameter (keyed by (name, slot)); ``default_dtype``
    decodes chunks that leave their dtype unset. Tensors named in ``into`` (the parameters a
    step's answer updates) are written straight into that tensor's memory when it is contiguous
    (``copy_``, so autograd's version counter moves; a CUDA tensor receives each chunk from host
    memory), else through a buffer that ``finish()`` copies in; the others go to host tensors of
    the assembler's own (``tensors()``). A chunk may be a ``TensorChunk`` or a ``FramedChunk``.
    """

    def __init__(self, sizes: Dict[str, int], default_dtype: str = "fp32",
                 into: Optional[Dict[str, torch.Tensor]] = None,
                 slot_sizes: Optional[Dict[ChunkKey, int]] = None):
        self._sizes = sizes
        self._slot_sizes = slot_sizes or {}
        self._default = default_dtype
        self._into = into or {}
        self._buffers: Dict[ChunkKey, torch.Tensor] = {}
        self._filled: Dict[ChunkKey, int] = {}

    def _destination(self, key: ChunkKey) -> torch.Tensor:
        flat = self._buffers.get(key)
        if flat is None:
            target = None if key[1] else self._into.get(key[0])
            if target is not None and target.is_contiguous():
                flat = target.detach().view(-1)
            else:
                flat = torch.empty(self._size(key), dtype=torch.float32)
            self._buffers[key] = flat
            self._filled[key] = 0
        return flat

    def add(self, chunk: Union[pb.TensorChunk, FramedChunk]) -> None:
        meta, payload = (chunk.meta, chunk.payload) if isinstance(chunk, FramedChunk) \
            else (chunk, memoryview(chunk.data))
        if meta.name not in self._sizes:
            raise ValueError(f"the daemon sent a chunk of unknown tensor '{meta.name}'")
        key = (meta.name, meta.slot)
        flat = self._destination(key)
        if meta.offset != self._filled[key]:
            raise ValueError(f"chunk of '{meta.name}' at offset {meta.offset}, expected "
                             f"{self._filled[key]}")
        dtype = _FROM_ENUM.get(meta.dtype, self._default)
        if len(payload) % _ITEMSIZE[dtype]:
            raise ValueError(f"chunk of '{meta.name}' is not a whole number of {dtype} elements")
        count = len(payload) // _ITEMSIZE[dtype]
        if meta.offset + count > flat.numel():
            raise ValueError(f"chunk of '{meta.name}' at offset {meta.offset} overruns its "
                             f"{flat.numel()} elements")
        if count:  # `flat` is detached or the assembler's own: nothing for autograd to record
            flat[meta.offset:meta.offset + count].copy_(payload_tensor(payload, dtype))
        self._filled[key] += count

    def add_packed(self, chunks: Iterable[pb.TensorChunk]) -> None:
        """The chunks of one ``PackedChunks`` message, as ``add`` takes each. The whole tensors
        among them in one dtype (a first chunk at offset 0 with every element) are decoded
        together: one conversion of their joined payloads, then one ``copy_`` each."""
        whole: List[Tuple[torch.Tensor, bytes]] = []
        whole_dtype = None
        for chunk in chunks:
            key = (chunk.name, chunk.slot)
            dtype = _FROM_ENUM.get(chunk.dtype, self._default)
            data = chunk.data
            if (chunk.offset or not data or key in self._buffers or chunk.name not in self._sizes
                    or (whole_dtype is not None and dtype != whole_dtype)
                    or len(data) != self._size(key) * _ITEMSIZE[dtype]):
                self.add(chunk)
                continue
            flat = self._destination(key)
            self._filled[key] = flat.numel()
            whole.append((flat, data))
            whole_dtype = dtype
        if not whole:
            return
        values = payload_tensor(memoryview(b"".join(data for _, data in whole)), whole_dtype)
        for (flat, _), piece in zip(whole, values.split([flat.numel() for flat, _ in whole])):
            flat.copy_(piece)

    def _size(self, key: ChunkKey) -> int:
        return self._slot_sizes.get(key, self._sizes[key[0]])

    def clear(self) -> None:
        """Forgets every chunk received so far (before a read is retried from the start)."""
        self._buffers.clear()
        self._filled.clear()

    def add_all(self, chunks: Iterable[Union[pb.TensorChunk, FramedChunk]]) -> None:
        for chunk in chunks:
            self.add(chunk)

    def tensors(self) -> Dict[ChunkKey, torch.Tensor]:
        """Every complete tensor, keyed by (name, slot); raises if one arrived partially."""
        for key, filled in self._filled.items():
            if filled != self._size(key):
                raise ValueError(f"tensor '{key[0]}'{'/' + key[1] if key[1] else ''} arrived "
                                 f"with {filled} of {self._size(key)} elements")
        return dict(self._buffers)

    def finish(self) -> None:
        """Checks that every tensor that arrived is complete and copies the buffered ones of
        ``into`` into their tensors."""
        for (name, slot), flat in self.tensors().items():
            target = None if slot else self._into.get(name)
            if target is not None and (flat.data_ptr() != target.data_ptr()
                                       or flat.device != target.device):
                with torch.no_grad():
                    target.copy_(flat.view(target.shape))
