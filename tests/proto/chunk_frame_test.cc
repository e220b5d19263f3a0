// Chunk framing on gRPC byte buffers: what FrameChunk writes is what protobuf would write, what
// ParseChunkFrame reads from any split of the bytes into slices agrees with protobuf, everything
// else is left to protobuf, payloads decode across piece boundaries, and the slice pool recycles.
#include "proto/wire/chunk_frame.h"

#include <cstring>
#include <string>
#include <vector>

#include "grpcpp/impl/codegen/proto_utils.h"
#include "gtest/gtest.h"
#include "proto/wire/dtype_codec.h"

namespace muond::wire {
namespace {

std::string Bytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// `bytes` as a byte buffer cut at the given offsets.
grpc::ByteBuffer Split(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t begin = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + begin, cut - begin);
    begin = cut;
  }
  slices.emplace_back(bytes.data() + begin, bytes.size() - begin);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Joined(const FramedChunk& chunk) {
  std::string out;
  for (absl::string_view piece : chunk.data) out.append(piece.data(), piece.size());
  return out;
}

v1::TensorChunk SampleChunk() {
  v1::TensorChunk chunk;
  chunk.set_name("layer.0.weight");
  chunk.set_offset(4096);
  chunk.set_dtype(v1::DTYPE_BF16);
  chunk.add_shape(3);
  chunk.add_shape(5);
  std::string data(30, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 1);
  chunk.set_data(data);
  return chunk;
}

// The payload goes last (after `shape`, which protobuf would write after it): the same message,
// in a field order protobuf accepts.
TEST(ChunkFrameTest, FrameChunkWritesAProtobufEncodingOfTheChunk) {
  v1::TensorChunk chunk = SampleChunk();
  v1::TensorChunk meta = chunk;
  meta.clear_data();
  grpc::Slice payload(chunk.data());
  v1::StepRequest request;
  *request.mutable_chunk() = chunk;
  const std::string framed = Bytes(FrameChunk(kChunkField, meta, payload));
  EXPECT_EQ(framed.size(), request.ByteSizeLong());
  v1::StepResponse response;
  ASSERT_TRUE(response.ParseFromString(framed));
  EXPECT_EQ(response.chunk().SerializeAsString(), chunk.SerializeAsString());
}

TEST(ChunkFrameTest, ParsesEverySplitOfTheBytesLikeProtobuf) {
  v1::StepRequest request;
  *request.mutable_chunk() = SampleChunk();
  const std::string bytes = request.SerializeAsString();
  for (size_t a = 0; a <= bytes.size(); ++a) {
    for (size_t b = a; b <= bytes.size(); b += 3) {
      FramedChunk framed;
      ASSERT_TRUE(ParseChunkFrame(Split(bytes, {a, b}), kChunkField, &framed)) << a << "," << b;
      EXPECT_EQ(framed.meta.name(), "layer.0.weight");
      EXPECT_EQ(framed.meta.offset(), 4096u);
      EXPECT_EQ(framed.meta.dtype(), v1::DTYPE_BF16);
      ASSERT_EQ(framed.meta.shape_size(), 2);
      EXPECT_EQ(framed.meta.shape(1), 5);
      EXPECT_TRUE(framed.meta.data().empty());
      EXPECT_EQ(framed.data_bytes, request.chunk().data().size());
      EXPECT_EQ(Joined(framed), request.chunk().data());
    }
  }
}

TEST(ChunkFrameTest, FieldsInAnyOrderAndTheLastDataWin) {
  // data first, then the name, then data again: protobuf keeps the last data.
  v1::TensorChunk first;
  first.set_data("abcd");
  v1::TensorChunk second;
  second.set_name("w");
  v1::TensorChunk third;
  third.set_data("wxyz1234");
  const std::string inner = first.SerializeAsString() + second.SerializeAsString() + third.SerializeAsString();
  std::string bytes;
  bytes.push_back(static_cast<char>(kChunkField << 3 | 2));
  bytes.push_back(static_cast<char>(inner.size()));
  bytes += inner;
  v1::StepRequest reference;
  ASSERT_TRUE(reference.ParseFromString(bytes));

  FramedChunk framed;
  ASSERT_TRUE(ParseChunkFrame(Split(bytes, {5}), kChunkField, &framed));
  EXPECT_EQ(framed.meta.name(), reference.chunk().name());
  EXPECT_EQ(Joined(framed), reference.chunk().data());
  EXPECT_EQ(framed.data_bytes, 8u);
}

TEST(ChunkFrameTest, LeavesEverythingElseToProtobuf) {
  FramedChunk framed;
  v1::StepRequest header;
  header.mutable_header()->set_session_id("s");
  EXPECT_FALSE(ParseChunkFrame(Split(header.SerializeAsString(), {}), kChunkField, &framed));

  v1::StepRequest request;
  *request.mutable_chunk() = SampleChunk();
  const std::string bytes = request.SerializeAsString();
  // Two chunk fields (protobuf merges them), trailing bytes, a cut-off message, an empty one.
  EXPECT_FALSE(ParseChunkFrame(Split(bytes + bytes, {bytes.size()}), kChunkField, &framed));
  EXPECT_FALSE(ParseChunkFrame(Split(bytes + std::string(1, '\0'), {}), kChunkField, &framed));
  EXPECT_FALSE(ParseChunkFrame(Split(bytes.substr(0, bytes.size() - 1), {7}), kChunkField, &framed));
  EXPECT_FALSE(ParseChunkFrame(grpc::ByteBuffer(), kChunkField, &framed));
  // A chunk whose declared data length runs past the message.
  std::string lying = bytes;
  const size_t length_byte = bytes.find(request.chunk().data()) - 1;
  ASSERT_EQ(static_cast<uint8_t>(bytes[length_byte]), 30);
  lying[length_byte] = 100;
  EXPECT_FALSE(ParseChunkFrame(Split(lying, {}), kChunkField, &framed));
  // A group (wire type 3) inside the chunk.
  std::string group = {static_cast<char>(kChunkField << 3 | 2), 2, static_cast<char>(7 << 3 | 3),
                       static_cast<char>(7 << 3 | 4)};
  EXPECT_FALSE(ParseChunkFrame(Split(group, {}), kChunkField, &framed));
}

TEST(PayloadReaderTest, DecodesElementsSplitAcrossPieces) {
  std::vector<float> values(37);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 3.0f;
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    std::string bytes;
    Encode(dtype, values, &bytes);
    // Cut at 1, 4, 5, 11, 12, ... bytes: some cuts inside elements, one empty piece.
    std::vector<absl::string_view> pieces;
    size_t begin = 0;
    for (size_t cut : {1u, 4u, 5u, 11u, 11u, 12u, 40u, 41u}) {
      pieces.push_back(absl::string_view(bytes).substr(begin, cut - begin));
      begin = cut;
    }
    pieces.push_back(absl::string_view(bytes).substr(begin));
    PayloadReader reader(pieces);
    EXPECT_EQ(reader.remaining(), bytes.size());
    std::vector<float> out(values.size());
    ASSERT_TRUE(reader.Read(dtype, std::span<float>(out).subspan(0, 3)));
    ASSERT_TRUE(reader.Read(dtype, std::span<float>(out).subspan(3)));
    EXPECT_EQ(reader.remaining(), 0u);
    std::vector<float> expected(values.size());
    Decode(dtype, bytes, expected);
    EXPECT_EQ(out, expected) << DTypeName(dtype);
    float extra;
    EXPECT_FALSE(reader.Read(dtype, std::span<float>(&extra, 1)));
  }
}

TEST(SlicePoolTest, RecyclesBuffersWhenGrpcReleasesThem) {
  std::shared_ptr<SlicePool> pool = SlicePool::Create(64, /*keep=*/2);
  char* first = nullptr;
  {
    grpc::Slice slice = pool->Take(10, &first);
    EXPECT_EQ(slice.size(), 10u);
    std::memcpy(first, "0123456789", 10);
    grpc::ByteBuffer buffer(&slice, 1);
    EXPECT_EQ(Bytes(buffer), "0123456789");
    EXPECT_EQ(pool->idle(), 0u);
  }
  EXPECT_EQ(pool->idle(), 1u);
  char* again = nullptr;
  grpc::Slice reused = pool->Take(64, &again);
  EXPECT_EQ(again, first);
  EXPECT_EQ(pool->idle(), 0u);
  char* big = nullptr;
  {
    grpc::Slice larger = pool->Take(100, &big);  // larger than any idle buffer: a new one, kept after
    EXPECT_EQ(larger.size(), 100u);
  }
  EXPECT_EQ(pool->idle(), 1u);
  char* small = nullptr;
  grpc::Slice fits = pool->Take(3, &small);
  EXPECT_EQ(small, big);
  {
    std::vector<grpc::Slice> many;
    for (int i = 0; i < 4; ++i) {
      char* data = nullptr;
      many.push_back(pool->Take(8, &data));
    }
  }
  EXPECT_EQ(pool->idle(), 2u);  // at most `keep` idle buffers
}

TEST(SlicePoolTest, SlicesOutliveThePoolHandle) {
  char* data = nullptr;
  grpc::Slice slice;
  {
    std::shared_ptr<SlicePool> pool = SlicePool::Create(16);
    slice = pool->Take(16, &data);
  }
  std::memset(data, 1, 16);  // still owned by the slice
  EXPECT_EQ(slice.begin()[15], 1);
}

}  // namespace
}  // namespace muond::wire
