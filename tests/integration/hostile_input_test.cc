// Hostile input against the real daemon: streams the client cancels halfway, chunks past the chunk
// limit and past gRPC's message limit, bytes on the port that are not gRPC at all, and hundreds of
// random well-formed requests that are each wrong somewhere. Every test starts from a session with
// three applied steps; afterwards that session must be exactly as it was (parameters, every optimizer
// slot, step counts, last step), the daemon must still be running, and the next step must apply.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/muond_client.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "proto/wire/dtype_codec.h"
#include "tests/integration/daemon_process.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;

constexpr size_t kMaxChunkBytes = 4096;  // the daemon's --max-chunk-bytes in these tests
constexpr int64_t kRows = 64, kCols = 32, kBias = 32;
constexpr int kTrainedSteps = 3;

// Everything GetState returns, to compare a session before and after.
struct StateDump {
  int64_t last_step = -1;
  std::map<std::string, int64_t> step_counts;
  std::map<std::string, std::string> tensors;  // "name/slot" → the fp32 bytes
  bool operator==(const StateDump&) const = default;
};

std::vector<float> Values(const std::string& name, int step, size_t count) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = std::cos(0.37f * i + 1.1f * step + (name == "b" ? 0.5f : 0.0f));
  return v;
}

v1::TensorChunk Chunk(const std::string& name, std::span<const float> values, uint64_t offset,
                      v1::DType dtype = v1::DTYPE_FP32) {
  v1::TensorChunk chunk;
  chunk.set_name(name);
  chunk.set_offset(offset);
  chunk.set_dtype(dtype);
  wire::Encode(dtype, values, chunk.mutable_data());
  return chunk;
}

// Every value of "w" then "b" for `step` (0: the initial values), `per_chunk` elements a chunk.
std::vector<v1::TensorChunk> TensorChunks(int step, size_t per_chunk, const std::string& slot = "") {
  std::vector<v1::TensorChunk> chunks;
  for (const auto& [name, count] : {std::pair<std::string, size_t>{"w", kRows * kCols}, {"b", kBias}}) {
    const std::vector<float> values = Values(name, step, count);
    for (size_t offset = 0; offset < count; offset += per_chunk) {
      const size_t n = std::min(per_chunk, count - offset);
      v1::TensorChunk& chunk = chunks.emplace_back(Chunk(name, std::span(values).subspan(offset, n), offset));
      chunk.set_slot(slot);
    }
  }
  return chunks;
}

class HostileInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = new DaemonProcess();
    std::string error;
    ASSERT_TRUE(daemon_->Start({"--backend", "cpu", "--max-chunk-bytes", std::to_string(kMaxChunkBytes)}, &error))
        << error;
    client::ClientOptions options;
    options.endpoint = daemon_->endpoint();
    options.chunk_bytes = 1024;
    options.rpc_timeout = std::chrono::seconds(60);
    auto client = client::Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }

  static void TearDownTestSuite() {
    client_.reset();
    if (daemon_ == nullptr) return;
    EXPECT_FALSE(daemon_->Exited()) << "muond exited during the tests";
    const int status = daemon_->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "muond exit status " << status;
    delete daemon_;
    daemon_ = nullptr;
  }

  static v1::SessionSpec Spec() {
    v1::SessionSpec spec;
    auto* matrices = spec.add_groups();
    matrices->set_name("matrices");
    matrices->mutable_options()->set_optimizer(v1::OPTIMIZER_MUON);
    auto* vectors = spec.add_groups();
    vectors->set_name("vectors");
    vectors->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
    auto* w = spec.add_parameters();
    w->set_name("w");
    w->add_shape(kRows);
    w->add_shape(kCols);
    w->set_group("matrices");
    auto* b = spec.add_parameters();
    b->set_name("b");
    b->add_shape(kBias);
    b->set_group("vectors");
    return spec;
  }

  // A session trained for kTrainedSteps, and what it looks like.
  void SetUp() override {
    ASSERT_NE(client_, nullptr);
    ASSERT_FALSE(daemon_->Exited()) << "muond is not running";
    id_ = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ASSERT_OK_AND_ASSIGN(session_, client_->CreateSession(id_, Spec()));
    ASSERT_OK(session_->UploadParameters(Views(0)));
    for (int step = 1; step <= kTrainedSteps; ++step) ASSERT_OK(session_->Step(step, Views(step)).status());
    ASSERT_OK_AND_ASSIGN(parameters_before_, session_->GetParameters());
    state_before_ = DumpState();
  }

  void TearDown() override {
    if (session_ != nullptr) {
      EXPECT_OK(session_->Close());
    }
  }

  std::vector<client::TensorView> Views(int step) {
    storage_ = {Values("w", step, kRows * kCols), Values("b", step, kBias)};
    return {{"w", {kRows, kCols}, storage_[0]}, {"b", {kBias}, storage_[1]}};
  }

  v1::StepHeader Header(int64_t step) const {
    v1::StepHeader header;
    header.set_session_id(id_);
    header.set_step(step);
    return header;
  }

  StateDump DumpState() const {
    StateDump dump;
    grpc::ClientContext context;
    client_->PrepareContext(context);
    v1::GetStateRequest request;
    request.set_session_id(id_);
    auto reader = client_->stub().GetState(&context, request);
    v1::GetStateResponse response;
    while (reader->Read(&response)) {
      if (response.has_header()) {
        dump.last_step = response.header().last_step();
        for (const auto& count : response.header().step_counts()) dump.step_counts[count.name()] = count.count();
      } else {
        dump.tensors[response.chunk().name() + "/" + response.chunk().slot()] += response.chunk().data();
      }
    }
    const grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << "GetState: " << status.error_message();
    return dump;
  }

  // The session is exactly as SetUp left it.
  void ExpectIntact() {
    int64_t last_step = 0;
    ASSERT_OK_AND_ASSIGN(client::ParameterMap after, session_->GetParameters(&last_step));
    EXPECT_EQ(last_step, kTrainedSteps);
    EXPECT_TRUE(after == parameters_before_) << "the parameters changed";
    const StateDump state = DumpState();
    EXPECT_EQ(state.last_step, kTrainedSteps);
    EXPECT_TRUE(state == state_before_) << "the optimizer state changed";
  }

  // ... and the daemon still applies the next step.
  void ExpectIntactAndServing() {
    ExpectIntact();
    ASSERT_FALSE(daemon_->Exited()) << "muond died";
    ASSERT_OK_AND_ASSIGN(client::StepReply reply, session_->Step(kTrainedSteps + 1, Views(kTrainedSteps + 1)));
    EXPECT_TRUE(reply.applied);
    EXPECT_FALSE(reply.replayed) << "step " << kTrainedSteps + 1 << " had been applied already";
    EXPECT_NE(reply.parameters, parameters_before_);
  }

  // Sends a step stream: the header, then `chunks`; half-closes and reads the answer.
  grpc::Status RawStep(const v1::StepHeader& header, const std::vector<v1::TensorChunk>& chunks,
                       v1::StepResult* result = nullptr) {
    grpc::ClientContext context;
    client_->PrepareContext(context);
    auto stream = client_->stub().Step(&context);
    v1::StepRequest request;
    *request.mutable_header() = header;
    // The count the client library would announce, unless the test set its own.
    if (!header.has_num_chunks()) request.mutable_header()->set_num_chunks(static_cast<uint32_t>(chunks.size()));
    bool open = stream->Write(request);
    for (size_t i = 0; open && i < chunks.size(); ++i) {
      request.Clear();
      *request.mutable_chunk() = chunks[i];
      open = stream->Write(request);
    }
    stream->WritesDone();
    v1::StepResponse response;
    while (stream->Read(&response)) {
      if (response.has_result() && result != nullptr) *result = response.result();
    }
    return stream->Finish();
  }

  // Upload and set-state streams: `first` messages (session id, header), then one chunk each.
  template <typename Request, typename Response, typename Open>
  grpc::Status RawClientStream(Open open, const std::vector<Request>& messages, int cancel_after = -1) {
    grpc::ClientContext context;
    client_->PrepareContext(context);
    Response response;
    auto writer = open(&context, &response);
    for (size_t i = 0; i < messages.size(); ++i) {
      if (static_cast<int>(i) == cancel_after) break;
      if (!writer->Write(messages[i])) break;
    }
    if (cancel_after >= 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      context.TryCancel();
    } else {
      writer->WritesDone();
    }
    return writer->Finish();
  }

  std::vector<v1::UploadParametersRequest> UploadMessages(const std::string& id,
                                                          const std::vector<v1::TensorChunk>& chunks) {
    std::vector<v1::UploadParametersRequest> messages(1);
    messages[0].set_session_id(id);
    for (const v1::TensorChunk& chunk : chunks) *messages.emplace_back().mutable_chunk() = chunk;
    return messages;
  }

  grpc::Status Upload(const std::vector<v1::UploadParametersRequest>& messages, int cancel_after = -1) {
    return RawClientStream<v1::UploadParametersRequest, v1::UploadParametersResponse>(
        [](grpc::ClientContext* c, v1::UploadParametersResponse* r) { return client_->stub().UploadParameters(c, r); },
        messages, cancel_after);
  }

  grpc::Status SetState(const std::vector<v1::SetStateRequest>& messages, int cancel_after = -1) {
    return RawClientStream<v1::SetStateRequest, v1::SetStateResponse>(
        [](grpc::ClientContext* c, v1::SetStateResponse* r) { return client_->stub().SetState(c, r); }, messages,
        cancel_after);
  }

  // A complete, valid state for the session that differs from its own (so that applying it would
  // show): step 10, every slot filled from step 7's values.
  std::vector<v1::SetStateRequest> OtherState() const {
    std::vector<v1::SetStateRequest> messages(2);
    messages[0].set_session_id(id_);
    v1::StateHeader* header = messages[1].mutable_header();
    header->set_last_step(10);
    for (const char* name : {"w", "b"}) {
      v1::ParameterStepCount* count = header->add_step_counts();
      count->set_name(name);
      count->set_count(10);
    }
    for (const auto& [slot, names] : std::vector<std::pair<std::string, std::vector<std::string>>>{
             {"master", {"w", "b"}}, {"momentum", {"w"}}, {"exp_avg", {"b"}}, {"exp_avg_sq", {"b"}}}) {
      for (const v1::TensorChunk& chunk : TensorChunks(7, 256, slot)) {
        if (std::find(names.begin(), names.end(), chunk.name()) == names.end()) continue;
        v1::TensorChunk c = chunk;
        if (slot == "exp_avg_sq") {  // a second moment is never negative
          std::vector<float> v(c.data().size() / 4);
          std::memcpy(v.data(), c.data().data(), c.data().size());
          for (float& x : v) x = x * x;
          c.mutable_data()->assign(reinterpret_cast<const char*>(v.data()), c.data().size());
        }
        *messages.emplace_back().mutable_chunk() = c;
      }
    }
    return messages;
  }

  static DaemonProcess* daemon_;
  static std::unique_ptr<client::Client> client_;
  std::string id_;
  std::unique_ptr<client::Session> session_;
  client::ParameterMap parameters_before_;
  StateDump state_before_;
  std::vector<std::vector<float>> storage_;
};

DaemonProcess* HostileInputTest::daemon_ = nullptr;
std::unique_ptr<client::Client> HostileInputTest::client_;

// The client cancels a step stream after every possible number of chunks — including exactly at
// the boundary between "w" and "b", where what arrived is a complete gradient for "w" alone — both
// at once and after giving the daemon time to read what was sent. No cut may apply a step.
TEST_F(HostileInputTest, CancelledStepStreamsApplyNothing) {
  const std::vector<v1::TensorChunk> chunks = TensorChunks(kTrainedSteps + 1, 256);  // 8 of "w", 1 of "b"
  ASSERT_EQ(chunks.size(), 9u);
  for (int pause_ms : {0, 2, 20}) {
    for (size_t cut = 0; cut < chunks.size(); ++cut) {
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
      if (pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
      context.TryCancel();
      v1::StepResponse response;
      while (stream->Read(&response)) {
      }
      EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED) << "cut after " << cut << " chunks";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a late handler would have applied by now
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
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
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
TEST_F(HostileInputTest, StepWhoseFirstChunkIsOverGrpcsLimitAppliesNothing) {
  const std::vector<float> huge(4u << 20, 0.25f);  // a 16 MiB message
  const grpc::Status status = RawStep(Header(kTrainedSteps + 1), {Chunk("w", huge, 0)});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ExpectIntactAndServing();
}

TEST_F(HostileInputTest, StepCutShortAfterOneTensorByAnOversizedChunkAppliesNothing) {
  std::vector<v1::TensorChunk> chunks = TensorChunks(kTrainedSteps + 1, 1024);  // 2 of "w", 1 of "b"
  chunks.back() = Chunk("b", std::vector<float>(4u << 20, 0.25f), 0);
  const grpc::Status status = RawStep(Header(kTrainedSteps + 1), chunks);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ExpectIntactAndServing();
}

// Connects to the daemon's port, sends `bytes`, reads whatever comes back for up to `linger` and
// closes. Returns the socket still open instead when `keep_open` (the caller closes it).
int SendRaw(int port, const std::string& bytes, std::chrono::milliseconds linger, bool keep_open = false) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    return -1;
  }
  for (size_t sent = 0; sent < bytes.size();) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the daemon hung up on us: fine
    sent += static_cast<size_t>(n);
  }
  const auto deadline = std::chrono::steady_clock::now() + linger;
  char buffer[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 10) <= 0) continue;
    if (recv(fd, buffer, sizeof buffer, 0) <= 0) break;  // closed by the daemon
  }
  if (keep_open) return fd;
  close(fd);
  return 0;
}

// Bytes that are not gRPC: random noise, HTTP/1.1, every prefix of the HTTP/2 preface, the preface
// followed by broken frames, a TLS hello to a plaintext port, and idle connections held open while a
// real client works.
TEST_F(HostileInputTest, GarbageOnThePortIsDroppedAndChangesNothing) {
  const int port = daemon_->port();
  std::mt19937 rng(1234);
  auto random_bytes = [&](size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  };
  const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  std::vector<std::string> inputs = {
      "",
      "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
      "POST /muond.v1.Muond/Step HTTP/1.1\r\nContent-Type: application/grpc\r\nContent-Length: 5\r\n\r\nhello",
      std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11) + random_bytes(300),  // TLS ClientHello
      preface + random_bytes(64),
      // SETTINGS frame announcing a 16 MiB payload, then nothing.
      preface + std::string("\xff\xff\xff\x04\x00\x00\x00\x00\x00", 9),
      // HEADERS on stream 1 whose HPACK block is noise.
      preface + std::string("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9) +
          std::string("\x00\x00\x20\x01\x05\x00\x00\x00\x01", 9) + random_bytes(32),
      // DATA on a stream that was never opened.
      preface + std::string("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9) +
          std::string("\x00\x00\x05\x00\x01\x00\x00\x00\x07", 9) + "hello",
  };
  for (size_t n = 1; n < preface.size(); ++n) inputs.push_back(preface.substr(0, n));
  for (size_t n : {1, 7, 24, 1000, 70000}) inputs.push_back(random_bytes(n));
  for (const std::string& bytes : inputs) {
    ASSERT_EQ(SendRaw(port, bytes, std::chrono::milliseconds(20)), 0) << "cannot connect to port " << port;
  }
  ExpectIntact();

  // Half-open connections (a partial preface, noise, nothing) do not stop the real client.
  std::vector<int> held;
  for (int i = 0; i < 16; ++i) {
    const std::string bytes = i % 3 == 0 ? preface.substr(0, 10) : i % 3 == 1 ? random_bytes(100) : "";
    held.push_back(SendRaw(port, bytes, std::chrono::milliseconds(0), /*keep_open=*/true));
    ASSERT_GE(held.back(), 0);
  }
  ExpectIntact();
  for (int fd : held) close(fd);
  ASSERT_FALSE(daemon_->Exited()) << "muond died on bytes that are not gRPC";
  ExpectIntactAndServing();
}

// Random requests of the right message types, each wrong somewhere: random names, session ids,
// offsets, dtypes, shapes, step numbers, ranks, overrides, byte counts. None may change the
// session; each must be refused with a status that names a client error, never a crash.
class RandomRequests {
 public:
  RandomRequests(uint32_t seed, std::string id) : rng_(seed), id_(std::move(id)) {}

  int Int(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }
  bool Chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  template <typename T>
  T Pick(std::initializer_list<T> values) {
    return *(values.begin() + Int(static_cast<int>(values.size())));
  }

  std::string Text() {
    std::string s(Int(12), 'a');
    for (char& c : s) c = static_cast<char>(Pick<int>({'a', 'z', 'w', 'b', '.', '-', '_', '0', ' ', '/', '!'}));
    return s;
  }
  std::string SessionId() { return Pick<int>({0, 0, 1, 2, 3}) == 0 ? id_ : Pick<std::string>({"", "no-such", id_ + "x", "bad id!"}); }
  std::string ParameterName() { return Pick<int>({0, 1, 2}) < 2 ? Pick<std::string>({"w", "b"}) : Text(); }
  std::string GroupName() { return Chance(0.7) ? Pick<std::string>({"matrices", "vectors"}) : Text(); }
  v1::DType DType() { return static_cast<v1::DType>(Pick<int>({0, 1, 2, 3, 4, 99, -1})); }
  double Real() { return Pick<double>({0.0, 0.01, 0.9, 1.0, -1.0, 1e300, std::nan(""), INFINITY, -INFINITY}); }
  int64_t Huge() { return Pick<int64_t>({-1, 0, 1, 32, 64, 2048, int64_t{1} << 40, std::numeric_limits<int64_t>::max()}); }

  v1::TensorChunk RandomChunk() {
    v1::TensorChunk chunk;
    chunk.set_name(ParameterName());
    chunk.set_offset(Chance(0.5) ? 0 : static_cast<uint64_t>(Huge()));
    chunk.set_dtype(DType());
    const size_t bytes = Pick<size_t>({0, 1, 3, 4, 6, 128, 1024, 4096, 4100, 8192});
    std::string data(bytes, '\0');
    for (char& c : data) c = static_cast<char>(rng_());
    chunk.set_data(std::move(data));
    if (Chance(0.2)) chunk.set_slot(Pick<std::string>({"master", "momentum", "exp_avg", "exp_avg_sq", "nope"}));
    if (Chance(0.3)) {
      for (int d = Int(4); d > 0; --d) chunk.add_shape(Huge());
    }
    return chunk;
  }

  v1::StepHeader RandomHeader(int64_t next_step) {
    v1::StepHeader header;
    header.set_session_id(SessionId());
    header.set_step(Chance(0.6) ? next_step : Pick<int64_t>({-1, 0, 1, next_step - 1, next_step + 1, 1 << 30}));
    header.set_rank(Chance(0.8) ? 0 : Pick<int>({-1, 1, 7}));
    for (int i = Int(3); i > 0; --i) {
      v1::GroupOverride* o = header.add_overrides();
      o->set_group(GroupName());
      if (Chance(0.7)) o->set_lr(Real());
      if (Chance(0.3)) o->set_momentum(Real());
      if (Chance(0.3)) o->set_weight_decay(Real());
    }
    if (Chance(0.3)) header.set_max_grad_norm(Real());
    if (Chance(0.3)) header.set_return_dtype(DType());
    if (Chance(0.3)) header.set_max_chunk_bytes(Pick<uint32_t>({1, 7, 4096, std::numeric_limits<uint32_t>::max()}));
    // Unset, the count of chunks actually sent is announced; otherwise a wrong one.
    if (Chance(0.1)) header.set_num_chunks(Pick<uint32_t>({0, 1, 1000, std::numeric_limits<uint32_t>::max()}));
    if (Chance(0.1)) {
      v1::QkClipLogits* logits = header.add_qk_logits();
      logits->set_query(ParameterName());
      logits->add_max_logits(Real());
    }
    return header;
  }

  // Something that makes a step request wrong however the rest came out.
  void Spoil(v1::StepHeader& header, std::vector<v1::TensorChunk>& chunks) {
    switch (Int(6)) {
      case 0: {
        v1::TensorChunk chunk = RandomChunk();
        chunk.set_name("not-a-parameter");
        chunks.push_back(chunk);
        break;
      }
      case 1: {
        v1::GroupOverride* o = header.add_overrides();
        o->set_group("matrices");
        o->set_lr(-1);
        break;
      }
      case 2:
        header.set_rank(5);
        break;
      case 3:
        header.set_max_grad_norm(-1);
        break;
      case 4:
        header.set_return_dtype(static_cast<v1::DType>(42));
        break;
      default:
        header.add_qk_logits()->set_query("w");  // the session has no QK-clip pairs
        break;
    }
  }

  v1::SessionSpec RandomSpec(const v1::SessionSpec& real) {
    v1::SessionSpec spec = real;
    switch (Int(5)) {
      case 0:
        spec.mutable_parameters(Int(2))->set_name(Text());
        break;
      case 1: {
        v1::ParameterSpec* p = spec.mutable_parameters(Int(2));
        p->clear_shape();
        // Small or refused: never a shape the daemon would have to allocate gigabytes for.
        for (int d = Chance(0.1) ? 9 : Int(4); d > 0; --d) p->add_shape(Pick<int64_t>({-1, 0, 1, 3, 64}));
        if (Chance(0.2)) p->add_shape(int64_t{1} << 40);
        break;
      }
      case 2:
        spec.mutable_parameters(Int(2))->set_wire_dtype(DType());
        break;
      case 3:
        spec.mutable_groups(Int(2))->mutable_options()->set_ns_steps(Pick<int>({-1, 0, 1, 1000}));
        break;
      default:
        spec.mutable_parameters(Int(2))->set_group(GroupName());
        spec.set_world_size(Pick<int>({-1, 0, 2, 1000}));
        break;
    }
    spec.add_parameters()->set_name("extra-" + std::to_string(Int(1000)));  // never the real spec
    return spec;
  }

  std::mt19937& rng() { return rng_; }

 private:
  std::mt19937 rng_;
  const std::string id_;
};

bool IsClientError(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::OUT_OF_RANGE:
      return true;
    default:
      return false;
  }
}

TEST_F(HostileInputTest, RandomWrongRequestsAreRefusedAndChangeNothing) {
  constexpr uint32_t kSeed = 20240607;
  constexpr int kRequests = 400;
  SCOPED_TRACE(::testing::Message() << "random requests from seed " << kSeed);
  RandomRequests random(kSeed, id_);
  const int64_t next = kTrainedSteps + 1;
  std::map<std::string, int> outcomes;  // "kind code" → count, printed at the end
  for (int i = 0; i < kRequests; ++i) {
    grpc::Status status;
    std::string kind;
    bool may_succeed = false;  // reads, replays, and sessions created under other ids
    switch (random.Int(7)) {
      case 0:
      case 1:
      case 2: {
        kind = "Step";
        v1::StepHeader header = random.RandomHeader(next);
        std::vector<v1::TensorChunk> chunks;
        for (int n = random.Int(10); n > 0; --n) chunks.push_back(random.RandomChunk());
        if (random.Chance(0.3)) {  // a real gradient in the mix, so the bad part is all that is wrong
          std::vector<v1::TensorChunk> real = TensorChunks(static_cast<int>(next), 512);
          chunks.insert(chunks.begin(), real.begin(), real.end());
        }
        if (header.session_id() == id_ && header.step() == next) random.Spoil(header, chunks);
        v1::StepResult result;
        status = RawStep(header, chunks, &result);
        may_succeed = status.ok() && result.replayed();
        break;
      }
      case 3: {
        kind = "CreateSession";
        const std::string id = random.Chance(0.7) ? id_ : "other-" + std::to_string(i);
        grpc::ClientContext context;
        client_->PrepareContext(context);
        v1::CreateSessionRequest request;
        request.set_session_id(id);
        *request.mutable_spec() = random.RandomSpec(Spec());
        v1::CreateSessionResponse response;
        status = client_->stub().CreateSession(&context, request, &response);
        if (status.ok()) {  // a valid spec under another id: a session of its own, closed again
          ASSERT_NE(id, id_) << "a different spec attached to the trained session";
          EXPECT_OK(client_->CloseSession(id));
          may_succeed = true;
        }
        break;
      }
      case 4: {
        kind = "UploadParameters";  // the trained session takes no upload; other ids do not exist
        std::vector<v1::TensorChunk> chunks = random.Chance(0.5) ? TensorChunks(0, 1024) : std::vector<v1::TensorChunk>{};
        for (int n = random.Int(4); n > 0; --n) chunks.push_back(random.RandomChunk());
        std::vector<v1::UploadParametersRequest> messages = UploadMessages(random.SessionId(), chunks);
        if (random.Chance(0.1)) messages.erase(messages.begin());
        status = Upload(messages);
        break;
      }
      case 5: {
        kind = "SetState";  // never complete: "b"'s exp_avg_sq is always missing
        std::vector<v1::SetStateRequest> messages = OtherState();
        std::erase_if(messages, [](const v1::SetStateRequest& m) {
          return m.has_chunk() && m.chunk().name() == "b" && m.chunk().slot() == "exp_avg_sq";
        });
        messages[0].set_session_id(random.SessionId());
        if (random.Chance(0.5)) messages[1].mutable_header()->set_last_step(random.Huge() * (random.Chance(0.5) ? -1 : 1));
        if (random.Chance(0.3)) messages[1].mutable_header()->mutable_step_counts(0)->set_count(-random.Huge());
        for (int n = random.Int(4); n > 0; --n) {
          v1::SetStateRequest& m = *messages.insert(messages.begin() + 2 + random.Int(static_cast<int>(messages.size()) - 1),
                                                    v1::SetStateRequest());
          *m.mutable_chunk() = random.RandomChunk();
        }
        status = SetState(messages);
        break;
      }
      default: {
        kind = "GetParameters";
        grpc::ClientContext context;
        client_->PrepareContext(context);
        v1::GetParametersRequest request;
        request.set_session_id(random.SessionId());
        for (int n = random.Int(3); n > 0; --n) request.add_names(random.ParameterName());
        request.set_dtype(random.DType());
        request.set_max_chunk_bytes(random.Pick<uint32_t>({0, 1, 3, 4096, std::numeric_limits<uint32_t>::max()}));
        auto reader = client_->stub().GetParameters(&context, request);
        v1::GetParametersResponse response;
        while (reader->Read(&response)) {
        }
        status = reader->Finish();
        may_succeed = true;
        break;
      }
    }
    ++outcomes[kind + " " + std::to_string(status.error_code())];
    if (status.ok()) {
      EXPECT_TRUE(may_succeed) << "request " << i << " (" << kind << ") was accepted";
    } else {
      EXPECT_TRUE(IsClientError(status.error_code()))
          << "request " << i << " (" << kind << "): " << status.error_code() << " " << status.error_message();
      EXPECT_FALSE(status.error_message().empty()) << "request " << i << " (" << kind << ") names no field";
    }
    if (i % 100 == 99) ExpectIntact();
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::string summary;
  for (const auto& [outcome, count] : outcomes) summary += " [" + outcome + "]x" + std::to_string(count);
  std::printf("outcomes by kind and status code:%s\n", summary.c_str());
  ExpectIntactAndServing();
}

}  // namespace
}  // namespace muond::testing
