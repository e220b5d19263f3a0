// Bad input: every malformed request gets the documented status code with the offending field in
// its message, leaves the session exactly as it was, and the daemon keeps serving.
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
