// Hostile streams against the real daemon: streams the client cancels halfway, chunks past the
// chunk limit and past gRPC's message limit, and two streams of one step at once. The fixture (see
// hostile_input_fixture.h) checks that the trained session is untouched and the daemon serves.
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/hostile_input_fixture.h"

namespace muond::testing::hostile {
namespace {

using ::testing::HasSubstr;

// The client cancels a step stream after every possible number of chunks — including exactly at
// the boundary between "w" and "b", where what arrived is a complete gradient for "w" alone — once
// the daemon's handler runs, at once or after a pause that lets it read what was sent (the pauses
// only vary the interleaving). Each check waits until every handler has ended, so a late one
// cannot apply after it. No cut may apply a step.
TEST_F(HostileInputTest, CancelledStepStreamsApplyNothing) {
  const std::vector<v1::TensorChunk> chunks = TensorChunks(kTrainedSteps + 1, 256);  // 8 of "w", 1 of "b"
  ASSERT_EQ(chunks.size(), 9u);
  for (int pause_ms : {0, 2, 20}) {
    for (size_t cut = 0; cut < chunks.size(); ++cut) {
      const double ended = CallsEnded("Step");
      grpc::ClientContext context;
      client_->PrepareContext(context);
      auto stream = client_->stub().Step(&context);
      v1::StepRequest request;
      *request.mutable_header() = Header(kTrainedSteps + 1);
      request.mutable_header()->set_num_chunks(static_cast<uint32_t>(chunks.size()));
      bool open = stream->Write(request);
      for (size_t i = 0; open && i < cut; ++i) {
        request.Clear();
        *request.mutable_chunk() = chunks[i];
        open = stream->Write(request);
      }
      AwaitCallStarted("Step");
      if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
      context.TryCancel();
      v1::StepResponse response;
      while (stream->Read(&response)) {
      }
      EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED) << "cut after " << cut << " chunks";
      AwaitCallsEnded("Step", ended + 1);
    }
    ExpectIntact();
  }
  ExpectIntactAndServing();
}

// Two streams of the same step at once. The first is still sending while the client library sends
// the step whole; normally the first holds the session's staging buffers by then, so the second
// goes through the host path. Either way the step is applied once: the second stream gets it, the
// first the replay of it, and the steps after it match a session that never saw an overlap.
TEST_F(HostileInputTest, OverlappingStreamsOfOneStepApplyItOnce) {
  const int next = kTrainedSteps + 1;
  const std::vector<v1::TensorChunk> chunks = TensorChunks(next, 256);
  grpc::ClientContext context;
  client_->PrepareContext(context);
  auto slow = client_->stub().Step(&context);
  v1::StepRequest request;
  *request.mutable_header() = Header(next);
  request.mutable_header()->set_num_chunks(static_cast<uint32_t>(chunks.size()));
  ASSERT_TRUE(slow->Write(request));
  for (size_t i = 0; i < chunks.size() / 2; ++i) {
    request.Clear();
    *request.mutable_chunk() = chunks[i];
    ASSERT_TRUE(slow->Write(request));
  }
  ASSERT_OK_AND_ASSIGN(client::StepReply whole, session_->Step(next, Views(next)));
  EXPECT_TRUE(whole.applied);
  EXPECT_FALSE(whole.replayed);
  for (size_t i = chunks.size() / 2; i < chunks.size(); ++i) {
    request.Clear();
    *request.mutable_chunk() = chunks[i];
    ASSERT_TRUE(slow->Write(request));
  }
  slow->WritesDone();
  v1::StepResponse response;
  bool replayed = false;
  while (slow->Read(&response)) {
    if (response.has_result()) replayed = response.result().replayed();
  }
  ASSERT_TRUE(slow->Finish().ok());
  EXPECT_TRUE(replayed) << "the step was applied twice";
  ASSERT_OK_AND_ASSIGN(client::StepReply after, session_->Step(next + 1, Views(next + 1)));

  ASSERT_OK_AND_ASSIGN(auto reference, client_->CreateSession(id_ + ".reference", Spec()));
  ASSERT_OK(reference->UploadParameters(Views(0)));
  client::StepReply expected;
  for (int step = 1; step <= next + 1; ++step) {
    ASSERT_OK_AND_ASSIGN(expected, reference->Step(step, Views(step)));
  }
  EXPECT_EQ(after.parameters, expected.parameters);
  EXPECT_OK(reference->Close());
}

// Cancelled uploads leave a fresh session without parameters; cancelled state uploads leave the
// trained session as it was.
TEST_F(HostileInputTest, CancelledUploadsAndStateTransfersChangeNothing) {
  const std::string fresh = id_ + ".fresh";
  ASSERT_OK_AND_ASSIGN(auto other, client_->CreateSession(fresh, Spec()));
  const std::vector<v1::UploadParametersRequest> upload = UploadMessages(fresh, TensorChunks(0, 256));
  for (size_t cut = 0; cut < upload.size(); ++cut) {
    EXPECT_EQ(Upload(upload, static_cast<int>(cut)).error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_THAT(other->GetParameters(), StatusIs(absl::StatusCode::kFailedPrecondition, "no parameters"));
  EXPECT_OK(other->Close());

  const std::vector<v1::SetStateRequest> state = OtherState();
  for (size_t cut = 0; cut < state.size(); cut += 3) {
    EXPECT_EQ(SetState(state, static_cast<int>(cut)).error_code(), grpc::StatusCode::CANCELLED);
  }
  ExpectIntactAndServing();
}

// A chunk over --max-chunk-bytes is refused by the daemon naming the field; a message over gRPC's
// limit (the chunk limit plus 1 MiB) is refused by gRPC before the daemon sees it. In steps, uploads
// and state uploads alike.
TEST_F(HostileInputTest, OversizedChunksAreRefusedAndChangeNothing) {
  const std::vector<float> over(kMaxChunkBytes / 4 + 1, 0.25f);  // 4 bytes past the chunk limit
  const std::vector<float> huge(4u << 20, 0.25f);                // a 16 MiB message
  grpc::Status status = RawStep(Header(kTrainedSteps + 1), {Chunk("w", over, 0)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("chunk.data"));
  EXPECT_THAT(status.error_message(), HasSubstr("chunk limit"));
  ExpectIntact();
  {
    SCOPED_TRACE("a step whose header is over gRPC's message limit");
    v1::StepHeader header = Header(kTrainedSteps + 1);
    header.set_session_id(std::string(2u << 20, 'x'));
    status = RawStep(header, {});
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    ExpectIntact();
  }

  // Uploads are refused after the first step anyway; the size check must not make that worse.
  for (const auto& values : {over, huge}) {
    status = Upload(UploadMessages(id_, {Chunk("w", values, 0)}));
    EXPECT_TRUE(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                status.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
                status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED)
        << status.error_code() << ": " << status.error_message();
  }
  ExpectIntact();
  std::vector<v1::SetStateRequest> state = OtherState();
  state.resize(3);
  *state[2].mutable_chunk() = Chunk("w", over, 0);
  state[2].mutable_chunk()->set_slot("master");
  status = SetState(state);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("chunk.data"));
  *state[2].mutable_chunk() = Chunk("w", huge, 0);
  status = SetState(state);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  ExpectIntact();

  // An answer chunk size past the limit is bounded by it, not refused.
  grpc::ClientContext context;
  client_->PrepareContext(context);
  v1::GetParametersRequest request;
  request.set_session_id(id_);
  request.set_max_chunk_bytes(std::numeric_limits<uint32_t>::max());
  auto reader = client_->stub().GetParameters(&context, request);
  v1::GetParametersResponse response;
  while (reader->Read(&response)) EXPECT_LE(response.chunk().data().size(), kMaxChunkBytes);
  EXPECT_TRUE(reader->Finish().ok());
  ExpectIntactAndServing();
}

// A step stream that gRPC ends because a chunk message is over its limit must not be applied with
// the gradients that arrived before it: the client sees RESOURCE_EXHAUSTED, retries the step, and a
// retry of an applied step is answered as a replay, so the rest of its gradients would be lost. The
// daemon's handler cannot tell gRPC's failed read from a half-close (both end the read loop, and
// ServerContext::IsCancelled() is still false); the header's num_chunks tells it.
// The handler has the call (it reads the header before gRPC fails the oversized read), so the test
// waits for it to end.
TEST_F(HostileInputTest, StepWhoseFirstChunkIsOverGrpcsLimitAppliesNothing) {
  const std::vector<float> huge(4u << 20, 0.25f);  // a 16 MiB message
  const double ended = CallsEnded("Step");
  const grpc::Status status = RawStep(Header(kTrainedSteps + 1), {Chunk("w", huge, 0)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  AwaitCallsEnded("Step", ended + 1);
  ExpectIntactAndServing();
}

TEST_F(HostileInputTest, StepCutShortAfterOneTensorByAnOversizedChunkAppliesNothing) {
  std::vector<v1::TensorChunk> chunks = TensorChunks(kTrainedSteps + 1, 1024);  // 2 of "w", 1 of "b"
  chunks.back() = Chunk("b", std::vector<float>(4u << 20, 0.25f), 0);
  const double ended = CallsEnded("Step");
  const grpc::Status status = RawStep(Header(kTrainedSteps + 1), chunks);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  AwaitCallsEnded("Step", ended + 1);
  ExpectIntactAndServing();
}

}  // namespace
}  // namespace muond::testing::hostile
