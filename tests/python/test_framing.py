"""The Step stream's framing: what frame_chunks sends is the protobuf encoding of the chunks
wire.encode builds, answer chunks parse like protobuf parses them (anything unusual is left to
protobuf), and the assembler decodes them straight into the parameters it is given."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from muond import wire
from muond._stubs import pb
from muond.transport import framing


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_frame_chunks_are_the_protobuf_encoding_of_the_chunks(dtype):
    tensor = torch.randn(5, 7)
    framed = list(framing.frame_chunks("w", tensor, dtype, max_chunk_bytes=24))
    expected = list(wire.encode("w", tensor, dtype, max_chunk_bytes=24))
    assert len(framed) == len(expected) == wire.chunk_count(35, dtype, 24)
    for data, chunk in zip(framed, expected):
        parsed = pb.StepRequest.FromString(data)
        assert parsed.WhichOneof("kind") == "chunk"
        assert parsed.chunk == chunk


def test_an_empty_tensor_is_one_empty_chunk():
    (data,) = framing.frame_chunks("e", torch.zeros(0), "fp32")
    chunk = pb.StepRequest.FromString(data).chunk
    assert chunk.name == "e" and chunk.data == b"" and list(chunk.shape) == [0]


def test_answer_chunks_parse_like_protobuf_with_the_payload_as_a_view():
    chunk = pb.TensorChunk(name="layer.weight", offset=12, dtype=pb.DTYPE_BF16,
                           data=bytes(range(40)), shape=[4, 5])
    data = pb.StepResponse(chunk=chunk).SerializeToString()
    parsed = framing.parse_step_response(data)
    assert isinstance(parsed, wire.FramedChunk)
    assert isinstance(parsed.payload, memoryview)
    assert bytes(parsed.payload) == chunk.data
    expected = pb.TensorChunk()
    expected.CopyFrom(chunk)
    expected.ClearField("data")
    assert parsed.meta == expected


def test_everything_else_is_left_to_protobuf():
    result = pb.StepResponse(result=pb.StepResult(step=3, applied=True))
    parsed = framing.parse_step_response(result.SerializeToString())
    assert isinstance(parsed, pb.StepResponse) and parsed.result.step == 3
    one = pb.StepResponse(chunk=pb.TensorChunk(name="a", data=b"\0\0\0\0")).SerializeToString()
    merged = framing.parse_step_response(one + one)  # two chunk fields: protobuf merges them
    assert isinstance(merged, pb.StepResponse) and merged.chunk.name == "a"
    with pytest.raises(Exception):
        framing.parse_step_response(one[:-1])  # cut short: protobuf refuses it


def test_the_last_data_field_wins_as_in_protobuf():
    inner = (pb.TensorChunk(data=b"abcd").SerializeToString()
             + pb.TensorChunk(name="w").SerializeToString()
             + pb.TensorChunk(data=b"wxyz1234").SerializeToString())
    data = bytes([(2 << 3) | 2, len(inner)]) + inner
    parsed = framing.parse_step_response(data)
    reference = pb.StepResponse.FromString(data)
    assert parsed.meta.name == reference.chunk.name == "w"
    assert bytes(parsed.payload) == reference.chunk.data == b"wxyz1234"


def _answer(name, values, dtype, chunk_bytes):
    for chunk in wire.encode(name, values, dtype, max_chunk_bytes=chunk_bytes):
        yield framing.parse_step_response(pb.StepResponse(chunk=chunk).SerializeToString())


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_answers_are_decoded_into_the_parameters_memory(dtype):
    param = torch.nn.Parameter(torch.zeros(6, 5))
    pointer, version = param.data_ptr(), param._version
    answer = torch.randn(6, 5)
    writer = wire.ChunkAssembler({"w": 30}, dtype, into={"w": param})
    for chunk in _answer("w", answer, dtype, 16):
        writer.add(chunk)
    writer.finish()
    expected = answer.to(wire.torch_dtype(dtype)).float()
    assert torch.equal(param.detach(), expected)
    assert param.data_ptr() == pointer
    assert param._version > version  # autograd sees the in-place update
    assert param.grad is None


def test_a_non_contiguous_parameter_is_written_by_finish():
    param = torch.zeros(5, 6).t()  # shape (6, 5), not contiguous
    answer = torch.randn(6, 5)
    writer = wire.ChunkAssembler({"w": 30}, into={"w": param})
    for chunk in _answer("w", answer, "fp32", 20):
        writer.add(chunk)
    assert not torch.equal(param, answer)
    writer.finish()
    assert torch.equal(param, answer)


def test_writing_into_parameters_refuses_what_the_assembler_refuses():
    param = torch.zeros(8)
    chunks = list(_answer("w", torch.ones(8), "fp32", 16))
    writer = wire.ChunkAssembler({"w": 8}, into={"w": param})
    with pytest.raises(ValueError, match="offset 4, expected 0"):
        writer.add(chunks[1])
    with pytest.raises(ValueError, match="unknown tensor 'v'"):
        wire.ChunkAssembler({"w": 8}, into={"w": param}).add(
            next(_answer("v", torch.ones(8), "fp32", 16)))
    with pytest.raises(ValueError, match="overruns"):
        wire.ChunkAssembler({"w": 3}, into={"w": torch.zeros(3)}).add(chunks[0])
    partial = wire.ChunkAssembler({"w": 8}, into={"w": param})
    partial.add(chunks[0])
    with pytest.raises(ValueError, match="4 of 8 elements"):
        partial.finish()


@pytest.mark.parametrize("pack", [False, True])
def test_step_messages_count_what_they_send_and_pack_only_small_whole_tensors(pack):
    # 1024-byte chunks: tensors of at most 256 bytes (64 fp32) are packed, up to 1024 bytes a message.
    grads = [("big", torch.randn(300)), ("a", torch.randn(64)), ("b", torch.randn(10)),
             ("c", torch.randn(64)), ("d", torch.randn(64)), ("e", torch.randn(64)), ("empty", torch.zeros(0))]
    count, messages = framing.step_messages(grads, "fp32", 1024, pack)
    parsed = [pb.StepRequest.FromString(m) for m in messages]
    assert count == len(parsed)
    kinds = [p.WhichOneof("kind") for p in parsed]
    sent = {}
    for p in parsed:
        for chunk in (p.packed.chunks if p.WhichOneof("kind") == "packed" else [p.chunk]):
            values = torch.frombuffer(bytearray(chunk.data), dtype=torch.float32) if chunk.data else torch.zeros(0)
            sent.setdefault(chunk.name, []).append((chunk.offset, values))
    for name, g in grads:
        pieces = sorted(sent[name], key=lambda piece: piece[0])
        assert torch.equal(torch.cat([v for _, v in pieces]), g), name
    if not pack:
        assert "packed" not in kinds and count == 2 + 6  # "big" in two chunks, the rest one each
        return
    packed = [p.packed for p in parsed if p.WhichOneof("kind") == "packed"]
    assert [[c.name for c in m.chunks] for m in packed] == [["a", "b", "c", "d"], ["e"]]
    assert all(sum(len(c.data) for c in m.chunks) <= 1024 for m in packed)
    assert count == 2 + 1 + 2  # "big" and "empty" alone, two packed messages


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "int8", "int4"])
def test_a_packed_message_is_the_protobuf_encoding_of_each_tensors_chunk(dtype):
    # Made from one host copy of all the tensors and prefixes kept between steps, the message must
    # still parse as the chunks wire.encode builds one tensor at a time (each payload after its
    # chunk's other fields, as frame_chunks puts it); a transposed tensor, a 1-element one and a
    # float64 one among them, and the prefixes reused a second time.
    torch.manual_seed(3)
    grads = [("w", torch.randn(4, 8)), ("t", torch.randn(8, 3).t()), ("one", torch.randn(1)),
             ("bias", torch.randn(16, dtype=torch.float64))]
    for _ in range(2):
        count, messages = framing.step_messages(grads, dtype, 1 << 20, True)
        (message,) = list(messages)
        assert count == 1
        expected = pb.StepRequest()
        for name, g in grads:
            (chunk,) = wire.encode(name, g, dtype)
            expected.packed.chunks.add().CopyFrom(chunk)
        assert pb.StepRequest.FromString(message) == expected
        grads = [(name, g * 2) for name, g in grads]


def test_a_packed_answer_is_decoded_as_its_chunks_one_by_one():
    # Whole tensors of one dtype are decoded together; a chunk of another dtype, one that is part
    # of a tensor, a slot, a non-contiguous parameter and an empty one take the one-by-one path.
    # Both must leave the same tensors.
    torch.manual_seed(4)
    sizes = {"a": 6, "b": 4, "c": 8, "d": 10, "e": 0, "t": 6}
    values = {name: torch.randn(n) for name, n in sizes.items()}
    chunks = [next(wire.encode("a", values["a"], "fp32")), next(wire.encode("b", values["b"], "bf16")),
              *wire.encode("c", values["c"], "fp32", max_chunk_bytes=16),
              next(wire.encode("d", values["d"], "fp32")), next(wire.encode("d", values["d"][:3], "fp32", slot="m")),
              next(wire.encode("e", values["e"], "fp32")), next(wire.encode("t", values["t"], "fp32"))]

    def assembled(packed):
        params = {name: torch.zeros(n) for name, n in sizes.items()}
        params["t"] = torch.zeros(2, 3).t()
        writer = wire.ChunkAssembler(sizes, into=params, slot_sizes={("d", "m"): 3})
        writer.add_packed(chunks) if packed else writer.add_all(chunks)
        writer.finish()
        return params, writer.tensors()

    (packed, packed_all), (single, single_all) = assembled(True), assembled(False)
    for name in sizes:
        assert torch.equal(packed[name], single[name]), name
    assert torch.equal(packed_all[("d", "m")], single_all[("d", "m")])
    assert torch.equal(packed["a"], values["a"]) and torch.equal(packed["t"].reshape(-1), values["t"])
    with pytest.raises(ValueError, match="unknown tensor 'x'"):
        wire.ChunkAssembler(sizes).add_packed([next(wire.encode("x", torch.ones(2), "fp32"))])
    twice = wire.ChunkAssembler(sizes)
    with pytest.raises(ValueError, match="chunk of 'a' at offset 0, expected 6"):
        twice.add_packed([chunks[0], chunks[0]])
    short = wire.ChunkAssembler(sizes)
    short.add_packed([next(wire.encode("a", values["a"][:4], "fp32"))])
    with pytest.raises(ValueError, match="4 of 6 elements"):
        short.finish()


def test_decoding_payloads_warns_nothing_and_reads_every_dtype_from_a_fresh_process():
    # torch warns once per process about read-only buffers; the decoding keeps that once quiet and
    # then no longer guards each chunk. A process of its own, so that the once is still to come.
    script = textwrap.dedent("""
        import warnings
        warnings.simplefilter("error")
        import torch
        from muond import wire
        for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            for _ in range(3):
                values = torch.tensor([1.5, -2.0, 0.25], dtype=torch_dtype)
                decoded = wire.payload_tensor(memoryview(values.numpy().tobytes() if dtype != "bf16"
                                                         else values.view(torch.int16).numpy().tobytes()), dtype)
                assert decoded.dtype == torch_dtype and torch.equal(decoded, values), dtype
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
