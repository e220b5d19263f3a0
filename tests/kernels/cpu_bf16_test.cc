// The CPU backend's bf16 GEMMs (kernels/cpu/onednn_bf16_gemm.h) and Newton–Schulz with
// matmul_precision bf16 against fp64 references, on whatever CPU runs the test. Where the CPU (or
// ONEDNN_MAX_CPU_ISA, which the second ctest registration sets) offers no bf16 kernel, the same tests
// check the fallback instead — fp32 results bit for bit, one logged reason — and say that the bf16
// kernel was not exercised. No test asserts a timing.
//
// Bounds, with u = 2⁻⁸ the unit roundoff of bf16 (8 significant bits) and u₃₂ = 2⁻²⁴:
//  - One GEMM entry: rounding both operands moves each product by at most (2u + u²)·|a·b|, and the
//    product of two bf16 values is exact in fp32, so against the fp64 product of the rounded
//    operands only fp32 accumulation remains: 2·(k + 2)·u₃₂·Σ|α·a·b| + |β·c| (Higham's γ_k, +2 for
//    α and β, doubled for headroom), the same as an fp32 GEMM's.
//  - Newton–Schulz: ‖O_bf16 − O_fp64‖_F / ‖O_fp64‖_F ≤ steps·3·u (5 steps: 15·2⁻⁸ ≈ 5.9e-2): one
//    relative u per GEMM per step, first order. Each GEMM's result is perturbed by its rounded
//    operands by ≈ u relative (two independent roundings of 2⁻⁹ average size each), and the
//    iteration does not amplify those perturbations overall: singular values near 1 are contracted
//    (|p′(σ)| < 1 there for the default set), and small ones, which p amplifies by a ≈ 3.4, carry
//    proportionally small errors of their own.
#include <cblas.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/half_float.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/onednn_bf16_gemm.h"
#include "kernels/optim/newton_schulz.h"
#include "kernels/optim/options.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/kernels/forwarding_backend.h"
#include "tests/kernels/fp64_ns.h"
#include "tests/kernels/reference.h"
#include "tests/testing/status_matchers.h"

namespace muond::kernels {
namespace {

using ::muond::testing::Download;
using ::muond::testing::Upload;

constexpr double kBf16Unit = 0x1p-8;
constexpr double kFp32Unit = 0x1p-24;

// Says, in the test's output, which path ran.
void Announce() {
  const Bf16Support& s = Bf16GemmSupport();
  if (s.available) {
    std::printf("[bf16] kernel exercised: %s %s\n", s.library.c_str(), s.kernel.c_str());
  } else {
    std::printf("[bf16] bf16 kernel NOT exercised, the fallback is tested instead: %s\n", s.reason.c_str());
  }
}

double RoundBf16(float x) { return Bf16ToFloat(FloatToBf16(x)); }

std::vector<float> Random(std::mt19937& rng, size_t n, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(CpuBf16Gemm, RoundsOperandsAndAccumulatesInFp32) {
  Announce();
  const bool bf16 = Bf16GemmSupport().available;
  std::unique_ptr<Backend> backend = NewCpuBackend(2);
  std::mt19937 rng(5);
  struct Case {
    Transpose ta, tb;
    int64_t m, n, k, batch;
    float alpha, beta;
    bool same_ab;
  };
  std::vector<Case> cases;
  for (Transpose ta : {Transpose::kNo, Transpose::kYes}) {
    for (Transpose tb : {Transpose::kNo, Transpose::kYes})
      cases.push_back({ta, tb, 37, 29, 53, 3, 0.75f, -0.5f, false});
  }
  cases.push_back({Transpose::kNo, Transpose::kYes, 40, 40, 300, 2, 1.0f, 0.0f, true});  // X·Xᵀ, as Newton–Schulz
  cases.push_back({Transpose::kNo, Transpose::kNo, 24, 24, 24, 2, -4.775f, 2.0315f, true});  // c·A·A + b·B
  bool any_rounding_seen = false;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "m=" << c.m << " n=" << c.n << " k=" << c.k
                                      << " ta=" << (c.ta == Transpose::kYes) << " tb=" << (c.tb == Transpose::kYes)
                                      << " same=" << c.same_ab);
    const int64_t a_rows = c.ta == Transpose::kNo ? c.m : c.k, a_cols = c.ta == Transpose::kNo ? c.k : c.m;
    const int64_t b_rows = c.tb == Transpose::kNo ? c.k : c.n, b_cols = c.tb == Transpose::kNo ? c.n : c.k;
    // Rows padded by 3 and matrices by 5, so leading dimensions and strides are the caller's.
    GemmShape s{.trans_a = c.ta, .trans_b = c.tb, .m = c.m, .n = c.n, .k = c.k};
    s.lda = a_cols + 3;
    s.ldb = b_cols + 3;
    s.ldc = c.n + 3;
    s.stride_a = a_rows * s.lda + 5;
    s.stride_b = b_rows * s.ldb + 5;
    s.stride_c = c.m * s.ldc + 5;
    s.batch = c.batch;
    if (c.same_ab) {
      s.ldb = s.lda;
      s.stride_b = s.stride_a;
    }
    const std::vector<float> a = Random(rng, static_cast<size_t>(s.stride_a * c.batch));
    const std::vector<float> b = c.same_ab ? a : Random(rng, static_cast<size_t>(s.stride_b * c.batch));
    const std::vector<float> c0 = Random(rng, static_cast<size_t>(s.stride_c * c.batch));
    auto da = Upload(*backend, a), db = Upload(*backend, b);
    auto dc16 = Upload(*backend, c0), dc32 = Upload(*backend, c0);
    const float* b_ptr = c.same_ab ? da->data() : db->data();
    ASSERT_OK(backend->Gemm(s, c.alpha, da->data(), b_ptr, c.beta, dc16->data(), MatmulPrecision::kBf16));
    ASSERT_OK(backend->Gemm(s, c.alpha, da->data(), b_ptr, c.beta, dc32->data(), MatmulPrecision::kFp32));
    const std::vector<float> got = Download(*backend, dc16->data(), c0.size());
    const std::vector<float> fp32 = Download(*backend, dc32->data(), c0.size());
    if (!bf16) {
      // The fallback is the fp32 GEMM itself.
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(fp32[i])) << i;
      continue;
    }
    for (int64_t bi = 0; bi < c.batch; ++bi) {
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < c.n; ++j) {
          double rounded = 0, exact = 0, mag = 0;
          for (int64_t p = 0; p < c.k; ++p) {
            const float av =
                c.ta == Transpose::kNo ? a[bi * s.stride_a + i * s.lda + p] : a[bi * s.stride_a + p * s.lda + i];
            const float bv =
                c.tb == Transpose::kNo ? b[bi * s.stride_b + p * s.ldb + j] : b[bi * s.stride_b + j * s.ldb + p];
            rounded += RoundBf16(av) * RoundBf16(bv);
            exact += static_cast<double>(av) * bv;
            mag += std::abs(static_cast<double>(av) * bv);
          }
          const size_t at = static_cast<size_t>(bi * s.stride_c + i * s.ldc + j);
          const double old = c0[at];
          const double scale = std::abs(c.alpha) * mag + std::abs(c.beta) * std::abs(old);
          const double fp32_bound = 2.0 * static_cast<double>(c.k + 2) * kFp32Unit * scale;
          // Against the rounded operands: fp32 accumulation only.
          ASSERT_NEAR(got[at], c.alpha * rounded + c.beta * old, fp32_bound) << bi << " " << i << " " << j;
          // Against the exact operands: the operand rounding too.
          ASSERT_NEAR(got[at], c.alpha * exact + c.beta * old,
                      fp32_bound + (2 * kBf16Unit + kBf16Unit * kBf16Unit) * std::abs(c.alpha) * mag);
          if (std::abs(got[at] - (c.alpha * exact + c.beta * old)) > fp32_bound) any_rounding_seen = true;
        }
      }
    }
    // The padding between rows and matrices is not written.
    for (int64_t bi = 0; bi < c.batch; ++bi) {
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = c.n; j < s.ldc && bi * s.stride_c + i * s.ldc + j < static_cast<int64_t>(got.size()); ++j) {
          const size_t at = static_cast<size_t>(bi * s.stride_c + i * s.ldc + j);
          ASSERT_EQ(got[at], c0[at]) << "padding at " << at;
        }
      }
    }
  }
  // The bf16 path really narrowed its operands: beyond what fp32 arithmetic could explain.
  if (bf16) {
    EXPECT_TRUE(any_rounding_seen);
  }
}

// The outcome of the first bf16 request is logged once per backend, with the reason when it falls
// back; the backend's Detail() says which GEMMs bf16 gets.
TEST(CpuBf16Gemm, LogsItsChoiceOnce) {
  Announce();
  const Bf16Support& support = Bf16GemmSupport();
  std::ostringstream log;
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(
      std::make_shared<spdlog::logger>("bf16_test", std::make_shared<spdlog::sinks::ostream_sink_mt>(log)));
  {
    std::unique_ptr<Backend> backend = NewCpuBackend(1);
    std::mt19937 rng(8);
    const std::vector<float> a = Random(rng, 16 * 16);
    auto da = Upload(*backend, a), dc = Upload(*backend, a);
    const GemmShape s{.m = 16, .n = 16, .k = 16, .lda = 16, .ldb = 16, .ldc = 16};
    for (int i = 0; i < 3; ++i) {
      ASSERT_OK(backend->Gemm(s, 1.0f, da->data(), da->data(), 0.0f, dc->data(), MatmulPrecision::kBf16));
    }
    const std::string detail = backend->Detail();
    EXPECT_NE(detail.find("bf16 GEMMs: "), std::string::npos) << detail;
    EXPECT_NE(detail.find(support.available ? support.kernel : support.reason), std::string::npos) << detail;
  }
  spdlog::set_default_logger(previous);
  const std::string text = log.str();
  size_t lines = 0;
  for (size_t at = text.find("matmul_precision bf16"); at != std::string::npos;
       at = text.find("matmul_precision bf16", at + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 1u) << text;
  if (support.available) {
    EXPECT_NE(text.find("fp32 accumulation"), std::string::npos) << text;
  } else {
    EXPECT_FALSE(support.reason.empty());
    EXPECT_NE(text.find("runs in fp32: " + support.reason), std::string::npos) << text;
  }
}

size_t ThreadCount() {
  size_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) n += entry.exists() ? 1 : 0;
  return n;
}

// A backend of one thread runs its bf16 GEMMs on the calling thread alone, whatever OpenMP's default
// team (the number of cores, or OMP_NUM_THREADS) would be. The GEMMs run on a fresh thread, whose
// OpenMP settings are the defaults, as a daemon's request threads are.
TEST(CpuBf16Gemm, UsesNoMoreThreadsThanTheBackend) {
  Announce();
  std::unique_ptr<Backend> backend = NewCpuBackend(1);
  std::mt19937 rng(3);
  const int64_t n = 256;
  const std::vector<float> a = Random(rng, static_cast<size_t>(n * n));
  auto da = Upload(*backend, a), dc = Upload(*backend, a);
  const GemmShape s{.m = n, .n = n, .k = n, .lda = n, .ldb = n, .ldc = n};
  size_t before = 0, after = 0;
  absl::Status status;
  std::thread([&] {
    before = ThreadCount();
    for (int i = 0; i < 3 && status.ok(); ++i) {
      status = backend->Gemm(s, 1.0f, da->data(), da->data(), 0.0f, dc->data(), MatmulPrecision::kBf16);
    }
    after = ThreadCount();
  }).join();
  ASSERT_OK(status);
  EXPECT_EQ(after, before) << "threads appeared during bf16 GEMMs of a one-thread backend";
}

using ::muond::testing::CompareNs;
using ::muond::testing::Fp64ReferenceNs;
using ::muond::testing::NsErrors;

// Newton–Schulz (5 steps, the default set) in bf16 and fp32 against fp64, on Gaussian inputs and on
// a decaying spectrum (singular values 1 down to 1e-2, like gradients), up to the 1024×2752 of the
// README's figures. Prints the errors (docs/algorithms.md quotes them).
TEST(CpuBf16Gemm, NewtonSchulzWithinBoundOfFp64) {
  Announce();
  const bool bf16 = Bf16GemmSupport().available;
  std::unique_ptr<Backend> backend = NewCpuBackend(2);
  const int steps = 5;
  const double bound = steps * 3 * kBf16Unit;
  std::mt19937 rng(21);
  struct Shape {
    int64_t rows, cols;
    bool decaying;
  };
  for (const Shape& sh : {Shape{64, 176, true}, Shape{688, 256, true}, Shape{64, 176, false}, Shape{256, 688, false},
                          Shape{1024, 2752, false}}) {
    SCOPED_TRACE(::testing::Message() << sh.rows << "x" << sh.cols << (sh.decaying ? " decaying" : " gaussian"));
    std::vector<float> g;
    if (sh.decaying) {
      g = ::muond::testing::DecayingSpectrum(rng, sh.rows, sh.cols);
    } else {
      g = Random(rng, static_cast<size_t>(sh.rows * sh.cols));
    }
    const std::vector<double> want = Fp64ReferenceNs(g, sh.rows, sh.cols, steps);
    auto in = Upload(*backend, g);
    auto out16 = Upload(*backend, g), out32 = Upload(*backend, g);
    optim::NsWorkspace ws;
    const optim::NsSchedule schedule;
    ASSERT_OK(optim::NewtonSchulz(*backend, schedule, steps, 1e-7, 1.0, MatmulPrecision::kBf16, in->data(),
                                  out16->data(), sh.rows, sh.cols, 1, ws));
    ASSERT_OK(optim::NewtonSchulz(*backend, schedule, steps, 1e-7, 1.0, MatmulPrecision::kFp32, in->data(),
                                  out32->data(), sh.rows, sh.cols, 1, ws));
    const std::vector<float> got16 = Download(*backend, out16->data(), g.size());
    const std::vector<float> got32 = Download(*backend, out32->data(), g.size());
    const NsErrors e16 = CompareNs(got16, want), e32 = CompareNs(got32, want);
    std::printf("[bf16] NS %lldx%lld %-8s vs fp64: %s relative %.3e max abs %.3e | fp32 relative %.3e max abs %.3e\n",
                static_cast<long long>(sh.rows), static_cast<long long>(sh.cols), sh.decaying ? "decaying" : "gaussian",
                bf16 ? "bf16" : "bf16 (fp32 fallback)", e16.relative, e16.max_abs, e32.relative, e32.max_abs);
    EXPECT_LT(e16.relative, bound);
    if (bf16) {
      // The bf16 result differs from the fp32 one by far more than fp32 rounding could.
      EXPECT_GT(CompareNs(got16, ::muond::testing::ToDouble(got32)).relative, 100 * e32.relative + 1e-6);
    } else {
      EXPECT_EQ(got16, got32);
    }
  }
}

// The CPU backend with GemmMayWriteAnOperand set for every precision (`in_place`) or for none.
class GemmInPlace final : public ::muond::testing::ForwardingBackend {
 public:
  GemmInPlace(Backend& inner, bool in_place) : ForwardingBackend(inner), in_place_(in_place) {}
  bool GemmMayWriteAnOperand(MatmulPrecision) const override { return in_place_; }

 private:
  bool in_place_;
};

// Newton–Schulz and Gram Newton–Schulz (with a restart, a cubic tuple, AOL) updating their iterates
// in place give the results of the copies, bit for bit: through oneDNN's bf16 GEMMs where this CPU
// has them (which say in place is free), and through BLAS, which reads an operand its C overlaps
// from a copy (fp32, and bf16 on the fallback).
TEST(CpuBf16Gemm, NewtonSchulzInPlaceGivesTheCopiesResultsBitForBit) {
  Announce();
  std::unique_ptr<Backend> cpu = NewCpuBackend(2);
  EXPECT_EQ(cpu->GemmMayWriteAnOperand(MatmulPrecision::kBf16), Bf16GemmSupport().available);
  EXPECT_FALSE(cpu->GemmMayWriteAnOperand(MatmulPrecision::kFp32));
  GemmInPlace in_place(*cpu, true), copies(*cpu, false);
  std::mt19937 rng(5);
  const optim::NsSchedule simple, cubic5 = *optim::NamedSchedule("cubic5");
  const std::vector<int> restart_at_2 = {2};
  struct Case {
    const char* what;
    int64_t rows, cols, batch;
  };
  for (const Case& c : {Case{"wide", 24, 80, 1}, Case{"tall, batched", 96, 40, 3}, Case{"square", 32, 32, 2}}) {
    const std::vector<float> g = Random(rng, static_cast<size_t>(c.rows * c.cols * c.batch));
    for (MatmulPrecision precision : {MatmulPrecision::kBf16, MatmulPrecision::kFp32}) {
      SCOPED_TRACE(::testing::Message() << c.what << (precision == MatmulPrecision::kBf16 ? " bf16" : " fp32"));
      // Each way of running it, on a backend: its output.
      using Run = std::function<absl::Status(Backend&, const float* in, float* out, optim::NsWorkspace&)>;
      const std::vector<std::pair<const char*, Run>> runs = {
          {"simple",
           [&](Backend& b, const float* in, float* out, optim::NsWorkspace& ws) {
             return optim::NewtonSchulz(b, simple, 5, 1e-7, 1.0, precision, in, out, c.rows, c.cols, c.batch, ws);
           }},
          {"cubic5",
           [&](Backend& b, const float* in, float* out, optim::NsWorkspace& ws) {
             return optim::NewtonSchulz(b, cubic5, 5, 1e-7, 1.0, precision, in, out, c.rows, c.cols, c.batch, ws);
           }},
          {"aol",
           [&](Backend& b, const float* in, float* out, optim::NsWorkspace& ws) {
             return optim::NewtonSchulz(b, simple, 4, 1e-7, 1.0, precision, in, out, c.rows, c.cols, c.batch, ws,
                                        nullptr, optim::NsPreconditioner::kAol);
           }},
          {"gram",
           [&](Backend& b, const float* in, float* out, optim::NsWorkspace& ws) {
             return optim::GramNewtonSchulz(b, simple, 5, restart_at_2, 1e-7, 1.0, precision, in, out, c.rows, c.cols,
                                            c.batch, ws);
           }},
          {"gram cubic5",
           [&](Backend& b, const float* in, float* out, optim::NsWorkspace& ws) {
             return optim::GramNewtonSchulz(b, cubic5, 5, {}, 1e-7, 1.0, precision, in, out, c.rows, c.cols, c.batch,
                                            ws);
           }},
      };
      for (const auto& [name, run] : runs) {
        SCOPED_TRACE(name);
        auto in = Upload(*cpu, g), want = Upload(*cpu, g), got = Upload(*cpu, g);
        optim::NsWorkspace ws_copies, ws_in_place;
        ASSERT_OK(run(copies, in->data(), want->data(), ws_copies));
        ASSERT_OK(run(in_place, in->data(), got->data(), ws_in_place));
        const std::vector<float> expected = Download(*cpu, want->data(), g.size());
        EXPECT_EQ(Download(*cpu, got->data(), g.size()), expected);
        EXPECT_NE(expected, g);  // it ran
      }
    }
  }
}

// In place, Newton–Schulz holds no second iterate and no B (AOL keeps its row scales and transposed
// A; otherwise one m×m matrix stays for the orthogonality residual), and Gram Newton–Schulz only a
// column of ones for its scratch: what NsSlotFloats says.
TEST(CpuBf16Gemm, NewtonSchulzInPlaceHoldsNeitherXPrimeNorB) {
  std::unique_ptr<Backend> cpu = NewCpuBackend(1);
  GemmInPlace in_place(*cpu, true), copies(*cpu, false);
  const int64_t rows = 24, cols = 80, batch = 2, m = 24;
  const size_t mat = rows * cols * batch, gram = m * m * batch;
  std::mt19937 rng(3);
  const std::vector<float> g = Random(rng, mat);
  const optim::NsSchedule simple;
  struct Case {
    const char* what;
    optim::NsUse use;
    size_t copies_hold, in_place_holds;
  };
  for (const Case& c : {Case{"standard", {}, 2 * mat + 2 * gram, mat + gram + m * m},
                        Case{"aol", {.aol = true}, 2 * mat + 2 * gram, mat + m * batch + 2 * gram},
                        Case{"gram", {.gram = true}, 2 * mat + 4 * gram, 2 * mat + 3 * gram + m}}) {
    SCOPED_TRACE(c.what);
    for (Backend* backend : {static_cast<Backend*>(&copies), static_cast<Backend*>(&in_place)}) {
      const bool place = backend == &in_place;
      optim::NsWorkspace ws;
      auto data = Upload(*cpu, g);
      if (c.use.gram) {
        ASSERT_OK(optim::GramNewtonSchulz(*backend, simple, 5, {}, 1e-7, 1.0, MatmulPrecision::kFp32, data->data(),
                                          data->data(), rows, cols, batch, ws));
      } else {
        ASSERT_OK(optim::NewtonSchulz(*backend, simple, 5, 1e-7, 1.0, MatmulPrecision::kFp32, data->data(),
                                      data->data(), rows, cols, batch, ws, nullptr,
                                      c.use.aol ? optim::NsPreconditioner::kAol : optim::NsPreconditioner::kFrobenius));
      }
      optim::NsUse use = c.use;
      use.in_place = place;
      size_t planned = 0;
      for (size_t floats : optim::NsSlotFloats(rows, cols, batch, use)) planned += floats;
      EXPECT_EQ(ws.held(), place ? c.in_place_holds : c.copies_hold) << (place ? "in place" : "copies");
      EXPECT_EQ(ws.held(), planned) << (place ? "in place" : "copies");
    }
  }
}

}  // namespace
}  // namespace muond::kernels
