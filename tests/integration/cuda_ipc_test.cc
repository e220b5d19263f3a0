// The C++ client's CUDA IPC steps (client/cuda_ipc_stepper.h) against the real daemon. On a daemon
// without a GPU the stepper is refused up front, naming the transport; on `muond --backend cuda`
// (skipped, with the daemon's reason, without a usable GPU) steps from device memory train exactly as
// the same steps over gRPC, a retried step is a replay, bad references are refused naming the
// field with nothing applied, and ranks that hold parts (docs/ranks.md) step their parts from device
// memory bit for bit like one rank stepping the whole gradients over gRPC.
#include <cuda_runtime_api.h>

#include <cmath>
#include <future>
#include <string>
#include <vector>

#include "client/cuda_ipc_stepper.h"
#include "common/partition_rules.h"
#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/gpu_skip.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

using ::testing::HasSubstr;

// The integration tests' spec: w (8×4, Muon) and b (4, AdamW).
v1::SessionSpec Spec() { return DaemonTest::SmallSpec(); }
constexpr size_t kW = 32, kB = 4;

std::vector<float> Wave(size_t n, float phase) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.05f * std::sin(phase + 0.013f * static_cast<float>(i));
  return v;
}

TEST(CudaIpcStepperTest, ADaemonWithoutAGpuIsRefusedNamingTheTransport) {
  DaemonProcess cpu;
  std::string error;
  ASSERT_TRUE(cpu.Start({"--backend", "cpu"}, &error)) << error;
  client::ClientOptions options = TestClientOptions();
  options.endpoint = cpu.endpoint();
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(auto session, client->CreateSession("ipc-on-cpu", Spec()));
  const absl::StatusOr<std::unique_ptr<client::CudaIpcStepper>> stepper =
      client::CudaIpcStepper::Create(client.get(), session.get(), 0);
  EXPECT_EQ(stepper.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stepper.status().message(),
              HasSubstr("transport: 'cuda_ipc' is not possible: the daemon offers no CUDA IPC"));
}

// Device memory holding `values` (fp32).
struct DeviceVector {
  explicit DeviceVector(const std::vector<float>& values) : numel(values.size()) {
    EXPECT_EQ(cudaMalloc(&data, numel * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, values.data(), numel * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceVector() { cudaFree(data); }
  std::vector<float> Read() const {
    std::vector<float> out(numel);
    EXPECT_EQ(cudaMemcpy(out.data(), data, numel * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  void* data = nullptr;
  size_t numel = 0;
};

TEST(CudaIpcStepperTest, TrainsExactlyAsGrpcAndARetryIsAReplay) {
  DaemonProcess gpu;
  std::string error;
  if (!gpu.Start({"--backend", "cuda"}, &error)) MUOND_SKIP_WITHOUT_GPU() << "no usable GPU: " << error;
  client::ClientOptions options = TestClientOptions();
  options.endpoint = gpu.endpoint();
  options.transport = "grpc";
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(auto over_ipc, client->CreateSession("over-ipc", Spec()));
  ASSERT_OK_AND_ASSIGN(auto over_grpc, client->CreateSession("over-grpc", Spec()));
  const std::vector<float> w0 = Wave(kW, 0.1f), b0 = Wave(kB, 0.2f);
  const std::vector<client::TensorView> initial = {{"w", {8, 4}, w0}, {"b", {kB}, b0}};
  ASSERT_OK(over_ipc->UploadParameters(initial));
  ASSERT_OK(over_grpc->UploadParameters(initial));
  ASSERT_OK_AND_ASSIGN(auto stepper, client::CudaIpcStepper::Create(client.get(), over_ipc.get(), 0));
  DeviceVector w_out(w0), b_out(b0);
  for (int step = 1; step <= 5; ++step) {
    const std::vector<float> gw = Wave(kW, 1.0f + step), gb = Wave(kB, 2.0f + step);
    DeviceVector dw(gw), db(gb);
    const std::vector<client::DeviceTensor> grads = {{"w", dw.data, kW}, {"b", db.data, kB}};
    const std::vector<client::DeviceTensor> out = {{"w", w_out.data, kW}, {"b", b_out.data, kB}};
    ASSERT_OK_AND_ASSIGN(client::StepReply ipc, stepper->Step(step, grads, out));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_OK_AND_ASSIGN(client::StepReply grpc,
                         over_grpc->Step(step, std::vector<client::TensorView>{{"w", {8, 4}, gw}, {"b", {kB}, gb}}));
    EXPECT_TRUE(ipc.applied);
    // No clipping: the norm (summed on the device) does not enter the update, which is bit-identical.
    EXPECT_EQ(w_out.Read(), grpc.parameters.at("w")) << "step " << step;
    EXPECT_EQ(b_out.Read(), grpc.parameters.at("b")) << "step " << step;
    EXPECT_NEAR(ipc.grad_norm, grpc.grad_norm, 1e-6 * grpc.grad_norm);
    if (step == 5) {
      // The answer was lost: the same step again is a replay with the same parameters.
      ASSERT_EQ(cudaMemset(w_out.data, 0, kW * sizeof(float)), cudaSuccess);
      ASSERT_OK_AND_ASSIGN(client::StepReply again, stepper->Step(step, grads, out));
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(again.replayed);
      EXPECT_EQ(w_out.Read(), grpc.parameters.at("w"));
    }
  }
  // A wrong element count is refused before anything is sent; the daemon refuses a wrong byte size
  // naming the field, and nothing is applied either way.
  DeviceVector small(std::vector<float>(10, 1.0f));
  const std::vector<client::DeviceTensor> bad = {{"b", small.data, 10}};
  const absl::Status refused = stepper->Step(6, bad, {}).status();
  EXPECT_THAT(refused.message(), HasSubstr("gradients[0].numel"));
  v1::StepSharedRequest request;
  request.mutable_header()->set_session_id("over-ipc");
  request.mutable_header()->set_step(6);
  v1::SharedTensor* ref = request.add_gradients();
  ref->set_name("b");
  ref->set_region(stepper->region_name());
  ref->set_byte_size(kB * 4 - 4);
  grpc::ClientContext context;
  v1::StepSharedResponse response;
  const grpc::Status daemon = client->stub().StepCuda(&context, request, &response);
  EXPECT_EQ(daemon.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(daemon.error_message(), HasSubstr("gradients[0].byte_size"));
  EXPECT_EQ(over_ipc->last_step(), 5);
}

// Three ranks, both groups cut by rows: w's 8 rows as 3, 3, 2; b's 4 elements as 2, 2 and none for
// rank 2, whose DeviceTensor of b is empty.
TEST(CudaIpcStepperTest, RanksThatHoldPartsStepLikeOneRankOverGrpc) {
  DaemonProcess gpu;
  std::string error;
  if (!gpu.Start({"--backend", "cuda"}, &error)) MUOND_SKIP_WITHOUT_GPU() << "no usable GPU: " << error;
  constexpr int kWorld = 3;
  client::ClientOptions options = TestClientOptions();
  options.endpoint = gpu.endpoint();
  options.transport = "grpc";
  ASSERT_OK_AND_ASSIGN(auto client, client::Client::Connect(options));
  ASSERT_OK_AND_ASSIGN(auto whole, client->CreateSession("parts-reference", Spec()));
  v1::SessionSpec parted = Spec();
  parted.set_world_size(kWorld);
  for (v1::ParameterGroup& group : *parted.mutable_groups()) {
    group.mutable_partition()->set_kind(v1::PARTITION_KIND_ROWS);
  }
  const std::vector<float> w0 = Wave(kW, 0.1f), b0 = Wave(kB, 0.2f);
  ASSERT_OK(whole->UploadParameters(std::vector<client::TensorView>{{"w", {8, 4}, w0}, {"b", {kB}, b0}}));
  const auto part_of = [](const std::vector<float>& v, std::vector<int64_t> shape, int rank) {
    const ElementRange range = RowParts(shape, kWorld)[static_cast<size_t>(rank)];
    return std::vector<float>(v.begin() + range.begin, v.begin() + range.end);
  };
  struct Rank {
    std::unique_ptr<client::Session> session;
    std::unique_ptr<client::CudaIpcStepper> stepper;
    std::unique_ptr<DeviceVector> w_out, b_out;
  };
  std::vector<Rank> ranks(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    Rank& rank = ranks[static_cast<size_t>(r)];
    ASSERT_OK_AND_ASSIGN(rank.session, client->CreateSession("parts-over-ipc", parted));
    ASSERT_OK(rank.session->HoldParts(r));
    const std::vector<float> w = part_of(w0, {8, 4}, r), b = part_of(b0, {kB}, r);
    ASSERT_OK(rank.session->UploadParameters(std::vector<client::TensorView>{
        {"w", {static_cast<int64_t>(w.size())}, w}, {"b", {static_cast<int64_t>(b.size())}, b}}));
    ASSERT_OK_AND_ASSIGN(rank.stepper, client::CudaIpcStepper::Create(client.get(), rank.session.get(), 0));
    rank.w_out = std::make_unique<DeviceVector>(w);
    rank.b_out = std::make_unique<DeviceVector>(b);
  }
  for (int step = 1; step <= 3; ++step) {
    const std::vector<float> gw = Wave(kW, 1.0f + step), gb = Wave(kB, 2.0f + step);
    ASSERT_OK_AND_ASSIGN(client::StepReply want,
                         whole->Step(step, std::vector<client::TensorView>{{"w", {8, 4}, gw}, {"b", {kB}, gb}}));
    std::vector<std::future<absl::StatusOr<client::StepReply>>> sent;
    std::vector<std::unique_ptr<DeviceVector>> grads;
    for (int r = 0; r < kWorld; ++r) {
      grads.push_back(std::make_unique<DeviceVector>(part_of(gw, {8, 4}, r)));
      grads.push_back(std::make_unique<DeviceVector>(part_of(gb, {kB}, r)));
    }
    for (int r = 0; r < kWorld; ++r) {
      sent.push_back(std::async(std::launch::async, [&, r] {
        Rank& rank = ranks[static_cast<size_t>(r)];
        const DeviceVector& dw = *grads[2 * static_cast<size_t>(r)];
        const DeviceVector& db = *grads[2 * static_cast<size_t>(r) + 1];
        const std::vector<client::DeviceTensor> g = {{"w", dw.data, static_cast<int64_t>(dw.numel)},
                                                     {"b", db.data, static_cast<int64_t>(db.numel)}};
        const std::vector<client::DeviceTensor> out = {
            {"w", rank.w_out->data, static_cast<int64_t>(rank.w_out->numel)},
            {"b", rank.b_out->data, static_cast<int64_t>(rank.b_out->numel)}};
        client::StepOptions step_options;
        step_options.rank = r;
        return rank.stepper->Step(step, g, out, step_options);
      }));
    }
    for (int r = 0; r < kWorld; ++r) {
      absl::StatusOr<client::StepReply> reply = sent[static_cast<size_t>(r)].get();
      ASSERT_OK(reply.status()) << "rank " << r << " step " << step;
      EXPECT_TRUE(reply->applied);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int r = 0; r < kWorld; ++r) {
      const Rank& rank = ranks[static_cast<size_t>(r)];
      EXPECT_EQ(rank.w_out->Read(), part_of(want.parameters.at("w"), {8, 4}, r)) << "rank " << r << " step " << step;
      EXPECT_EQ(rank.b_out->Read(), part_of(want.parameters.at("b"), {kB}, r)) << "rank " << r << " step " << step;
    }
  }
}

}  // namespace
}  // namespace muond::testing
