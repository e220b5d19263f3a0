// The requests a hostile client once got accepted, each sent to the real daemon over gRPC: every one
// is now refused with an error naming the field, and the trained session is exactly as it was
// (HostileInputTest checks its parameters, every slot, its step counts and its last step) and
// still serves the next step.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "tests/integration/hostile_input_fixture.h"

namespace muond::testing::hostile {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMaxStep = (int64_t{1} << 53) - 1;  // docs/protocol.md, Ranges and rules

// A valid state (OtherState) with its header's last step replaced.
std::vector<v1::SetStateRequest> WithLastStep(std::vector<v1::SetStateRequest> messages, int64_t last_step) {
  messages[1].mutable_header()->set_last_step(last_step);
  return messages;
}

void ExpectRefused(const grpc::Status& status, grpc::StatusCode code, const std::string& text) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(text));
}

// Finding 1: SetState accepted last_step 2^63 − 1, after which step −2^63 (last + 1, overflowed) was
// applied.
TEST_F(HostileInputTest, StepNumbersAndCountsOutsideTheRangeAreRefused) {
  for (int64_t last_step : {std::numeric_limits<int64_t>::max(), int64_t{1} << 62, kMaxStep + 1}) {
    ExpectRefused(SetState(WithLastStep(OtherState(), last_step)), grpc::StatusCode::INVALID_ARGUMENT,
                  "header.last_step: must be between 0 and 9007199254740991");
  }
  std::vector<v1::SetStateRequest> counts = OtherState();
  counts[1].mutable_header()->mutable_step_counts(0)->set_count(11);  // last_step is 10
  ExpectRefused(SetState(counts), grpc::StatusCode::INVALID_ARGUMENT, "header.step_counts: 'w' has count 11");
  for (int64_t step : {std::numeric_limits<int64_t>::min(), int64_t{0}, std::numeric_limits<int64_t>::max()}) {
    const grpc::Status status = RawStep(Header(step), TensorChunks(kTrainedSteps + 1, 1024));
    EXPECT_FALSE(status.ok()) << "step " << step;
    EXPECT_THAT(status.error_message(), HasSubstr("header.step")) << status.error_message();
  }
  ExpectIntactAndServing();
}

// A session may reach the last step there is; the step after it is refused, nothing wraps around.
TEST_F(HostileInputTest, TheLastStepHasNoSuccessor) {
  ASSERT_TRUE(SetState(WithLastStep(OtherState(), kMaxStep)).ok());
  ExpectRefused(RawStep(Header(kMaxStep + 1), TensorChunks(1, 1024)), grpc::StatusCode::INVALID_ARGUMENT,
                "header.step: must be between 1 and 9007199254740991");
  // Outside the range a step number may take, whatever step the session is at (docs/protocol.md, Ranges).
  ExpectRefused(RawStep(Header(std::numeric_limits<int64_t>::min()), TensorChunks(1, 1024)),
                grpc::StatusCode::INVALID_ARGUMENT, "header.step: must be between 1 and");
  int64_t last_step = 0;
  ASSERT_OK(session_->GetParameters(&last_step).status());
  EXPECT_EQ(last_step, kMaxStep);
}

// Finding 2: an empty chunk counted as leaving its tensor out — alone, with a shape, or after the
// tensor's last element.
TEST_F(HostileInputTest, EmptyChunksAreRefused) {
  const int next = kTrainedSteps + 1;
  v1::TensorChunk empty_b = Chunk("b", {}, 0);
  ExpectRefused(RawStep(Header(next), {empty_b}), grpc::StatusCode::INVALID_ARGUMENT,
                "chunk.data: empty chunk for 'b'");
  v1::TensorChunk empty_w = Chunk("w", {}, 0);
  empty_w.add_shape(kRows);
  empty_w.add_shape(kCols);
  ExpectRefused(RawStep(Header(next), {empty_w}), grpc::StatusCode::INVALID_ARGUMENT,
                "chunk.data: empty chunk for 'w'");
  std::vector<v1::TensorChunk> trailing = TensorChunks(next, 1024);
  trailing.push_back(Chunk("b", {}, kBias));
  ExpectRefused(RawStep(Header(next), trailing), grpc::StatusCode::INVALID_ARGUMENT, "empty chunk for 'b'");
  std::vector<v1::SetStateRequest> state = OtherState();
  *state.emplace_back().mutable_chunk() = Chunk("b", {}, kBias);
  state.back().mutable_chunk()->set_slot("master");
  ExpectRefused(SetState(state), grpc::StatusCode::INVALID_ARGUMENT, "empty chunk for 'b/master'");
  ExpectIntactAndServing();
}

// SetState took a tensor of the right size in any shape, and named an overrun as an offset: a
// shape that is not the tensor's is refused naming chunk.shape; elements beyond the tensor name
// chunk.data, and a gap or overlap chunk.offset.
TEST_F(HostileInputTest, SetStateChecksTheShapeAndNamesAnOverrunAsData) {
  std::vector<v1::SetStateRequest> transposed = OtherState();
  for (v1::SetStateRequest& message : transposed) {
    if (!message.has_chunk()) continue;
    v1::TensorChunk* chunk = message.mutable_chunk();
    if (chunk->name() == "w" && chunk->slot() == "momentum" && chunk->offset() == 0) {
      chunk->clear_shape();
      chunk->add_shape(kCols);
      chunk->add_shape(kRows);
    }
  }
  ExpectRefused(SetState(transposed), grpc::StatusCode::INVALID_ARGUMENT,
                "chunk.shape: w/momentum is [64, 32] here, got [32, 64]");
  for (const auto& [offset, text] :
       {std::pair<int64_t, std::string>{kBias,
                                        "chunk.data: b/master has at most 32 elements; this chunk brings it to 33"},
        {5, "chunk.offset: b/master expected offset 32, got 5"}}) {
    std::vector<v1::SetStateRequest> state = OtherState();
    const std::vector<float> one = {1.0f};
    *state.emplace_back().mutable_chunk() = Chunk("b", one, offset);
    state.back().mutable_chunk()->set_slot("master");
    ExpectRefused(SetState(state), grpc::StatusCode::INVALID_ARGUMENT, text);
  }
  ExpectIntactAndServing();
}

// A scalar parameter: its one element cannot be replaced by zero bytes either.
TEST_F(HostileInputTest, AnEmptyChunkDoesNotLeaveOutAScalar) {
  v1::SessionSpec spec;
  auto* group = spec.add_groups();
  group->set_name("scalars");
  group->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  auto* s = spec.add_parameters();
  s->set_name("s");
  s->set_group("scalars");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Session> scalar, client_->CreateSession(id_ + "-scalar", spec));
  std::vector<float> value = {0.5f};
  const std::vector<client::TensorView> views = {{"s", {}, value}};
  ASSERT_OK(scalar->UploadParameters(views));
  v1::StepHeader header = Header(1);
  header.set_session_id(id_ + "-scalar");
  ExpectRefused(RawStep(header, {Chunk("s", {}, 0)}), grpc::StatusCode::INVALID_ARGUMENT, "empty chunk for 's'");
  int64_t last_step = -1;
  ASSERT_OK(scalar->GetParameters(&last_step).status());
  EXPECT_EQ(last_step, 0);
  EXPECT_OK(scalar->Close());
}

// Finding 3: a finite but absurd override (lr 1e308) made the masters non-finite.
TEST_F(HostileInputTest, AbsurdOverridesAreRefused) {
  const int next = kTrainedSteps + 1;
  v1::StepHeader huge_lr = Header(next);
  auto* o = huge_lr.add_overrides();
  o->set_group("matrices");
  o->set_lr(1e308);
  ExpectRefused(RawStep(huge_lr, TensorChunks(next, 1024)), grpc::StatusCode::INVALID_ARGUMENT,
                "header.overrides[0].lr must be in [0, 100], got 1e+308");
  v1::StepHeader flipping = Header(next);
  o = flipping.add_overrides();
  o->set_group("vectors");
  o->set_lr(1);
  o->set_weight_decay(50);
  ExpectRefused(RawStep(flipping, TensorChunks(next, 1024)), grpc::StatusCode::INVALID_ARGUMENT,
                "header.overrides[0].lr * weight_decay must be <= 1");
  ExpectIntactAndServing();
}

// Within the ranges a step can still ask for more than fp32 holds (lr 100 times a gradient of 3e38):
// it is answered as not applied, saying why, and changes nothing but the step counter.
TEST_F(HostileInputTest, AStepThatWouldLeaveTheFp32RangeIsNotApplied) {
  const int next = kTrainedSteps + 1;
  v1::StepHeader header = Header(next);
  auto* o = header.add_overrides();
  o->set_group("vectors");
  o->set_lr(100);
  o->set_weight_decay(0);
  std::vector<float> huge(kBias, 3e38f);
  v1::StepResult result;
  ASSERT_TRUE(RawStep(header, {Chunk("b", huge, 0)}, &result).ok());
  EXPECT_FALSE(result.applied());
  EXPECT_THAT(result.skip_reason(), HasSubstr("the update could take 'b'"));
  const StateDump state = DumpState();
  EXPECT_EQ(state.last_step, next);
  StateDump expected = state_before_;
  expected.last_step = next;
  EXPECT_TRUE(state == expected) << "only the step counter moved";
}

// Finding 4: options that do not apply were ignored.
TEST_F(HostileInputTest, OptionsThatDoNotApplyAreRefused) {
  const int next = kTrainedSteps + 1;
  v1::StepHeader momentum = Header(next);
  auto* o = momentum.add_overrides();
  o->set_group("vectors");
  o->set_momentum(0.9);
  ExpectRefused(RawStep(momentum, TensorChunks(next, 1024)), grpc::StatusCode::INVALID_ARGUMENT,
                "header.overrides[0].momentum: does not apply to optimizer adamw");

  std::vector<v1::TensorChunk> with_slot = TensorChunks(next, 1024);
  with_slot[0].set_slot("momentum");
  ExpectRefused(RawStep(Header(next), with_slot), grpc::StatusCode::INVALID_ARGUMENT, "chunk.slot: 'momentum'");
  ExpectRefused(Upload(UploadMessages(id_, with_slot)), grpc::StatusCode::INVALID_ARGUMENT, "chunk.slot: 'momentum'");

  v1::SessionSpec qkv = Spec();
  qkv.mutable_parameters(1)->add_qkv_split(16);
  qkv.mutable_parameters(1)->add_qkv_split(8);
  qkv.mutable_parameters(1)->add_qkv_split(8);
  auto created = client_->CreateSession(id_ + "-qkv", qkv);
  ASSERT_FALSE(created.ok());
  EXPECT_THAT(created.status().message(),
              HasSubstr("spec.parameters[1] 'b': qkv_split applies only to parameters of Muon groups"));
  ExpectIntactAndServing();
}

// Finding 5: NaN in uploaded values and SetState slots, and names with NUL or control characters.
TEST_F(HostileInputTest, NonFiniteValuesAndControlCharactersAreRefused) {
  v1::SessionSpec spec = Spec();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Session> fresh, client_->CreateSession(id_ + "-fresh", spec));
  std::vector<v1::TensorChunk> nan_upload = TensorChunks(0, 1024);
  std::vector<float> with_nan(kBias, 0.25f);
  with_nan[5] = std::nanf("");
  nan_upload.back() = Chunk("b", with_nan, 0);
  ExpectRefused(Upload(UploadMessages(id_ + "-fresh", nan_upload)), grpc::StatusCode::INVALID_ARGUMENT,
                "chunk.data: 'b' has the value nan at element 5");
  EXPECT_OK(fresh->Close());

  std::vector<v1::SetStateRequest> nan_state = OtherState();
  for (v1::SetStateRequest& message : nan_state) {
    if (message.has_chunk() && message.chunk().slot() == "momentum") {
      std::vector<float> values(message.chunk().data().size() / 4, std::numeric_limits<float>::infinity());
      *message.mutable_chunk() = Chunk("w", values, message.chunk().offset());
      message.mutable_chunk()->set_slot("momentum");
      break;
    }
  }
  ExpectRefused(SetState(nan_state), grpc::StatusCode::INVALID_ARGUMENT, "'w/momentum' has the value inf");

  for (const std::string& name : {std::string("w\0x", 3), std::string("w\n"), std::string("\x1b[2Jw")}) {
    v1::SessionSpec bad = Spec();
    bad.mutable_parameters(0)->set_name(name);
    auto created = client_->CreateSession(id_ + "-names", bad);
    ASSERT_FALSE(created.ok());
    EXPECT_THAT(created.status().message(),
                HasSubstr("spec.parameters[0].name: must be 1 to 256 bytes without control"));
  }
  ExpectIntactAndServing();
}

}  // namespace
}  // namespace muond::testing::hostile
