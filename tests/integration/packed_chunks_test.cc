// Packed chunks (docs/protocol.md, "Packed chunks") against the real daemon (--max-chunk-bytes
// 4096): a step whose tensors share PackedChunks messages equals the same step in chunks; packed
// messages that break a rule are refused naming the field and change nothing; the answer packs
// small parameters only when the header asks.
#include "client/error_reason.h"
#include "proto/wire/chunk_frame.h"
#include "tests/integration/hostile_input_fixture.h"

namespace muond::testing::hostile {
namespace {

using ::testing::HasSubstr;

// Sends `messages` after `header` (num_chunks: their count); the answer's messages in *responses.
grpc::Status RawMessages(client::Client& client, v1::StepHeader header, const std::vector<v1::StepRequest>& messages,
                         std::vector<v1::StepResponse>* responses = nullptr) {
  grpc::ClientContext context;
  client.PrepareContext(context);
  auto stream = client.stub().Step(&context);
  header.set_num_chunks(static_cast<uint32_t>(messages.size()));
  v1::StepRequest first;
  *first.mutable_header() = header;
  bool open = stream->Write(first);
  for (size_t i = 0; open && i < messages.size(); ++i) open = stream->Write(messages[i]);
  stream->WritesDone();
  v1::StepResponse response;
  while (stream->Read(&response)) {
    if (responses != nullptr) responses->push_back(response);
  }
  return stream->Finish();
}

v1::StepRequest Packed(const std::vector<v1::TensorChunk>& chunks) {
  v1::StepRequest request;
  for (const v1::TensorChunk& chunk : chunks) *request.mutable_packed()->add_chunks() = chunk;
  return request;
}

v1::StepRequest Single(const v1::TensorChunk& chunk) {
  v1::StepRequest request;
  *request.mutable_chunk() = chunk;
  return request;
}

TEST_F(HostileInputTest, APackedStepEqualsTheSameStepInChunks) {
  // "w" (8 KiB) in 512-element chunks and "b" (128 B): "b" and the first chunk of "w" packed together,
  // the rest of "w" one chunk a message.
  const int step = kTrainedSteps + 1;
  const std::vector<v1::TensorChunk> chunks = TensorChunks(step, 512);  // 4 of "w", then "b"
  ASSERT_EQ(chunks.size(), 5u);
  std::vector<v1::StepRequest> messages = {Packed({chunks[4], chunks[0]})};
  for (size_t i = 1; i < 4; ++i) messages.push_back(Single(chunks[i]));
  std::vector<v1::StepResponse> answer;
  v1::StepHeader header = Header(step);
  header.set_packed_answer(true);
  const grpc::Status status = RawMessages(*client_, header, messages, &answer);
  ASSERT_TRUE(status.ok()) << status.error_message();
  // The answer packs "b" (128 bytes, at most a quarter of the answer's chunk size); "w" (8 KiB)
  // comes in chunks of its own.
  int packed = 0;
  for (const v1::StepResponse& response : answer) {
    if (!response.has_packed()) continue;
    ++packed;
    ASSERT_EQ(response.packed().chunks_size(), 1);
    EXPECT_EQ(response.packed().chunks(0).name(), "b");
  }
  EXPECT_EQ(packed, 1);
  int64_t last_step = 0;
  ASSERT_OK_AND_ASSIGN(client::ParameterMap packed_result, session_->GetParameters(&last_step));
  EXPECT_EQ(last_step, step);

  // The same step in chunks on a twin session reaches the same parameters.
  ASSERT_OK_AND_ASSIGN(auto twin, client_->CreateSession(session_->id() + "-twin", Spec()));
  ASSERT_OK(twin->UploadParameters(Views(0)));
  for (int s = 1; s <= kTrainedSteps; ++s) ASSERT_OK(twin->Step(s, Views(s)).status());
  ASSERT_OK_AND_ASSIGN(client::StepReply plain, twin->Step(step, Views(step)));
  EXPECT_EQ(plain.parameters, packed_result);
  ASSERT_OK(twin->Close());
}

TEST_F(HostileInputTest, AClientSendsChunksNoLargerThanTheDaemonTakes) {
  // The client's default chunks (1 MiB) exceed this daemon's limit, and "w" (8 KiB) in one chunk would
  // be refused: the client asks for the limit at its first CreateSession and sends chunks of it, and
  // trains exactly like the fixture's session (1 KiB chunks).
  client::ClientOptions options = testing::TestClientOptions();
  options.endpoint = daemon_->endpoint();
  ASSERT_GT(options.chunk_bytes, kMaxChunkBytes);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::Client> client, client::Client::Connect(options));
  EXPECT_EQ(client->chunk_bytes(), options.chunk_bytes);
  ASSERT_OK_AND_ASSIGN(auto twin, client->CreateSession(session_->id() + "-limit", Spec()));
  EXPECT_EQ(client->chunk_bytes(), kMaxChunkBytes);
  EXPECT_EQ(client->slice_pool().buffer_bytes(), kMaxChunkBytes);  // payload buffers of that size
  ASSERT_OK(twin->UploadParameters(Views(0)));
  for (int s = 1; s <= kTrainedSteps; ++s) ASSERT_OK(twin->Step(s, Views(s)).status());
  ASSERT_OK_AND_ASSIGN(client::ParameterMap got, twin->GetParameters());
  ASSERT_OK_AND_ASSIGN(client::ParameterMap want, session_->GetParameters());
  EXPECT_EQ(got, want);
  ASSERT_OK(twin->Close());
}

TEST_F(HostileInputTest, AnAnswerIsPackedOnlyWhenAsked) {
  std::vector<v1::StepRequest> messages;
  for (const v1::TensorChunk& chunk : TensorChunks(kTrainedSteps + 1, 512)) messages.push_back(Single(chunk));
  std::vector<v1::StepResponse> answer;
  const grpc::Status status = RawMessages(*client_, Header(kTrainedSteps + 1), messages, &answer);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_GT(answer.size(), 1u);
  for (const v1::StepResponse& response : answer) EXPECT_FALSE(response.has_packed());
}

TEST_F(HostileInputTest, PackedChunksOverTheChunkLimitAreRefusedAndChangeNothing) {
  // Two whole chunks of "w" (4096 bytes each): within the limit one by one, twice it together.
  const std::vector<v1::TensorChunk> chunks = TensorChunks(kTrainedSteps + 1, 1024);
  const grpc::Status status = RawMessages(*client_, Header(kTrainedSteps + 1), {Packed({chunks[0], chunks[1]})});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("packed.chunks"));
  EXPECT_THAT(status.error_message(), HasSubstr("--max-chunk-bytes"));
  EXPECT_EQ(client::ReasonOf(client::FromGrpcStatus(status)), v1::CHUNK_TOO_LARGE);
  ExpectIntactAndServing();
}

TEST_F(HostileInputTest, ABadPackedChunkIsRefusedNamingItAndChangesNothing) {
  const std::vector<v1::TensorChunk> chunks = TensorChunks(kTrainedSteps + 1, 256);
  v1::TensorChunk skipped = chunks[2];  // "w" from element 512, with 0 to 511 not sent
  grpc::Status status = RawMessages(*client_, Header(kTrainedSteps + 1), {Packed({chunks.back(), skipped})});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("packed.chunks[1].offset"));
  v1::TensorChunk unknown = chunks.back();
  unknown.set_name("nope");
  status = RawMessages(*client_, Header(kTrainedSteps + 1), {Packed({unknown})});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("packed.chunks[0].name"));
  ExpectIntactAndServing();
}

}  // namespace
}  // namespace muond::testing::hostile
