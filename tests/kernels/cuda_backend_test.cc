// What is specific to the CUDA backend (the shared behaviour is in the conformance suite): the
// pool's size classes, block reuse, a steady-state optimizer step that calls cudaMalloc no more,
// and concurrent callers. Built only with the CUDA backend; everything that needs a device skips
// with the reason when there is none. Includes no CUDA header (cuda_memory_pool.h and
// cuda_backend_factory.h are free of them).
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend_factory.h"
#include "kernels/cuda/cuda_memory_pool.h"
#include "kernels/optim/optimizer.h"
#include "tests/kernels/reference.h"
#include "tests/testing/gpu_skip.h"
#include "tests/testing/status_matchers.h"

namespace muond::kernels {
namespace {

using cuda::CudaMemoryPool;
using ::muond::testing::Download;
using ::muond::testing::Upload;

constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;

TEST(CudaMemoryPoolTest, SizeClasses) {
  EXPECT_EQ(CudaMemoryPool::RoundUp(0), 512u);
  EXPECT_EQ(CudaMemoryPool::RoundUp(1), 512u);
  EXPECT_EQ(CudaMemoryPool::RoundUp(513), 1024u);
  EXPECT_EQ(CudaMemoryPool::RoundUp(kMiB), kMiB);
  EXPECT_EQ(CudaMemoryPool::RoundUp(kMiB + 1), kMiB + 64 * kKiB);
  EXPECT_EQ(CudaMemoryPool::RoundUp(64 * kMiB), 64 * kMiB);
  EXPECT_EQ(CudaMemoryPool::RoundUp(64 * kMiB + 1), 66 * kMiB);
}

// A CUDA backend on device 0, or the reason there is none.
class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> backend = NewCudaBackend(0);
    if (!backend.ok()) MUOND_SKIP_WITHOUT_GPU() << "no usable CUDA device: " << backend.status().message();
    backend_ = std::move(*backend);
  }
  std::unique_ptr<Backend> backend_;
};

TEST_F(CudaBackendTest, NameDetailAndStats) {
  EXPECT_EQ(backend_->Name(), "cuda");
  EXPECT_NE(backend_->Detail().find("cuBLAS"), std::string::npos) << backend_->Detail();
  std::optional<CudaPoolStats> stats = GetCudaPoolStats(*backend_);
  ASSERT_TRUE(stats.has_value());
  EXPECT_GE(stats->bytes_in_use, 32 * kMiB);  // the cuBLAS workspace
  EXPECT_FALSE(GetCudaPoolStats(*NewCpuBackend(1)).has_value());
}

TEST_F(CudaBackendTest, PoolReusesFreedBlocks) {
  ASSERT_OK_AND_ASSIGN(auto first, backend_->Allocate(1000));
  const float* address = first->data();
  const size_t allocations = GetCudaPoolStats(*backend_)->device_allocations;
  first.reset();
  // 900 floats round to the same 4096-byte class as 1000.
  ASSERT_OK_AND_ASSIGN(auto second, backend_->Allocate(900));
  EXPECT_EQ(second->data(), address);
  EXPECT_EQ(GetCudaPoolStats(*backend_)->device_allocations, allocations);
}

// After the first step (which grows the pool), further steps must not call cudaMalloc.
TEST_F(CudaBackendTest, SteadyStateStepsAllocateNothing) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  optim::GroupOptions muon_options = optim::DefaultOptions(optim::OptimizerKind::kMuon);
  muon_options.matmul_precision = MatmulPrecision::kBf16;
  ASSERT_OK_AND_ASSIGN(auto muon, optim::Optimizer::Create(muon_options));
  const std::vector<std::vector<int64_t>> shapes = {{64, 128}, {64, 128}, {128, 64}, {4, 32, 48}};
  std::vector<optim::ParamState> params(shapes.size());
  std::vector<optim::ParamState*> ptrs;
  std::vector<std::vector<float>> grads;
  for (size_t i = 0; i < shapes.size(); ++i) {
    optim::ParamState& p = params[i];
    p.shape = shapes[i];
    p.numel = 1;
    for (int64_t d : p.shape) p.numel *= d;
    std::vector<float> w(p.numel);
    for (float& x : w) x = normal(rng);
    p.master = Upload(*backend_, w);
    ASSERT_OK_AND_ASSIGN(p.grad, backend_->Allocate(p.numel));
    ASSERT_OK(muon->InitState(*backend_, p));
    grads.push_back(w);
    ptrs.push_back(&p);
  }
  size_t after_first = 0;
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_OK(backend_->CopyToDevice(grads[i].data(), params[i].grad->data(), grads[i].size()));
      params[i].has_grad = true;
    }
    ASSERT_OK(muon->Step(*backend_, muon->DefaultHyper(), ptrs));
    const size_t allocations = GetCudaPoolStats(*backend_)->device_allocations;
    if (step == 0) after_first = allocations;
    EXPECT_EQ(allocations, after_first) << "step " << step;
  }
}

// Device memory running out is a refusal the backend survives: more than any GPU holds (2^38
// floats, 1 TiB) is refused, and the backend allocates and computes as before.
TEST_F(CudaBackendTest, OutOfMemoryIsARefusalNotACrash) {
  const absl::StatusOr<std::unique_ptr<DeviceBuffer>> huge = backend_->Allocate(size_t{1} << 38);
  EXPECT_FALSE(huge.ok());
  auto x = Upload(*backend_, std::vector<float>(4096, 2.0f));
  auto y = Upload(*backend_, std::vector<float>(4096, 1.0f));
  ASSERT_OK(backend_->Axpby(1.0f, x->data(), 1.0f, y->data(), 4096));
  for (float v : Download(*backend_, y->data(), 4096)) ASSERT_EQ(v, 3.0f);
}

// The same Muon steps from the same state give the same bits, run after run (bf16 and fp32
// Newton–Schulz, a batch of same-shaped matrices and one alone): nothing depends on timing or on
// what ran before.
TEST_F(CudaBackendTest, TheSameStepsGiveTheSameBits) {
  for (MatmulPrecision precision : {MatmulPrecision::kFp32, MatmulPrecision::kBf16}) {
    std::vector<std::vector<float>> results[2];
    for (int run = 0; run < 2; ++run) {
      std::mt19937 rng(11);
      std::normal_distribution<float> normal(0.0f, 0.1f);
      optim::GroupOptions options = optim::DefaultOptions(optim::OptimizerKind::kMuon);
      options.matmul_precision = precision;
      ASSERT_OK_AND_ASSIGN(auto muon, optim::Optimizer::Create(options));
      const std::vector<std::vector<int64_t>> shapes = {{96, 160}, {96, 160}, {96, 160}, {200, 72}};
      std::vector<optim::ParamState> params(shapes.size());
      std::vector<optim::ParamState*> ptrs;
      for (size_t i = 0; i < shapes.size(); ++i) {
        optim::ParamState& p = params[i];
        p.shape = shapes[i];
        p.numel = shapes[i][0] * shapes[i][1];
        std::vector<float> w(p.numel);
        for (float& x : w) x = normal(rng);
        p.master = Upload(*backend_, w);
        ASSERT_OK_AND_ASSIGN(p.grad, backend_->Allocate(p.numel));
        ASSERT_OK(muon->InitState(*backend_, p));
        ptrs.push_back(&p);
      }
      for (int step = 0; step < 3; ++step) {
        for (optim::ParamState& p : params) {
          std::vector<float> g(p.numel);
          for (float& x : g) x = normal(rng);
          ASSERT_OK(backend_->CopyToDevice(g.data(), p.grad->data(), g.size()));
          p.has_grad = true;
        }
        ASSERT_OK(muon->Step(*backend_, muon->DefaultHyper(), ptrs));
      }
      for (optim::ParamState& p : params) {
        results[run].push_back(Download(*backend_, p.master.fp32(), static_cast<size_t>(p.numel)));
      }
    }
    EXPECT_EQ(results[0], results[1]) << "matmul precision " << static_cast<int>(precision);
  }
}

// Two threads using one backend on distinct buffers: the backend serializes them.
TEST_F(CudaBackendTest, ConcurrentCallersOnDistinctBuffers) {
  constexpr size_t kN = 1 << 16;
  auto worker = [&](float value) {
    auto x = Upload(*backend_, std::vector<float>(kN, value));
    auto y = Upload(*backend_, std::vector<float>(kN, 1.0f));
    for (int i = 0; i < 50; ++i) EXPECT_OK(backend_->Axpby(1.0f, x->data(), 1.0f, y->data(), kN));
    for (float v : Download(*backend_, y->data(), kN)) ASSERT_EQ(v, 1.0f + 50 * value);
  };
  std::thread a(worker, 1.0f), b(worker, 2.0f);
  a.join();
  b.join();
}

}  // namespace
}  // namespace muond::kernels
