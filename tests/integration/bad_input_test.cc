// Bad input: every malformed request gets the documented status code with the offending field in
// its message, leaves the session exactly as it was, and the daemon keeps serving.
#include <cmath>
#include <string>

#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;

class BadInputTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    session_ = NewSession(::testing::UnitTest::GetInstance()->current_test_info()->name());
    ASSERT_NE(session_, nullptr);
    ASSERT_OK(session_->Step(1, Gradients(1)).status());
    ASSERT_OK_AND_ASSIGN(before_, session_->GetParameters());
  }

  // After a refused request: same parameters, same step, and the next step still works.
  void ExpectUnchangedAndServing() {
    int64_t last_step = 0;
    ASSERT_OK_AND_ASSIGN(client::ParameterMap after, session_->GetParameters(&last_step));
    EXPECT_EQ(last_step, 1);
    EXPECT_EQ(after, before_);
    ASSERT_OK_AND_ASSIGN(client::StepReply reply, session_->Step(2, Gradients(2)));
    EXPECT_TRUE(reply.applied);
  }

  v1::StepHeader Header(int64_t step = 2) {
    v1::StepHeader header;
    header.set_session_id(session_->id());
    header.set_step(step);
    return header;
  }

  std::unique_ptr<client::Session> session_;
  client::ParameterMap before_;
};

// A block-quantized chunk of all 32 elements of "w" (muond.v1.BlockQuantized): 8 bits, blocks of
// 16, every integer 1, scales 0.5 and 0.25.
v1::TensorChunk QuantizedChunk() {
  v1::TensorChunk chunk;
  chunk.set_name("w");
  chunk.set_data(std::string(32, '\x01'));
  v1::BlockQuantized* quantized = chunk.mutable_quantized();
  quantized->set_bits(8);
  quantized->set_block(16);
  quantized->set_count(32);
  const float scales[2] = {0.5f, 0.25f};
  quantized->set_scales(std::string(reinterpret_cast<const char*>(scales), sizeof(scales)));
  return chunk;
}

TEST_F(BadInputTest, AMalformedQuantizedChunkIsRefusedNamingTheField) {
  struct Case {
    const char* what;
    void (*spoil)(v1::TensorChunk&);
    const char* field;
  };
  const Case cases[] = {
      {"bits 3", [](v1::TensorChunk& c) { c.mutable_quantized()->set_bits(3); }, "chunk.quantized.bits"},
      {"block 0", [](v1::TensorChunk& c) { c.mutable_quantized()->set_block(0); }, "chunk.quantized.block"},
      {"count 0", [](v1::TensorChunk& c) { c.mutable_quantized()->set_count(0); }, "chunk.quantized.count"},
      {"count beyond the data", [](v1::TensorChunk& c) { c.mutable_quantized()->set_count(uint64_t{1} << 62); },
       "chunk.data"},
      {"a byte short", [](v1::TensorChunk& c) { c.mutable_data()->pop_back(); }, "chunk.data"},
      {"one scale", [](v1::TensorChunk& c) { c.mutable_quantized()->mutable_scales()->resize(4); },
       "chunk.quantized.scales"},
      {"4 bits in 32 bytes", [](v1::TensorChunk& c) { c.mutable_quantized()->set_bits(4); }, "chunk.data"},
  };
  for (const Case& bad : cases) {
    v1::TensorChunk chunk = QuantizedChunk();
    bad.spoil(chunk);
    grpc::Status status = RawStep(Header(), {chunk});
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad.what;
    EXPECT_THAT(status.error_message(), HasSubstr(bad.field)) << bad.what;
  }
  // Blocks count from the tensor's first element: a second chunk must start on a block.
  v1::TensorChunk first = QuantizedChunk(), second = QuantizedChunk();
  first.mutable_quantized()->set_count(8);
  first.mutable_data()->resize(8);
  first.mutable_quantized()->mutable_scales()->resize(4);
  second.set_offset(8);
  second.mutable_quantized()->set_count(24);
  second.mutable_data()->resize(24);
  grpc::Status status = RawStep(Header(), {first, second});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("chunk.offset: 8 is not a multiple of the block (16)"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, AQuantizedChunkIsAStepsGradientOnly) {
  // The same chunk as a step's gradient is taken (each element its integer times its scale).
  v1::StepResult result;
  ASSERT_TRUE(RawStep(Header(), {QuantizedChunk()}, &result).ok());
  EXPECT_TRUE(result.applied());
  EXPECT_DOUBLE_EQ(result.grad_norm(), std::sqrt(16 * 0.25 + 16 * 0.0625));
}

TEST_F(BadInputTest, WrongShapeIsInvalidArgumentNamingTheShape) {
  v1::TensorChunk chunk = Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32);
  chunk.add_shape(4);  // the transpose: right element count, wrong shape
  chunk.add_shape(8);
  grpc::Status status = RawStep(Header(), {chunk});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("chunk.shape"));
  EXPECT_THAT(status.error_message(), HasSubstr("[4, 8]"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, TooManyElementsIsInvalidArgumentNamingTheData) {
  grpc::Status status = RawStep(Header(), {Chunk("w", Gradient("w", 2, 33), v1::DTYPE_FP32)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("chunk.data"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, ByteCountNotAWholeNumberOfElementsIsInvalidArgument) {
  v1::TensorChunk chunk = Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32);
  chunk.mutable_data()->pop_back();
  grpc::Status status = RawStep(Header(), {chunk});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("chunk.data: 127 bytes"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, IncompleteTensorIsInvalidArgument) {
  grpc::Status status = RawStep(Header(), {Chunk("w", Gradient("w", 2, 16), v1::DTYPE_FP32)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("incomplete: 16 of 32"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, GapBetweenChunksIsInvalidArgumentNamingTheOffset) {
  grpc::Status status = RawStep(Header(), {Chunk("w", Gradient("w", 2, 16), v1::DTYPE_FP32),
                                           Chunk("w", Gradient("w", 2, 8), v1::DTYPE_FP32, 24)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("chunk.offset: expected 16"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, UnknownDTypeIsInvalidArgumentNamingTheDType) {
  v1::TensorChunk chunk = Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32);
  chunk.set_dtype(static_cast<v1::DType>(7));
  grpc::Status status = RawStep(Header(), {chunk});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("chunk.dtype: unknown dtype 7"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, UnknownReturnDTypeIsInvalidArgument) {
  v1::StepHeader header = Header();
  header.set_return_dtype(static_cast<v1::DType>(9));
  grpc::Status status = RawStep(header, {Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("header.return_dtype"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, UnknownParameterIsNotFoundNamingIt) {
  grpc::Status status = RawStep(
      Header(), {Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32), Chunk("nope", Gradient("w", 2, 4), v1::DTYPE_FP32)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("chunk.name: unknown parameter 'nope'"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, UnknownSessionIsNotFoundNamingIt) {
  v1::StepHeader header = Header();
  header.set_session_id("no-such-session");
  grpc::Status status = RawStep(header, {Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("no session 'no-such-session'"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, UnknownGroupInAnOverrideIsNotFound) {
  v1::StepHeader header = Header();
  header.add_overrides()->set_group("nope");
  grpc::Status status = RawStep(header, {Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("header.overrides[0].group"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, NegativeLearningRateIsInvalidArgument) {
  v1::StepHeader header = Header();
  auto* o = header.add_overrides();
  o->set_group("matrices");
  o->set_lr(-1);
  grpc::Status status = RawStep(header, {Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("header.overrides[0].lr"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, StreamShorterOrLongerThanAnnouncedIsRefused) {
  v1::StepHeader header = Header();
  header.set_num_chunks(2);  // announces "w" and "b", sends only "w"
  grpc::Status status = RawStep(header, {Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("ended after 1 of 2 announced chunks"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, MoreChunksThanAnnouncedIsRefused) {
  v1::StepHeader header = Header();
  header.set_num_chunks(1);
  grpc::Status status = RawStep(
      header, {Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32), Chunk("b", Gradient("b", 2, 4), v1::DTYPE_FP32)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("more chunks than the 1 announced"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, HeaderWithoutAChunkCountIsRefused) {
  v1::StepRequest request;
  *request.mutable_header() = Header();
  const grpc::Status status = RawStepMessages({request});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("header.num_chunks: required"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, StreamWithoutHeaderIsInvalidArgument) {
  v1::StepRequest request;
  *request.mutable_chunk() = Chunk("w", Gradient("w", 2, 32), v1::DTYPE_FP32);
  const grpc::Status status = RawStepMessages({request});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("header"));
  ExpectUnchangedAndServing();
}

TEST_F(BadInputTest, InvalidSpecsAreRefusedNamingTheField) {
  v1::SessionSpec spec = SmallSpec();
  spec.mutable_parameters(0)->set_shape(0, 0);
  EXPECT_THAT(client_->CreateSession("bad-spec", spec),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[0].shape"));
  spec = SmallSpec();
  spec.mutable_parameters(1)->set_group("nope");
  EXPECT_THAT(client_->CreateSession("bad-spec", spec),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[1].group"));
  spec = SmallSpec();
  spec.mutable_groups(0)->mutable_options()->set_ns_steps(0);
  EXPECT_THAT(client_->CreateSession("bad-spec", spec),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.groups[0].options.ns_steps"));
  spec = SmallSpec();
  spec.mutable_groups(1)->mutable_options()->set_ns_steps(3);  // not an AdamW option
  EXPECT_THAT(client_->CreateSession("bad-spec", spec),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.groups[1].options.ns_steps"));
  spec = SmallSpec();
  spec.mutable_parameters(1)->set_group("matrices");  // a vector cannot go to Muon
  EXPECT_THAT(client_->CreateSession("bad-spec", spec),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[1]"));
  spec = SmallSpec();
  spec.mutable_parameters(0)->set_wire_dtype(static_cast<v1::DType>(11));
  EXPECT_THAT(client_->CreateSession("bad-spec", spec),
              StatusIs(absl::StatusCode::kInvalidArgument, "spec.parameters[0].wire_dtype"));
  EXPECT_THAT(client_->CreateSession("bad id!", SmallSpec()),
              StatusIs(absl::StatusCode::kInvalidArgument, "session_id"));
  ASSERT_OK_AND_ASSIGN(auto sessions, client_->ListSessions());
  for (const auto& s : sessions) EXPECT_NE(s.session_id(), "bad-spec");
  ExpectUnchangedAndServing();
}

}  // namespace
}  // namespace muond::testing
