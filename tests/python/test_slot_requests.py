"""The requests of the slot transports (shared memory, CUDA IPC) with their unchanging parts kept
between steps, encoded (muond/transport/slots.py, SlotRequests): each one reads as the request built
from scratch, and every gradient lands in its slots, whichever way it was copied."""

import torch

from muond._stubs import pb
from muond import wire
from muond.transport.base import TransportContext
from muond.transport.slots import SlotRequests, slot_layout

SHAPES = {"a": (3,), "b": (2, 2), "c": (5,)}


def _setup(wire_dtype="fp32", return_dtype="fp32"):
    params = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    ctx = TransportContext(conn=None, session_id="s", names=list(SHAPES), sizes={n: p.numel() for n, p in params.items()},
                           by_name=params, wire_dtype=wire_dtype, return_dtype=return_dtype, chunk_bytes=1 << 20)
    offsets, nbytes = slot_layout(ctx.names, ctx.sizes)
    block = torch.full((nbytes,), 0xEE, dtype=torch.uint8)

    def view(offset, numel, dtype):
        size = torch.empty(0, dtype=dtype).element_size()
        return block[offset:offset + numel * size].view(dtype)

    return ctx, offsets, block, view


def _expected(ctx, offsets, region, grads):
    """The request as it is built from scratch, one entry per gradient and per parameter."""
    request = pb.StepSharedRequest()
    itemsize = torch.empty(0, dtype=wire.torch_dtype(ctx.wire_dtype)).element_size()
    out_size = torch.empty(0, dtype=wire.torch_dtype(ctx.return_dtype)).element_size()
    for name, g in grads:
        request.gradients.add(name=name, region=region, offset=offsets[name], byte_size=g.numel() * itemsize,
                              dtype=wire.dtype_enum(ctx.wire_dtype))
    for name in ctx.names:
        request.parameters.add(name=name, region=region, offset=offsets[name],
                               byte_size=ctx.sizes[name] * out_size, dtype=wire.dtype_enum(ctx.return_dtype))
    return request


def _read(request: bytes) -> pb.StepSharedRequest:
    return pb.StepSharedRequest.FromString(request)


def _grads(step, names=tuple(SHAPES)):
    return [(name, torch.arange(torch.Size(SHAPES[name]).numel(), dtype=torch.float32).view(SHAPES[name])
             + 100 * step + 10 * i) for i, name in enumerate(names)]


def test_kept_requests_name_every_slot_and_every_gradient_lands_in_its_slots():
    for wire_dtype in ("fp32", "bf16"):  # fp32: the slots lie end to end (one cat); bf16: one copy each
        ctx, offsets, block, view = _setup(wire_dtype)
        requests = SlotRequests(ctx, offsets)
        for step, names in enumerate([("a", "b", "c"), ("a", "b", "c"), ("a", "c"), ("a", "b", "c")]):
            grads = _grads(step, names)
            header = pb.StepHeader(session_id="s", step=step + 1, return_dtype=pb.DTYPE_BF16, num_chunks=3)
            request, views = requests.request(header, "region-1", view, grads)
            expected = _expected(ctx, offsets, "region-1", grads)
            expected.header.CopyFrom(header)
            expected.header.ClearField("return_dtype")
            expected.header.ClearField("num_chunks")
            assert _read(request) == expected, (wire_dtype, names)
            for name, g in grads:
                slots = view(offsets[name], g.numel(), wire.torch_dtype(wire_dtype))
                assert torch.equal(slots, g.reshape(-1).to(slots.dtype)), (wire_dtype, name)
            assert set(views) == set(SHAPES)
            for name, v in views.items():
                assert v.shape == SHAPES[name]
                assert v.data_ptr() == block.data_ptr() + offsets[name]


def test_gradients_a_streamed_try_wrote_are_not_written_again_and_another_block_gets_its_own_request():
    ctx, offsets, block, view = _setup()
    requests = SlotRequests(ctx, offsets)
    grads = _grads(0)
    before = view(offsets["b"], 4, torch.float32).clone()
    request = _read(requests.request(pb.StepHeader(step=1), "region-1", view, grads, written={"b"})[0])
    assert torch.equal(view(offsets["b"], 4, torch.float32), before)  # left as the streamed try wrote it
    assert torch.equal(view(offsets["a"], 3, torch.float32), grads[0][1])
    assert [g.name for g in request.gradients] == ["a", "b", "c"]  # b named all the same

    _, other_block, other_view = _setup()[1:]  # a block registered anew (the daemon restarted)
    encoded, views = requests.request(pb.StepHeader(step=2), "region-2", other_view, _grads(1))
    request = _read(encoded)
    assert {g.region for g in request.gradients} | {p.region for p in request.parameters} == {"region-2"}
    assert views["a"].data_ptr() == other_block.data_ptr() + offsets["a"]
    assert torch.equal(other_view(offsets["c"], 5, torch.float32), _grads(1)[2][1])
    # The same memory registered again under another name (CUDA IPC keeps its buffer).
    request = _read(requests.request(pb.StepHeader(step=3), "region-3", other_view, _grads(2))[0])
    assert {g.region for g in request.gradients} | {p.region for p in request.parameters} == {"region-3"}
