// The C++ client's CUDA IPC steps (client/cuda_ipc_stepper.h) against the real daemon. On a daemon
// without a GPU the stepper is refused up front, naming the transport; on `muond --backend cuda`
// (skipped, with the daemon's reason, without a usable GPU) steps from device memory train exactly as
// the same steps over gRPC, a retried step is a replay, and bad references are refused naming the
// field with nothing applied.
#include <cuda_runtime_api.h>

#include <cmath>
#include <string>
#include <vector>

#include "client/cuda_ipc_stepper.h"
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

}  // namespace
}  // namespace muond::testing
