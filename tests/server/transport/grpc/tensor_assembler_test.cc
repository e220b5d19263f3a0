// TensorAssembler: chunks are checked against the session's parameters and assembled in order.
#include "server/transport/grpc/tensor_assembler.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error_reason.h"
#include "gmock/gmock.h"
#include "proto/wire/dtype_codec.h"
#include "server/rpc/session_spec_codec.h"
#include "tests/testing/status_matchers.h"

namespace muond::transport {
namespace {

using rpc::ParseSessionSpec;
using session::SessionConfig;
using session::SpecLimits;

using ::muond::testing::StatusIs;

SessionConfig TwoParameters() {
  v1::SessionSpec spec;
  auto* g = spec.add_groups();
  g->set_name("g");
  g->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  auto* a = spec.add_parameters();
  a->set_name("a");
  a->add_shape(2);
  a->add_shape(3);
  a->set_group("g");
  auto* b = spec.add_parameters();
  b->set_name("b");
  b->add_shape(4);
  b->set_wire_dtype(v1::DTYPE_BF16);
  b->set_group("g");
  return ParseSessionSpec(spec, SpecLimits{}).value();
}

v1::TensorChunk Chunk(const std::string& name, std::vector<float> values, uint64_t offset,
                      v1::DType dtype = v1::DTYPE_UNSPECIFIED) {
  v1::TensorChunk chunk;
  chunk.set_name(name);
  chunk.set_offset(offset);
  chunk.set_dtype(dtype);
  wire::Encode(dtype == v1::DTYPE_UNSPECIFIED ? (name == "b" ? v1::DTYPE_BF16 : v1::DTYPE_FP32) : dtype, values,
               chunk.mutable_data());
  return chunk;
}

TEST(TensorAssemblerTest, AssemblesChunksInOrderWithTheirWireDType) {
  const SessionConfig config = TwoParameters();
  TensorAssembler assembler(config, 1 << 20);
  ASSERT_OK(assembler.Add(Chunk("a", {1, 2}, 0)));
  ASSERT_OK(assembler.Add(Chunk("a", {3, 4, 5, 6}, 2)));
  ASSERT_OK(assembler.Add(Chunk("b", {0.5, -1, 2, 3}, 0)));  // bf16, the parameter's wire dtype
  ASSERT_OK(assembler.Finish(/*require_all=*/true));
  EXPECT_EQ(assembler.tensors()[0].values, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(assembler.tensors()[1].values, (std::vector<float>{0.5, -1, 2, 3}));
  EXPECT_DOUBLE_EQ(assembler.tensors()[0].sum_squares, 91.0);
}

// An upload's tensors grow with what arrived: a stream that sent the first element of a parameter
// of a million and stopped holds that element, not the parameter (a few bytes sent must not pin the
// whole model until the stream ends); whole, a tensor takes no more than its elements.
TEST(TensorAssemblerTest, AnUploadsTensorsHoldWhatArrivedNotTheWholeParameter) {
  v1::SessionSpec spec;
  auto* g = spec.add_groups();
  g->set_name("g");
  g->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  auto* big = spec.add_parameters();
  big->set_name("big");
  big->add_shape(1024);
  big->add_shape(1024);
  big->set_group("g");
  const SessionConfig config = ParseSessionSpec(spec, SpecLimits{}).value();
  TensorAssembler assembler(config, 1 << 20);
  ASSERT_OK(assembler.Add(Chunk("big", {1.5f}, 0)));
  EXPECT_LE(assembler.tensors()[0].values.capacity(), 2u);
  std::vector<float> whole(1 << 20);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<float>(i % 251) - 125.0f;
  whole[0] = 1.5f;
  for (size_t offset = 1; offset < whole.size(); offset += 100000) {
    const size_t end = std::min(whole.size(), offset + 100000);
    ASSERT_OK(assembler.Add(Chunk("big", std::vector<float>(whole.begin() + offset, whole.begin() + end), offset)));
  }
  ASSERT_OK(assembler.Finish(/*require_all=*/true));
  EXPECT_EQ(assembler.tensors()[0].values, whole);
  EXPECT_EQ(assembler.tensors()[0].values.capacity(), whole.size());
}

TEST(TensorAssemblerTest, AChunkMayOverrideTheWireDType) {
  const SessionConfig config = TwoParameters();
  TensorAssembler assembler(config, 1 << 20);
  ASSERT_OK(assembler.Add(Chunk("b", {0.1f, 0.2f, 0.3f, 0.4f}, 0, v1::DTYPE_FP32)));
  EXPECT_EQ(assembler.tensors()[1].values[0], 0.1f);
}

TEST(TensorAssemblerTest, RefusesWhatDoesNotFit) {
  const SessionConfig config = TwoParameters();
  TensorAssembler assembler(config, 16);
  EXPECT_THAT(assembler.Add(Chunk("zz", {1}, 0)), StatusIs(absl::StatusCode::kNotFound, "chunk.name"));
  const absl::Status too_large = assembler.Add(Chunk("a", {1, 2, 3, 4, 5}, 0));
  EXPECT_THAT(too_large, StatusIs(absl::StatusCode::kInvalidArgument, "exceed the chunk limit of 16"));
  EXPECT_EQ(ReasonOf(too_large), "CHUNK_TOO_LARGE");
  EXPECT_THAT(assembler.Add(Chunk("a", {1}, 1)), StatusIs(absl::StatusCode::kInvalidArgument, "chunk.offset"));
  ASSERT_OK(assembler.Add(Chunk("a", {1, 2, 3, 4}, 0)));
  EXPECT_THAT(assembler.Add(Chunk("a", {1, 2, 3}, 4)),
              StatusIs(absl::StatusCode::kInvalidArgument, "end at element 7"));
  EXPECT_THAT(assembler.Finish(false), StatusIs(absl::StatusCode::kInvalidArgument, "'a' is incomplete: 4 of 6"));
  v1::TensorChunk odd = Chunk("b", {1}, 0);
  odd.mutable_data()->push_back('x');
  EXPECT_THAT(assembler.Add(odd),
              StatusIs(absl::StatusCode::kInvalidArgument, "3 bytes is not a whole number of bf16"));
  v1::TensorChunk shaped = Chunk("a", {5, 6}, 4);
  shaped.add_shape(3);
  shaped.add_shape(2);
  EXPECT_THAT(assembler.Add(shaped), StatusIs(absl::StatusCode::kInvalidArgument, "chunk.shape"));
}

TEST(TensorAssemblerTest, AbsentTensorsAreAllowedOnlyWhenNotRequired) {
  const SessionConfig config = TwoParameters();
  TensorAssembler assembler(config, 1 << 20);
  ASSERT_OK(assembler.Add(Chunk("b", {1, 2, 3, 4}, 0)));
  EXPECT_OK(assembler.Finish(/*require_all=*/false));
  EXPECT_THAT(assembler.Finish(/*require_all=*/true), StatusIs(absl::StatusCode::kInvalidArgument, "'a' is missing"));
}

TEST(TensorAssemblerTest, NonFiniteValuesShowInTheSumOfSquares) {
  const SessionConfig config = TwoParameters();
  TensorAssembler assembler(config, 1 << 20);
  ASSERT_OK(assembler.Add(Chunk("a", {1, NAN, 3, 4, 5, 6}, 0)));
  EXPECT_FALSE(std::isfinite(assembler.tensors()[0].sum_squares));
}

// A tensor named in a step arrives whole: an empty chunk is no way to leave it out, whether it is
// the tensor's only chunk or one more after its last element.
TEST(TensorAssemblerTest, EmptyChunksAreRefused) {
  const SessionConfig config = TwoParameters();
  TensorAssembler alone(config, 1 << 20);
  v1::TensorChunk empty = Chunk("a", {}, 0);
  empty.add_shape(2);
  empty.add_shape(3);
  EXPECT_THAT(alone.Add(empty), StatusIs(absl::StatusCode::kInvalidArgument, "chunk.data: empty chunk for 'a'"));
  TensorAssembler after_the_end(config, 1 << 20);
  ASSERT_OK(after_the_end.Add(Chunk("a", {1, 2, 3, 4, 5, 6}, 0)));
  EXPECT_THAT(after_the_end.Add(Chunk("a", {}, 6)), StatusIs(absl::StatusCode::kInvalidArgument, "empty chunk"));
}

TEST(TensorAssemblerTest, SlotsBelongToStateTransfersOnly) {
  const SessionConfig config = TwoParameters();
  TensorAssembler assembler(config, 1 << 20);
  v1::TensorChunk chunk = Chunk("a", {1, 2, 3, 4, 5, 6}, 0);
  chunk.set_slot("momentum");
  EXPECT_THAT(assembler.Add(chunk),
              StatusIs(absl::StatusCode::kInvalidArgument, "chunk.slot: 'momentum' given for 'a'"));
  EXPECT_EQ(assembler.tensors()[0].received, 0);
}

// The fused decode: every value as wire::Decode gives it, and a sum of squares equal to the plain
// running sum up to rounding (exact here: small integers), non-finite when a value is.
TEST(TensorAssemblerTest, DecodeSumSquaresDecodesAndSumsInOnePass) {
  std::vector<float> values(4096 * 2 + 13);
  double expected = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = static_cast<float>(static_cast<int>(i % 23) - 11);
    expected += static_cast<double>(values[i]) * values[i];
  }
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    std::string bytes;
    wire::Encode(dtype, values, &bytes);
    std::vector<float> out(values.size());
    EXPECT_EQ(DecodeSumSquares(dtype, bytes, out), expected) << static_cast<int>(dtype);
    EXPECT_EQ(out, values);
  }
  values[5000] = INFINITY;
  std::string bytes;
  wire::Encode(v1::DTYPE_FP32, values, &bytes);
  std::vector<float> out(values.size());
  EXPECT_FALSE(std::isfinite(DecodeSumSquares(v1::DTYPE_FP32, bytes, out)));
}

// The sum of squares has the bits of its definition — eight fp64 partial sums, element i into sum
// i % 8 (the tail into sum 0), each product rounded before its add, combined pairwise — whatever
// instructions compute it, for values whose squares span the whole fp32 range.
TEST(TensorAssemblerTest, TheSumOfSquaresHasTheBitsOfItsDefinition) {
  for (size_t n : {0, 1, 7, 8, 9, 4095, 4096, 4097, 3 * 4096 + 5}) {
    std::vector<float> values(n);
    for (size_t i = 0; i < n; ++i) {
      values[i] = std::ldexp(std::sin(1.3f * static_cast<float>(i) + 0.1f), static_cast<int>(i % 61) - 30);
    }
    double expected = 0;
    for (size_t begin = 0; begin < n; begin += 4096) {  // DecodeSumSquares' blocks
      double part[8] = {};
      const size_t end = std::min(n, begin + 4096);
      size_t i = begin;
      for (; i + 8 <= end; i += 8) {
        for (size_t k = 0; k < 8; ++k) part[k] += static_cast<double>(values[i + k]) * values[i + k];
      }
      for (; i < end; ++i) part[0] += static_cast<double>(values[i]) * values[i];
      expected += ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    }
    std::string bytes;
    wire::Encode(v1::DTYPE_FP32, values, &bytes);
    std::vector<float> out(n);
    EXPECT_EQ(DecodeSumSquares(v1::DTYPE_FP32, bytes, out), expected) << n;
  }
}

// A payload received in pieces (gRPC's receive slices, cut anywhere, elements straddling two) decodes
// to the same values and the same bits of the sum as the whole payload: the norm, the clipping and
// the non-finite skip cannot depend on how the network split a chunk.
TEST(TensorAssemblerTest, PiecesDecodeAndSumLikeTheWholePayload) {
  std::vector<float> values(4096 * 3 + 7);
  for (size_t i = 0; i < values.size(); ++i) values[i] = std::sin(0.37f * static_cast<float>(i)) * 1e-3f;
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16}) {
    std::string bytes;
    wire::Encode(dtype, values, &bytes);
    std::vector<float> whole(values.size());
    const double expected = DecodeSumSquares(dtype, bytes, whole);
    std::vector<absl::string_view> pieces;
    for (size_t begin = 0; begin < bytes.size();) {
      const size_t n = std::min<size_t>(bytes.size() - begin, 8191 + begin % 5);  // odd lengths
      pieces.push_back(absl::string_view(bytes).substr(begin, n));
      begin += n;
    }
    std::vector<float> split(values.size());
    const double sum = DecodeSumSquares(dtype, pieces, split);
    EXPECT_EQ(std::memcmp(&sum, &expected, sizeof(sum)), 0) << static_cast<int>(dtype);
    EXPECT_EQ(split, whole);
  }
}

}  // namespace
}  // namespace muond::transport
