// The daemon on a GPU, end to end: `muond --backend cuda` driven by the C++ client trains the same
// parameters as `muond --backend cpu` from the same start, with gradients that depend on the
// parameters each daemon returned (so a wrong step shows in every later one). Tensors span several
// chunks, so their gradients reach the GPU through the pinned staging while the stream is read;
// every other step is clipped (on the GPU). Skips, with the daemon's own reason, without a usable
// GPU.
#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "tests/integration/daemon_fixture.h"
#include "tests/testing/gpu_skip.h"
#include "tests/testing/status_matchers.h"

namespace muond::testing {
namespace {

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  size_t numel() const {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    return n;
  }
};

// Two same-shape matrices (batched together in Newton–Schulz), a tall one and a vector.
const std::vector<Param> kParams = {{"a", {256, 512}}, {"b", {256, 512}}, {"c", {512, 128}}, {"bias", {512}}};

v1::SessionSpec Spec(const std::string& precision) {
  v1::SessionSpec spec;
  auto* matrices = spec.add_groups();
  matrices->set_name("matrices");
  matrices->mutable_options()->set_optimizer(v1::OPTIMIZER_MUON);
  matrices->mutable_options()->set_matmul_precision(precision);
  auto* vectors = spec.add_groups();
  vectors->set_name("vectors");
  vectors->mutable_options()->set_optimizer(v1::OPTIMIZER_ADAMW);
  for (const Param& p : kParams) {
    auto* param = spec.add_parameters();
    param->set_name(p.name);
    for (int64_t d : p.shape) param->add_shape(d);
    param->set_group(p.shape.size() == 2 ? "matrices" : "vectors");
  }
  return spec;
}

std::vector<float> Initial(const Param& p) {
  std::vector<float> v(p.numel());
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.02f * std::sin(0.001f * i + static_cast<float>(p.name.size()));
  return v;
}

// Trains `steps` steps; returns the parameters after the last one.
client::ParameterMap Train(client::Client& client, const std::string& precision, int steps) {
  auto created = client.CreateSession("gpu-e2e-" + precision, Spec(precision));
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return {};
  client::Session& session = **created;
  client::ParameterMap params;
  std::vector<client::TensorView> views;
  for (const Param& p : kParams) params[p.name] = Initial(p);
  for (const Param& p : kParams) views.push_back({p.name, p.shape, params[p.name]});
  EXPECT_OK(session.UploadParameters(views));
  std::map<std::string, std::vector<float>> grads;
  for (int step = 1; step <= steps; ++step) {
    views.clear();
    for (const Param& p : kParams) {
      std::vector<float>& g = grads[p.name];
      const std::vector<float>& w = params[p.name];
      g.resize(w.size());
      for (size_t i = 0; i < g.size(); ++i) g[i] = w[i] + 0.05f * std::cos(0.37f * i + 1.1f * step);
      views.push_back({p.name, p.shape, g});
    }
    client::StepOptions options;
    if (step % 2 == 0) options.max_grad_norm = 1.0;
    auto reply = session.Step(step, views, options);
    EXPECT_TRUE(reply.ok()) << "step " << step << ": " << reply.status();
    if (!reply.ok()) return {};
    EXPECT_TRUE(reply->applied);
    params = std::move(reply->parameters);
  }
  EXPECT_OK(session.Close());
  return params;
}

// ‖(x − x0) − (y − x0)‖ / ‖y − x0‖: the error of what training changed.
double ChangeError(const std::vector<float>& x, const std::vector<float>& y, const std::vector<float>& x0) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
    norm += (double(y[i]) - x0[i]) * (double(y[i]) - x0[i]);
  }
  return std::sqrt(diff / norm);
}

TEST(GpuDaemonTest, TrainsLikeTheCpuDaemon) {
  DaemonProcess gpu;
  std::string error;
  if (!gpu.Start({"--backend", "cuda"}, &error)) MUOND_SKIP_WITHOUT_GPU() << "no usable GPU: " << error;
  DaemonProcess cpu;
  ASSERT_TRUE(cpu.Start({"--backend", "cpu"}, &error)) << error;
  client::ClientOptions options = testing::TestClientOptions();
  options.chunk_bytes = 64 << 10;  // 8 chunks per matrix
  options.endpoint = gpu.endpoint();
  ASSERT_OK_AND_ASSIGN(auto on_gpu, client::Client::Connect(options));
  options.endpoint = cpu.endpoint();
  ASSERT_OK_AND_ASSIGN(auto on_cpu, client::Client::Connect(options));

  // fp32 GEMMs differ from OpenBLAS's only in summation order; bf16 operands round to 8 bits, which
  // docs/algorithms.md (Matmul precision) bounds at 2e-2 for one Newton–Schulz output.
  for (const auto& [precision, tolerance] : {std::pair<std::string, double>{"fp32", 1e-3}, {"bf16", 5e-2}}) {
    SCOPED_TRACE(precision);
    const client::ParameterMap got = Train(*on_gpu, precision, 12);
    const client::ParameterMap want = Train(*on_cpu, precision, 12);
    ASSERT_FALSE(got.empty());
    ASSERT_FALSE(want.empty());
    for (const Param& p : kParams) {
      EXPECT_LT(ChangeError(got.at(p.name), want.at(p.name), Initial(p)), tolerance) << p.name;
    }
  }
  EXPECT_THAT(gpu.ReadStderr(), ::testing::HasSubstr("with the cuda backend"));
}

}  // namespace
}  // namespace muond::testing
