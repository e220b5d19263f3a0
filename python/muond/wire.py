"""Tensors on the wire: dtype names, encoding into ``TensorChunk`` messages and reassembly.

Tensors travel as raw little-endian bytes in chunks of at most ``max_chunk_bytes``; ``offset`` is
the index of a chunk's first element. Encoding converts on the tensor's own device first (so a
CUDA gradient crosses PCIe already in the wire dtype) and then copies to host memory once.
Reassembly decodes every chunk straight into one fp32 host buffer per tensor.

Pure functions plus ``ChunkAssembler``, which is not thread-safe: use one per call.
"""

from __future__ import annotations

import sys
from typing import Dict, Iterable, Iterator, Optional, Tuple, Union

import numpy as np
import torch

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


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name ("fp32", "bf16", "fp16")."""
    return _TORCH[name]


def dtype_enum(name: str) -> int:
    """The ``muond.v1.DType`` value of a canonical dtype name."""
    return _ENUM[name]


def dtype_from_enum(value: int, default: str) -> str:
    """The canonical name of a ``muond.v1.DType`` value; ``default`` when it is unset."""
    return _FROM_ENUM.get(value, default)


def itemsize(name: str) -> int:
    """Bytes per element of a canonical dtype name."""
    return _ITEMSIZE[name]


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


def encode(name: str, tensor: torch.Tensor, dtype: str, *, slot: str = "",
           max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """Yields the chunks of one tensor; the first carries its shape. An empty tensor is one chunk."""
    data = host_bytes(tensor, dtype)
    itemsize = _ITEMSIZE[dtype]
    per_chunk = max(1, max_chunk_bytes // itemsize) * itemsize
    enum = _ENUM[dtype]
    start = 0
    while True:
        piece = data[start:start + per_chunk]
        chunk = pb.TensorChunk(name=name, offset=start // itemsize, dtype=enum, data=bytes(piece),
                               slot=slot)
        if start == 0 and CHUNK_HAS_SHAPE:
            chunk.shape.extend(tensor.shape)
        yield chunk
        start += per_chunk
        if start >= len(data):
            return


def chunk_count(numel: int, dtype: str, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """How many chunks ``encode`` yields for a tensor of ``numel`` elements (at least one)."""
    itemsize = _ITEMSIZE[dtype]
    per_chunk = max(1, max_chunk_bytes // itemsize) * itemsize
    return max(1, -(-numel * itemsize // per_chunk))


def _decode_into(dest: np.ndarray, chunk: pb.TensorChunk, dtype: str) -> int:
    raw = chunk.data
    if dtype == "fp32":
        values = np.frombuffer(raw, dtype="<f4")
    elif dtype == "bf16":
        values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        values = np.frombuffer(raw, dtype="<f2")
    start = chunk.offset
    if start + values.size > dest.size:
        raise ValueError(f"chunk of '{chunk.name}' at offset {start} overruns its "
                         f"{dest.size} elements")
    dest[start:start + values.size] = values
    return values.size


class ChunkAssembler:
    """Collects the chunks of a response into one fp32 host tensor per (name, slot).

    ``sizes`` gives the element count of every tensor name that may arrive; ``default_dtype``
    decodes chunks that leave their dtype unset.
    """

    def __init__(self, sizes: Dict[str, int], default_dtype: str = "fp32"):
        self._sizes = sizes
        self._default = default_dtype
        self._buffers: Dict[ChunkKey, torch.Tensor] = {}
        self._filled: Dict[ChunkKey, int] = {}

    def add(self, chunk: pb.TensorChunk) -> None:
        if chunk.name not in self._sizes:
            raise ValueError(f"the daemon sent a chunk of unknown tensor '{chunk.name}'")
        key = (chunk.name, chunk.slot)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(self._sizes[chunk.name], dtype=torch.float32)
            self._filled[key] = 0
        if chunk.offset != self._filled[key]:
            raise ValueError(f"chunk of '{chunk.name}' at offset {chunk.offset}, expected "
                             f"{self._filled[key]}")
        dtype = _FROM_ENUM.get(chunk.dtype, self._default)
        self._filled[key] += _decode_into(self._buffers[key].numpy(), chunk, dtype)

    def clear(self) -> None:
        """Forgets every chunk received so far (before a read is retried from the start)."""
        self._buffers.clear()
        self._filled.clear()

    def add_all(self, chunks: Iterable[pb.TensorChunk]) -> None:
        for chunk in chunks:
            self.add(chunk)

    def tensors(self) -> Dict[ChunkKey, torch.Tensor]:
        """Every complete tensor, keyed by (name, slot); raises if one arrived partially."""
        for key, filled in self._filled.items():
            if filled != self._sizes[key[0]]:
                raise ValueError(f"tensor '{key[0]}'{'/' + key[1] if key[1] else ''} arrived "
                                 f"with {filled} of {self._sizes[key[0]]} elements")
        return dict(self._buffers)


def optional_dtype_enum(value: Optional[DTypeLike]) -> int:
    """``DTYPE_UNSPECIFIED`` for None, else the enum of the named dtype."""
    return pb.DTYPE_UNSPECIFIED if value is None else _ENUM[dtype_name(value)]
