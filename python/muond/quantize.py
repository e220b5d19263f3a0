"""Block-quantized gradients on the wire: the ``int8`` and ``int4`` wire dtypes.

A tensor is cut into blocks of ``BLOCK`` elements from its first (the last may be shorter). Each
block gets one fp32 scale, max|x| / qmax (qmax 127 for int8, 7 for int4), and each element the
integer round(x / scale) (half to even), clamped to [−qmax, qmax]; a block of zeros has scale 0 and
integers 0. The daemon decodes element i as the fp32 product q[i] · scale[i // BLOCK]
(``muond.v1.BlockQuantized``), which ``dequantize`` computes bit for bit. int4 packs two integers a
byte, the element of even index in the low nibble. Chunks split a tensor at multiples of the block,
so the values do not depend on the chunk size.

What rounds away is the sender's to keep: ``muond.DiLoCo`` adds it to its next pseudo-gradient
(error feedback). Only a step's gradients travel quantized, and only over gRPC.

Pure functions; thread-safe.
"""

from __future__ import annotations

from typing import Iterator, Tuple

import torch

from ._stubs import pb

BLOCK = 256
BITS = {"int8": 8, "int4": 4}
_QMAX = {"int8": 127, "int4": 7}


def is_quantized(dtype: str) -> bool:
    """Whether ``dtype`` (a canonical wire dtype name) is block-quantized."""
    return dtype in BITS


def quantize(values: torch.Tensor, dtype: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the integers as int8, one per element; the fp32 scales, one per block) of ``values``
    (any shape, read as fp32 in order, on the CPU)."""
    flat = values.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    n = flat.numel()
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
    padded[:n] = flat
    rows = padded.view(blocks, BLOCK)
    qmax = _QMAX[dtype]
    scales = rows.abs().amax(dim=1) / qmax
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / divisor[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.reshape(-1)[:n], scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values the daemon decodes from ``quantize``'s output (flat)."""
    expanded = scales.repeat_interleave(BLOCK)[:q.numel()]
    return q.to(torch.float32) * expanded


def round_trip(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """``values`` as the daemon receives them in ``dtype`` (flat, fp32, on the CPU)."""
    return dequantize(*quantize(values, dtype))


def payload_bytes(numel: int, dtype: str) -> int:
    """Bytes a tensor of ``numel`` elements puts on the wire in ``dtype``: integers and scales."""
    return -(-numel * BITS[dtype] // 8) + 4 * -(-numel // BLOCK)


def _elements_per_chunk(dtype: str, max_chunk_bytes: int) -> int:
    """Whole blocks whose integers and scales together fit in ``max_chunk_bytes`` (at least one):
    the daemon's message limit counts both."""
    block_bytes = BLOCK * BITS[dtype] // 8 + 4
    return max(1, max_chunk_bytes // block_bytes) * BLOCK


def chunk_count(numel: int, dtype: str, max_chunk_bytes: int) -> int:
    """How many chunks ``chunk_pieces`` yields for ``numel`` elements (at least one)."""
    return max(1, -(-numel // _elements_per_chunk(dtype, max_chunk_bytes)))


def _packed(q: torch.Tensor, bits: int) -> memoryview:
    if bits == 8:
        return memoryview(q.contiguous().numpy()).cast("B")
    nibbles = (q.to(torch.int16) & 0xF).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, torch.zeros(1, dtype=torch.uint8)])
    pairs = nibbles.view(-1, 2)
    return memoryview((pairs[:, 0] | (pairs[:, 1] << 4)).contiguous().numpy()).cast("B")


def chunk_pieces(name: str, tensor: torch.Tensor, dtype: str, *, with_shape: bool,
                 max_chunk_bytes: int) -> Iterator[Tuple[pb.TensorChunk, memoryview]]:
    """Each chunk of ``tensor`` (at least one element) as (the chunk without its data, its packed
    integers); the first carries the shape when ``with_shape``."""
    q, scales = quantize(tensor, dtype)
    n, bits = q.numel(), BITS[dtype]
    per_chunk = _elements_per_chunk(dtype, max_chunk_bytes)
    for start in range(0, n, per_chunk):
        count = min(per_chunk, n - start)
        block_scales = scales[start // BLOCK:-(-(start + count) // BLOCK)]
        meta = pb.TensorChunk(name=name, offset=start, quantized=pb.BlockQuantized(
            bits=bits, block=BLOCK, count=count, scales=block_scales.numpy().tobytes()))
        if start == 0 and with_shape:
            meta.shape.extend(tensor.shape)
        yield meta, _packed(q[start:start + count], bits)
