// What an optimizer step asks of its backend that makes the host wait for the device: results read
// back (SumSquares, SumSquaresEach, AllFinite, CopyToHost, CopyBytes), copies from host memory
// (CopyToDevice) and Synchronize. On the CUDA backend each of them stalls the host until the GPU
// has caught up, so a step's math must not ask for them per matrix or per batch. Counted on the CPU
// backend, through a wrapper, so these run everywhere: a step of every optimizer asks for none; a
// step with telemetry asks for one at its end, whatever it measured (the update's sums, Muon's
// momentum norms and orthogonality residual) and whatever the number of tensors; a Muon step whose
// telemetry does not measure still reads its momentum norms, with that one wait.
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optim/optimizer.h"
#include "kernels/optim/step_telemetry.h"
#include "tests/kernels/forwarding_backend.h"
#include "tests/kernels/reference.h"
#include "tests/testing/status_matchers.h"

namespace muond::kernels {
namespace {

class WaitCountingBackend final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  int waits = 0;

  absl::Status CopyToDevice(const float* host, float* device, size_t count) override {
    ++waits;
    return ForwardingBackend::CopyToDevice(host, device, count);
  }
  absl::Status CopyToHost(const float* device, float* host, size_t count) override {
    ++waits;
    return ForwardingBackend::CopyToHost(device, host, count);
  }
  absl::Status SumSquares(const float* x, size_t count, size_t batch, double* sums) override {
    ++waits;
    return ForwardingBackend::SumSquares(x, count, batch, sums);
  }
  absl::Status SumSquaresEach(std::span<const Slice> tensors, double* sums) override {
    ++waits;
    return ForwardingBackend::SumSquaresEach(tensors, sums);
  }
  absl::StatusOr<bool> AllFinite(const float* x, size_t count) override {
    ++waits;
    return ForwardingBackend::AllFinite(x, count);
  }
  absl::Status CopyBytes(const void* src, void* dst, size_t bytes) override {
    ++waits;
    return ForwardingBackend::CopyBytes(src, dst, bytes);
  }
  absl::Status Synchronize() override {
    ++waits;
    return ForwardingBackend::Synchronize();
  }
};

struct Case {
  std::string name;
  optim::GroupOptions options;
  std::vector<std::vector<int64_t>> shapes;
};

std::vector<Case> Cases() {
  // Same-shaped matrices (one batch), a tall one (transposed), a square one; vectors for the
  // element-wise optimizers.
  const std::vector<std::vector<int64_t>> matrices = {{32, 48}, {32, 48}, {32, 48}, {80, 24}, {40, 40}};
  const std::vector<std::vector<int64_t>> tensors = {{32, 48}, {300}, {7, 3, 5}};
  std::vector<Case> cases;
  cases.push_back({"muon", optim::DefaultOptions(optim::OptimizerKind::kMuon), matrices});
  Case gram{"muon_gram", optim::DefaultOptions(optim::OptimizerKind::kMuon), matrices};
  gram.options.ns_algorithm = optim::NsAlgorithm::kGram;
  cases.push_back(gram);
  Case normuon{"normuon", optim::DefaultOptions(optim::OptimizerKind::kMuon), matrices};
  normuon.options.moment2_method = optim::Moment2Method::kNormuon;
  cases.push_back(normuon);
  Case adamuon{"adamuon", optim::DefaultOptions(optim::OptimizerKind::kMuon), matrices};
  adamuon.options.moment2_method = optim::Moment2Method::kAdamuon;
  cases.push_back(adamuon);
  for (optim::Moment2Method method : {optim::Moment2Method::kNamo, optim::Moment2Method::kNamoD}) {
    Case namo{method == optim::Moment2Method::kNamo ? "namo" : "namo_d",
              optim::DefaultOptions(optim::OptimizerKind::kMuon), matrices};
    namo.options.moment2_method = method;
    cases.push_back(namo);
  }
  cases.push_back({"adamw", optim::DefaultOptions(optim::OptimizerKind::kAdamW), tensors});
  cases.push_back({"lion", optim::DefaultOptions(optim::OptimizerKind::kLion), tensors});
  cases.push_back({"sgd", optim::DefaultOptions(optim::OptimizerKind::kSgd), tensors});
  // More sums than one segment of the step's pending sums holds (4096 doubles): still one wait.
  cases.push_back({"adamw_2100_tensors", optim::DefaultOptions(optim::OptimizerKind::kAdamW),
                   std::vector<std::vector<int64_t>>(2100, {3})});
  cases.push_back({"muon_4100_matrices", optim::DefaultOptions(optim::OptimizerKind::kMuon),
                   std::vector<std::vector<int64_t>>(4100, {2, 3})});
  return cases;
}

TEST(HostWaitsTest, AStepWaitsForTheDeviceAtMostOnce) {
  std::unique_ptr<Backend> cpu = NewCpuBackend(1);
  WaitCountingBackend backend(*cpu);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    ASSERT_OK_AND_ASSIGN(auto optimizer, optim::Optimizer::Create(c.options));
    std::vector<optim::ParamState> params(c.shapes.size());
    std::vector<optim::ParamState*> ptrs;
    for (size_t i = 0; i < c.shapes.size(); ++i) {
      optim::ParamState& p = params[i];
      p.name = "p" + std::to_string(i);
      p.shape = c.shapes[i];
      p.numel = 1;
      for (int64_t d : p.shape) p.numel *= d;
      std::vector<float> w(p.numel);
      for (float& x : w) x = normal(rng);
      p.master = ::muond::testing::Upload(backend, w);
      ASSERT_OK_AND_ASSIGN(p.grad, backend.Allocate(p.numel));
      ASSERT_OK(optimizer->InitState(backend, p));
      ptrs.push_back(&p);
    }
    const auto load_gradients = [&] {
      for (optim::ParamState& p : params) {
        std::vector<float> g(p.numel);
        for (float& x : g) x = normal(rng);
        ASSERT_OK(backend.CopyToDevice(g.data(), p.grad->data(), g.size()));
        p.has_grad = true;
      }
    };
    const bool muon = c.options.optimizer == optim::OptimizerKind::kMuon;

    load_gradients();
    backend.waits = 0;
    ASSERT_OK(optimizer->Step(backend, optimizer->DefaultHyper(), ptrs));
    EXPECT_EQ(backend.waits, 0) << "an unmeasured step";

    load_gradients();
    optim::StepTelemetry quiet;
    quiet.measure = false;
    backend.waits = 0;
    ASSERT_OK(optimizer->StepMeasured(backend, optimizer->DefaultHyper(), ptrs, quiet));
    EXPECT_EQ(backend.waits, muon ? 1 : 0) << "a step with telemetry that does not measure";

    load_gradients();
    optim::StepTelemetry measured;
    backend.waits = 0;
    ASSERT_OK(optimizer->StepMeasured(backend, optimizer->DefaultHyper(), ptrs, measured));
    std::printf("[waits] %s: a measured step waits %d times for %zu tensors\n", c.name.c_str(), backend.waits,
                params.size());
    // The update measurements, Muon's momentum norms and its residual, read back together.
    EXPECT_EQ(backend.waits, 1) << "a measured step";
  }
}

}  // namespace
}  // namespace muond::kernels
