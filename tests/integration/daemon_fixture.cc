#include "tests/integration/daemon_fixture.h"

#include <cmath>

#include "grpcpp/grpcpp.h"
#include "proto/wire/dtype_codec.h"

namespace muond::testing {

DaemonProcess* DaemonTest::daemon_ = nullptr;
std::unique_ptr<client::Client> DaemonTest::client_;

void DaemonTest::SetUpTestSuite() {
  daemon_ = new DaemonProcess();
  std::string error;
  ASSERT_TRUE(daemon_->Start({"--backend", "cpu"}, &error)) << error;
  client::ClientOptions options = testing::TestClientOptions();
  options.endpoint = daemon_->endpoint();
  options.chunk_bytes = 64;  // tiny chunks, so every tensor travels in several
  auto client = client::Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  client_ = std::move(*client);
}

void DaemonTest::TearDownTestSuite() {
  client_.reset();
  if (daemon_ != nullptr) {
    // The daemon must have survived every test and must stop cleanly on SIGTERM.
    EXPECT_FALSE(daemon_->Exited()) << "muond exited during the tests";
    const int status = daemon_->Stop();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "muond exit status " << status;
    delete daemon_;
    daemon_ = nullptr;
  }
}

void DaemonTest::SetUp() {
  ASSERT_NE(client_, nullptr);
  ASSERT_FALSE(daemon_->Exited()) << "muond is not running";
}

v1::SessionSpec DaemonTest::SmallSpec(v1::DType wire_dtype) {
  v1::SessionSpec spec;
  auto* matrices = spec.add_groups();
  matrices->set_name("matrices");
  matrices->mutable_options()->set_optimizer(v1::OPTIMIZER_MUON);
  auto* vectors = spec.add_groups();
  vectors->set_name("vectors");
  vectors->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  auto* w = spec.add_parameters();
  w->set_name("w");
  w->add_shape(8);
  w->add_shape(4);
  w->set_wire_dtype(wire_dtype);
  w->set_group("matrices");
  auto* b = spec.add_parameters();
  b->set_name("b");
  b->add_shape(4);
  b->set_wire_dtype(wire_dtype);
  b->set_group("vectors");
  return spec;
}

std::vector<float> DaemonTest::Initial(const std::string& name, size_t count) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = 0.1f * std::sin(1.0f + i + (name == "b" ? 100.0f : 0.0f));
  return v;
}

std::vector<float> DaemonTest::Gradient(const std::string& name, int step, size_t count) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = std::cos(0.7f * i + 1.3f * step + (name == "b" ? 0.5f : 0.0f));
  return v;
}

std::vector<client::TensorView> DaemonTest::Gradients(int step) {
  gradient_storage_ = {Gradient("w", step, 32), Gradient("b", step, 4)};
  return {{"w", {8, 4}, gradient_storage_[0]}, {"b", {4}, gradient_storage_[1]}};
}

std::unique_ptr<client::Session> DaemonTest::NewSession(const std::string& id, v1::DType wire_dtype) {
  auto session = client_->CreateSession(id, SmallSpec(wire_dtype));
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return nullptr;
  const std::vector<float> w = Initial("w", 32), b = Initial("b", 4);
  const std::vector<client::TensorView> initial = {{"w", {8, 4}, w}, {"b", {4}, b}};
  absl::Status uploaded = (*session)->UploadParameters(initial);
  EXPECT_TRUE(uploaded.ok()) << uploaded;
  return std::move(*session);
}

v1::TensorChunk DaemonTest::Chunk(const std::string& name, const std::vector<float>& values, v1::DType dtype,
                                  uint64_t offset) {
  v1::TensorChunk chunk;
  chunk.set_name(name);
  chunk.set_offset(offset);
  chunk.set_dtype(dtype);
  if (wire::IsConcrete(dtype)) wire::Encode(dtype, values, chunk.mutable_data());
  return chunk;
}

grpc::Status DaemonTest::RawStep(const v1::StepHeader& header, const std::vector<v1::TensorChunk>& chunks,
                                 v1::StepResult* result) {
  std::vector<v1::StepRequest> messages(1);
  *messages[0].mutable_header() = header;
  // The count the client library would announce, unless the test set its own.
  if (!header.has_num_chunks()) messages[0].mutable_header()->set_num_chunks(static_cast<uint32_t>(chunks.size()));
  for (const v1::TensorChunk& chunk : chunks) *messages.emplace_back().mutable_chunk() = chunk;
  return RawStepMessages(messages, result);
}

grpc::Status DaemonTest::RawStepMessages(const std::vector<v1::StepRequest>& messages, v1::StepResult* result) {
  grpc::ClientContext context;
  auto stream = client_->stub().Step(&context);
  for (const v1::StepRequest& request : messages) {
    if (!stream->Write(request)) break;
  }
  stream->WritesDone();
  v1::StepResponse response;
  while (stream->Read(&response)) {
    if (response.has_result() && result != nullptr) *result = response.result();
  }
  return stream->Finish();
}

}  // namespace muond::testing
