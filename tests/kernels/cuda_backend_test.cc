// What is specific to the CUDA backend (the shared behaviour is in the conformance suite): the
// pool's size classes, block reuse, a steady-state optimizer step that calls cudaMalloc no more,
// concurrent callers, large shapes (4096×11008, 8192², more than 2³¹ elements, a transpose batch
// past the grid's 65535) and bf16 Newton–Schulz against fp64 at the sizes of real models. Built only with the CUDA
// backend; everything that needs a device skips with the reason when there is none. Includes no CUDA header
// (cuda_memory_pool.h and cuda_backend_factory.h are free of them).
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend_factory.h"
#include "kernels/cuda/cuda_memory_pool.h"
#include "kernels/optim/newton_schulz.h"
#include "kernels/optim/optimizer.h"
#include "tests/kernels/fp64_ns.h"
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

std::vector<float> Gaussian(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// A buffer of `count` floats, or the skip that names the memory it needed: a device too small for
// a test is not a broken GPU path, so this skips plainly even under MUOND_REQUIRE_GPU=1.
#define MUOND_ALLOCATE_OR_SKIP(var, backend, count)                                      \
  std::unique_ptr<DeviceBuffer> var;                                                     \
  {                                                                                      \
    absl::StatusOr<std::unique_ptr<DeviceBuffer>> allocated = (backend).Allocate(count); \
    if (!allocated.ok()) {                                                               \
      GTEST_SKIP() << "needs " << (4.0 * static_cast<double>(count) / (1 << 30))         \
                   << " GiB more device memory: " << allocated.status().message();       \
    }                                                                                    \
    var = std::move(*allocated);                                                         \
  }

// Newton–Schulz at the shapes of a 7B model's MLP (4096×11008, both orientations, so the
// transposes run on 45M elements) and of a large square layer (8192²), in fp32 and bf16. The fp32
// result is finite and as orthogonal as five steps of the default set make a Gaussian matrix: over
// the Marchenko–Pastur law of its singular values the residual ‖G² − G‖_F/‖G‖_F (G = XXᵀ) comes to
// 0.32 for both (8192²'s smallest singular values stay below the set's band, but weigh little), so it
// must be < 0.5. The bf16 result is within 2·(steps·3·2⁻⁸) ≈ 0.12 of the fp32 one relative (each
// is within the bound of Bf16NewtonSchulzWithinBoundOfFp64, fp32 far closer): a wrong transpose,
// stride or leading dimension in either path breaks one of the two.
TEST_F(CudaBackendTest, NewtonSchulzOnLargeShapes) {
  std::mt19937 rng(31);
  struct Shape {
    int64_t rows, cols;
  };
  for (const Shape& sh : {Shape{4096, 11008}, Shape{11008, 4096}, Shape{8192, 8192}}) {
    SCOPED_TRACE(::testing::Message() << sh.rows << "x" << sh.cols);
    const size_t n = static_cast<size_t>(sh.rows * sh.cols);
    auto in = Upload(*backend_, Gaussian(rng, n));
    MUOND_ALLOCATE_OR_SKIP(out32, *backend_, n);
    MUOND_ALLOCATE_OR_SKIP(out16, *backend_, n);
    optim::NsWorkspace ws;
    ASSERT_OK(optim::NewtonSchulz(*backend_, optim::NsSchedule{}, 5, 1e-7, 1.0, MatmulPrecision::kFp32, in->data(),
                                  out32->data(), sh.rows, sh.cols, 1, ws));
    ASSERT_OK(optim::NewtonSchulz(*backend_, optim::NsSchedule{}, 5, 1e-7, 1.0, MatmulPrecision::kBf16, in->data(),
                                  out16->data(), sh.rows, sh.cols, 1, ws));
    ASSERT_OK_AND_ASSIGN(bool finite, backend_->AllFinite(out32->data(), n));
    EXPECT_TRUE(finite);
    ASSERT_OK_AND_ASSIGN(double residual, optim::OrthogonalityResidual(*backend_, out32->data(), sh.rows, sh.cols, ws));
    const std::vector<float> got32 = Download(*backend_, out32->data(), n);
    const auto between =
        ::muond::testing::CompareNs(Download(*backend_, out16->data(), n), ::muond::testing::ToDouble(got32));
    std::printf("[cuda] NS %lldx%lld: fp32 residual %.4f, bf16 vs fp32 relative %.3e\n",
                static_cast<long long>(sh.rows), static_cast<long long>(sh.cols), residual, between.relative);
    EXPECT_LT(residual, 0.5);
    EXPECT_LT(between.relative, 2 * 5 * 3 * 0x1p-8);
  }
}

// The element-wise kernels, the reductions and the transpose index with 64 bits: on 2³¹ + 4099
// elements (8 GiB each buffer) a 32-bit index would wrap and miss the tail. Values placed past
// 2³¹ must be seen by SumSquares and AllFinite, scaled by ScaleBatched and moved by the
// transpose to where they belong.
TEST_F(CudaBackendTest, MoreThanTwoToTheThirtyOneElements) {
  const size_t n = (size_t{1} << 31) + 4099;
  MUOND_ALLOCATE_OR_SKIP(x, *backend_, n);
  ASSERT_OK(backend_->Fill(x->data(), n, 1.0f));
  const float two = 2.0f;
  ASSERT_OK(backend_->CopyToDevice(&two, x->data() + n - 1, 1));
  double sum = 0;
  ASSERT_OK(backend_->SumSquares(x->data(), n, 1, &sum));
  EXPECT_EQ(sum, static_cast<double>(n - 1) + 4.0);  // every partial sum is an integer below 2⁵³: exact
  const float half = 0.5f;
  ASSERT_OK(backend_->ScaleBatched(x->data(), n, 1, &half));
  ASSERT_OK(backend_->SumSquares(x->data(), n, 1, &sum));
  EXPECT_EQ(sum, static_cast<double>(n - 1) * 0.25 + 1.0);
  ASSERT_OK_AND_ASSIGN(bool finite, backend_->AllFinite(x->data(), n));
  EXPECT_TRUE(finite);
  const float nan = std::nanf("");
  ASSERT_OK(backend_->CopyToDevice(&nan, x->data() + (size_t{1} << 31) + 7, 1));
  ASSERT_OK_AND_ASSIGN(finite, backend_->AllFinite(x->data(), n));
  EXPECT_FALSE(finite);

  // Transpose a 32769 × 65536 matrix (2³¹ + 65536 elements) with marked entries past 2³¹.
  const int64_t rows = 32769, cols = 65536;
  const size_t total = static_cast<size_t>(rows * cols);
  x.reset();
  MUOND_ALLOCATE_OR_SKIP(in, *backend_, total);
  MUOND_ALLOCATE_OR_SKIP(out, *backend_, total);
  struct Mark {
    int64_t row, col;
    float value;
  };
  const std::vector<Mark> marks = {{0, 0, 3.0f}, {rows - 1, cols - 1, 5.0f}, {rows - 1, 123, 7.0f}, {32768, 1, 9.0f}};
  for (const Mark& mark : marks) {
    ASSERT_OK(backend_->CopyToDevice(&mark.value, in->data() + mark.row * cols + mark.col, 1));
  }
  ASSERT_OK(backend_->Transpose2D(in->data(), out->data(), rows, cols, 1));
  for (const Mark& mark : marks) {
    float got = 0;
    ASSERT_OK(backend_->CopyToHost(out->data() + mark.col * rows + mark.row, &got, 1));
    EXPECT_EQ(got, mark.value) << mark.row << ", " << mark.col;
  }
  ASSERT_OK(backend_->SumSquares(out->data(), total, 1, &sum));
  EXPECT_EQ(sum, 9.0 + 25.0 + 49.0 + 81.0);
}

// A batch of 70000 small matrices: the transpose's grid is sliced at 65535 in z, and Newton–Schulz
// of a tall batch (transposed in and out, normalized per matrix) matches the CPU backend's within
// its rounding bound — the last matrices included, which a grid cut short would leave untouched.
TEST_F(CudaBackendTest, TransposeAndNewtonSchulzOnABatchPastTheGridLimit) {
  const int64_t rows = 6, cols = 4, batch = 70000;
  const size_t n = static_cast<size_t>(rows * cols * batch);
  std::mt19937 rng(41);
  const std::vector<float> host = Gaussian(rng, n);
  std::unique_ptr<Backend> cpu = NewCpuBackend(2);
  auto on_gpu = Upload(*backend_, host);
  auto on_cpu = Upload(*cpu, host);
  auto gpu_t = Upload(*backend_, std::vector<float>(n, -1.0f));
  auto cpu_t = Upload(*cpu, std::vector<float>(n, -1.0f));
  ASSERT_OK(backend_->Transpose2D(on_gpu->data(), gpu_t->data(), rows, cols, batch));
  ASSERT_OK(cpu->Transpose2D(on_cpu->data(), cpu_t->data(), rows, cols, batch));
  EXPECT_EQ(Download(*backend_, gpu_t->data(), n), Download(*cpu, cpu_t->data(), n));

  optim::NsWorkspace gpu_ws, cpu_ws;
  ASSERT_OK(optim::NewtonSchulz(*backend_, optim::NsSchedule{}, 5, 1e-7, 1.0, MatmulPrecision::kFp32, on_gpu->data(),
                                on_gpu->data(), rows, cols, batch, gpu_ws));
  ASSERT_OK(optim::NewtonSchulz(*cpu, optim::NsSchedule{}, 5, 1e-7, 1.0, MatmulPrecision::kFp32, on_cpu->data(),
                                on_cpu->data(), rows, cols, batch, cpu_ws));
  const std::vector<float> got = Download(*backend_, on_gpu->data(), n), want = Download(*cpu, on_cpu->data(), n);
  // Entries of O are ≤ 1.2 in size; two fp32 computations of 5 steps on k ≤ 6 differ by far less
  // than 1e-4 (NsRoundingBound for these sizes is ~1e-5).
  double worst = 0;
  for (size_t i = 0; i < n; ++i) worst = std::max(worst, static_cast<double>(std::abs(got[i] - want[i])));
  EXPECT_LT(worst, 1e-4);
  for (size_t i = n - static_cast<size_t>(rows * cols); i < n; ++i) ASSERT_NE(got[i], host[i]) << i;
}

// Newton–Schulz with matmul_precision bf16 on the GPU against fp64 at the sizes of real models
// (GPT-2 small's MLP 768×3072 both ways, a 1024×2752 with the decaying spectrum of a gradient,
// 4096²). The CUDA backend rounds both operands of every GEMM to bf16 and accumulates in fp32, as
// the CPU's bf16 path does, so the same bound holds (tests/kernels/cpu_bf16_test.cc derives it):
// with u = 2⁻⁸, bf16's unit roundoff (8 significant bits), ‖O_bf16 − O_fp64‖_F/‖O_fp64‖_F ≤
// steps·3·u = 15·2⁻⁸ ≈ 5.9e-2 — one relative u per GEMM per step, to first order; the iteration
// contracts singular values near 1 and the small ones it amplifies carry proportionally small
// errors. The fp32 path must stay ≥ 100× closer. Prints the errors for the README's figures.
TEST_F(CudaBackendTest, Bf16NewtonSchulzWithinBoundOfFp64) {
  const int steps = 5;
  const double bound = steps * 3 * 0x1p-8;
  std::mt19937 rng(23);
  struct Shape {
    int64_t rows, cols;
    bool decaying;
  };
  for (const Shape& sh :
       {Shape{768, 3072, false}, Shape{3072, 768, false}, Shape{1024, 2752, true}, Shape{4096, 4096, false}}) {
    SCOPED_TRACE(::testing::Message() << sh.rows << "x" << sh.cols << (sh.decaying ? " decaying" : " gaussian"));
    std::vector<float> g;
    if (sh.decaying) {
      g = ::muond::testing::DecayingSpectrum(rng, sh.rows, sh.cols);
    } else {
      g = Gaussian(rng, static_cast<size_t>(sh.rows * sh.cols));
    }
    const std::vector<double> want = ::muond::testing::Fp64ReferenceNs(g, sh.rows, sh.cols, steps);
    auto in = Upload(*backend_, g);
    auto out16 = Upload(*backend_, g), out32 = Upload(*backend_, g);
    optim::NsWorkspace ws;
    ASSERT_OK(optim::NewtonSchulz(*backend_, optim::NsSchedule{}, steps, 1e-7, 1.0, MatmulPrecision::kBf16, in->data(),
                                  out16->data(), sh.rows, sh.cols, 1, ws));
    ASSERT_OK(optim::NewtonSchulz(*backend_, optim::NsSchedule{}, steps, 1e-7, 1.0, MatmulPrecision::kFp32, in->data(),
                                  out32->data(), sh.rows, sh.cols, 1, ws));
    const auto e16 = ::muond::testing::CompareNs(Download(*backend_, out16->data(), g.size()), want);
    const auto e32 = ::muond::testing::CompareNs(Download(*backend_, out32->data(), g.size()), want);
    std::printf("[cuda] NS %lldx%lld %-8s vs fp64: bf16 relative %.3e max abs %.3e | fp32 relative %.3e max abs %.3e\n",
                static_cast<long long>(sh.rows), static_cast<long long>(sh.cols), sh.decaying ? "decaying" : "gaussian",
                e16.relative, e16.max_abs, e32.relative, e32.max_abs);
    EXPECT_LT(e16.relative, bound);
    EXPECT_LT(100 * e32.relative, e16.relative);
  }
}

}  // namespace
}  // namespace muond::kernels
