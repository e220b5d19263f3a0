"""Block-quantized gradients (wire_dtype "int8" and "int4", muond/quantize.py): the encoding's
bounds, the daemon decoding exactly what ``quantize.dequantize`` computes (one chunk or many, packed
with other tensors or not), the payload's size, and the refusals."""

import pytest
import torch

import muond
from muond import quantize, wire


def _unpacked(chunk):
    """The integers of one quantized chunk, decoded from its bytes as the daemon does."""
    data, q = bytes(chunk[1]), chunk[0].quantized
    if q.bits == 8:
        return [b - 256 if b >= 128 else b for b in data][:q.count]
    nibbles = [n for b in data for n in (b & 0xF, b >> 4)][:q.count]
    return [n - 16 if n >= 8 else n for n in nibbles]


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_each_element_rounds_to_its_blocks_grid(dtype):
    torch.manual_seed(3)
    x = torch.randn(1000) * torch.logspace(-6, 2, 1000)  # blocks of very different scales
    x[256:512] = 0.0                                     # a block of zeros
    q, scales = quantize.quantize(x, dtype)
    qmax = 127 if dtype == "int8" else 7
    assert q.dtype == torch.int8 and q.abs().max().item() <= qmax
    assert scales.numel() == 4 and scales[1].item() == 0.0
    back = quantize.dequantize(q, scales)
    step = scales.repeat_interleave(quantize.BLOCK)[:1000]
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-6) + 1e-30)
    assert torch.equal(back[256:512], torch.zeros(256))
    # The largest magnitude of each block is exact up to one rounding of its scale.
    for b in (0, 2, 3):
        block = x[b * 256:(b + 1) * 256]
        i = block.abs().argmax()
        assert q[b * 256 + i].abs().item() == qmax


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_chunks_cut_at_blocks_and_pack_the_integers(dtype):
    torch.manual_seed(4)
    x = torch.randn(3, 700)
    q, scales = quantize.quantize(x, dtype)
    chunks = list(wire.chunk_pieces("w", x, dtype, max_chunk_bytes=300))
    per = quantize.BLOCK * (2 if dtype == "int4" else 1)  # 300 bytes hold one (int8) or two blocks
    assert [c[0].offset for c in chunks] == list(range(0, 2100, per))
    assert len(chunks) == wire.chunk_count(2100, dtype, max_chunk_bytes=300)
    assert list(chunks[0][0].shape) == [3, 700] and not chunks[1][0].shape
    got = [v for c in chunks for v in _unpacked(c)]
    assert got == q.tolist()
    scale_bytes = b"".join(c[0].quantized.scales for c in chunks)
    assert scale_bytes == scales.numpy().tobytes()
    assert sum(len(c[1]) + len(c[0].quantized.scales) for c in chunks) == \
        wire.payload_bytes(2100, dtype)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_chunks_integers_and_scales_together_fit_its_bytes(dtype):
    """The daemon's message limit counts the scales too: 515 bytes hold one int8 block (256 + 4
    bytes), not the two whose integers alone would fit, and three int4 blocks (3 · 132), not four."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(5))
    chunks = list(wire.chunk_pieces("w", x, dtype, max_chunk_bytes=515))
    assert all(len(data) + len(chunk.quantized.scales) <= 515 for chunk, data in chunks)
    assert chunks[1][0].offset == quantize.BLOCK * (1 if dtype == "int8" else 3)


def test_int4_is_at_most_a_seventh_of_fp32():
    for numel in (4096, 1 << 20, 12345):
        assert quantize.payload_bytes(numel, "int4") * 7 <= numel * 4
        assert quantize.payload_bytes(numel, "int8") * 3.9 <= numel * 4


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 512])
def test_the_daemon_applies_exactly_the_decoded_gradient(endpoint, dtype, chunk_bytes):
    # SGD with lr 1 and no momentum: each step subtracts the gradient the daemon decoded, so the
    # parameters show it bit for bit. Small chunks cut the matrix into many chunks; the vectors
    # are packed with each other.
    torch.manual_seed(5)
    shapes = {"w": (64, 48), "b": (48,), "c": (5,)}
    params = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    start = {n: p.detach().clone() for n, p in params.items()}
    groups = [{"params": list(params.values()), "param_names": list(params),
               "optimizer": "sgd", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0}]
    conn = muond.ConnectionOptions(endpoint=endpoint, chunk_bytes=chunk_bytes, transport="auto")
    with muond.RemoteOptimizer(groups, connection=conn, wire_dtype=dtype) as opt:
        assert opt.transport == "grpc"  # quantized chunks travel over gRPC only
        grads = {n: torch.randn(s) * 10.0 ** -i for i, (n, s) in enumerate(shapes.items())}
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
        decoded = {n: quantize.round_trip(g, dtype).view_as(g) for n, g in grads.items()}
        for n, p in params.items():
            assert torch.equal(p.detach(), start[n] - decoded[n]), n
        norm = torch.sqrt(sum((d.double() ** 2).sum() for d in decoded.values())).item()
        assert opt.last_info.grad_norm == pytest.approx(norm, rel=1e-12)


def test_quantized_dtypes_are_for_gradients_over_grpc_only(endpoint):
    p = torch.nn.Parameter(torch.randn(8, 8))
    conn = muond.Connection(endpoint)
    before = {s.session_id for s in conn.list_sessions()}  # the shared daemon's other tests' too
    with pytest.raises(ValueError, match="transport: 'shm' .* quantized gradients travel over grpc only"):
        muond.RemoteOptimizer([p], endpoint=endpoint, wire_dtype="int4", transport="shm")
    assert {s.session_id for s in conn.list_sessions()} <= before  # refused before anything was sent
    conn.close()
    with pytest.raises(ValueError, match="return_dtype: unsupported wire dtype 'int8'"):
        muond.RemoteOptimizer([p], endpoint=endpoint, wire=muond.WireOptions(return_dtype="int8"))
    with pytest.raises(ValueError, match="'int8' or 'int4'"):
        muond.RemoteOptimizer([p], endpoint=endpoint, wire_dtype="int2")
