// HostileInputTest: the fixture of the hostile-input tests (hostile_input_test.cc: cancelled,
// oversized and overlapping streams; hostile_bytes_test.cc: bytes that are not gRPC and random wrong
// requests). One real daemon per test suite with a small --max-chunk-bytes; every test starts from a
// session with three applied steps and checks afterwards that it is exactly as it was (parameters,
// every optimizer slot, step counts, last step) and that the daemon still applies the next step.
// Test-only; not thread-safe.
#pragma once

#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client/muond_client.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "proto/wire/dtype_codec.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing::hostile {

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

inline std::vector<float> Values(const std::string& name, int step, size_t count) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = std::cos(0.37f * i + 1.1f * step + (name == "b" ? 0.5f : 0.0f));
  return v;
}

inline v1::TensorChunk Chunk(const std::string& name, std::span<const float> values, uint64_t offset,
                             v1::DType dtype = v1::DTYPE_FP32) {
  v1::TensorChunk chunk;
  chunk.set_name(name);
  chunk.set_offset(offset);
  chunk.set_dtype(dtype);
  wire::Encode(dtype, values, chunk.mutable_data());
  return chunk;
}

// Every value of "w" then "b" for `step` (0: the initial values), `per_chunk` elements a chunk.
inline std::vector<v1::TensorChunk> TensorChunks(int step, size_t per_chunk, const std::string& slot = "") {
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
    // Metrics on: the tests wait for the daemon's calls to start and end (muond_calls_*).
    ASSERT_TRUE(daemon_->Start(
        {"--backend", "cpu", "--max-chunk-bytes", std::to_string(kMaxChunkBytes), "--metrics-listen", "127.0.0.1:0"},
        &error))
        << error;
    client::ClientOptions options = testing::TestClientOptions();
    options.endpoint = daemon_->endpoint();
    options.chunk_bytes = 1024;
    options.rpc_timeout = std::chrono::seconds(60);
    auto client = client::Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    metrics_address_ = info->metrics_address();
  }

  // Calls of `method` the daemon has ended so far, and those whose handler runs now.
  static double CallsEnded(const std::string& method) {
    return std::max(0.0,
                    SumOfSamples(ScrapeMetrics(metrics_address_), "muond_calls_total", "method=\"" + method + "\""));
  }
  static double CallsRunning(const std::string& method) {
    return std::max(
        0.0, SumOfSamples(ScrapeMetrics(metrics_address_), "muond_calls_in_flight", "method=\"" + method + "\""));
  }
  // Waits until a handler of `method` runs (the daemon has the call).
  static void AwaitCallStarted(const std::string& method) {
    ASSERT_TRUE(Eventually([&] { return CallsRunning(method) >= 1; })) << "no " << method << " call started";
  }
  // Waits until `ended` calls of `method` have ended and none runs: no handler is left that could
  // still change the session.
  static void AwaitCallsEnded(const std::string& method, double ended) {
    ASSERT_TRUE(Eventually([&] { return CallsRunning(method) == 0 && CallsEnded(method) >= ended; }))
        << method << ": " << CallsEnded(method) << " of " << ended << " calls ended, " << CallsRunning(method)
        << " running";
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

  // Upload and set-state streams (`method`): `first` messages (session id, header), then one chunk
  // each. A stream cancelled after `cancel_after` messages is cancelled once the daemon's handler
  // runs, and returns once that handler has ended.
  template <typename Request, typename Response, typename Open>
  grpc::Status RawClientStream(const std::string& method, Open open, const std::vector<Request>& messages,
                               int cancel_after = -1) {
    const double ended = CallsEnded(method);
    grpc::ClientContext context;
    client_->PrepareContext(context);
    Response response;
    auto writer = open(&context, &response);
    for (size_t i = 0; i < messages.size(); ++i) {
      if (static_cast<int>(i) == cancel_after) break;
      if (!writer->Write(messages[i])) break;
    }
    if (cancel_after < 0) {
      writer->WritesDone();
      return writer->Finish();
    }
    AwaitCallStarted(method);
    context.TryCancel();
    const grpc::Status status = writer->Finish();
    AwaitCallsEnded(method, ended + 1);
    return status;
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
        "UploadParameters",
        [](grpc::ClientContext* c, v1::UploadParametersResponse* r) { return client_->stub().UploadParameters(c, r); },
        messages, cancel_after);
  }

  grpc::Status SetState(const std::vector<v1::SetStateRequest>& messages, int cancel_after = -1) {
    return RawClientStream<v1::SetStateRequest, v1::SetStateResponse>(
        "SetState", [](grpc::ClientContext* c, v1::SetStateResponse* r) { return client_->stub().SetState(c, r); },
        messages, cancel_after);
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

  static inline DaemonProcess* daemon_ = nullptr;
  static inline std::unique_ptr<client::Client> client_;
  static inline std::string metrics_address_;
  std::string id_;
  std::unique_ptr<client::Session> session_;
  client::ParameterMap parameters_before_;
  StateDump state_before_;
  std::vector<std::vector<float>> storage_;
};

}  // namespace muond::testing::hostile
